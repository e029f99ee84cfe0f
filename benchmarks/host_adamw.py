"""The optimizer step on the host: torch's AdamW, foreach against fused, on the CPU's own cores.

An offloaded optimizer step (fsdp-offload, zero2-offload, zero3-offload) runs torch's AdamW on the host's fp32
master weights; the planner's host rates (plan/comm.py *_HOST_STEP_PARAMS_PER_S) are fitted on whole steps that
include it.
This times one step of each kernel on the tensors of a Llama-shaped model (default: the 1.14B anchor of
benchmarks/strategies_gpu.py), in the engine's two groups (weight decay on matrices, none on norms), alternating the
kernels for --rounds rounds after one warm-up step each, and reports how far apart the two kernels' weights end.

    python benchmarks/host_adamw.py                       # the anchor, all cores
    python benchmarks/host_adamw.py --layers 2 --json F   # a quick check
    python benchmarks/host_adamw.py --clip                # the clip then the fused step, against the clip folded
                                                          # into the step (its grad_scale), as Strategy.step does
    python benchmarks/host_adamw.py --norm                # the gradient norm alone: torch's get_total_norm
                                                          # against strategies/gradnorm.py's host_grad_norm

Prints one line per kernel and writes --json (medians, every step, threads, versions).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

ANCHOR = dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=16,
              num_key_value_heads=8)


def shapes(layers: int, vocab: int, hidden: int, inter: int, heads: int, kv_heads: int) -> list[tuple[int, ...]]:
    kv = hidden // heads * kv_heads
    block = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (inter, hidden), (inter, hidden),
             (hidden, inter), (hidden,), (hidden,)]
    return [(vocab, hidden)] + block * layers + [(hidden,), (vocab, hidden)]


def make(shape_list, seed: int):
    g = torch.Generator().manual_seed(seed)
    params = []
    for s in shape_list:
        p = torch.nn.Parameter(torch.randn(s, generator=g) * 0.02)
        p.grad = torch.randn(s, generator=g) * 1e-3
        params.append(p)
    return params


def optimizer(params, kernel: str):
    decay = [p for p in params if p.ndim >= 2]
    rest = [p for p in params if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
                             lr=1e-4, betas=(0.9, 0.999), eps=1e-8, **{kernel: True})


def clip_variants(sl, rounds: int, max_norm: float = 1.0) -> dict[str, list[float]]:
    """The whole host step, fused kernel: clip_grad_norm_ (a norm pass and a scaling pass over the gradients) then
    the step, against the norm alone then the step dividing each gradient by the clip's divisor as it reads it."""
    from shardwise import config
    from shardwise.strategies.base import DistEnv, Strategy

    cfg = config.load_config(None, {"mixed_precision": ("no", "bench"), "max_grad_norm": (max_norm, "bench")}).cfg
    strategy = Strategy(cfg, DistEnv(0, 1, 0, 1, torch.device("cpu"), "gloo"))  # its clip_divisor, as step uses it
    sets = {k: make(sl, 1) for k in ("clip_then_step", "folded")}
    opts = {k: optimizer(ps, "fused") for k, ps in sets.items()}
    times: dict[str, list[float]] = {k: [] for k in sets}

    def run(k):
        ps, opt = sets[k], opts[k]
        if k == "clip_then_step":
            torch.nn.utils.clip_grad_norm_(ps, max_norm, foreach=True)
            opt.step()
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in ps], foreach=True)
            opt.grad_scale = strategy.clip_divisor(norm)
            opt.step()
            del opt.grad_scale

    for k in sets:
        run(k)  # warm-up
    for _ in range(rounds):
        for k in sets:
            t = time.perf_counter()
            run(k)
            times[k].append(time.perf_counter() - t)
    return times


def norm_variants(sl, rounds: int) -> tuple[dict[str, list[float]], dict[str, float]]:
    """The global gradient norm alone over the model's host gradients: torch's get_total_norm (foreach; one
    reduction per tensor) against host_grad_norm (rows over the threads). Also each one's relative error against a
    float64 norm."""
    from shardwise.strategies.gradnorm import host_grad_norm

    grads = [p.grad for p in make(sl, 2)]
    variants = {"torch_get_total_norm": lambda: torch.nn.utils.get_total_norm(grads, foreach=True),
                "host_grad_norm": lambda: host_grad_norm(grads)}
    want = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.double()) for g in grads])))
    errors = {k: abs(float(f()) - want) / want for k, f in variants.items()}  # also the warm-up
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(rounds):
        for k, f in variants.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    return times, errors


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=ANCHOR["num_hidden_layers"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default, the cores)")
    ap.add_argument("--clip", action="store_true", help="time the clip folded into the fused step instead")
    ap.add_argument("--norm", action="store_true", help="time the gradient norm alone, torch's against ours")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    cfg = dict(ANCHOR, num_hidden_layers=a.layers)
    sl = shapes(cfg["num_hidden_layers"], cfg["vocab_size"], cfg["hidden_size"], cfg["intermediate_size"],
                cfg["num_attention_heads"], cfg["num_key_value_heads"])
    n = sum(torch.Size(s).numel() for s in sl)
    if a.norm:
        times, errors = norm_variants(sl, a.rounds)
        med = {k: statistics.median(v) for k, v in times.items()}
        for k, v in med.items():
            print(f"{k:21s} {n / 1e9:.3f}B params, {torch.get_num_threads()} threads: {v * 1e3:.1f} ms "
                  f"(relative error against float64 {errors[k]:.1e})")
        print(f"host_grad_norm / torch: {med['host_grad_norm'] / med['torch_get_total_norm']:.2f}")
        if a.json:
            with open(a.json, "w") as fh:
                json.dump({"params": n, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                           "torch": torch.__version__, "steps_s": times, "median_s": med, "rel_error": errors},
                          fh, indent=1)
        return 0
    if a.clip:
        times = clip_variants(sl, a.rounds)
        med = {k: statistics.median(v) for k, v in times.items()}
        for k, v in med.items():
            print(f"{k:15s} {n / 1e9:.3f}B params, {torch.get_num_threads()} threads: {v:.3f} s a step")
        print(f"folded saves {med['clip_then_step'] - med['folded']:.3f} s a step "
              f"({1 - med['folded'] / med['clip_then_step']:.0%})")
        if a.json:
            with open(a.json, "w") as fh:
                json.dump({"params": n, "threads": torch.get_num_threads(), "torch": torch.__version__,
                           "steps_s": times, "median_s": med}, fh, indent=1)
        return 0
    kernels = ("foreach", "fused")
    sets = {k: make(sl, 0) for k in kernels}  # the same weights and gradients for both
    opts = {k: optimizer(sets[k], k) for k in kernels}
    times: dict[str, list[float]] = {k: [] for k in kernels}
    for k in kernels:  # warm-up: the states are allocated in the first step
        opts[k].step()
    for _ in range(a.rounds):
        for k in kernels:
            t = time.perf_counter()
            opts[k].step()
            times[k].append(time.perf_counter() - t)
    diff = max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(sets["foreach"], sets["fused"]))
    out = {"params": n, "layers": a.layers, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
           "torch": torch.__version__, "python": platform.python_version(), "machine": platform.processor() or
           platform.machine(), "max_abs_diff_after_steps": diff, "steps_s": times,
           "median_s": {k: statistics.median(v) for k, v in times.items()},
           "params_per_s": {k: n / statistics.median(v) for k, v in times.items()}}
    for k in kernels:
        print(f"{k:8s} {n / 1e9:.3f}B params, {torch.get_num_threads()} threads: {out['median_s'][k]:.3f} s a step "
              f"({out['params_per_s'][k]:.3g} params/s)")
    print(f"fused / foreach: {out['median_s']['foreach'] / out['median_s']['fused']:.2f}x; "
          f"largest difference between their weights after {a.rounds + 1} steps: {diff:.2e}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
