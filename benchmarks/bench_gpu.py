"""`shardwise bench` on one GPU for a named model shape: builds the random-init model and
text data, then runs the real `shardwise bench` command (each strategy in fresh processes
through `shardwise train`) and writes its report (md + json + png) named
MODEL_HARDWARE_DATE, as docs/benchmarks/ keeps them.

    python benchmarks/bench_gpu.py --shape llama3.2-3b --strategies single,ddp,fsdp,zero2,zero3 \
        --micro-batch-size 4 --report-dir docs/benchmarks
    python benchmarks/bench_gpu.py --shape anchor-1.1b --layers 2 --steps 3 --warmup 1 --report-dir /tmp/smoke

Shapes (random init; shardwise's small word-level tokenizer of the same vocabulary):
- anchor-1.1b: the issue-6 anchor (vocab 32000, hidden 2048, intermediate 8192, 16 layers,
  16 heads, 8 KV heads, untied; 1.14B).
- llama3.2-3b: the published config of meta-llama/Llama-3.2-3B (vocab 128256, hidden 3072,
  intermediate 8192, 28 layers, 24 heads, 8 KV heads, tied embeddings, rope theta 500000;
  3.21B). Only the shape: the weights are random.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ANCHOR, build_model_dir, write_text_data  # noqa: E402

SHAPES = {
    "anchor-1.1b": dict(ANCHOR),
    "llama3.2-3b": dict(vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                        num_attention_heads=24, num_key_value_heads=8, max_position_embeddings=4096,
                        rope_theta=500000.0, tie_word_embeddings=True),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama3.2-3b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=0, help="fewer layers, for a quick check")
    ap.add_argument("--strategies", default="single,ddp,fsdp,zero2,zero3")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--timeout", type=float, default=180, help="seconds per strategy")
    ap.add_argument("--report-dir", required=True)
    ap.add_argument("--work", default="/tmp/shardwise-bench-gpu")
    a = ap.parse_args()

    import torch

    shape = dict(SHAPES[a.shape])
    if a.layers:
        shape["num_hidden_layers"] = a.layers
    name = a.shape.replace(".", "") + (f"-{a.layers}l" if a.layers else "")
    os.makedirs(a.work, exist_ok=True)
    model = build_model_dir(os.path.join(a.work, name), shape, disk_dtype="bfloat16")
    n = a.micro_batch_size * (a.steps + a.warmup + 4)
    data = write_text_data(os.path.join(a.work, f"text-{name}-{n}.jsonl"), n, a.seq_len + 16, shape["vocab_size"])
    hw = "h200" if "H200" in (torch.cuda.get_device_name(0) if torch.cuda.is_available() else "") else (
        "gpu" if torch.cuda.is_available() else "cpu")
    report = f"{name}_{hw}_{datetime.date.today().isoformat()}"
    cmd = [sys.executable, "-m", "shardwise", "bench", "--model", model, "--data", data, "--data-format", "text",
           "--strategies", a.strategies, "--nproc-per-node", "1", "--steps", str(a.steps), "--warmup", str(a.warmup),
           "--micro-batch-size", str(a.micro_batch_size), "--seq-len", str(a.seq_len), "--report-dir", a.report_dir,
           "--report-name", report, "--runs-dir", os.path.join(a.work, "runs-" + name), "--timeout", str(a.timeout)]
    print("bench_gpu:", " ".join(cmd[1:]), flush=True)
    return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main())
