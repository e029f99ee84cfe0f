"""Padded against padding-free micro-batches on the CPU (--padding-free; docs/data.md): one forward/backward.

  python benchmarks/padding_free_step.py            # the default row sets below
  python benchmarks/padding_free_step.py 88,60,50,50 1000,1000,1000,1000

Builds the time_to_first_step.py model shape (3.9M Qwen2, random init, fp32, SDPA) and times, on one thread (as each
rank of the tiny CPU job runs), one forward/backward of the same rows laid out two ways, through shardwise's own
collate: padded (B x the longest rounded up to 8; no mask, SDPA's causal kernel) and flattened (1 x the total rounded
up to 8; positions restart per row, so transformers builds a dense block-diagonal mask). Each is the fastest of
--repeats, alternated. The flattened row computes no padding but attends over a dense (S, S) mask of the whole
micro-batch, so long rows with little padding can cost more than they save.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

DEFAULT_SETS = ["88,60,50,50", "256,200,120,60", "512,400,300,300", "1024,800,700,600", "1024,1000,1000,1000"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sets", nargs="*", default=DEFAULT_SETS, help="row lengths of one micro-batch, comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import torch
    from time_to_first_step import QWEN2_SHAPE
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from shardwise.data.batches import StepSampler
    from shardwise.data.encode import Encoded
    from shardwise.models.speed import token_loss_sum

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=512, **{**QWEN2_SHAPE, "max_position_embeddings": 8192}))
    model.config.use_cache = False
    model.train()

    def one(mb) -> float:
        t = time.perf_counter()
        logits = model(input_ids=mb.input_ids, position_ids=mb.position_ids).logits
        token_loss_sum(logits, mb.targets).backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t

    print(f"torch {torch.__version__}, 1 thread; forward/backward, fastest of {args.repeats}")
    print("| rows | real / padded slots | padded | ms | flattened | ms | flattened / padded |")
    print("|---|---:|---|---:|---|---:|---:|")
    for spec in args.sets:
        lengths = [int(n) for n in spec.split(",")]
        ids = [torch.randint(1, 512, (n,)).tolist() for n in lengths]
        data = Encoded(ids, ids, [list(range(n)) for n in lengths], [""] * len(lengths))
        rows = list(range(len(lengths)))
        padded = StepSampler(data, len(rows), 1, 1, 0, 0, 0).collate(rows)
        flat = StepSampler(data, len(rows), 1, 1, 0, 0, 0, padding_free=True).collate(rows)
        one(padded), one(flat)  # warm-up
        times = {"p": [], "f": []}
        for _ in range(args.repeats):
            times["p"].append(one(padded))
            times["f"].append(one(flat))
        p, f = min(times["p"]) * 1e3, min(times["f"]) * 1e3
        shape = lambda mb: " x ".join(map(str, mb.input_ids.shape))  # noqa: E731
        print(f"| {spec} | {sum(lengths) / padded.input_ids.numel():.2f} | {shape(padded)} | {p:.0f} | "
              f"{shape(flat)} | {f:.0f} | {f / p:.2f} |", flush=True)


if __name__ == "__main__":
    main()
