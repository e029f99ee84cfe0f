"""Task dpo's per-token log-probability head alone (models/speed.py linear_token_logprobs) on the CPU: the time of
one reference forward (no gradients) and one policy forward + backward, as a DPO micro-step runs them, fp32.

    PYTHONPATH=src python benchmarks/dpo_head_cpu.py --tokens 1032 --hidden 256 --vocab 32768 --chunk 1024 \\
        --base-src /tmp/base_src

--base-src DIR: another commit's src/ (`git archive COMMIT src | tar -x -C DIR --strip-components=1`), whose
models/speed.py is loaded beside this tree's; the two run alternately, repeat by repeat, so a busy machine slows
both alike. Each figure is the median of --repeats after one warm-up, in wall time and in this process's CPU time.
--compile: this tree's head with compile=True (the path a CUDA run takes by default) as a third variant.
What it does not say: the GPU's figure, where the head's passes are memory-bound (benchmarks/run.py dpo-vs-trl)."""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time

import torch


def load_speed(src: str):
    spec = importlib.util.spec_from_file_location("base_speed", f"{src}/shardwise/models/speed.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1032)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--base-src", default="")
    p.add_argument("--compile", action="store_true")
    a = p.parse_args()

    from shardwise.models.speed import linear_token_logprobs

    variants = {}
    if a.base_src:
        variants["base"] = load_speed(a.base_src).linear_token_logprobs
    variants["this tree"] = linear_token_logprobs
    if a.compile:
        variants["this tree, compiled"] = lambda *x: linear_token_logprobs(*x, compile=True)

    g = torch.Generator().manual_seed(0)
    h = torch.randn(a.tokens, a.hidden, generator=g, requires_grad=True)
    w = (torch.randn(a.vocab, a.hidden, generator=g) / a.hidden ** 0.5).requires_grad_(True)
    t = torch.randint(0, a.vocab, (a.tokens,), generator=g)
    t[: a.tokens // 4] = -100  # the prompt's tokens score nothing
    up = torch.randn(a.tokens, generator=g)

    def ref_forward(fn):
        with torch.no_grad():
            fn(h, w, t, a.chunk)

    def policy_step(fn):
        out = fn(h, w, t, a.chunk)
        torch.autograd.grad((out * up).sum(), (h, w))

    parts = (("reference forward", ref_forward), ("policy forward+backward", policy_step))
    times = {(v, part, clock): [] for v in variants for part, _ in parts for clock in ("wall", "cpu")}
    for i in range(a.repeats + 1):
        for v, fn in variants.items():
            for part, step in parts:
                w0, c0 = time.perf_counter(), time.process_time()
                step(fn)
                if i:  # the first round warms up (and compiles)
                    times[(v, part, "wall")].append(time.perf_counter() - w0)
                    times[(v, part, "cpu")].append(time.process_time() - c0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; tokens {a.tokens}, hidden {a.hidden}, "
          f"vocab {a.vocab}, chunk {a.chunk}, fp32; median of {a.repeats}, variants alternating")
    print(f"  {'variant':22s} {'part':26s} {'wall ms':>9s} {'cpu ms':>9s}")
    for v in variants:
        tot = {"wall": 0.0, "cpu": 0.0}
        for part, _ in parts:
            m = {c: statistics.median(times[(v, part, c)]) for c in tot}
            for c in tot:
                tot[c] += m[c]
            print(f"  {v:22s} {part:26s} {m['wall'] * 1e3:9.1f} {m['cpu'] * 1e3:9.1f}")
        print(f"  {v:22s} {'micro-step (both)':26s} {tot['wall'] * 1e3:9.1f} {tot['cpu'] * 1e3:9.1f}")


if __name__ == "__main__":
    main()
