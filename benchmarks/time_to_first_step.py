"""Time to first step on the CPU (issue 17 item 3): the tiny 2-rank DDP job, end to end.

Builds, once, under --work (default /tmp/shardwise-ttfs): a 3.9M-parameter Qwen2-shaped model
(random init, the built-in tiny byte-level BPE tokenizer with its chat template) and 2,000 chat
records; then runs

    shardwise train --model M --data D --strategy ddp --nproc-per-node 2 --micro-batch-size 4
                    --seq-len 256 --max-steps 50 --mixed-precision no --output-dir O --overwrite

--runs times and prints each run's wall time and the phases the run wrote to summary.json
(`phases_s`). `--setup-only` builds the inputs and prints the command (to time it with an
external tool, e.g. `/usr/bin/time -v`, or pairs of commands A/B).

    python benchmarks/time_to_first_step.py --runs 3
    python benchmarks/time_to_first_step.py --runs 4 --base-src ../base/src --swift benchmarks/swift_tiny_job.sh

Each round runs the variants one after another, in this order: `base` (--base-src: shardwise from another source
tree, e.g. a worktree of an older commit, by PYTHONPATH), `shardwise` (this tree), `swift` (--swift: ms-swift's
`swift sft` on the same job, benchmarks/swift_tiny_job.sh). --json writes every run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

QWEN2_SHAPE = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=5, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0,
                   tie_word_embeddings=False)


def build(work: str) -> tuple[str, str]:
    model_dir, data = os.path.join(work, "qwen2-3.9m"), os.path.join(work, "chat-2000.jsonl")
    if not os.path.isfile(os.path.join(model_dir, "model.safetensors")):
        import torch
        from transformers import Qwen2Config, Qwen2ForCausalLM

        from shardwise.models.tiny import build_tokenizer

        tok = build_tokenizer()
        cfg = Qwen2Config(vocab_size=512, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id, **QWEN2_SHAPE)
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(cfg)
        model.save_pretrained(model_dir)
        tok.save_pretrained(model_dir)
    if not os.path.isfile(data):
        words = ["apple", "river", "stone", "cloud", "green", "quiet", "music", "forest", "light", "paper"]
        with open(data, "w") as fh:
            for i in range(2000):
                q = " ".join(words[(i + k) % 10] for k in range(3 + i % 17))
                a = " ".join(words[(i * 7 + k) % 10] for k in range(5 + (i * 3) % 40))
                fh.write(json.dumps({"messages": [{"role": "user", "content": q},
                                                  {"role": "assistant", "content": a}]}) + "\n")
    return model_dir, data


def command(model_dir: str, data: str, out: str) -> list[str]:
    return [sys.executable, "-m", "shardwise", "train", "--model", model_dir, "--data", data, "--strategy", "ddp",
            "--nproc-per-node", "2", "--micro-batch-size", "4", "--seq-len", "256", "--max-steps", "50",
            "--mixed-precision", "no", "--output-dir", out, "--overwrite"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/shardwise-ttfs")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--setup-only", action="store_true")
    ap.add_argument("--base-src", default="", help="Also time shardwise from this src/ directory (an A/B).")
    ap.add_argument("--swift", default="", help="Also time this ms-swift script on the same job.")
    ap.add_argument("--json", default="", help="Write every run here.")
    ap.add_argument("--abba", action="store_true", help="With --base-src: this tree first in every other pair (the "
                    "second run of a pair has trained slower on the 2-core box, whichever tree it was)")
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    model_dir, data = build(a.work)
    cmd = command(model_dir, data, os.path.join(a.work, "run"))
    if a.setup_only:
        print(" ".join(cmd))
        return 0
    # base: its tree first on the path, then whatever PYTHONPATH the caller set for both (e.g. extra packages)
    base_path = os.pathsep.join([os.path.abspath(a.base_src), *filter(None, [os.environ.get("PYTHONPATH")])])
    variants = ([("base", {"PYTHONPATH": base_path})] if a.base_src else []) + [("shardwise", {})]
    results = []
    for i in range(a.runs):
        for name, env in (variants[::-1] if a.abba and i % 2 else variants):
            t0 = time.perf_counter()
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, **env})
            wall = time.perf_counter() - t0
            with open(os.path.join(a.work, "run", "summary.json")) as fh:
                phases = json.load(fh).get("phases_s", {})
            results.append({"run": i + 1, "variant": name, "wall_s": round(wall, 2), "phases_s": phases})
            print(json.dumps(results[-1]), flush=True)
        if a.swift:
            out = os.path.join(a.work, f"swift-{os.getpid()}-{i}")  # the script refuses an existing directory
            t0 = time.perf_counter()
            subprocess.run(["bash", a.swift, out], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            results.append({"run": i + 1, "variant": "swift", "wall_s": round(time.perf_counter() - t0, 2)})
            print(json.dumps(results[-1]), flush=True)
        if a.json:
            with open(a.json, "w") as fh:
                json.dump({"load_before": os.getloadavg(), "results": results}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
