"""What each candidate speed lever buys on one GPU, measured in one process through the engine's path.

A variant is a strategy preset plus optional levers; each builds what `shardwise train` builds
(`train.loop.build_model`: the fused loss head; the registry's
strategy and its `setup`) and runs `train.loop.forward_backward_step` + a step, as plan_accuracy.py does:

    single, fsdp, fsdp-grad-op, ddp ...   the preset as the engine runs it now
    +bf16reduce     FSDP's MixedPrecisionPolicy without reduce_dtype: gradients reduced (on one rank:
                    copied) in the compute dtype, then kept in fp32
    (+nosync, the fused AdamW's `found_inf` with no host sync, was a lever of run a at 757fe6f; it is
    the engine's step since e45764c. Runs a and b read no flags; since 9b86ecf every variant reads the
    previous step's flag where loop.run does, a pinned copy behind an event.)
    +sync           the engine's step before that: the non-finite check reads the norm on the host every step
    +reshard        fsdp on one rank resharding after forward, as before FSDPStrategy.keeps_gathered
    +noprefetch     fsdp.prefetch off (FSDP2's implicit prefetching only)

Variants run in the order given, --repeat times round-robin (A B C A B C: drift hits all alike); each
run warms up (--warmup steps, compiling) and then times --steps steps with CUDA events. Reported per
run: tokens/s, MFU (6N + 12·L·H·T per token against 989 TF/s, as the engine logs it), peak memory of
the timed steps; per variant the median over repeats. --profile NAME,... also writes the top CUDA
kernels of two profiled steps of those variants, and the GPU's busy fraction (kernel time / wall).

    python benchmarks/one_gpu_levers.py --variants single+sync,single,fsdp+sync+reshard,fsdp --json OUT.json
    python benchmarks/one_gpu_levers.py --device cpu --model cpu-b --variants single+sync,fsdp --steps 2 --warmup 1

`--device cpu` runs the same code at a tiny size on the CPU (a smoke test; speeds mean nothing there).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import plan_accuracy as pa  # noqa: E402  (the engine-path helpers: config, random-init loader, batch)

LEVERS = ("bf16reduce", "sync", "reshard", "noprefetch")


def parse(variant: str) -> tuple[str, set[str]]:
    preset, *levers = variant.split("+")
    bad = set(levers) - set(LEVERS)
    if bad:
        raise SystemExit(f"--variants: unknown lever(s) {sorted(bad)} in {variant!r}; known: {', '.join(LEVERS)}")
    return preset, set(levers)


def sync_step(strategy, model, optimizer):
    """The step as it was: clip, read the norm on the host, step or skip."""
    import torch

    norm = strategy.clip_grad_norm(model, optimizer)
    if bool(torch.isfinite(norm)):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def run_variant(variant: str, a, env, repeat: int = 0) -> dict:
    import torch

    from shardwise import strategies
    from shardwise.strategies.fsdp import FSDPStrategy
    from shardwise.train import dist as sdist
    from shardwise.train import loop
    from shardwise.train.faults import Faults
    from shardwise.train.metrics import flops_per_token

    preset, levers = parse(variant)
    c = pa.case(a.model, preset, a.micro_batch_size, a.seq_len, a.ckpt, "bf16", 1, a.device == "cuda" and not a.eager,
                True)
    cfg = pa.config_for(c, 1)
    if "noprefetch" in levers:
        cfg.fsdp.prefetch = False
    orig_policy, orig_keep = FSDPStrategy.mp_policy, FSDPStrategy.keeps_gathered
    if "reshard" in levers:
        FSDPStrategy.keeps_gathered = lambda self: False
    if "bf16reduce" in levers:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        FSDPStrategy.mp_policy = lambda self: MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=None)
    cuda = env.device.type == "cuda"
    out = {"variant": variant}
    try:
        with pa.random_init_loader(c, env.device):
            torch.manual_seed(cfg.seed)
            model = loop.build_model(cfg, "random-init")
        n_params = sum(p.numel() for p in model.parameters())
        head = model.get_output_embeddings()
        fused_head = head if getattr(head, "loss_targets", "absent") is None else None
        sdist.ensure_same_weights(model, env)
        strategy = strategies.get(cfg.strategy)(cfg, env)
        model, optimizer = strategy.setup(model)
        batch = pa.make_batch(c, 1, 0, pa.MODELS[a.model][0])
        faults = Faults(0)
        model.train()

        def one(step):
            for g in optimizer.param_groups:
                g["lr"] = 1e-5
            loss = loop.forward_backward_step(model, strategy, batch, 1, env.device, faults, step + 1, fused_head)
            strategy.take_nonfinite()  # the previous step's flag, read where loop.run reads it
            if "sync" in levers:
                sync_step(strategy, model, optimizer)
            else:
                strategy.step(model, optimizer)
            return loss

        t0 = time.time()
        for s in range(a.warmup):
            float(one(s))
        out["warmup_s"] = round(time.time() - t0, 1)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ev0.record()
        t0 = time.time()
        for s in range(a.steps):
            loss = one(a.warmup + s)
        if cuda:
            ev1.record()
            torch.cuda.synchronize()
            elapsed = ev0.elapsed_time(ev1) / 1e3
            out["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        else:
            elapsed = time.time() - t0
        out["loss"] = float(loss)
        tokens = a.micro_batch_size * a.seq_len * a.steps
        out["step_s"] = round(elapsed / a.steps, 4)
        out["tokens_per_s"] = round(tokens / elapsed)
        L, H = pa.MODELS[a.model][3], pa.MODELS[a.model][1]
        out["mfu"] = round(flops_per_token(n_params, L, H, a.seq_len) * tokens / elapsed / 989e12, 4)
        if cuda and repeat == 0 and variant in a.profile.split(","):
            out["profile"] = profile(one, a.warmup + a.steps)
        model = optimizer = strategy = batch = head = fused_head = None  # free them before cleanup (one() holds them)
    finally:
        FSDPStrategy.mp_policy, FSDPStrategy.keeps_gathered = orig_policy, orig_keep
        pa.cleanup(cuda)
    return out


def profile(one, step0: int) -> dict:
    """Two profiled steps: the top CUDA kernels by total time and the GPU's busy fraction."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    torch.cuda.synchronize()
    t0 = time.time()
    with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for s in range(2):
            one(step0 + s)
        torch.cuda.synchronize()
    wall = time.time() - t0
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = merged_us([(k.time_range.start, k.time_range.end) for k in kernels])
    span = (max(k.time_range.end for k in kernels) - min(k.time_range.start for k in kernels)) if kernels else 0
    table = prof.key_averages().table(sort_by="device_time_total", row_limit=25, max_name_column_width=70)
    return {"wall_s": round(wall, 3), "kernel_span_ms": round(span / 1e3, 1), "busy_ms": round(busy / 1e3, 1),
            "busy_fraction_of_span": round(busy / span, 4) if span else None, "top": table}


def merged_us(ranges) -> float:
    total, end = 0.0, None
    for s, e in sorted(ranges):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default="single,ddp,fsdp")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--model", default="llama-1.1B", choices=sorted(pa.MODELS))
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--ckpt", action="store_true", help="gradient checkpointing on")
    ap.add_argument("--eager", action="store_true", help="no torch.compile (on by default on CUDA, as the engine)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--profile", default="", help="comma-separated variants to profile (two steps after timing, first repeat)")
    ap.add_argument("--json")
    a = ap.parse_args()
    for v in a.variants.split(","):
        parse(v)
    import torch

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(pa.free_port()))
    if a.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    from shardwise.train import dist as sdist

    env = sdist.init_distributed(600.0)
    pa.quiet()
    import transformers

    meta = {"torch": torch.__version__, "transformers": transformers.__version__,
            "device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu",
            "date": time.strftime("%Y-%m-%d %H:%M"), "model": a.model, "micro_batch": a.micro_batch_size,
            "seq_len": a.seq_len, "ckpt": a.ckpt, "compile": a.device == "cuda" and not a.eager,
            "steps": a.steps, "warmup": a.warmup}
    runs = []
    for r in range(a.repeat):
        for v in a.variants.split(","):
            res = run_variant(v, a, env, r)
            res["repeat"] = r
            runs.append(res)
            print(f"[{r}] {v}: {res['tokens_per_s']:,} tok/s, MFU {100 * res['mfu']:.1f}%, "
                  f"{res.get('peak_gib', '-')} GiB, step {res['step_s']} s (warmup {res['warmup_s']} s)", flush=True)
            if a.json:
                pa.write_json(a.json, {"meta": meta, "runs": runs})
    base = None
    print(f"\n| variant | tokens/s (median of {a.repeat}) | vs first | MFU | peak GiB |\n|---|---|---|---|---|")
    for v in a.variants.split(","):
        rs = [x for x in runs if x["variant"] == v]
        tps = statistics.median(x["tokens_per_s"] for x in rs)
        base = base or tps
        print(f"| {v} | {tps:,.0f} | {100 * (tps / base - 1):+.1f}% | {100 * statistics.median(x['mfu'] for x in rs):.1f}% "
              f"| {max((x.get('peak_gib') or 0) for x in rs)} |")
    for x in runs:
        if "profile" in x:
            p = x["profile"]
            print(f"\n## profile {x['variant']} (repeat {x['repeat']}): kernels busy {p['busy_ms']} ms of a "
                  f"{p['kernel_span_ms']} ms span ({p['busy_fraction_of_span']}), wall {p['wall_s']} s\n{p['top']}")


if __name__ == "__main__":
    main()
