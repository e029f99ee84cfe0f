"""shardwise vs the Hugging Face Trainer (the engine under ms-swift, LLaMA-Factory, Axolotl)
on one GPU, on the identical job, in the same run.

Job (issue 6 / ../shared/MEASUREMENTS.md): random-init Llama-style model, vocab 32000,
hidden 2048, intermediate 8192, 16 layers, 16 heads, 8 KV heads (1.14B params),
micro-batch 8 x 2048 tokens, bf16 autocast over fp32 master weights, fused AdamW, SDPA.

    python benchmarks/vs_hf_trainer.py --out DIR [--steps 30] [--warmup 10] [--variants a,b,...]
    python benchmarks/vs_hf_trainer.py --out DIR --curves 300     # loss curves, both runners

Each runner is a fresh process. Tokens/s is the median over the counted steps (after the
warm-up, which includes compilation), MFU counts 6N + 12*L*H*T FLOPs per token against
the GPU's dense bf16 peak (989 TFLOP/s on an H100/H200), peak memory is
torch.cuda.max_memory_allocated. Writes DIR/results.json and DIR/results.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import ANCHOR, build_model_dir, shardwise, versions, write_text_data  # noqa: E402

MB, SEQ = 8, 2048
PEAK = 989e12


def flops_per_token(n_params: int) -> float:
    return 6 * n_params + 12 * ANCHOR["num_hidden_layers"] * ANCHOR["hidden_size"] * SEQ


# name -> extra shardwise train flags
SHARDWISE_VARIANTS = {
    "sw-single-plain": ["--strategy", "single", "--compile", "off", "--no-fused-loss"],
    "sw-single-fusedloss": ["--strategy", "single", "--compile", "off"],
    "sw-single": ["--strategy", "single"],
    "sw-fsdp": ["--strategy", "fsdp", "--nproc-per-node", "1"],
    "sw-ddp": ["--strategy", "ddp", "--nproc-per-node", "1"],
    "sw-single-gc": ["--strategy", "single", "--gradient-checkpointing"],
    "sw-single-plain-gc": ["--strategy", "single", "--gradient-checkpointing", "--compile", "off", "--no-fused-loss"],
}
HF_VARIANTS = {"hf-trainer": False, "hf-trainer-gc": True}


def run_shardwise(name, model_dir, data, steps, warmup, workdir, lr, extra_common=()):
    out = os.path.join(workdir, name)
    args = ["train", "--model", model_dir, "--data", data, "--seq-len", str(SEQ), "--micro-batch-size", str(MB),
            "--max-steps", str(steps), "--log-every", "1", "--lr", str(lr), "--warmup-steps", "10",
            "--mixed-precision", "bf16", "--output-dir", out, "--overwrite", "--no-save-final", "--seed", "0",
            *SHARDWISE_VARIANTS[name], *extra_common]
    t0 = time.time()
    p = shardwise(*args)
    if p.returncode != 0:
        return {"name": name, "error": (p.stderr.strip().splitlines() or ["?"])[-1][:400], "wall_s": time.time() - t0}
    with open(os.path.join(out, "metrics.jsonl")) as fh:
        recs = [json.loads(line) for line in fh]
    with open(os.path.join(out, "summary.json")) as fh:
        summary = json.load(fh)
    counted = recs[warmup:]
    return {"name": name, "tokens_per_s": statistics.median(r["tokens_per_s"] for r in counted),
            "step_time_s": statistics.median(r["step_time_s"] for r in counted),
            "peak_mem_gib": max(r["peak_mem_gib"] for r in recs), "losses": [r["loss"] for r in recs],
            "params": summary["params"], "wall_s": time.time() - t0}


HF_WORKER = r'''
import json, os, sys, time, torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments, TrainerCallback
model_dir, data, steps, gc, lr, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1", float(sys.argv[5]), sys.argv[6]
tok = AutoTokenizer.from_pretrained(model_dir)
rows = []
with open(data) as fh:
    for line in fh:
        ids = tok(json.loads(line)["text"])["input_ids"][:%(SEQ)d]
        rows.append({"input_ids": ids, "labels": ids})
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
class Times(TrainerCallback):
    def __init__(self): self.t = []; self.loss = []
    def on_step_end(self, args, state, control, **kw):
        torch.cuda.synchronize(); self.t.append(time.perf_counter())
    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "loss" in logs: self.loss.append(logs["loss"])
cb = Times()
args = TrainingArguments(output_dir=out, per_device_train_batch_size=%(MB)d, max_steps=steps, bf16=True,
    optim="adamw_torch_fused", learning_rate=lr, warmup_steps=10, lr_scheduler_type="cosine_with_min_lr",
    lr_scheduler_kwargs={"min_lr_rate": 0.1}, weight_decay=0.0, max_grad_norm=1.0, logging_steps=1,
    report_to=[], save_strategy="no", gradient_checkpointing=gc, seed=0, data_seed=0, dataloader_drop_last=True,
    remove_unused_columns=False)
torch.cuda.reset_peak_memory_stats()
Trainer(model=model, args=args, train_dataset=rows, callbacks=[cb]).train()
dts = [b - a for a, b in zip(cb.t, cb.t[1:])]
print("RESULT " + json.dumps({"step_times": dts, "losses": cb.loss, "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
      "params": sum(p.numel() for p in model.parameters())}))
''' % {"SEQ": SEQ, "MB": MB}


def run_hf(name, model_dir, data, steps, warmup, workdir, lr):
    import subprocess

    script = os.path.join(workdir, "hf_worker.py")
    with open(script, "w") as fh:
        fh.write(HF_WORKER)
    t0 = time.time()
    p = subprocess.run([sys.executable, script, model_dir, data, str(steps), "1" if HF_VARIANTS[name] else "0",
                        str(lr), os.path.join(workdir, name)], capture_output=True, text=True)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode != 0 or not line:
        return {"name": name, "error": (p.stderr.strip().splitlines() or ["?"])[-1][:400], "wall_s": time.time() - t0}
    r = json.loads(line[-1][7:])
    dt = statistics.median(r["step_times"][warmup:])
    return {"name": name, "tokens_per_s": MB * SEQ / dt, "step_time_s": dt, "peak_mem_gib": r["peak_mem_gib"],
            "losses": r["losses"], "params": r["params"], "wall_s": time.time() - t0}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--workdir", default="/tmp/vs_hf")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--variants", default="hf-trainer,sw-single-plain,sw-single,sw-fsdp")
    ap.add_argument("--curves", type=int, default=0, help="Run hf-trainer and sw-single for N steps; compare losses.")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.workdir, exist_ok=True)
    t0 = time.time()
    model_dir = build_model_dir(os.path.join(args.workdir, "anchor-1.1b"))
    steps = args.curves or args.steps
    data = write_text_data(os.path.join(args.workdir, f"text-{steps}.jsonl"), steps * MB, SEQ + 1,
                           ANCHOR["vocab_size"])
    print(f"setup {time.time() - t0:.0f}s", flush=True)
    names = ["hf-trainer", "sw-single"] if args.curves else args.variants.split(",")
    results = []
    for name in names:
        runner = run_hf if name in HF_VARIANTS else run_shardwise
        r = runner(name, model_dir, data, steps, args.warmup, args.workdir, args.lr)
        if "tokens_per_s" in r:
            r["mfu"] = r["tokens_per_s"] * flops_per_token(r["params"]) / PEAK
        results.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "losses"}), flush=True)
    base = {r["name"]: r for r in results}
    lines = [f"# shardwise vs HF Trainer — {time.strftime('%Y-%m-%d')}", "",
             f"Versions: `{json.dumps(versions())}`", "",
             f"Job: 1.14B Llama-style (random init), micro-batch {MB} x {SEQ}, bf16 autocast, fp32 master weights, "
             f"fused AdamW, lr {args.lr}, {steps} steps, median over steps {args.warmup + 1}-{steps}.", "",
             "| runner | tokens/s | vs HF Trainer | MFU | peak allocated GiB | step s |", "|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['name']} | failed: {r['error']} | | | | |")
            continue
        ref = base.get("hf-trainer-gc" if r["name"].endswith("-gc") else "hf-trainer")
        ratio = f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}x" if ref and "tokens_per_s" in ref else "n/a"
        lines.append(f"| {r['name']} | {r['tokens_per_s']:,.0f} | {ratio} | {r['mfu']:.1%} | {r['peak_mem_gib']:.1f} | "
                     f"{r['step_time_s']:.3f} |")
    if args.curves and all("losses" in r for r in results):
        a, b = base["hf-trainer"]["losses"], base["sw-single"]["losses"]
        n = min(len(a), len(b))
        lines += ["", "Loss curves (same init, data, order):", "", "| step | HF Trainer | shardwise |", "|---|---|---|"]
        for i in sorted({0, 1, 4, 9, 19, 49, 99, 199, n - 1} & set(range(n))):
            lines.append(f"| {i + 1} | {a[i]:.4f} | {b[i]:.4f} |")
        tail = slice(max(n - 20, 0), n)
        lines.append(f"\nMean loss over the last 20 steps: HF {statistics.mean(a[tail]):.4f}, "
                     f"shardwise {statistics.mean(b[tail]):.4f}.")
    text = "\n".join(lines) + "\n"
    print(text)
    with open(os.path.join(args.out, "results.md"), "w") as fh:
        fh.write(text)
    with open(os.path.join(args.out, "results.json"), "w") as fh:
        json.dump({"versions": versions(), "results": results, "args": vars(args)}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
