"""What one causal attention call costs in GPU memory beyond its inputs and output, by SDPA backend and sequence
length: the Llama-3.1-8B shape (32 query heads, 8 key/value heads, head_dim 128, bf16), one sequence, called as
transformers calls it without a mask (`is_causal=True, enable_gqa=True`).

For each length and each backend (the default choice, then flash, cuDNN and memory-efficient forced) it reports
the forward's peak above the inputs, the backward's peak above the inputs, output and its gradient, the times of
both, and each peak in units of one (tokens x 4096) bf16 tensor, the unit the planner's block terms count in. The
default's row says which forced backend it matches. Seconds on a GPU; the planner's long-context terms are checked
against it (docs/planner.md, "the 256K gap").

    python benchmarks/attention_memory.py --lengths 65536,131072,262144 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import versions  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def one(t: int, backend) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    torch.cuda.empty_cache()
    dev = "cuda"
    q = torch.randn(1, HEADS, t, HEAD_DIM, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, KV_HEADS, t, HEAD_DIM, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, KV_HEADS, t, HEAD_DIM, device=dev, dtype=torch.bfloat16, requires_grad=True)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    try:
        ctx = sdpa_kernel(backend) if backend is not None else _null()
        with ctx:
            start.record()
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            mid.record()
            torch.cuda.synchronize()
            fwd_peak = torch.cuda.max_memory_allocated() - base
            grad = torch.randn_like(out)
            torch.cuda.synchronize()
            base_b = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            mid2 = torch.cuda.Event(enable_timing=True)
            mid2.record()
            out.backward(grad)
            end.record()
            torch.cuda.synchronize()
            bwd_peak = torch.cuda.max_memory_allocated() - base_b
    except Exception as e:  # a backend that cannot take this call: say why, in one line
        return {"ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    finally:
        q.grad = k.grad = v.grad = None
    unit = t * HEADS * HEAD_DIM * 2
    return {"ok": True, "fwd_extra_bytes": fwd_peak - out.numel() * 2, "bwd_extra_bytes": bwd_peak,
            "fwd_extra_units": round((fwd_peak - out.numel() * 2) / unit, 3), "bwd_extra_units": round(bwd_peak / unit, 3),
            "fwd_ms": round(start.elapsed_time(mid), 1), "bwd_ms": round(mid2.elapsed_time(end), 1)}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="65536,131072,196608,262144")
    ap.add_argument("--out", default=os.environ.get("OUT") or "/tmp/out")
    a = ap.parse_args(argv)
    import torch
    from torch.nn.attention import SDPBackend

    backends = [("default", None), ("flash", SDPBackend.FLASH_ATTENTION),
                ("cudnn", SDPBackend.CUDNN_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION)]
    rows = []
    for t in (int(x) for x in a.lengths.split(",")):
        one(min(t, 4096), None)  # warm the kernels once
        for name, b in backends:
            r = {"tokens": t, "backend": name, **one(t, b)}
            rows.append(r)
            print(json.dumps(r), flush=True)
        default = next(r for r in rows if r["tokens"] == t and r["backend"] == "default")
        if default["ok"]:
            same = [r["backend"] for r in rows if r["tokens"] == t and r["backend"] != "default" and r["ok"]
                    and r["bwd_extra_bytes"] == default["bwd_extra_bytes"]
                    and r["fwd_extra_bytes"] == default["fwd_extra_bytes"]]
            default["matches"] = same
            print(f"{t}: the default's memory matches {same or 'no forced backend'}", flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"attention-memory-{torch.cuda.get_device_name().replace(' ', '_')}.json"),
              "w") as fh:
        json.dump({"versions": versions(), "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
