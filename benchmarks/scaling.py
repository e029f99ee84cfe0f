"""Weak scaling over 1 -> 2 -> 4 -> 8 GPUs, through the real `shardwise train` CLI, with the planner's
prediction and `--strategy auto`'s pick beside every row (issue 21, items 1 and 2).

Each job keeps its per-GPU batch as the GPU count grows (weak scaling), so tokens/s per GPU should
stay flat; scaling efficiency = tokens/s per GPU at N GPUs / tokens/s per GPU at the smallest count
the same strategy ran at (1 GPU where it fits; the 8B shape does not fit one H200 without offload,
so its baseline is the smallest count that ran, and the report says which).

Jobs:
- anchor: the 1.14B Llama shape of docs/measurements.md (vocab 32000, hidden 2048, 16 layers), 8 x 2048
  tokens per GPU, bf16 compute over fp32 weights, no checkpointing;
- llama8b: Llama-3.1-8B's shape (random init), full fine-tune, gradient checkpointing, 2 x 4096 per GPU;
- tiny (for the CPU check): a 4-layer 64-wide Llama on gloo ranks.

Strategies: single (one GPU), ddp, fsdp, hybrid2 / hybrid4 (`--strategy hybrid --fsdp-shard-group-size 2|4`, only where
the count is a multiple larger than the group), zero2, zero3. A strategy the plan says does not fit
is recorded as such and not launched (`--force-all` launches it anyway). Per GPU count the plan's
`recommended` (with its TP/SP degrees) is recorded and compared with the fastest measured row.

Writes OUT/scaling_<date>[-tag].{json,md}, rewritten after every row (a call cut short keeps what
finished).

    python benchmarks/scaling.py --gpus 1,2,4,8 --jobs anchor,llama8b --out benchmarks/results --tag x8
    python benchmarks/scaling.py --gpus 1,2 --jobs anchor --strategies ddp,fsdp,zero3 --out $OUT --tag x2
    python benchmarks/scaling.py --device cpu --gpus 1,2 --jobs tiny --steps 4 --out /tmp/sc   # the CPU check
    python benchmarks/scaling.py --dry-run --gpus 1,2,4,8                                     # list the rows
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import ANCHOR, build_model_dir, run_killable, versions, write_text_data  # noqa: E402

LLAMA8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
               rms_norm_eps=1e-5)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)
# name -> (shape, micro-batch, seq_len, checkpointing, model files' dtype)
JOBS = {"anchor": (ANCHOR, 8, 2048, False, "float32"),
        "llama8b": (LLAMA8B, 2, 4096, True, "bfloat16"),
        "tiny": (TINY, 2, 128, False, "float32")}
STRATEGIES = ["single", "ddp", "fsdp", "hybrid2", "hybrid4", "zero2", "zero3"]


def preset_flags(strategy: str) -> tuple[str, list[str]]:
    """(the preset the plan and train know, extra flags): hybridK is hybrid with shard groups of K."""
    if strategy.startswith("hybrid") and strategy != "hybrid":
        return "hybrid", ["--fsdp-shard-group-size", strategy[len("hybrid"):]]
    return strategy, []


def applies(strategy: str, gpus: int) -> bool:
    """single runs on one GPU only; hybridK needs more ranks than K and a multiple of K; everything else runs at
    any count (one GPU included: ddp/fsdp/zero on one rank are the per-GPU overhead baseline)."""
    if strategy == "single":
        return gpus == 1
    if strategy.startswith("hybrid") and strategy != "hybrid":
        k = int(strategy[len("hybrid"):])
        return gpus > k and gpus % k == 0
    return True


def job_flags(job: str, device: str) -> list[str]:
    _, mb, seq, ckpt, _ = JOBS[job]
    flags = ["--seq-len", str(seq), "--micro-batch-size", str(mb)]
    flags += ["--gradient-checkpointing"] if ckpt else []
    flags += ["--mixed-precision", "bf16" if device == "cuda" else "no"]
    return flags


def plan(job: str, strategy: str, gpus: int, model_dir: str, a) -> dict:
    """The plan's row for this strategy at this GPU count, and auto's pick (preset + degrees)."""
    preset, extra = preset_flags(strategy)
    cmd = [sys.executable, "-m", "shardwise", "plan", "--model", model_dir, "--gpus", str(gpus), "--json",
           *job_flags(job, a.device), *(["--strategy", preset, *extra] if preset == "hybrid" else [])]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        return {"plan_error": (p.stderr or p.stdout).strip()[-300:]}
    d = json.loads(p.stdout)
    row = next((s for s in d["strategies"] if s["strategy"] == preset), None)
    par = d.get("parallel") or {}
    auto = d["recommended"] + "".join(f"+{k}{par[n]}" for k, n in (("tp", "tensor_parallel"),
                                                                    ("sp", "sequence_parallel"))
                                      if (par.get(n) or 1) > 1)
    if row is None:
        return {"plan_error": f"no {preset} row in the plan", "auto": auto}
    return {"auto": auto, "fits": row["fits"], "pred_step_time_s": row["step_time_s"],
            "pred_tokens_per_s_gpu": row["tokens_per_s"] / gpus,
            "pred_peak_tensors_gib": row["mem_gib"]["peak_tensors"]}


def train(job: str, strategy: str, gpus: int, model_dir: str, data: str, a) -> dict:
    preset, extra = preset_flags(strategy)
    out = os.path.join(a.work, "runs", job, f"{strategy}-{gpus}")
    shutil.rmtree(out, ignore_errors=True)  # never report an earlier run's metrics
    cmd = [sys.executable, "-m", "shardwise", "train", "--model", model_dir, "--data", data, "--data-format", "text",
           "--strategy", preset, *extra, "--nproc-per-node", str(gpus), *job_flags(job, a.device),
           "--grad-accum", "1", "--max-steps", str(a.steps), "--log-every", str(a.log_every), "--lr", "1e-5",
           "--warmup-steps", "0", "--param-dtype", "fp32", "--no-save-final", "--output-dir", out, "--overwrite",
           "--force", *a.extra]
    env = dict(os.environ)
    if a.device == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(gpus))
    rec = {"command": " ".join(cmd[1:])}
    t0 = time.time()
    rec["exit_code"], output = run_killable(cmd, a.timeout, env)
    rec["wall_s"] = round(time.time() - t0, 1)
    metrics = os.path.join(out, "metrics.jsonl")
    rows = [json.loads(x) for x in open(metrics)] if os.path.isfile(metrics) else []
    steady = rows[1:] or rows  # the first window holds compilation and the allocator's warm-up
    if steady and rec["exit_code"] == 0:
        rec["tokens_per_s_gpu"] = round(statistics.median(r["tokens_per_s"] for r in steady) / gpus)
        rec["step_time_s"] = round(statistics.median(r["step_time_s"] for r in steady), 4)
        rec["peak_mem_gib"] = round(max(r["peak_mem_gib"] for r in rows), 2)
        if "mfu" in steady[0]:
            rec["mfu"] = round(statistics.median(r["mfu"] for r in steady), 4)
    else:
        text = output or ""
        rec["oom"] = "OutOfMemoryError" in text or "CUDA out of memory" in text
        rec["error_tail"] = text[-1500:]
    shutil.rmtree(out, ignore_errors=True)
    return rec


def efficiencies(rows: list[dict]) -> None:
    """Per job and strategy: tokens/s per GPU against the smallest GPU count that ran (its count recorded)."""
    for r in rows:
        same = sorted((x for x in rows if x["job"] == r["job"] and x["strategy"] == r["strategy"]
                       and x.get("tokens_per_s_gpu")), key=lambda x: x["gpus"])
        if same and r.get("tokens_per_s_gpu"):
            r["baseline_gpus"] = same[0]["gpus"]
            r["efficiency"] = round(r["tokens_per_s_gpu"] / same[0]["tokens_per_s_gpu"], 4)


def auto_verdicts(rows: list[dict]) -> list[dict]:
    """Per job and GPU count: auto's pick against the fastest measured strategy."""
    out = []
    for job, gpus in sorted({(r["job"], r["gpus"]) for r in rows}):
        mine = [r for r in rows if r["job"] == job and r["gpus"] == gpus]
        ok = {r["strategy"]: r["tokens_per_s_gpu"] for r in mine if r.get("tokens_per_s_gpu")}
        auto = next((r["plan"].get("auto") for r in mine if r["plan"].get("auto")), None)
        v = {"job": job, "gpus": gpus, "auto": auto, "fastest": max(ok, key=ok.get) if ok else None}
        if auto in ok:
            v["auto_vs_fastest"] = round(ok[auto] / ok[v["fastest"]] - 1, 4)
        elif auto is not None:
            v["auto_vs_fastest"] = None  # auto's pick was not among the measured rows (e.g. an offload preset)
        out.append(v)
    return out


def pct(pred, meas) -> str:
    return f"{100 * (pred / meas - 1):+.1f}%" if pred and meas else "—"


def write(base: str, meta: dict, rows: list[dict]) -> None:
    efficiencies(rows)
    verdicts = auto_verdicts(rows)
    with open(base + ".json.tmp", "w") as fh:
        json.dump({**meta, "rows": rows, "auto": verdicts}, fh, indent=1)
    os.replace(base + ".json.tmp", base + ".json")
    v = meta["versions"]
    lines = [f"# Weak scaling, {meta['gpus']} GPUs — {meta['date']}", "",
             f"{v.get('gpu', 'CPU (gloo)')}, driver {v.get('driver', '—')}, CUDA {v.get('cuda', '—')}; torch "
             f"{v.get('torch')}, transformers {v.get('transformers')}, deepspeed {v.get('deepspeed', '—')}, "
             f"Python {v.get('python')}. `{meta['command']}`", "",
             f"{meta['steps']} steps per run; tokens/s per GPU: median of the logged windows after the first. "
             "Efficiency: against the smallest GPU count the same strategy ran at (baseline column). Predicted: "
             "`shardwise plan` for the same run (step time; the tensor peak beside max_memory_allocated).", "",
             "| job | GPUs | strategy | tokens/s/GPU | efficiency (baseline) | step s | predicted step s | peak GiB | "
             "predicted GiB | status |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p = r["plan"]
        status = r.get("status", "ok")
        lines.append(
            f"| {r['job']} | {r['gpus']} | {r['strategy']} | {r.get('tokens_per_s_gpu', '—')} | "
            + (f"{r['efficiency']:.1%} ({r['baseline_gpus']})" if "efficiency" in r else "—")
            + f" | {r.get('step_time_s', '—')} | "
            + (f"{p['pred_step_time_s']:.3f} ({pct(p['pred_step_time_s'], r.get('step_time_s'))})"
               if p.get("pred_step_time_s") else p.get("plan_error", "—")[:50])
            + f" | {r.get('peak_mem_gib', '—')} | "
            + (f"{p['pred_peak_tensors_gib']:.2f} ({pct(p['pred_peak_tensors_gib'], r.get('peak_mem_gib'))})"
               if p.get("pred_peak_tensors_gib") else "—")
            + f" | {status} |")
    lines += ["", "## `--strategy auto` against the fastest measured", "",
              "| job | GPUs | auto | fastest | auto vs fastest |", "|---|---|---|---|---|"]
    for v in verdicts:
        d = v.get("auto_vs_fastest")
        lines.append(f"| {v['job']} | {v['gpus']} | {v['auto']} | {v['fastest']} | "
                     f"{'—' if d is None else f'{d:+.1%}'} |")
    with open(base + ".md", "w") as fh:
        fh.write("\n".join(lines) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", default="1,2,4,8", help="comma-separated GPU counts (ranks on --device cpu)")
    ap.add_argument("--jobs", default="anchor,llama8b", help=f"comma-separated of {', '.join(JOBS)}")
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--log-every", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=300, help="seconds per run (then it is marked timeout)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--force-all", action="store_true", help="also launch what the plan says does not fit")
    ap.add_argument("--dry-run", action="store_true", help="list the rows, run nothing")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "shardwise-scaling"))
    ap.add_argument("extra", nargs="*", help="extra `shardwise train` flags, after --")
    a = ap.parse_args()
    counts = [int(x) for x in a.gpus.split(",")]
    jobs = a.jobs.split(",")
    strategies = a.strategies.split(",")
    bad = [j for j in jobs if j not in JOBS] + [s for s in strategies if preset_flags(s)[0] not in
                                                ("single", "ddp", "fsdp", "fsdp-grad-op", "hybrid", "zero1", "zero2", "zero3")]
    if bad:
        print(f"scaling: unknown job or strategy: {', '.join(bad)}", file=sys.stderr)
        return 2
    todo = [(j, n, s) for j in jobs for n in counts for s in strategies if applies(s, n)]
    if a.dry_run:
        for j, n, s in todo:
            print(f"{j} {n} {s}")
        return 0
    if a.device == "cuda":
        import torch

        have = torch.cuda.device_count()
        if max(counts) > have:
            print(f"scaling: --gpus {a.gpus} asks for {max(counts)} GPUs; this machine has {have}", file=sys.stderr)
            return 2
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.work, exist_ok=True)
    date = datetime.date.today().isoformat()
    base = os.path.join(a.out, f"scaling_{date}" + (f"-{a.tag}" if a.tag else ""))
    meta = {"date": date, "gpus": a.gpus, "steps": a.steps, "versions": versions(), "command": " ".join(sys.argv),
            "jobs": {j: {"shape": JOBS[j][0], "micro_batch": JOBS[j][1], "seq_len": JOBS[j][2],
                         "checkpointing": JOBS[j][3]} for j in jobs}}
    rows: list[dict] = []
    for job in jobs:
        shape, mb, seq, _, dtype = JOBS[job]
        model_dir = build_model_dir(os.path.join(a.work, "models", job), {**shape, "max_position_embeddings":
                                                                          max(shape["max_position_embeddings"], seq)},
                                    disk_dtype=dtype)
        data = write_text_data(os.path.join(a.work, f"data-{job}.jsonl"),
                               n_records=mb * max(counts) * (a.steps + 4), words_per_record=seq + 64,
                               vocab=shape["vocab_size"])
        for j, n, s in todo:
            if j != job:
                continue
            row = {"job": job, "gpus": n, "strategy": s, "plan": plan(job, s, n, model_dir, a)}
            if row["plan"].get("fits") is False and not a.force_all:
                row["status"] = "not run: the plan says it does not fit"
            else:
                row.update(train(job, s, n, model_dir, data, a))
                row["status"] = ("ok" if row.get("tokens_per_s_gpu") else
                                 "OOM" if row.get("oom") else f"exit {row.get('exit_code')}")
            rows.append(row)
            print(f"scaling: {job} {n} {s}: {row['status']}, {row.get('tokens_per_s_gpu')} tok/s/GPU, "
                  f"{row.get('peak_mem_gib')} GiB", flush=True)
            write(base, meta, rows)
    print(f"scaling: wrote {base}.md and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
