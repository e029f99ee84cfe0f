"""Strategy throughput and memory on one GPU, through the real `shardwise train` CLI.

Each strategy that can run here trains a random-init ~1.14B Llama-style model (the shape of
docs/measurements.md: vocab 32000, hidden 2048, intermediate 8192, 16 layers, 16
heads, 8 KV heads) for --steps steps, micro-batch 8 x 2048 tokens, bf16 compute with fp32
master weights, AdamW, SDPA, with shardwise's CUDA defaults (torch.compile per decoder
block, chunked loss head; extra train flags after -- change them). Reported per strategy:
tokens/s and MFU (median over logged windows after the first), peak GPU memory allocated,
wall time, exit status.

Writes OUT/strategies-gpu-YYYY-MM-DD.{md,json} (rewritten after every strategy, so a run
cut short keeps what finished), with the GPU, versions and the exact command of each run.

    python benchmarks/strategies_gpu.py --out benchmarks/results
    python benchmarks/strategies_gpu.py --strategies ddp,fsdp,zero2 --steps 20 --out $OUT --tag part1
    python benchmarks/strategies_gpu.py --layers 2 --steps 4 --out /tmp/smoke   # a one-minute check

Needs one CUDA GPU, torch >= 2.6 (FSDP2), transformers 5; DeepSpeed strategies are skipped
(and listed as such) when DeepSpeed is not installed. With one GPU every strategy runs on
one rank: the numbers show each strategy's per-GPU overhead and memory, not scaling.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ALL = ["single", "ddp", "fsdp", "fsdp-grad-op", "fsdp-offload", "zero1", "zero2", "zero3", "zero2-offload",
       "zero3-offload"]
MODEL = dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
             num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=4096, rms_norm_eps=1e-5,
             rope_theta=10000.0, tie_word_embeddings=False)


def make_model_dir(path: str, layers: int) -> str:
    """A random-init Llama model (bf16 safetensors) + the tiny tokenizer, once."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardwise.models.tiny import build_tokenizer

    tok = build_tokenizer()
    cfg = LlamaConfig(**{**MODEL, "num_hidden_layers": layers}, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    tmp = path + ".tmp"
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, path)
    return path


def make_data(path: str, n: int, seq_len: int) -> str:
    """n text records, each longer than seq_len tokens (truncated to full sequences)."""
    import random

    rng = random.Random(0)
    words = ["apple", "river", "stone", "cloud", "green", "quiet", "music", "north", "paper", "light"]
    with open(path, "w") as fh:
        for _ in range(n):
            fh.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(seq_len * 2))}) + "\n")
    return path


def versions() -> dict:
    import torch
    import transformers

    out = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0),
           "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)}
    for mod in ("deepspeed", "peft", "shardwise"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - optional
            out[mod] = None
    try:
        out["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                       capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception:  # noqa: BLE001
        out["driver"] = None
    return out


def run_one(strategy: str, args, model_dir: str, data: str, work: str) -> dict:
    out = os.path.join(work, strategy)
    shutil.rmtree(out, ignore_errors=True)  # never report an earlier run's metrics
    cmd = [sys.executable, "-m", "shardwise", "train", "--model", model_dir, "--data", data, "--data-format", "text",
           "--strategy", strategy, "--nproc-per-node", "1", "--seq-len", str(args.seq_len),
           "--micro-batch-size", str(args.micro_batch_size), "--grad-accum", "1", "--max-steps", str(args.steps),
           "--log-every", str(args.log_every), "--lr", "1e-5", "--warmup-steps", "0",
           "--mixed-precision", "bf16", "--param-dtype", "fp32", "--no-save-final", "--output-dir", out,
           "--overwrite", *args.extra]
    if strategy != "single":
        cmd.append("--force")  # the planner's fit check is not what is measured here
    t0 = time.time()
    rec = {"strategy": strategy, "command": " ".join(cmd[1:])}
    # own process group: on timeout the launcher *and* its workers (holding GPU memory) go
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = p.communicate(timeout=args.timeout)
        rec["exit_code"] = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        output, _ = p.communicate()
        rec["exit_code"] = "timeout"
    tail = (output or "")[-2000:]
    rec["wall_s"] = round(time.time() - t0, 1)
    metrics = os.path.join(out, "metrics.jsonl")
    rows = [json.loads(x) for x in open(metrics)] if os.path.isfile(metrics) else []
    steady = rows[1:] or rows  # the first window holds warm-up (allocator, kernels, prefetch)
    if steady:
        rec["tokens_per_s"] = round(statistics.median(r["tokens_per_s"] for r in steady))
        rec["mfu"] = round(statistics.median(r["mfu"] for r in steady), 4) if "mfu" in steady[0] else None
        rec["step_time_s"] = round(statistics.median(r["step_time_s"] for r in steady), 3)
        rec["peak_mem_gib"] = round(max(r["peak_mem_gib"] for r in rows), 2)
        rec["final_loss"] = rows[-1]["loss"]
    if rec["exit_code"] != 0:
        rec["error_tail"] = tail
    return rec


def write_report(path_base: str, meta: dict, results: list[dict]) -> None:
    with open(path_base + ".json.tmp", "w") as fh:
        json.dump({**meta, "results": results}, fh, indent=1)
    os.replace(path_base + ".json.tmp", path_base + ".json")
    v, c = meta["versions"], meta["config"]
    lines = [f"# Strategies on one GPU — {meta['date']}", "",
             f"{v['gpu']} ({v['gpu_memory_gib']} GiB), driver {v['driver']}, CUDA {v['cuda']}; torch {v['torch']}, "
             f"transformers {v['transformers']}, deepspeed {v['deepspeed']}, peft {v['peft']}, "
             f"shardwise {v['shardwise']}, Python {v['python']}.", "",
             f"Model: random-init Llama, {c['params'] / 1e9:.2f}B params ({json.dumps(c['model'])}). "
             f"Micro-batch {c['micro_batch_size']} x {c['seq_len']} tokens, grad accum 1, {c['steps']} steps, "
             "bf16 compute, fp32 master weights, AdamW, SDPA, shardwise's CUDA defaults (per-block compile, "
             f"chunked loss head){' + extra flags ' + ' '.join(c['extra_flags']) if c['extra_flags'] else ''}, 1 rank. "
             "Tokens/s and MFU: median of "
             f"the {c['log_every']}-step windows after the first.", "",
             "| strategy | tokens/s | MFU | step s | peak GiB | wall s | status |", "|---|---|---|---|---|---|---|"]
    for r in results:
        status = "ok" if r.get("exit_code") == 0 else (r.get("skipped") or f"exit {r.get('exit_code')}")
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") else "—"
        lines.append(f"| {r['strategy']} | {r.get('tokens_per_s', '—'):,} | {mfu} | {r.get('step_time_s', '—')} | "
                     f"{r.get('peak_mem_gib', '—')} | {r.get('wall_s', '—')} | {status} |"
                     if isinstance(r.get("tokens_per_s"), int) else
                     f"| {r['strategy']} | — | — | — | — | {r.get('wall_s', '—')} | {status} |")
    lines += ["", "Commands (run from the repository root):", ""]
    lines += [f"- `{r['strategy']}`: `python {r['command']}`" for r in results if "command" in r]
    failed = [r for r in results if r.get("error_tail")]
    for r in failed:
        lines += ["", f"## {r['strategy']}: last output", "", "```", r["error_tail"].strip()[-1500:], "```"]
    with open(path_base + ".md.tmp", "w") as fh:
        fh.write("\n".join(lines) + "\n")
    os.replace(path_base + ".md.tmp", path_base + ".md")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--strategies", default=",".join(ALL), help="comma-separated; default: all")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--layers", type=int, default=MODEL["num_hidden_layers"], help="fewer for a quick check")
    ap.add_argument("--timeout", type=float, default=240, help="seconds per strategy (then it is marked timeout)")
    ap.add_argument("--tag", default="", help="suffix of the result files, e.g. part1 when split over calls")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "shardwise-bench-gpu"))
    ap.add_argument("extra", nargs="*", help="extra `shardwise train` flags, after --")
    args = ap.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("strategies_gpu: needs a CUDA GPU", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.work, exist_ok=True)
    model_dir = make_model_dir(os.path.join(args.work, f"llama-{args.layers}l"), args.layers)
    n_seq = args.micro_batch_size * (args.steps + 2)
    data = make_data(os.path.join(args.work, "data.jsonl"), n_seq, args.seq_len)
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model_dir)
    h, i, L, V, kv = hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers, hf.vocab_size, hf.num_key_value_heads
    hd = h // hf.num_attention_heads
    params = 2 * V * h + L * (2 * h * h + 2 * h * kv * hd + 3 * h * i + 2 * h) + h
    date = datetime.date.today().isoformat()
    meta = {"date": date, "versions": versions(),
            "config": {"model": {**MODEL, "num_hidden_layers": L}, "params": params, "steps": args.steps,
                       "log_every": args.log_every, "seq_len": args.seq_len,
                       "micro_batch_size": args.micro_batch_size, "extra_flags": args.extra}}
    base = os.path.join(args.out, f"strategies-gpu-{date}" + (f"-{args.tag}" if args.tag else ""))
    results = []
    has_ds = importlib.util.find_spec("deepspeed") is not None
    for s in [x.strip() for x in args.strategies.split(",") if x.strip()]:
        if s.startswith("zero") and not has_ds:
            results.append({"strategy": s, "skipped": "skipped: deepspeed not installed"})
        else:
            print(f"strategies_gpu: {s} ...", flush=True)
            results.append(run_one(s, args, model_dir, data, args.work))
            r = results[-1]
            print(f"strategies_gpu: {s}: exit {r['exit_code']}, {r.get('tokens_per_s')} tok/s, "
                  f"{r.get('peak_mem_gib')} GiB, {r['wall_s']} s", flush=True)
        write_report(base, meta, results)
    print(f"strategies_gpu: wrote {base}.md and .json")
    return 0 if all(r.get("exit_code", 0) == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
