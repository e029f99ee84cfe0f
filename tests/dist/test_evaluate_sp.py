"""Validation under sequence parallelism, on 2 gloo ranks in-process: the Evaluator gives each rank of the
sequence group its slice of every held-out row (as training does), so the validation loss and its token count
equal one process's over the whole rows. Before, every rank evaluated whole rows through the split attention:
the token count came out doubled (and each rank held the whole sequence, which SP exists to avoid)."""

from __future__ import annotations

import json

import torch
import torch.multiprocessing as mp

from tests.helpers import forked_ranks


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardwise import strategies
    from shardwise.config import load_config
    from shardwise.data.batches import StepSampler
    from shardwise.data.encode import Encoded
    from shardwise.models.sequence_parallel import apply_sequence_parallel
    from shardwise.models.speed import token_loss_sum
    from shardwise.models.tiny import TINY_CONFIG
    from shardwise.strategies.base import DistEnv
    from shardwise.strategies.parallel import ParallelDims
    from shardwise.train.evaluate import Evaluator

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    g = torch.Generator().manual_seed(3)
    lengths = [21, 40, 9, 33, 17]  # 5 rows of other lengths: padded widths, a short last micro-batch
    ids = [torch.randint(1, 512, (n,), generator=g).tolist() for n in lengths]
    targets = [r[1:] + [-100] for r in ids]
    data = Encoded(ids, targets, [list(range(n)) for n in lengths], [""] * len(lengths))
    val_file = f"{out_dir}/val{rank}.safetensors"
    save_file(data.to_tensors(), val_file)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY_CONFIG, "num_hidden_layers": 2}, attn_implementation="sdpa"))
    model.eval()
    with torch.no_grad():  # one process, whole rows
        collate = StepSampler(data, 1, 1, 1, 0, 0, 0).collate
        mb = collate(list(range(len(lengths))))
        ref = token_loss_sum(model(input_ids=mb.input_ids, position_ids=mb.position_ids).logits, mb.targets).item()
    ref_tokens = sum(n - 1 for n in lengths)
    cfg = load_config(None, {"strategy": ("ddp", "test"), "micro_batch_size": (2, "test"),
                             "nproc_per_node": (2, "test"), "sequence_parallel": (2, "test"),
                             "mixed_precision": ("no", "test")}).cfg
    dims = ParallelDims(1, 1, 2, 1, world_size=2, rank=rank)
    env = DistEnv(rank, 2, rank, 2, torch.device("cpu"), "gloo", dims)
    apply_sequence_parallel(model, dims, "ulysses")
    got = Evaluator(cfg, env, val_file, 0, 1, out_dir).run(model, strategies.get("ddp")(cfg, env), 1)
    with open(f"{out_dir}/rank{rank}.json", "w") as fh:
        json.dump({"got": got, "ref": ref / ref_tokens, "ref_tokens": ref_tokens}, fh)
    dist.barrier()
    dist.destroy_process_group()
    # what is tested is written; leave without the interpreter's teardown, whose destruction of the sequence
    # mesh's gloo groups aborted a rank now and then on a loaded machine ("terminate called without an active
    # exception") after its results were written
    import os

    os._exit(0)


def test_validation_under_sequence_parallelism_equals_one_process(tmp_path):
    with forked_ranks("tests.dist.test_evaluate_sp", "shardwise.strategies", "shardwise.train.evaluate"):
        mp.start_processes(_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, start_method="forkserver")
    for rank in range(2):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["got"]["val_tokens"] == r["ref_tokens"], r
        torch.testing.assert_close(torch.tensor(r["got"]["val_loss"]), torch.tensor(r["ref"]), rtol=1e-5, atol=0)
