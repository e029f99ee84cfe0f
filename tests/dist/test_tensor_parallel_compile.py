"""torch.compile with tensor parallelism, on 2 gloo ranks in-process: the parallelize order's `apply_compile`
after `apply_tensor_parallel` (strategies/parallelize.py) compiles each block whose linears are DTensors (dynamo
traces the DTensor ops; under TP the blocks' own hooks stay eager). Two AdamW steps on the same rows give the
eager TP model's losses and weights, with the fused vocabulary-parallel loss and packed rows. Sharp: compiling
the whole block call (hooks traced) left the embedding without a gradient, so its weights and the second loss
differed. The workers compile with the aot_eager backend (dynamo + AOTAutograd, no inductor codegen)."""

from __future__ import annotations

import copy
import functools
import json
import types

import torch
import torch.multiprocessing as mp

from tests.helpers import forked_ranks

STEPS = 2


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardwise.config import load_config
    from shardwise.models.speed import install_fused_loss
    from shardwise.models.tiny import TINY_CONFIG
    from shardwise.strategies.parallelize import apply_compile, apply_tensor_parallel

    # dynamo and AOTAutograd (where a traced hook loses the embedding's gradient) without inductor's C++ build of
    # the kernels: the same trace and graphs in a fraction of the suite's CPU time (the bug shows with both backends)
    torch.compile = functools.partial(torch.compile, backend="aot_eager")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    dims = types.SimpleNamespace(tp=world, mesh={"tp": init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))})
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, TINY_CONFIG["vocab_size"], (2, 24), generator=gen)
    pos = torch.cat([torch.arange(10), torch.arange(14)]).repeat(2, 1)  # two packed documents per row
    targets = torch.randint(0, TINY_CONFIG["vocab_size"], (2, 24), generator=gen)
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(**{**TINY_CONFIG, "num_hidden_layers": 1}, attn_implementation="sdpa"))
    cfg = load_config(None, {"compile": ("on", "test")}).cfg
    assert install_fused_loss(base, chunk=16)
    report = {}
    for name in ("eager", "compiled"):
        model = copy.deepcopy(base)
        apply_tensor_parallel(model, dims)
        done = apply_compile(model, cfg, dims) if name == "compiled" else ""
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
        losses = []
        for _ in range(STEPS):
            model.lm_head.loss_targets = targets
            loss = model(input_ids=ids, position_ids=pos).logits / 48
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        report[name] = {"losses": losses, "done": done,
                        "weights": {n: p.full_tensor().tolist() for n, p in model.named_parameters()
                                    if n.endswith(("embed_tokens.weight", "q_proj.weight", "lm_head.weight"))}}
    with open(f"{out_dir}/rank{rank}.json", "w") as fh:
        json.dump(report, fh)
    dist.destroy_process_group()


def test_compiled_tp_blocks_train_like_eager_tp(tmp_path):
    with forked_ranks("tests.dist.test_tensor_parallel_compile", "shardwise.strategies.parallelize"):
        mp.start_processes(_worker, args=(2, str(tmp_path / "init"), str(tmp_path)),
                           nprocs=2, start_method="forkserver")
    for rank in range(2):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        eager, compiled = r["eager"], r["compiled"]
        assert compiled["done"] == "compile: 1 blocks (forward only; TP hooks eager)", compiled["done"]
        assert eager["losses"][-1] < eager["losses"][0]  # it trains
        torch.testing.assert_close(torch.tensor(compiled["losses"]), torch.tensor(eager["losses"]), rtol=1e-4, atol=0)
        assert len(eager["weights"]) == 3
        for n, w in eager["weights"].items():
            torch.testing.assert_close(torch.tensor(compiled["weights"][n]), torch.tensor(w), rtol=0, atol=1e-4)
