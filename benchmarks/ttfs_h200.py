"""Time to first step on one GPU (issue 17 item 3, the H200 half): the anchor job under `shardwise train --strategy
single` beside the Hugging Face Trainer on the same job, each a fresh process, in one call.

Job (docs/measurements.md's anchor): random-init Llama-style 1.14B (vocab 32000, hidden 2048, intermediate
8192, 16 layers, 16 heads, 8 KV heads), stored as fp32 safetensors with a word-level tokenizer
(benchmarks/common.py), micro-batch 8 x 2048, bf16 autocast over fp32 weights, --steps optimizer steps.

shardwise: summary.json's `phases_s` (imports, prepare, worker start, model load, wrap, data, first step;
`time_to_first_step` counts from the launcher process's start). HF Trainer: the same marks taken inside its
process (process start from /proc, as shardwise.phases does): imports, data (tokenising the records), model load,
Trainer built, first step (the end of step 1, after a CUDA synchronize). Both also report the wall time of the
whole process as seen from here.

    python benchmarks/ttfs_h200.py --out DIR [--steps 6] [--runs 1] [--shardwise single,ddp,ddp-serial]

--shardwise lists the shardwise variants run before the Trainer in each round: `single` (one process: the launcher
trains in-process), `ddp` (one rank through torchrun's elastic agent, which starts the worker while the launcher
still checks and tokenizes) and `ddp-serial` (the same with SHARDWISE_EARLY_WORKERS=0: prepared first, then started).
A variant named `base-VARIANT` runs VARIANT from the source tree --base-src (e.g. an older commit's src/, carried to
the device), for an A/B in one call.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import ANCHOR, build_model_dir, versions, write_text_data  # noqa: E402

MB, SEQ = 8, 2048
SMOKE_SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=256)  # --smoke: the same path on the CPU, tiny

HF_WORKER = r'''
import json, os, sys, time
from shardwise import phases
marks = {"process_start": phases.process_start()}
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments, TrainerCallback
marks["imported"] = time.time()
model_dir, data, steps, out, MB, SEQ = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
tok = AutoTokenizer.from_pretrained(model_dir)
rows = []
with open(data) as fh:
    for line in fh:
        ids = tok(json.loads(line)["text"])["input_ids"][:SEQ]
        rows.append({"input_ids": ids, "labels": ids})
marks["data_ready"] = time.time()
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
marks["model_loaded"] = time.time()
class First(TrainerCallback):
    def on_step_end(self, args, state, control, **kw):
        if "first_step" not in marks:
            if torch.cuda.is_available(): torch.cuda.synchronize()
            marks["first_step"] = time.time()
args = TrainingArguments(output_dir=out, per_device_train_batch_size=MB, max_steps=steps, bf16=torch.cuda.is_available(), use_cpu=not torch.cuda.is_available(),
    optim="adamw_torch_fused" if torch.cuda.is_available() else "adamw_torch", learning_rate=3e-4, warmup_steps=2, logging_steps=1, report_to=[], save_strategy="no",
    seed=0, data_seed=0, dataloader_drop_last=True, remove_unused_columns=False)
trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=[First()])
marks["trainer_built"] = time.time()
trainer.train()
marks["trained"] = time.time()
print("RESULT " + json.dumps(marks))
'''

HF_PHASES = (("imports", "process_start", "imported"), ("data", "imported", "data_ready"),
             ("model_load", "data_ready", "model_loaded"), ("trainer_init", "model_loaded", "trainer_built"),
             ("first_step", "trainer_built", "first_step"), ("training", "first_step", "trained"))


def run_shardwise(model_dir: str, data: str, steps: int, work: str, tag: str, variant: str = "single",
                  base_src: str = "") -> dict:
    out = os.path.join(work, f"sw-{variant}-{tag}")
    base = variant.startswith("base-")
    strategy = variant.removeprefix("base-").split("-")[0]
    env = {**os.environ, "SHARDWISE_EARLY_WORKERS": "0" if variant.endswith("-serial") else "1"}
    if base:
        if not base_src:
            raise SystemExit(f"variant {variant} needs --base-src")
        here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
        rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != here]
        env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(base_src), *rest])
    cmd = [sys.executable, "-m", "shardwise", "train", "--model", model_dir, "--data", data, "--strategy", strategy,
           "--nproc-per-node", "1",
           "--seq-len", str(SEQ), "--micro-batch-size", str(MB), "--max-steps", str(steps), "--log-every", "1",
           "--mixed-precision", "bf16", "--output-dir", out, "--overwrite", "--no-save-final", "--seed", "0"]
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.time() - t0
    if p.returncode != 0:
        return {"runner": f"shardwise {variant}", "error": (p.stderr.strip().splitlines() or ["?"])[-1][:400],
                "wall_s": round(wall, 2)}
    with open(os.path.join(out, "summary.json")) as fh:
        summary = json.load(fh)
    return {"runner": f"shardwise {variant}", "wall_s": round(wall, 2), "phases_s": summary.get("phases_s"),
            "time_to_first_step_s": (summary.get("phases_s") or {}).get("time_to_first_step"),
            "command": " ".join(cmd[1:])}


def run_hf(model_dir: str, data: str, steps: int, work: str, tag: str) -> dict:
    script = os.path.join(work, "ttfs_hf_worker.py")
    with open(script, "w") as fh:
        fh.write(HF_WORKER)
    t0 = time.time()
    p = subprocess.run([sys.executable, script, model_dir, data, str(steps), os.path.join(work, f"hf-{tag}"),
                        str(MB), str(SEQ)],
                       capture_output=True, text=True)
    wall = time.time() - t0
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode != 0 or not line:
        return {"runner": "HF Trainer", "error": (p.stderr.strip().splitlines() or ["?"])[-1][:400],
                "wall_s": round(wall, 2)}
    marks = json.loads(line[-1][7:])
    ph = {n: round(marks[b] - marks[a], 3) for n, a, b in HF_PHASES if a in marks and b in marks}
    ph["time_to_first_step"] = round(marks["first_step"] - marks["process_start"], 3)
    return {"runner": "HF Trainer", "wall_s": round(wall, 2), "phases_s": ph,
            "time_to_first_step_s": ph["time_to_first_step"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/ttfs-h200")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--runs", type=int, default=1, help="Pairs of runs (shardwise, then HF Trainer).")
    ap.add_argument("--shardwise", default="single", help="Comma-separated: single, ddp, ddp-serial.")
    ap.add_argument("--base-src", default="", help="The source tree the base-* variants run (its src/ directory).")
    ap.add_argument("--smoke", action="store_true", help="A tiny model, 2 x 64 tokens (a CPU check of the script).")
    a = ap.parse_args()
    global MB, SEQ
    shape = ANCHOR
    if a.smoke:
        MB, SEQ, shape = 2, 64, SMOKE_SHAPE
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.work, exist_ok=True)
    t0 = time.time()
    model_dir = build_model_dir(os.path.join(a.work, "smoke" if a.smoke else "anchor-1.1b"), shape)
    data = write_text_data(os.path.join(a.work, f"text-{a.steps}.jsonl"), a.steps * MB, SEQ + 1, shape["vocab_size"])
    print(f"setup {time.time() - t0:.0f}s", flush=True)
    results = []
    for i in range(a.runs):
        runners = [lambda *x, v=v: run_shardwise(*x, variant=v, base_src=a.base_src)
                   for v in a.shardwise.split(",")] + [run_hf]
        for runner in runners:
            r = {**runner(model_dir, data, a.steps, a.work, str(i)), "run": i}
            results.append(r)
            print(json.dumps(r), flush=True)
            with open(os.path.join(a.out, "ttfs_h200.json"), "w") as fh:
                json.dump({"versions": versions(), "job": f"1.14B Llama, {MB} x {SEQ}, bf16, {a.steps} steps",
                           "results": results}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
