"""shardwise's DPO (task dpo) vs TRL's DPOTrainer on one GPU, on the identical job, in the same run, beside the plan.

Job (issue 44): the Qwen2.5-1.5B shape (random init, no download: vocab 151936, hidden 1536, intermediate 8960,
28 layers, 12 heads, 2 KV heads, tied embeddings, rope theta 1e6) as a Llama-architecture model (Qwen2 adds only
the q/k/v biases, 0.2M parameters; transformers loads a Qwen2 directory with Qwen2's own BPE tokenizer class, which
the benchmarks' word-level tokenizer is not), a word-level tokenizer (one token a word) and
synthetic preference pairs of 2,048 tokens a pair: a prompt of --prompt-words words and two answers of
--answer-words words each, in the chat template (each row is the prompt and one answer: ~1,030 tokens with the
defaults). DPO (sigmoid, beta 0.1) with the starting model as the reference; full fine-tuning (bf16 autocast over fp32
master weights, fused AdamW; the reference a frozen copy) and LoRA (r 16, alpha 32, all linear layers; the reference
the base with the adapters off). --micro-batch-size pairs a step, no gradient checkpointing on either side (TRL's
DPOConfig turns it on by default: off here, so both hold the same activations).

    python benchmarks/dpo_vs_trl.py --out DIR [--steps 30] [--warmup 10] [--variants sw-full,trl-full,sw-lora,trl-lora]
    python benchmarks/dpo_vs_trl.py --out DIR --smoke      # the CPU check of shardwise's side (tiny shape, 4 steps)
    python benchmarks/dpo_vs_trl.py --install-missing .whl/trl --out DIR ...   # TRL's wheels first, where missing

TRL is imported only by its worker process. On the device, --install-missing DIR installs the wheels of DIR (trl,
datasets and their dependencies, `pip download`ed on a machine with network) into /tmp/site, each only where no
distribution of that name is installed (no dependency resolution: what the device has stays as it is). Each
runner is a fresh process. Tokens/s counts the real tokens of both rows of every pair (what shardwise's metrics
count), the median over the counted steps (after --warmup, which includes compilation); peak memory is
torch.cuda.max_memory_allocated. The plan's prediction is `shardwise plan --json` of the same job. Writes
DIR/results.json and DIR/dpo_vs_trl_<date>.md (hardware, versions, the exact job, the ratios against TRL and the
plan's errors).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import build_model_dir, free_port, shardwise, versions  # noqa: E402,F401

QWEN15 = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
              num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768, tie_word_embeddings=True,
              rope_theta=1000000.0)
SMOKE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)
LORA = {"r": 16, "alpha": 32, "dropout": 0.05}
VARIANTS = ("sw-full", "trl-full", "sw-lora", "trl-lora")


def write_pairs(path: str, n: int, prompt_words: int, answer_words: int, vocab: int, seed: int = 0) -> str:
    """TRL-form pairs ({prompt, chosen, rejected} message lists): random words; the chosen answer repeats the
    prompt's first words (something to prefer), the rejected one is random."""
    import random

    rng = random.Random(seed)
    words = [f"w{i}" for i in range(vocab - 6)]
    with open(path, "w") as fh:
        for _ in range(n):
            prompt = [rng.choice(words) for _ in range(prompt_words)]
            chosen = (prompt * (answer_words // max(1, prompt_words) + 1))[:answer_words]
            rejected = [rng.choice(words) for _ in range(answer_words)]
            fh.write(json.dumps({"prompt": [{"role": "user", "content": " ".join(prompt)}],
                                 "chosen": [{"role": "assistant", "content": " ".join(chosen)}],
                                 "rejected": [{"role": "assistant", "content": " ".join(rejected)}]}) + "\n")
    return path


def pair_tokens(model_dir: str, data: str) -> tuple[int, int]:
    """(tokens of a pair's two rows, the longest row), as shardwise encodes them (data/preference.py)."""
    from shardwise.data.encode import pair_texts
    from shardwise.data.preference import parse_preference
    from shardwise.models.load import load_tokenizer

    tok = load_tokenizer(model_dir, False)
    with open(data) as fh:
        rec = parse_preference(json.loads(fh.readline()), "trl", "pairs:1")
    p, c, r = (len(tok(t, add_special_tokens=False)["input_ids"]) for t in pair_texts(tok, rec))
    return 2 * p + c + r, p + max(c, r)


def sw_flags(variant: str) -> list[str]:
    if variant.endswith("lora"):
        return ["--tuner", "lora", "--lora-r", str(LORA["r"]), "--lora-alpha", str(LORA["alpha"]),
                "--lora-dropout", str(LORA["dropout"])]
    return []


def run_shardwise(variant, model_dir, data, a, seq) -> dict:
    out = os.path.join(a.workdir, variant)
    precision = ["--mixed-precision", "no"] if a.smoke else ["--mixed-precision", "bf16"]
    args = ["train", "--model", model_dir, "--data", data, "--task", "dpo", "--beta", "0.1", "--strategy", "single",
            "--seq-len", str(seq), "--micro-batch-size", str(a.micro_batch_size), "--max-steps", str(a.steps),
            "--log-every", "1", "--lr", str(a.lr), "--warmup-steps", "2", *precision, "--output-dir", out,
            "--overwrite", "--no-save-final", "--seed", "0", "--report-to", "none", *sw_flags(variant)]
    t0 = time.time()
    p = shardwise(*args)
    if p.returncode != 0:
        return {"name": variant, "error": (p.stderr.strip().splitlines() or ["?"])[-1][:400], "wall_s": time.time() - t0}
    with open(os.path.join(out, "metrics.jsonl")) as fh:
        recs = [json.loads(line) for line in fh]
    counted = recs[a.warmup:] or recs
    return {"name": variant, "tokens_per_s": statistics.median(r["tokens_per_s"] for r in counted),
            "step_time_s": statistics.median(r["step_time_s"] for r in counted),
            "peak_mem_gib": max(r["peak_mem_gib"] for r in recs), "losses": [r["loss"] for r in recs],
            "margins": [r["rewards/margins"] for r in recs], "wall_s": time.time() - t0}


# Written against TRL 1.x's documented API (DPOConfig / DPOTrainer(model, ref_model, args, train_dataset,
# processing_class, peft_config)); ref_model None: TRL makes the frozen copy itself, or with a PEFT model uses the
# base with the adapters off, as shardwise does.
TRL_WORKER = r'''
import json, sys, time, torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import DPOConfig, DPOTrainer
model_dir, data, steps, lr, out, mb, seq, lora = sys.argv[1:9]
steps, lr, mb, seq, lora = int(steps), float(lr), int(mb), int(seq), json.loads(lora)
cuda = torch.cuda.is_available()
tok = AutoTokenizer.from_pretrained(model_dir)
rows = [json.loads(line) for line in open(data)]
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
peft_config = None
if lora:
    from peft import LoraConfig
    peft_config = LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                             target_modules="all-linear", task_type="CAUSAL_LM")
class Times(TrainerCallback):
    def __init__(self): self.t = []; self.loss = []; self.margin = []
    def on_step_end(self, args, state, control, **kw):
        if cuda: torch.cuda.synchronize()
        self.t.append(time.perf_counter())
    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "loss" in logs:
            self.loss.append(logs["loss"]); self.margin.append(logs.get("rewards/margins"))
cb = Times()
args = DPOConfig(output_dir=out, per_device_train_batch_size=mb, max_steps=steps, bf16=cuda, use_cpu=not cuda,
    gradient_checkpointing=False, optim="adamw_torch_fused" if cuda else "adamw_torch", learning_rate=lr,
    warmup_steps=2, lr_scheduler_type="cosine", weight_decay=0.0, max_grad_norm=1.0, logging_steps=1, report_to=[],
    save_strategy="no", seed=0, data_seed=0, dataloader_drop_last=True, beta=0.1, loss_type=["sigmoid"],
    max_length=seq)
if cuda: torch.cuda.reset_peak_memory_stats()
trainer = DPOTrainer(model=model, ref_model=None, args=args, train_dataset=Dataset.from_list(rows),
                     processing_class=tok, peft_config=peft_config, callbacks=[cb])
trainer.train()
dts = [b - a for a, b in zip(cb.t, cb.t[1:])]
print("RESULT " + json.dumps({"step_times": dts, "losses": cb.loss, "margins": cb.margin,
      "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0}), flush=True)
'''


def run_trl(variant, model_dir, data, a, seq, pair_tok) -> dict:
    script = os.path.join(a.workdir, "trl_worker.py")
    with open(script, "w") as fh:
        fh.write(TRL_WORKER)
    t0 = time.time()
    lora = json.dumps(LORA if variant.endswith("lora") else None)
    p = subprocess.run([sys.executable, script, model_dir, data, str(a.steps), str(a.lr),
                        os.path.join(a.workdir, variant), str(a.micro_batch_size), str(seq), lora],
                       capture_output=True, text=True)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode != 0 or not line:
        return {"name": variant, "error": (p.stderr.strip().splitlines() or ["?"])[-1][:400], "wall_s": time.time() - t0}
    r = json.loads(line[-1][7:])
    dt = statistics.median(r["step_times"][max(0, a.warmup - 1):] or r["step_times"])
    return {"name": variant, "tokens_per_s": a.micro_batch_size * pair_tok / dt, "step_time_s": dt,
            "peak_mem_gib": r["peak_mem_gib"], "losses": r["losses"], "margins": r["margins"],
            "wall_s": time.time() - t0}


def predict(variant, model_dir, a, seq, gpu_mem: float) -> dict:
    """`shardwise plan --json` of the same job, for strategy single."""
    precision = ["--mixed-precision", "no"] if a.smoke else ["--mixed-precision", "bf16"]
    p = shardwise("plan", "--model", model_dir, "--gpus", "1", "--gpu-memory", str(gpu_mem), "--task", "dpo",
                  "--seq-len", str(seq), "--micro-batch-size", str(a.micro_batch_size), "--strategy", "single",
                  *precision, *(sw_flags(variant)[:4]), "--json")
    if p.returncode != 0:
        return {"error": (p.stderr.strip().splitlines() or ["?"])[-1][:300]}
    s = next(x for x in json.loads(p.stdout)["strategies"] if x["strategy"] == "single")
    return {"tokens_per_s": s["tokens_per_s"], "peak_mem_gib": s["mem_gib"]["total"],
            "peak_tensors_gib": s["mem_gib"]["peak_tensors"]}


def report(results: list[dict], a, info: dict) -> str:
    by = {r["name"]: r for r in results}
    lines = [f"# DPO: shardwise vs TRL DPOTrainer ({info['date']})", "",
             f"Hardware and versions: `{json.dumps(info['versions'])}`", "",
             f"Job: {info['job']}", "",
             "Peak GiB is torch.cuda.max_memory_allocated (tensors); the plan's beside it is its tensor peak, then its "
             "peak with the allocator's reserve.", "",
             "| variant | tokens/s | peak GiB | vs TRL tokens/s | vs TRL memory | plan tokens/s (err) | "
             "plan tensor GiB (err) | plan with reserve GiB |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['name']} | error: {r['error']} | | | | | | |")
            continue
        trl = by.get("trl-" + r["name"].split("-", 1)[1]) if r["name"].startswith("sw-") else None
        vs = (f"{r['tokens_per_s'] / trl['tokens_per_s']:.2f}x", f"{r['peak_mem_gib'] / trl['peak_mem_gib']:.2f}x") \
            if trl and "error" not in trl and trl["peak_mem_gib"] else ("", "")
        pr = r.get("plan") or {}
        plan = ("", "", "") if not pr or "error" in pr else (
            f"{pr['tokens_per_s']:,.0f} ({pr['tokens_per_s'] / r['tokens_per_s'] - 1:+.0%})",
            f"{pr['peak_tensors_gib']:.2f} ({pr['peak_tensors_gib'] / r['peak_mem_gib'] - 1:+.0%})"
            if r["peak_mem_gib"] else f"{pr['peak_tensors_gib']:.2f}", f"{pr['peak_mem_gib']:.2f}")
        lines.append(f"| {r['name']} | {r['tokens_per_s']:,.0f} | {r['peak_mem_gib']:.2f} | {vs[0]} | {vs[1]} | "
                     f"{plan[0]} | {plan[1]} | {plan[2]} |")
    lines += ["", "Goal (issue 44): >= 1.3x TRL's tokens/s at no more memory; the plan within 10% (memory) and "
              "20% (tokens/s).", "", "Raw per-step losses and reward margins: results.json beside this file."]
    if a.smoke:
        lines += ["", "Smoke run on the CPU: the plan assumes a GPU, so its columns say nothing here."]
    return "\n".join(lines) + "\n"


def install_missing(folder: str, target: str = "/tmp/site") -> list[str]:
    """pip install --no-deps into `target` each wheel of `folder` whose distribution is not installed; the names."""
    import glob
    from importlib import metadata

    todo = []
    for whl in sorted(glob.glob(os.path.join(folder, "*.whl"))):
        dist = os.path.basename(whl).split("-")[0]
        try:
            metadata.version(dist)
        except metadata.PackageNotFoundError:
            todo.append(whl)
    if todo:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--target", target, *todo], check=True)
        if target not in sys.path:
            sys.path.insert(0, target)
        os.environ["PYTHONPATH"] = os.pathsep.join([target, *filter(None, [os.environ.get("PYTHONPATH")])])
    return [os.path.basename(w).split("-")[0] for w in todo]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--workdir", default="/tmp/dpo_vs_trl")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--lr", type=float, default=5e-6)
    ap.add_argument("--micro-batch-size", type=int, default=2, help="Pairs per step (one micro-batch). TRL holds the "
                    "full fp32 logits of the 2 x N rows (151,936 a token): 4 pairs may not fit TRL's full fine-tune "
                    "on an 80 GiB card.")
    ap.add_argument("--prompt-words", type=int, default=512)
    ap.add_argument("--answer-words", type=int, default=512)
    ap.add_argument("--pairs", type=int, default=512)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--gpu-memory", type=float, default=0.0, help="GiB for the plan (default: the device's).")
    ap.add_argument("--smoke", action="store_true", help="The tiny shape on the CPU, 4 steps, shardwise's side "
                    "(and TRL's if it is installed).")
    ap.add_argument("--install-missing", metavar="DIR", help="First install DIR's wheels whose distributions are "
                    "not installed (into --site, no dependencies).")
    ap.add_argument("--site", default="/tmp/site", help="Where --install-missing installs (benchmarks/run.py's "
                    "setup puts /tmp/site first on PYTHONPATH).")
    a = ap.parse_args()
    if a.install_missing:
        print("installed: " + (", ".join(install_missing(a.install_missing, a.site)) or "nothing (all present)"), flush=True)
    if a.smoke:
        a.steps, a.warmup, a.micro_batch_size, a.prompt_words, a.answer_words, a.pairs = 4, 1, 2, 24, 12, 16
        a.variants = ",".join(v for v in a.variants.split(",") if v.startswith("sw-") or _has_trl())
    os.makedirs(a.workdir, exist_ok=True)
    os.makedirs(a.out, exist_ok=True)
    shape = SMOKE if a.smoke else QWEN15
    model_dir = build_model_dir(os.path.join(a.workdir, "model-smoke" if a.smoke else "model-qwen2.5-1.5b"), shape)
    data = write_pairs(os.path.join(a.workdir, "pairs.jsonl"), a.pairs, a.prompt_words, a.answer_words,
                       shape["vocab_size"])
    pair_tok, longest = pair_tokens(model_dir, data)
    seq = -(-longest // 8) * 8
    gpu_mem = a.gpu_memory or _device_gib()
    results = []
    for v in a.variants.split(","):
        r = run_shardwise(v, model_dir, data, a, seq) if v.startswith("sw-") else run_trl(v, model_dir, data, a, seq,
                                                                                        pair_tok)
        if v.startswith("sw-"):
            r["plan"] = predict(v, model_dir, a, seq, gpu_mem)
        print(json.dumps({k: x for k, x in r.items() if k not in ("losses", "margins")}), flush=True)
        results.append(r)
    date = datetime.date.today().isoformat()
    info = {"date": date, "versions": {**versions(), **_trl_version()},
            "job": (f"{'tiny smoke shape' if a.smoke else 'Qwen2.5-1.5B shape'} ({json.dumps(shape)}), {pair_tok} "
                    f"tokens a pair (rows up to {longest}, seq_len {seq}), {a.micro_batch_size} pairs a step, "
                    f"{a.steps} steps ({a.warmup} warm-up), lr {a.lr}, DPO sigmoid beta 0.1, "
                    f"{'fp32' if a.smoke else 'bf16 autocast over fp32 weights'}; LoRA {LORA}")}
    with open(os.path.join(a.out, "results.json"), "w") as fh:
        json.dump({"info": info, "results": results}, fh, indent=1)
    md = os.path.join(a.out, f"dpo_vs_trl_{'smoke_' if a.smoke else ''}{date}.md")
    with open(md, "w") as fh:
        fh.write(report(results, a, info))
    print(f"wrote {md}")
    return 0 if all("error" not in r for r in results) else 1


def _has_trl() -> bool:
    import importlib.util

    return importlib.util.find_spec("trl") is not None


def _trl_version() -> dict:
    try:
        import trl

        return {"trl": trl.__version__}
    except ImportError:
        return {}


def _device_gib() -> float:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / 2**30
    return 16.0


if __name__ == "__main__":
    sys.exit(main())
