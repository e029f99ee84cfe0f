"""Predicted vs measured peak memory per rank: the planner's accuracy table.

Runs real training steps on 2 gloo ranks (CPU) launched through torch's elastic agent:
a Hugging Face Llama-style model (random init, SDPA), wrapped as shardwise's strategies
wrap it (DDP with gradient_as_bucket_view; FSDP2 `fully_shard` per decoder layer, the last
kept gathered, then the root, MixedPrecisionPolicy(reduce fp32)), AdamW (foreach), the
engine's loss (logits.float() -> cross-entropy, sum). Each rank counts the bytes of its
live tensor storages with shardwise.plan.simulate.LiveBytes and keeps the peak of the
second step; the table shows the larger rank. The prediction is the planner's tensor
peak (before the CUDA context / fragmentation allowance, which does not exist here).

    python benchmarks/plan_accuracy.py [--quick] [--json OUT.json]

On a GPU machine the same script measures with torch.cuda.max_memory_allocated as well
(rows are marked with the device); GPU rows are to be added.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid

MODELS = {  # name: (vocab, hidden, intermediate, layers, heads, kv heads)
    "tiny-0.9M": (512, 128, 352, 4, 4, 2),
    "s-5M": (4096, 256, 704, 4, 4, 2),
    "m-27M": (8192, 512, 1408, 8, 8, 4),
}
SHAPES = [(2, 128), (4, 256), (8, 512)]  # (micro-batch, seq len)


def cases(quick: bool) -> list[dict]:
    out = []
    for model in (["s-5M"] if quick else list(MODELS)):
        for mb, seq in (SHAPES[:2] if quick else SHAPES):
            for strategy in ("ddp", "fsdp"):
                for ckpt in (False, True):
                    out.append(dict(model=model, strategy=strategy, micro_batch=mb, seq_len=seq, ckpt=ckpt,
                                    compute="fp32", grad_accum=1))
    # the GPU regime, on CPU: bf16 compute over fp32 weights (autocast for DDP, MixedPrecisionPolicy for FSDP)
    for strategy in ("ddp", "fsdp"):
        out.append(dict(model="s-5M", strategy=strategy, micro_batch=4, seq_len=256, ckpt=False, compute="bf16",
                        grad_accum=2))
    return out


def spec_for(name: str):
    from shardwise.plan.model_spec import ModelSpec

    v, h, i, L, a, k = MODELS[name]
    return ModelSpec(name, "benchmark", v, h, i, L, a, k, h // a, False)


def predict(case: dict, world: int) -> float:
    from shardwise.plan.memory import Job, Opts, estimate

    job = Job(world=world, micro_batch=case["micro_batch"], seq_len=case["seq_len"], grad_accum=case["grad_accum"],
              compute=case["compute"], checkpointing=case["ckpt"], accelerator="cpu")
    return estimate(spec_for(case["model"]), job, Opts(case["strategy"])).peak_tensors


# ----------------------------------------------------------------------------- per rank


def measure_case(case: dict, mesh) -> dict:
    import torch
    import torch.nn.functional as F

    from shardwise.plan.simulate import LiveBytes, build_model, wrap_fsdp
    from shardwise.plan.memory import Opts

    torch.manual_seed(0)
    spec = spec_for(case["model"])
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda") if cuda else torch.device("cpu")
    compute = torch.bfloat16 if case["compute"] == "bf16" else torch.float32
    tracker = LiveBytes()
    with tracker:  # count everything from construction on: DDP's buckets included
        model = build_model(spec, torch.float32, case["ckpt"]).to(dev)
        autocast, no_sync = None, None
        if case["strategy"] == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = DDP(model, gradient_as_bucket_view=True)
            autocast = compute if compute != torch.float32 else None
            no_sync = None
        else:
            model = wrap_fsdp(model, mesh, Opts("fsdp"), compute, torch.float32)
            no_sync = lambda skip: model.set_requires_gradient_sync(not skip)  # noqa: E731
        decay = [p for p in model.parameters() if p.ndim >= 2]
        rest = [p for p in model.parameters() if p.ndim < 2]
        opt = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=1e-4,
                                foreach=not cuda, fused=cuda or None)
        batches = [(torch.randint(0, spec.vocab_size, (case["micro_batch"], case["seq_len"]), device=dev),
                    torch.randint(0, spec.vocab_size, (case["micro_batch"], case["seq_len"]), device=dev))
                   for _ in range(case["grad_accum"])]
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        for step in range(2):
            if step == 1:
                tracker.reset_peak()
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
            for i, (ids, tg) in enumerate(batches):
                last = i == len(batches) - 1
                ctx = model.no_sync() if (case["strategy"] == "ddp" and not last) else _null()
                if no_sync is not None:
                    no_sync(not last)
                with ctx, torch.autocast(dev.type, dtype=autocast, enabled=autocast is not None):
                    logits = model(input_ids=ids).logits
                    loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), tg.view(-1), reduction="sum")
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del logits, loss
    out = {"peak_bytes": tracker.peak}
    if cuda:
        out["cuda_max_allocated"] = torch.cuda.max_memory_allocated()
    return out


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def worker(out_path: str, cases_json: str) -> None:
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cuda" if cuda else "cpu", (dist.get_world_size(),))
    rows = []
    for case in json.loads(cases_json):
        t = time.time()
        r = measure_case(case, mesh)
        peaks = [None] * dist.get_world_size()
        dist.all_gather_object(peaks, r)
        rows.append({**case, "measured": max(p["peak_bytes"] for p in peaks),
                     "cuda_max_allocated": max(p.get("cuda_max_allocated", 0) for p in peaks) or None,
                     "seconds": round(time.time() - t, 1)})
    if dist.get_rank() == 0:
        with open(out_path, "w") as fh:
            json.dump(rows, fh)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="A few cases only.")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--json", help="Also write the rows here.")
    a = ap.parse_args()
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    sel = cases(a.quick)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // a.nproc)))
    lc = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=a.nproc, run_id=f"acc-{uuid.uuid4().hex[:6]}",
                      rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, start_method="spawn")
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rows.json")
        elastic_launch(lc, sys.executable)(os.path.abspath(__file__), "--worker", out, json.dumps(sel))
        rows = json.load(open(out))
    import torch

    dev = "cuda" if torch.cuda.is_available() else "cpu (gloo)"
    print(f"| device | model | strategy | micro-batch x seq | ckpt | compute | accum | predicted MiB | measured MiB | error |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        r["predicted"] = predict(r, a.nproc)
        r["error_pct"] = 100 * (r["predicted"] / r["measured"] - 1)
        print(f"| {dev} ×{a.nproc} | {r['model']} | {r['strategy']} | {r['micro_batch']} × {r['seq_len']} | "
              f"{'on' if r['ckpt'] else 'off'} | {r['compute']} | {r['grad_accum']} | {r['predicted'] / 2**20:.2f} | "
              f"{r['measured'] / 2**20:.2f} | {r['error_pct']:+.1f}% |")
    errs = [abs(r["error_pct"]) for r in rows]
    print(f"\n{len(rows)} cases; mean |error| {sum(errs) / len(errs):.1f}%, max {max(errs):.1f}%; "
          f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
        worker(sys.argv[2], sys.argv[3])
    else:
        main()
