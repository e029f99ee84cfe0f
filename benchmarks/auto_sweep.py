"""`auto` checked against a measured sweep on two GPUs (issue 16, "an auto sweep on two H200s").

For each configuration (0.5B-8B shapes, 2k-16k tokens, full fine-tuning and LoRA, some where ddp
does not fit): `shardwise plan --json` for the job on this machine gives the presets that fit and
`auto`'s pick (the plan's recommendation is what `--strategy auto` runs); then every fitting preset
is measured through `shardwise train` (2 ranks, random-init weights, text records longer than the
sequence so every slot is a real token). Written as it goes: results/auto_sweep_<date>[-tag].json
and .md, with, per configuration, the measured fastest, auto's pick, its measured speed relative to
the fastest (the goal: within 5% in >= 90% of the configurations) and whether the pick ran out of
memory (never allowed).

    python benchmarks/auto_sweep.py --quick          # 2 small configurations, 4 presets + auto's: ~9 min, 2 H200s
    python benchmarks/auto_sweep.py                  # all of them (build time of the 7-8B shapes included)
    python benchmarks/auto_sweep.py --only q0.5b-full-2k,l8b-lora-8k --plan-only   # picks only, no training

Models are Llama-style directories (benchmarks/common.build_model_dir) with the named shape; the
Qwen shapes keep their vocabulary, tying and head counts (no attention bias: a small difference).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import build_model_dir, versions, write_text_data  # noqa: E402
from common import run_killable as run  # noqa: E402

# name -> HF config fields (Llama-style); published shapes
SHAPES = {
    "q0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "l1.1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                  num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=False),
    "q1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                  num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
    "l3b": dict(vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                num_attention_heads=24, num_key_value_heads=8, tie_word_embeddings=True),
    "q7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False),
    "l8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
}

# (name, shape, seq_len, micro_batch, tuner, checkpointing); the first QUICK are the --quick subset
CONFIGS = [
    ("q0.5b-full-2k", "q0.5b", 2048, 8, "full", False),
    ("l1.1b-lora-4k", "l1.1b", 4096, 4, "lora", False),
    ("l1.1b-full-2k", "l1.1b", 2048, 8, "full", False),
    ("q1.5b-full-4k", "q1.5b", 4096, 4, "full", False),
    ("q1.5b-lora-8k-ckpt", "q1.5b", 8192, 2, "lora", True),
    ("l3b-full-4k", "l3b", 4096, 4, "full", False),
    ("l3b-full-16k-ckpt", "l3b", 16384, 1, "full", True),
    ("q7b-full-4k-ckpt", "q7b", 4096, 2, "full", True),  # ddp does not fit on 141 GiB (7.6B x 16 B of states)
    ("q7b-lora-4k-ckpt", "q7b", 4096, 2, "lora", True),
    ("l8b-full-8k-ckpt", "l8b", 8192, 1, "full", True),  # ddp does not fit (8B x 16 B of states)
    ("l8b-lora-16k-ckpt", "l8b", 16384, 1, "lora", True),
]
QUICK = 2
QUICK_PRESETS = ("ddp", "fsdp", "zero2", "zero3")  # --quick measures these and auto's pick (each run ~45 s)
WITHIN = 0.05  # auto's pick counts as right within 5% of the measured fastest


def job_flags(c: tuple) -> list[str]:
    _, _, seq, mb, tuner, ckpt = c
    return ["--seq-len", str(seq), "--micro-batch-size", str(mb), "--tuner", tuner,
            *(["--gradient-checkpointing"] if ckpt else [])]


def plan_of(c: tuple, model_dir: str, gpus: int, extra: list[str]) -> dict:
    """`shardwise plan --json` for the configuration: presets, what fits, auto's pick and the predictions."""
    code, out = run([sys.executable, "-m", "shardwise", "plan", "--model", model_dir, "--gpus", str(gpus), "--json",
                     *job_flags(c), *extra], 300)
    if code != 0:
        return {"error": out[-1500:]}
    d = json.loads(out)
    par = d.get("parallel") or {}
    return {"recommended": d["recommended"], "reasons": d["reasons"],
            "degrees": {"tensor_parallel": par.get("tensor_parallel", 1),
                        "sequence_parallel": par.get("sequence_parallel", 1), "sp_mode": par.get("sp_mode", "auto")},
            "strategies": {s["strategy"]: {"fits": s["fits"], "tokens_per_s": s["tokens_per_s"],
                                           "step_time_s": s["step_time_s"],
                                           "peak_tensors_gib": s["mem_gib"]["peak_tensors"]}
                           for s in d["strategies"]}}


def pick_name(plan: dict) -> str | None:
    """auto's whole pick: the preset, plus its tensor/sequence-parallel degrees when it adds any
    (e.g. 'fsdp+tp2', 'fsdp+sp2'), so it is measured and compared as what auto would launch."""
    pick = plan.get("recommended")
    deg = plan.get("degrees") or {}
    if pick is None:
        return None
    tp, sp = deg.get("tensor_parallel", 1), deg.get("sequence_parallel", 1)
    return pick + (f"+tp{tp}" if tp > 1 else "") + (f"+sp{sp}" if sp > 1 else "")


def degree_flags(name: str, plan: dict) -> tuple[str, list[str]]:
    """(preset, train flags) for a measured name: a plain preset, or auto's pick with its degrees."""
    if "+" not in name:
        return name, []
    deg = plan.get("degrees") or {}
    flags = []
    if deg.get("tensor_parallel", 1) > 1:
        flags += ["--tensor-parallel", str(deg["tensor_parallel"])]
    if deg.get("sequence_parallel", 1) > 1:
        flags += ["--sequence-parallel", str(deg["sequence_parallel"]), "--sp-mode", deg.get("sp_mode", "auto")]
    return name.split("+")[0], flags


def measure(c: tuple, name: str, model_dir: str, data: str, work: str, a, plan: dict | None = None) -> dict:
    strategy, flags = degree_flags(name, plan or {})
    out = os.path.join(work, "runs", c[0], name)
    cmd = [sys.executable, "-m", "shardwise", "train", "--model", model_dir, "--data", data, "--data-format", "text",
           "--strategy", strategy, "--nproc-per-node", str(a.gpus), *job_flags(c), *flags, "--grad-accum", "1",
           "--max-steps", str(a.steps), "--log-every", str(a.log_every), "--lr", "1e-5", "--warmup-steps", "0",
           "--no-save-final", "--output-dir", out, "--overwrite", "--force", *a.extra]
    t0 = time.time()
    code, output = run(cmd, a.timeout)
    rec = {"strategy": name, "exit_code": code, "wall_s": round(time.time() - t0, 1)}
    oom = "out of memory" in output.lower() or "OutOfMemoryError" in output
    metrics = os.path.join(out, "metrics.jsonl")
    rows = [json.loads(x) for x in open(metrics)] if os.path.isfile(metrics) else []
    steady = rows[1:] or rows  # the first window holds the warm-up (compile, allocator, prefetch)
    if steady and code == 0:
        rec.update(tokens_per_s=round(statistics.median(r["tokens_per_s"] for r in steady)),
                   step_time_s=round(statistics.median(r["step_time_s"] for r in steady), 4),
                   peak_mem_gib=round(max(r["peak_mem_gib"] for r in rows), 2))
    rec["status"] = "ok" if "tokens_per_s" in rec else ("oom" if oom else f"failed ({code})")
    if rec["status"] != "ok":
        rec["tail"] = output[-1500:]
    return rec


def verdict(entry: dict) -> dict:
    """Fastest measured preset, auto's pick and how far behind it is; whether the pick ran out of memory."""
    ok = {r["strategy"]: r["tokens_per_s"] for r in entry["measured"] if r["status"] == "ok"}
    pick = pick_name(entry["plan"])
    out = {"auto": pick, "fastest": max(ok, key=ok.get) if ok else None}
    status = {r["strategy"]: r["status"] for r in entry["measured"]}
    out["auto_oom"] = status.get(pick) == "oom"
    if ok and pick in ok:
        out["auto_vs_fastest"] = ok[pick] / ok[out["fastest"]] - 1
        out["auto_within_5pct"] = out["auto_vs_fastest"] >= -WITHIN
    return out


def write(base: str, meta: dict, entries: list[dict]) -> None:
    with open(base + ".json.tmp", "w") as fh:
        json.dump({**meta, "configs": entries}, fh, indent=1)
    os.replace(base + ".json.tmp", base + ".json")
    judged = [e for e in entries if "auto_within_5pct" in e.get("verdict", {})]
    good = sum(e["verdict"]["auto_within_5pct"] for e in judged)
    ooms = [e["name"] for e in entries if e.get("verdict", {}).get("auto_oom")]
    v = meta["versions"]
    lines = [f"# `auto` against a measured sweep, {meta['gpus']} GPUs — {meta['date']}", "",
             f"{v.get('gpu', 'no GPU')}; torch {v.get('torch')}, transformers {v.get('transformers')}, "
             f"deepspeed {v.get('deepspeed')}. `shardwise train`, {meta['steps']} steps, tokens/s the median of the "
             f"{meta['log_every']}-step windows after the first; random-init weights, text records longer than the "
             "sequence (no padding). auto = the plan's recommendation for the same flags.", "",
             f"**auto within {WITHIN:.0%} of the measured fastest in {good} of {len(judged)} configurations"
             + (f"; auto's pick ran out of memory in: {', '.join(ooms)}" if ooms else "; no pick ran out of memory")
             + "**", "",
             "| configuration | auto | fastest (measured) | auto vs fastest | measured tokens/s per preset (planned) |",
             "|---|---|---|---|---|"]
    for e in entries:
        vd = e.get("verdict", {})
        plan = e["plan"].get("strategies", {})
        cells = ", ".join(f"{r['strategy']} {r.get('tokens_per_s', r['status'])}"
                          + (f" ({plan[r['strategy']]['tokens_per_s']:,.0f})" if r["strategy"] in plan else "")
                          for r in e["measured"])
        diff = f"{vd['auto_vs_fastest']:+.1%}" if "auto_vs_fastest" in vd else "—"
        lines.append(f"| {e['name']} | {vd.get('auto') or '—'} | {vd.get('fastest') or '—'} | {diff} | {cells or '—'} |")
    lines += ["", "Presets the plan said do not fit were not run (their planned peak is in the JSON)."]
    with open(base + ".md.tmp", "w") as fh:
        fh.write("\n".join(lines) + "\n")
    os.replace(base + ".md.tmp", base + ".md")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help=f"the first {QUICK} configurations, {', '.join(QUICK_PRESETS)} and auto's pick, 15 steps")
    ap.add_argument("--only", default="", help="comma-separated configuration names")
    ap.add_argument("--plan-only", action="store_true", help="record the plans and auto's picks, train nothing")
    ap.add_argument("--skip-offload", action="store_true", help="do not measure the offload presets (slow)")
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=300, help="seconds per run (then it is marked timeout)")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "shardwise-auto-sweep"))
    ap.add_argument("extra", nargs="*", help="extra flags for both plan and train, after --")
    a = ap.parse_args()
    configs = CONFIGS[:QUICK] if a.quick else CONFIGS
    if a.only:
        names = {x.strip() for x in a.only.split(",") if x.strip()}
        unknown = names - {c[0] for c in CONFIGS}
        if unknown:
            print(f"auto_sweep: --only: unknown configuration(s) {', '.join(sorted(unknown))}; known: "
                  f"{', '.join(c[0] for c in CONFIGS)}", file=sys.stderr)
            return 2
        configs = [c for c in CONFIGS if c[0] in names]
    skip_offload = a.skip_offload or a.quick
    if a.quick:
        a.steps = min(a.steps, 15)
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.work, exist_ok=True)
    date = datetime.date.today().isoformat()
    base = os.path.join(a.out, f"auto_sweep_{date}" + (f"-{a.tag}" if a.tag else ""))
    meta = {"date": date, "gpus": a.gpus, "steps": a.steps, "log_every": a.log_every, "versions": versions(),
            "command": " ".join(sys.argv)}
    has_ds = importlib.util.find_spec("deepspeed") is not None
    entries = []
    for c in configs:
        name, shape = c[0], c[1]
        big = SHAPES[shape]["hidden_size"] >= 3072
        hf = {**SHAPES[shape], "max_position_embeddings": max(cc[2] for cc in CONFIGS)}
        if a.plan_only:  # the planner reads config.json only
            model_dir = os.path.join(a.work, "configs", shape)
            os.makedirs(model_dir, exist_ok=True)
            with open(os.path.join(model_dir, "config.json"), "w") as fh:
                json.dump({"model_type": "llama", "architectures": ["LlamaForCausalLM"], **hf}, fh)
        else:
            model_dir = build_model_dir(os.path.join(a.work, "models", shape), hf,
                                        disk_dtype="bfloat16" if big else "float32")
        data = None if a.plan_only else write_text_data(os.path.join(a.work, f"data-{c[2]}.jsonl"), n_records=c[3] * a.gpus * (a.steps + 4),
                               words_per_record=c[2] + 64, vocab=SHAPES[shape]["vocab_size"])
        plan = plan_of(c, model_dir, a.gpus, a.extra)
        entry = {"name": name, "shape": {"name": shape, **SHAPES[shape]}, "seq_len": c[2], "micro_batch": c[3],
                 "tuner": c[4], "checkpointing": c[5], "plan": plan, "measured": []}
        print(f"auto_sweep: {name}: auto -> {plan.get('recommended')}", flush=True)
        if not a.plan_only and "strategies" in plan:
            for s, p in plan["strategies"].items():
                if not p["fits"] or (skip_offload and "offload" in s):
                    continue
                if a.quick and s not in QUICK_PRESETS and s != plan["recommended"]:
                    continue
                if s.startswith("zero") and not has_ds:
                    entry["measured"].append({"strategy": s, "status": "skipped: deepspeed not installed"})
                    continue
                r = measure(c, s, model_dir, data, a.work, a)
                entry["measured"].append(r)
                print(f"auto_sweep: {name}: {s}: {r['status']}, {r.get('tokens_per_s')} tok/s, "
                      f"{r.get('peak_mem_gib')} GiB, {r['wall_s']} s", flush=True)
                entry["verdict"] = verdict(entry)
                write(base, meta, entries + [entry])
            whole = pick_name(plan)
            if whole and whole != plan["recommended"]:  # auto adds TP/SP degrees: measure what it would launch
                r = measure(c, whole, model_dir, data, a.work, a, plan)
                entry["measured"].append(r)
                print(f"auto_sweep: {name}: {whole} (auto's pick): {r['status']}, {r.get('tokens_per_s')} tok/s",
                      flush=True)
        entry["verdict"] = verdict(entry)
        entries.append(entry)
        write(base, meta, entries)
    print(f"auto_sweep: wrote {base}.md and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
