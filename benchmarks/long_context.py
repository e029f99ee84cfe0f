"""Long-context training on 2 GPUs with and without sequence parallelism, through the real
`shardwise train` CLI, with the planner's prediction beside every row.

For each length and each SP degree: a random-init model of a published shape (default the
Llama-3.1-8B shape: hidden 4096, 32 layers, 32/8 heads, ffn 14336, vocab 128256, untied,
rope theta 500000) trains --steps steps of one sequence per data-parallel rank (so SP 1 on
2 GPUs trains 2 sequences a step, SP 2 trains one), fsdp with gradient checkpointing, bf16
compute and fp32 master weights (extra train flags after --). Reported per row: tokens/s per
GPU (median over the logged steps after the first), step time, peak memory allocated (max
over ranks), exit status (an OOM shows as the error tail), and `shardwise plan`'s predicted
peak memory and tokens/s for the same run.

Writes OUT/long-context-YYYY-MM-DD[-TAG].{md,json}, rewritten after every run, so a run cut
short keeps what finished.

    python benchmarks/long_context.py --lengths 32768,65536,131072 --sp 1,2 --out $OUT
    python benchmarks/long_context.py --lengths 131072,262144 --sp 2 --tag limit --out $OUT
    python benchmarks/long_context.py --shape qwen2.5-7b --lengths 131072 --sp 2 --packing --tag qwen-lora \
        --out $OUT -- --tuner lora --lora-r 16
    python benchmarks/long_context.py --layers 2 --lengths 4096 --sp 1,2 --steps 3 --out /tmp/smoke  # minutes

Needs 2 CUDA GPUs (--gpus to change), torch >= 2.6, transformers 5.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import build_model_dir, versions  # noqa: E402

SHAPES = {
    "llama3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072 * 4,
                        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
    "qwen2.5-7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=131072 * 4,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
}


def make_data(path: str, n_records: int, words: int, vocab: int, packing: bool, seed: int = 0) -> str:
    """Text records of the word-level tokenizer's words: one record per sequence (each
    longer than the sequence, truncated), or with packing documents of 2k-16k words, so a
    packed sequence holds several and the document mask matters."""
    rng = random.Random(seed)
    with open(path, "w") as fh:
        for _ in range(n_records):
            n = rng.randrange(2048, 16384) if packing else words
            fh.write(json.dumps({"text": " ".join(f"w{rng.randrange(vocab - 6)}" for _ in range(n))}) + "\n")
    return path


def predict(model_dir: str, length: int, sp: int, gpus: int, extra: list[str]) -> dict:
    """`shardwise plan --json` for the run: fsdp's predicted peak GiB and tokens/s per GPU."""
    cmd = [sys.executable, "-m", "shardwise", "plan", "--model", model_dir, "--strategy", "fsdp", "--gpus", str(gpus),
           "--seq-len", str(length), "--micro-batch-size", "1", "--gradient-checkpointing",
           "--mixed-precision", "bf16", "--sequence-parallel", str(sp), "--json",
           *[x for x in extra if x in ("--tuner", "lora", "--packing")]]
    if "--tensor-parallel" in extra:  # the TP degree reaches the plan too (issue 20's TP 2 vs fsdp rows)
        cmd += ["--tensor-parallel", extra[extra.index("--tensor-parallel") + 1]]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        return {"plan_error": (p.stderr or p.stdout).strip()[-300:]}
    plan = json.loads(p.stdout)
    row = next((s for s in plan.get("strategies", []) if s.get("strategy") == "fsdp"), None)
    if row is None:
        return {"plan_error": "no fsdp row in the plan"}
    tps, mem = row.get("tokens_per_s"), row.get("mem_gib") or {}
    # like with like: the run logs torch.cuda.max_memory_allocated (tensors), so the prediction beside it is the
    # plan's tensor peak; the plan's total adds the CUDA context and fragmentation allowance (kept as _total)
    tensors, total = mem.get("peak_tensors"), mem.get("total")
    return {"pred_mem_gib": round(tensors, 2) if tensors else None,
            "pred_mem_total_gib": round(total, 2) if total else None,
            "pred_tokens_per_s_gpu": tps / gpus if tps else None, "pred_fits": row.get("fits")}


def run_one(model_dir: str, data: str, length: int, sp: int, a, work: str) -> dict:
    name = f"L{length}-sp{sp}"
    out = os.path.join(work, name)
    shutil.rmtree(out, ignore_errors=True)  # never report an earlier run's metrics
    cmd = [sys.executable, "-m", "shardwise", "train", "--model", model_dir, "--data", data, "--data-format", "text",
           "--strategy", "fsdp", "--gradient-checkpointing", "--nproc-per-node", str(a.gpus),
           "--sequence-parallel", str(sp), "--seq-len", str(length), "--micro-batch-size", "1", "--grad-accum", "1",
           "--max-steps", str(a.steps), "--log-every", "1", "--lr", "1e-5", "--warmup-steps", "0",
           "--mixed-precision", "bf16", "--param-dtype", "fp32", "--no-save-final", "--output-dir", out,
           "--overwrite", "--force", *(["--packing"] if a.packing else []), *a.extra]
    rec = {"length": length, "sp": sp, "command": " ".join(cmd[1:])}
    t0 = time.time()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = p.communicate(timeout=a.timeout)
        rec["exit_code"] = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)  # the launcher and its workers (holding GPU memory)
        output, _ = p.communicate()
        rec["exit_code"] = "timeout"
    rec["wall_s"] = round(time.time() - t0, 1)
    metrics = os.path.join(out, "metrics.jsonl")
    rows = [json.loads(x) for x in open(metrics)] if os.path.isfile(metrics) else []
    steady = rows[1:] or rows  # the first step holds compilation and allocator warm-up
    if steady:
        rec["tokens_per_s_gpu"] = round(statistics.median(r["tokens_per_s"] for r in steady) / a.gpus)
        rec["step_time_s"] = round(statistics.median(r["step_time_s"] for r in steady), 2)
        rec["peak_mem_gib"] = round(max(r["peak_mem_gib"] for r in rows), 2)
        rec["mfu"] = round(statistics.median(r["mfu"] for r in steady), 4) if "mfu" in steady[0] else None
        rec["final_loss"] = rows[-1]["loss"]
    if rec["exit_code"] != 0:
        text = output or ""
        rec["oom"] = "OutOfMemoryError" in text or "CUDA out of memory" in text
        rec["error_tail"] = text[-2000:]
    shutil.rmtree(out, ignore_errors=True)
    return rec


def write_report(base: str, meta: dict, results: list[dict]) -> None:
    with open(base + ".json.tmp", "w") as fh:
        json.dump({**meta, "results": results}, fh, indent=1)
    os.replace(base + ".json.tmp", base + ".json")
    v, c = meta["versions"], meta["config"]
    lines = [f"# Long context on {c['gpus']} GPUs, with and without sequence parallelism — {meta['date']}", "",
             f"{v.get('gpu')}, driver {v.get('driver')}, CUDA {v.get('cuda')}; torch {v.get('torch')}, "
             f"transformers {v.get('transformers')}, Python {v.get('python')}.", "",
             f"Model: {c['shape']} shape, random init ({json.dumps(c['model'])}). fsdp, gradient checkpointing, "
             f"bf16 compute, fp32 master weights, AdamW, one sequence per data-parallel rank, {c['steps']} steps"
             f"{', packed documents of 2k-16k tokens' if c['packing'] else ''}"
             f"{' + ' + ' '.join(c['extra_flags']) if c['extra_flags'] else ''}. Tokens/s per GPU: median of the "
             "steps after the first. Predicted: `shardwise plan` for the same run. Peak GiB: the largest "
             "`torch.cuda.max_memory_allocated` over ranks, beside the plan's tensor peak (its total, which adds the "
             "CUDA context and fragmentation allowance, in brackets).", "",
             "| tokens | SP | tokens/s/GPU | predicted | step s | peak GiB | predicted GiB | status |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        status = "ok" if r.get("exit_code") == 0 else ("OOM" if r.get("oom") else f"exit {r.get('exit_code')}")
        pt = r.get("pred_tokens_per_s_gpu")
        lines.append(f"| {r['length']:,} | {r['sp']} | {r.get('tokens_per_s_gpu', '—')} | "
                     f"{round(pt) if pt else r.get('plan_error', '—')[:60]} | {r.get('step_time_s', '—')} | "
                     f"{r.get('peak_mem_gib', '—')} | {r.get('pred_mem_gib', '—')} "
                     f"({r.get('pred_mem_total_gib', '—')}) | {status} |")
    lines += ["", "Commands (from the repository root):", ""]
    lines += [f"- {r['length']} SP {r['sp']}: `python {r['command']}`" for r in results]
    for r in results:
        if r.get("error_tail") and not r.get("oom"):
            lines += ["", f"## {r['length']} SP {r['sp']}: last output", "", "```", r["error_tail"].strip()[-1500:],
                      "```"]
    with open(base + ".md.tmp", "w") as fh:
        fh.write("\n".join(lines) + "\n")
    os.replace(base + ".md.tmp", base + ".md")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=0, help="fewer layers, for a quick check")
    ap.add_argument("--lengths", default="32768,65536,131072", help="comma-separated sequence lengths")
    ap.add_argument("--sp", default="1,2", help="comma-separated sequence-parallel degrees")
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--packing", action="store_true", help="pack documents of 2k-16k tokens into each sequence")
    ap.add_argument("--stop-after-oom", action="store_true",
                    help="skip longer lengths of an SP degree once one ran out of memory (to find the limit)")
    ap.add_argument("--timeout", type=float, default=540, help="seconds per run (then it is marked timeout)")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "shardwise-long-context"))
    ap.add_argument("extra", nargs="*", help="extra `shardwise train` flags, after --")
    a = ap.parse_args()

    import torch

    if torch.cuda.device_count() < a.gpus:
        print(f"long_context: needs {a.gpus} CUDA GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    lengths = [int(x) for x in a.lengths.split(",") if x.strip()]
    degrees = [int(x) for x in a.sp.split(",") if x.strip()]
    shape = dict(SHAPES[a.shape])
    if a.layers:
        shape["num_hidden_layers"] = a.layers
    name = a.shape.replace(".", "") + (f"-{a.layers}l" if a.layers else "")
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.work, exist_ok=True)
    model_dir = build_model_dir(os.path.join(a.work, name), shape, disk_dtype="bfloat16")
    # enough rows for every step of the longest run (SP 1 trains `gpus` sequences a step)
    n = a.gpus * (a.steps + 2) * (max(lengths) // 2048 + 1 if a.packing else 1)
    data = make_data(os.path.join(a.work, f"text-{max(lengths)}-{n}{'-packed' if a.packing else ''}.jsonl"), n,
                     max(lengths) + 16, shape["vocab_size"], a.packing)
    date = datetime.date.today().isoformat()
    meta = {"date": date, "versions": versions(),
            "config": {"shape": a.shape, "model": shape, "gpus": a.gpus, "steps": a.steps, "packing": a.packing,
                       "extra_flags": a.extra}}
    base = os.path.join(a.out, f"long-context-{date}" + (f"-{a.tag}" if a.tag else ""))
    results, oomed = [], set()
    for sp in degrees:
        for length in lengths:
            if sp in oomed:
                continue
            print(f"long_context: {length} tokens, SP {sp} ...", flush=True)
            rec = run_one(model_dir, data, length, sp, a, a.work)
            rec.update(predict(model_dir, length, sp, a.gpus, a.extra + (["--packing"] if a.packing else [])))
            results.append(rec)
            print(f"long_context: {length} SP {sp}: exit {rec['exit_code']}, {rec.get('tokens_per_s_gpu')} tok/s/GPU, "
                  f"{rec.get('peak_mem_gib')} GiB (predicted {rec.get('pred_mem_gib')} GiB), {rec['wall_s']} s",
                  flush=True)
            if rec.get("oom") and a.stop_after_oom:
                oomed.add(sp)
            write_report(base, meta, results)
    print(f"long_context: wrote {base}.md and .json")
    return 0 if all(r.get("exit_code") == 0 or r.get("oom") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
