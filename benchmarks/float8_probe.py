"""What float8 changes in one decoder block (issue 17: the planner's float8 terms), measured on the GPU.

For each model shape, one decoder block's saved activations and its forward + backward time, with the block's
linears in bf16 and as torchao's float8 linears (the engine's own `models.float8.convert` and
`models.speed.compile_blocks`, compiled as the engine compiles them), in the two ways the engine runs blocks:

    autocast   fp32 weights under bf16 autocast: single and ddp (the residual stream in fp32)
    bf16       bf16 weights, no autocast: what FSDP2's mixed precision hands each block (the residual in bf16)

A block's figures are differences between the same model built with `--deep` and `--shallow` decoder layers
(random init, the base model without its head): what the embedding, the final norm and the rotary tables take
cancels out. Per block:

    act_bytes       memory still allocated after forward (outside autocast: its weight cache freed), output kept
    cache_bytes     what autocast's weight cache holds at the end of forward on top of that (bf16 copies)
    fwd_bwd_ms      forward + backward of a sum-of-squares loss, CUDA events, median of --iters after --warmup

    python benchmarks/float8_probe.py --json OUT.json [--shapes llama-1.1B,qwen2.5-1.5B] [--tokens 8192]

`--device cpu` runs a tiny shape eagerly without float8 (a smoke test of the script: float8 needs CUDA).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

# name: (family, hidden, intermediate, heads, kv heads, head_dim); the published configs' block shapes
SHAPES = {
    "llama-0.3B": ("llama", 1024, 4096, 16, 8, 64),
    "llama-1.1B": ("llama", 2048, 8192, 16, 8, 128),  # the anchor (docs/measurements.md)
    "llama-3B": ("llama", 3072, 8192, 24, 8, 128),  # Llama-3.2-3B's blocks
    "llama-8B": ("llama", 4096, 14336, 32, 8, 128),  # Llama-3.1-8B's blocks
    "qwen2.5-1.5B": ("qwen2", 1536, 8960, 12, 2, 128),  # Qwen2.5-1.5B's blocks (q/k/v biases)
    "cpu-tiny": ("llama", 128, 352, 4, 2, 32),
}


def build(shape: str, layers: int, weights: str, device):
    import torch
    from transformers import AutoModel, LlamaConfig, Qwen2Config

    family, h, i, heads, kv, hd = SHAPES[shape]
    cls = Qwen2Config if family == "qwen2" else LlamaConfig
    cfg = cls(vocab_size=1024, hidden_size=h, intermediate_size=i, num_hidden_layers=layers, num_attention_heads=heads,
              num_key_value_heads=kv, head_dim=hd, max_position_embeddings=32768)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModel.from_config(cfg).to(device)
    if weights == "bf16":
        model = model.to(torch.bfloat16)
    return model


def measure(shape: str, layers: int, weights: str, float8: bool, a, device) -> dict:
    import torch

    from shardwise.models import float8 as f8
    from shardwise.models.speed import compile_blocks

    cuda = device.type == "cuda"
    torch._dynamo.reset()  # each build compiles afresh (the inductor cache stays): no recompile limit reached across
    model = build(shape, layers, weights, device)
    converted = f8.convert(model) if float8 else []
    if a.compile:
        compile_blocks(model)
    seq = min(a.seq_len, a.tokens)
    ids = torch.randint(0, 1024, (a.tokens // seq, seq), device=device)
    auto = weights == "autocast"

    def fwd():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=auto):
            out = model(input_ids=ids, use_cache=False).last_hidden_state
            inside = torch.cuda.memory_allocated() if cuda else 0
        return out, inside

    def step():
        out, _ = fwd()
        out.float().square().mean().backward()
        model.zero_grad(set_to_none=True)

    for _ in range(a.warmup):
        step()
    times = []
    for _ in range(a.iters):
        if cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            step()
            e1.record()
            torch.cuda.synchronize()
            times.append(e0.elapsed_time(e1))
        else:
            import time

            t = time.perf_counter()
            step()
            times.append((time.perf_counter() - t) * 1e3)
    if cuda:
        torch.cuda.synchronize()
    m0 = torch.cuda.memory_allocated() if cuda else 0
    out, inside = fwd()
    m1 = torch.cuda.memory_allocated() if cuda else 0
    r = {"act_bytes": m1 - m0, "cache_bytes": inside - m1, "fwd_bwd_ms": statistics.median(times),
         "converted": sorted({n.rsplit(".", 1)[-1] for n in converted})}
    out = model = None  # noqa: F841  (free them before the next build)
    if cuda:
        torch.cuda.empty_cache()
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="llama-0.3B,llama-1.1B,llama-3B,llama-8B,qwen2.5-1.5B")
    ap.add_argument("--weights", default="autocast,bf16")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per forward (micro-batch x seq-len)")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--deep", type=int, default=4)
    ap.add_argument("--shallow", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--json")
    a = ap.parse_args()
    import torch

    device = torch.device(a.device)
    a.compile = a.device == "cuda"
    variants = [False, True] if a.device == "cuda" else [False]
    rows = []
    for shape in a.shapes.split(","):
        for weights in a.weights.split(","):
            for float8 in variants:
                try:
                    deep = measure(shape, a.deep, weights, float8, a, device)
                    shallow = measure(shape, a.shallow, weights, float8, a, device)
                except Exception as e:  # noqa: BLE001  (record it, go on with the others)
                    rows.append({"shape": shape, "weights": weights, "float8": float8,
                                 "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"})
                    print(json.dumps(rows[-1]), flush=True)
                    write(a, rows)
                    continue
                n = a.deep - a.shallow
                row = {"shape": shape, "weights": weights, "float8": float8, "tokens": a.tokens,
                       "seq_len": min(a.seq_len, a.tokens), "converted": deep["converted"]}
                for k in ("act_bytes", "cache_bytes", "fwd_bwd_ms"):
                    row[f"block_{k}"] = (deep[k] - shallow[k]) / n
                row["act_bytes_per_token"] = row["block_act_bytes"] / a.tokens
                rows.append(row)
                print(json.dumps(row), flush=True)
                write(a, rows)  # after every row: a run cut short by its time limit keeps what it measured
    write(a, rows)
    return 0


def write(a, rows: list) -> None:
    if a.json:
        from common import versions

        with open(a.json, "w") as fh:
            json.dump({"versions": versions(), "args": vars(a), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    sys.exit(main())
