"""shardwise vs the Hugging Face Trainer (the engine under ms-swift, LLaMA-Factory, Axolotl)
on one GPU, on the identical job, in the same run.

Job (the anchor of docs/measurements.md): random-init Llama-style model, vocab 32000,
hidden 2048, intermediate 8192, 16 layers, 16 heads, 8 KV heads (1.14B params),
micro-batch 8 x 2048 tokens, bf16 autocast over fp32 master weights, fused AdamW, SDPA.

    python benchmarks/vs_hf_trainer.py --out DIR [--steps 30] [--warmup 10] [--variants a,b,...]
    python benchmarks/vs_hf_trainer.py --out DIR --curves 300     # loss curves, both runners
    python benchmarks/vs_hf_trainer.py --out DIR --gpus 2 --variants hf-trainer-zero3,sw-zero3,sw-fsdp-all,hf-trainer-zero3
        # issue 17 item 1: ZeRO-3 on N GPUs, the HF Trainer with DeepSpeed (launched by torchrun, as ms-swift
        # launches it) against shardwise's zero3 and fsdp, the same job per GPU
    python benchmarks/vs_hf_trainer.py --out DIR --smoke --gpus 2 --variants hf-trainer-zero3,sw-zero3
        # the CPU check of the harness: a 2-layer model, 2 x 128 tokens, gloo (about 2 minutes on 2 cores)

ZeRO-3 (`hf-trainer-zero3`): DeepSpeed stage 3 with overlap_comm and contiguous gradients, bucket, prefetch and
persistence sizes left to the Trainer ("auto": derived from the hidden size), max live parameters and reuse distance
1e9, bf16, gradient clipping from the Trainer; the optimizer is the Trainer's (fused AdamW), as in the other rows.
These are the stage-3 settings ms-swift ships as its default for large models (its `zero3` config).

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
SMOKE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)  # --smoke: the harness on the CPU


def flops_per_token(n_params: int, shape: dict = ANCHOR, seq: int = SEQ) -> float:
    return 6 * n_params + 12 * shape["num_hidden_layers"] * shape["hidden_size"] * seq


# name -> extra shardwise train flags
SHARDWISE_VARIANTS = {
    "sw-single-plain": ["--strategy", "single", "--compile", "off", "--no-fused-loss"],
    "sw-single-fusedloss": ["--strategy", "single", "--compile", "off"],
    "sw-single": ["--strategy", "single"],
    "sw-fsdp": ["--strategy", "fsdp", "--nproc-per-node", "1"],
    "sw-ddp": ["--strategy", "ddp", "--nproc-per-node", "1"],
    "sw-single-gc": ["--strategy", "single", "--gradient-checkpointing"],
    "sw-single-plain-gc": ["--strategy", "single", "--gradient-checkpointing", "--compile", "off", "--no-fused-loss"],
    # on every GPU of the machine (--gpus): the ZeRO-3 comparison of issue 17 item 1
    "sw-zero3": ["--strategy", "zero3"],
    # ZeRO-3's fetch unit (deepspeed.fetch): DeepSpeed's own per-submodule hooks, as before 2026-12-01; and eager
    "sw-zero3-module": ["--strategy", "zero3", "--deepspeed-fetch", "module"],
    "sw-zero3-eager": ["--strategy", "zero3", "--compile", "off"],
    "sw-zero3-module-eager": ["--strategy", "zero3", "--deepspeed-fetch", "module", "--compile", "off"],
    "sw-fsdp-all": ["--strategy", "fsdp"],
    "sw-ddp-all": ["--strategy", "ddp"],
    # shardwise's zero3 given the very JSON the Trainer gets (zero3_config: "auto" filled the Trainer's way, so the
    # same overlap_comm and bucket, prefetch and persistence sizes): the engine settings no longer differ
    "sw-zero3-hfjson": ["--strategy", "zero3"],
}
ON_ALL_GPUS = {"sw-zero3", "sw-zero3-module", "sw-zero3-eager", "sw-zero3-module-eager", "sw-fsdp-all", "sw-ddp-all",
               "hf-trainer-zero3", "sw-zero3-hfjson"}
HF_VARIANTS = {"hf-trainer": False, "hf-trainer-gc": True, "hf-trainer-zero3": False}


def zero3_config() -> dict:
    """The HF Trainer's DeepSpeed ZeRO-3 config ("auto": the Trainer fills it from its arguments and the model)."""
    return {"bf16": {"enabled": "auto"}, "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 10**9,
            "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                                  "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                  "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
                                  "stage3_max_reuse_distance": 1e9, "sub_group_size": 1e9}}


def run_shardwise(name, model_dir, data, steps, warmup, workdir, lr, extra_common=(), gpus=1, mb=MB, seq=SEQ,
                  smoke=False):
    out = os.path.join(workdir, name)
    procs = ["--nproc-per-node", str(gpus)] if name in ON_ALL_GPUS else []
    precision = ["--mixed-precision", "no"] if smoke else ["--mixed-precision", "bf16"]
    args = ["train", "--model", model_dir, "--data", data, "--seq-len", str(seq), "--micro-batch-size", str(mb),
            "--max-steps", str(steps), "--log-every", "1", "--lr", str(lr), "--warmup-steps", "10",
            *precision, "--output-dir", out, "--overwrite", "--no-save-final", "--seed", "0",
            *SHARDWISE_VARIANTS[name], *procs, *extra_common]
    if name == "sw-zero3-hfjson":
        ds = os.path.join(workdir, "zero3-sw.json")
        with open(ds, "w") as fh:
            json.dump(zero3_config(), fh, indent=1)
        args += ["--deepspeed-config", ds]
    t0 = time.time()
    p = shardwise(*args)
    if p.returncode != 0:
        return {"name": name, "error": (p.stderr.strip().splitlines() or ["?"])[-1][:400], "wall_s": time.time() - t0}
    with open(os.path.join(out, "metrics.jsonl")) as fh:
        recs = [json.loads(line) for line in fh]
    with open(os.path.join(out, "summary.json")) as fh:
        summary = json.load(fh)
    counted = recs[warmup:]
    ranks = summary.get("world_size", 1)
    return {"name": name, "ranks": ranks,  # tokens/s per GPU (the metric counts every rank's tokens)
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in counted) / ranks,
            "step_time_s": statistics.median(r["step_time_s"] for r in counted),
            "peak_mem_gib": max(r["peak_mem_gib"] for r in recs), "losses": [r["loss"] for r in recs],
            "params": summary["params"], "wall_s": time.time() - t0}


HF_WORKER = r'''
import json, os, sys, time, torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments, TrainerCallback
model_dir, data, steps, gc, lr, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1", float(sys.argv[5]), sys.argv[6]
mb, seq, ds = int(sys.argv[7]), int(sys.argv[8]), sys.argv[9]  # ds: a DeepSpeed config file, or "-"
cuda = torch.cuda.is_available()
tok = AutoTokenizer.from_pretrained(model_dir)
rows = []
with open(data) as fh:
    for line in fh:
        ids = tok(json.loads(line)["text"])["input_ids"][:seq]
        rows.append({"input_ids": ids, "labels": ids})
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
class Times(TrainerCallback):
    def __init__(self): self.t = []; self.loss = []
    def on_step_end(self, args, state, control, **kw):
        if cuda: torch.cuda.synchronize()
        self.t.append(time.perf_counter())
    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "loss" in logs: self.loss.append(logs["loss"])
cb = Times()
args = TrainingArguments(output_dir=out, per_device_train_batch_size=mb, max_steps=steps, bf16=cuda, use_cpu=not cuda,
    optim="adamw_torch_fused" if cuda else "adamw_torch", learning_rate=lr, warmup_steps=10,
    lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": 0.1}, weight_decay=0.0,
    max_grad_norm=1.0, logging_steps=1, report_to=[], save_strategy="no", gradient_checkpointing=gc, seed=0,
    data_seed=0, dataloader_drop_last=True, remove_unused_columns=False, deepspeed=None if ds == "-" else ds)
if cuda: torch.cuda.reset_peak_memory_stats()
trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=[cb])
trainer.train()
dts = [b - a for a, b in zip(cb.t, cb.t[1:])]
if int(os.environ.get("RANK", "0")) == 0:
    params = sum(getattr(p, "ds_numel", 0) or p.numel() for p in trainer.model.parameters())
    stage = trainer.accelerator.state.deepspeed_plugin.zero_stage if trainer.is_deepspeed_enabled else 0
    print("RESULT " + json.dumps({"step_times": dts, "losses": cb.loss, "params": params, "world": int(os.environ.get("WORLD_SIZE", "1")),
          "deepspeed_stage": stage,
          "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0}), flush=True)
'''


def run_hf(name, model_dir, data, steps, warmup, workdir, lr, gpus=1, mb=MB, seq=SEQ, smoke=False):
    import subprocess

    from common import free_port

    script = os.path.join(workdir, "hf_worker.py")
    with open(script, "w") as fh:
        fh.write(HF_WORKER)
    ds = "-"
    launch = [sys.executable]
    if name == "hf-trainer-zero3":
        ds = os.path.join(workdir, "zero3.json")
        with open(ds, "w") as fh:
            json.dump(zero3_config(), fh, indent=1)
        # torchrun, as `swift sft` / `accelerate launch` start a DeepSpeed job
        launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(gpus),
                  "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    env = dict(os.environ, DS_ACCELERATOR="cpu") if smoke else None
    t0 = time.time()
    p = subprocess.run([*launch, script, model_dir, data, str(steps), "1" if HF_VARIANTS[name] else "0",
                        str(lr), os.path.join(workdir, name), str(mb), str(seq), ds], capture_output=True, text=True,
                       env=env)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode != 0 or not line:
        return {"name": name, "error": (p.stderr.strip().splitlines() or ["?"])[-1][:400], "wall_s": time.time() - t0}
    r = json.loads(line[-1][7:])
    dt = statistics.median(r["step_times"][warmup:])
    if name == "hf-trainer-zero3" and r["deepspeed_stage"] != 3:
        return {"name": name, "error": f"the Trainer ran without DeepSpeed ZeRO-3 (stage {r['deepspeed_stage']})",
                "wall_s": time.time() - t0}
    return {"name": name, "ranks": r["world"], "tokens_per_s": mb * seq / dt, "step_time_s": dt,
            "peak_mem_gib": r["peak_mem_gib"], "losses": r["losses"], "params": r["params"], "wall_s": time.time() - t0}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--workdir", default="/tmp/vs_hf")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--variants", default="hf-trainer,sw-single-plain,sw-single,sw-fsdp")
    ap.add_argument("--curves", type=int, default=0, help="Run hf-trainer and sw-single for N steps; compare losses.")
    ap.add_argument("--gpus", type=int, default=1, help="GPUs (CPU processes with --smoke) for the all-GPU variants: "
                    + ", ".join(sorted(ON_ALL_GPUS)))
    ap.add_argument("--smoke", action="store_true", help="the CPU check: a 2-layer model, 2 x 128 tokens, fp32")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.workdir, exist_ok=True)
    t0 = time.time()
    shape, mb, seq = (SMOKE, 2, 128) if args.smoke else (ANCHOR, MB, SEQ)
    model_dir = build_model_dir(os.path.join(args.workdir, "smoke" if args.smoke else "anchor-1.1b"), shape)
    steps = args.curves or args.steps
    # every rank of the widest variant reads its own rows (the Trainer and shardwise both split the data by rank)
    data = write_text_data(os.path.join(args.workdir, f"text-{steps}-{args.gpus}-{seq}.jsonl"),
                           steps * mb * args.gpus, seq + 1, shape["vocab_size"])
    print(f"setup {time.time() - t0:.0f}s", flush=True)
    names = ["hf-trainer", "sw-single"] if args.curves else args.variants.split(",")
    results = []
    for name in names:
        runner = run_hf if name in HF_VARIANTS else run_shardwise
        r = runner(name, model_dir, data, steps, args.warmup, args.workdir, args.lr, gpus=args.gpus, mb=mb, seq=seq,
                   smoke=args.smoke)
        if "tokens_per_s" in r:
            r["mfu"] = r["tokens_per_s"] * flops_per_token(r["params"], shape, seq) / PEAK
        results.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "losses"}), flush=True)
    # several runs of one variant (e.g. the Trainer before and after the others): each is a row; ratios use the first
    base: dict = {}
    for r in results:
        base.setdefault(r["name"], r)
    what = "2-layer smoke model (CPU, fp32)" if args.smoke else "1.14B Llama-style (random init)"
    lines = [f"# shardwise vs HF Trainer — {time.strftime('%Y-%m-%d')}", "",
             f"Versions: `{json.dumps(versions())}`", "",
             f"Job: {what}, micro-batch {mb} x {seq} per GPU, "
             f"{'fp32, AdamW' if args.smoke else 'bf16 autocast, fp32 master weights, fused AdamW'}, lr {args.lr}, {steps} steps, median over steps {args.warmup + 1}-{steps}; "
             f"{', '.join(sorted(ON_ALL_GPUS))} on {args.gpus} GPU(s), the others on one. Tokens/s per GPU.", "",
             "| runner | GPUs | tokens/s per GPU | vs HF Trainer | MFU | peak allocated GiB | step s |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['name']} | | failed: {r['error']} | | | | |")
            continue
        ref = base.get("hf-trainer-gc" if r["name"].endswith("-gc") else
                       "hf-trainer-zero3" if r["name"] in ON_ALL_GPUS else "hf-trainer")
        ratio = f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}x" if ref and "tokens_per_s" in ref else "n/a"
        lines.append(f"| {r['name']} | {r.get('ranks', 1)} | {r['tokens_per_s']:,.0f} | {ratio} | {r['mfu']:.1%} | "
                     f"{r['peak_mem_gib']:.1f} | {r['step_time_s']:.3f} |")
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
