"""apply_tensor_parallel on 2 gloo ranks in-process (no CLI): the split model's summed loss and every
parameter's gradient equal one process's, for the cases the CLI runs of test_tensor_parallel.py do not reach:
tied input/output embeddings (one shared DTensor), the fused vocabulary-parallel loss over several chunks
(the CLI's 128-token micro-batches fit one 4096-token chunk) and packed rows (position ids restarting
mid-row). With eager attention transformers materialises a block-diagonal mask whose size it takes from the
embedding's output: a sequence-sharded embedding output (torchtitan's layout) gives an S/2 x S/2 mask and
fails here, which is why the embedding's output stays whole until the first block. Both loss paths: the
fused head, and the plain head's vocabulary-sharded logits under loss_parallel."""

from __future__ import annotations

import copy
import json
import types

import torch
import torch.multiprocessing as mp

from tests.helpers import forked_ranks


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardwise.models.speed import install_fused_loss, token_loss_sum
    from shardwise.models.tiny import TINY_CONFIG
    from shardwise.strategies.base import Strategy
    from shardwise.strategies.parallelize import apply_tensor_parallel

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    dims = types.SimpleNamespace(tp=world, mesh={"tp": mesh})
    strategy = Strategy.__new__(Strategy)
    strategy.dims, strategy.scaler = dims, None  # only its loss_parallel context and backward are used
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, TINY_CONFIG["vocab_size"], (2, 24), generator=gen)
    pos = torch.cat([torch.arange(10), torch.arange(14)]).repeat(2, 1)  # two packed documents per row
    targets = torch.randint(0, TINY_CONFIG["vocab_size"], (2, 24), generator=gen)
    targets[0, :5] = -100
    report = {}
    for tied, attn in ((False, "sdpa"), (True, "eager")):
        torch.manual_seed(0)
        base = LlamaForCausalLM(LlamaConfig(**{**TINY_CONFIG, "tie_word_embeddings": tied},
                                            attn_implementation=attn))
        ref = copy.deepcopy(base)
        ref_loss = token_loss_sum(ref(input_ids=ids, position_ids=pos).logits, targets)
        ref_loss.backward()
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}
        for fused in (False, True):
            model = copy.deepcopy(base)
            if fused:
                assert install_fused_loss(model, chunk=7)  # 48 tokens: 7 chunks, the last one short
            apply_tensor_parallel(model, dims)
            with strategy.loss_parallel():
                if fused:
                    model.lm_head.loss_targets = targets
                    loss = model(input_ids=ids, position_ids=pos).logits
                else:
                    loss = token_loss_sum(model(input_ids=ids, position_ids=pos).logits, targets)
            strategy.backward(loss)
            worst = max(((p.grad.full_tensor() - ref_grads[n]).abs().max() / ref_grads[n].abs().max()).item()
                        for n, p in model.named_parameters())
            report[f"tied={tied} fused={fused}"] = {
                "loss": loss.item(), "ref": ref_loss.item(), "worst_grad": worst,
                "tie_kept": model.get_input_embeddings().weight is model.get_output_embeddings().weight,
                "all_dtensors": all(hasattr(p, "device_mesh") for p in model.parameters()),
                "head_rows": model.lm_head.weight.to_local().shape[0]}
    with open(f"{out_dir}/rank{rank}.json", "w") as fh:
        json.dump(report, fh)
    dist.destroy_process_group()


def test_split_model_gives_one_process_loss_and_gradients_tied_fused_and_packed(tmp_path):
    with forked_ranks("tests.dist.test_tensor_parallel_model", "shardwise.strategies.parallelize"):
        mp.start_processes(_worker, args=(2, str(tmp_path / "init"), str(tmp_path)),
                           nprocs=2, start_method="forkserver")
    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(report) == 4
        for case, r in report.items():
            assert abs(r["loss"] - r["ref"]) <= 2e-5 * r["ref"], (rank, case, r)
            assert r["worst_grad"] < 2e-5, (rank, case, r)  # observed ~1e-6: reduction order only
            assert r["all_dtensors"] and r["head_rows"] == 256, (rank, case, r)  # 512 vocabulary rows / 2
            assert r["tie_kept"] == case.startswith("tied=True"), (rank, case, r)
