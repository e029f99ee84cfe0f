"""The planner's grid of issue 41, measured by rehearsal on one GPU: `shardwise plan ... --rehearse --json` for
each row (rank 0 of the row's N-GPU job through torch's fake process group, plan/rehearse.py), with the planner's
prediction beside what the rank measured.

Rows, most important first (one device call of a few minutes measures as many as fit its budget):
the Llama-3.1-8B shape under fsdp at 8 and 64 GPUs (8k first, then 32k), fsdp + TP 2/4/8 and SP 2/4/8 (Ulysses,
ring where asked), full fine-tune and LoRA, with and without checkpointing; then the Llama-3.1-70B shape (LoRA
under fsdp 8, full under fsdp 64, full with CPU offload on 8; QLoRA, which only ddp/single take, runs only when
named in --rows: its bf16 base is made on the host first, ~150 GB of RAM); then
Qwen2.5-7B and a Qwen-MoE shape (Qwen1.5-MoE-A2.7B's config.json, written to a temporary directory: 60 experts
of 1408, 4 shared, top 4) under fsdp 8 and zero3 8.

Each row reports: the plan's total per rank (tensors + allowance) and the rehearsal's (peak reserved + the CUDA
context), the peak allocated beside the plan's tensor peak, the plan's compute time and the measured
compute-only step (the fake group moves nothing), the planner's exposed communication, the predicted step
(measured + communication) against the plan's step, and the differences, (plan - measured) / measured. A row
that does not fit the GPU says so (out of memory); a row the engine refuses says why.

The blocks run eager unless --compile (the compiled rows' first step compiles every block: minutes per row);
3 steps per row, the first a warm-up. Writes OUT/rehearse-grid-GPU-YYYY-MM-DD[-TAG].{md,json}, rewritten after
every row, so a run cut short keeps what finished; rows start only while --budget-s has room for one more.

    python benchmarks/rehearse_grid.py --out $OUT                      # the grid, on the device
    python benchmarks/rehearse_grid.py --rows 8b-fsdp8-8k,8b-fsdp64-8k --out $OUT
    python benchmarks/rehearse_grid.py --smoke --out /tmp/smoke        # the tiny model on the CPU, a few rows

Follows benchmarks/run.py's conventions (its docstring: the carried wheels in .whl/, PYTHONPATH=/tmp/site:src:.).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import versions  # noqa: E402

# Qwen1.5-MoE-A2.7B's config.json values (Qwen/Qwen1.5-MoE-A2.7B): 14.3B parameters, 2.7B active
QWEN_MOE = dict(model_type="qwen2_moe", vocab_size=151936, hidden_size=2048, intermediate_size=5632,
                moe_intermediate_size=1408, shared_expert_intermediate_size=5632, num_experts=60,
                num_experts_per_tok=4, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
                max_position_embeddings=8192, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                decoder_sparse_step=1, norm_topk_prob=False, mlp_only_layers=[])

CK = ("--gradient-checkpointing",)
NO_CK = ("--no-gradient-checkpointing",)
LORA = ("--tuner", "lora", "--lora-r", "16")


def row(name, model, gpus, nodes, strategy, seq, *flags):
    return {"name": name, "model": model, "gpus": gpus, "nodes": nodes, "strategy": strategy, "seq_len": seq,
            "flags": list(flags)}


GRID = [
    # the Llama-3.1-8B shape: fsdp 8 / 64, 8k then 32k (the probe: 27.6 / 17.8 GiB at 8k, 69.6 / 59.8 at 32k)
    row("8b-fsdp8-8k", "llama-3.1-8b", 8, 1, "fsdp", 8192, *CK),
    row("8b-fsdp64-8k", "llama-3.1-8b", 8, 8, "fsdp", 8192, *CK),
    row("8b-fsdp8-tp2-8k", "llama-3.1-8b", 8, 1, "fsdp", 8192, *CK, "--tensor-parallel", "2"),
    row("8b-fsdp8-sp2-8k", "llama-3.1-8b", 8, 1, "fsdp", 8192, *CK, "--sequence-parallel", "2"),
    row("8b-fsdp8-lora-8k", "llama-3.1-8b", 8, 1, "fsdp", 8192, *CK, *LORA),
    row("8b-fsdp8-32k", "llama-3.1-8b", 8, 1, "fsdp", 32768, *CK),
    row("8b-fsdp64-32k", "llama-3.1-8b", 8, 8, "fsdp", 32768, *CK),
    row("8b-fsdp8-tp4-8k", "llama-3.1-8b", 8, 1, "fsdp", 8192, *CK, "--tensor-parallel", "4"),
    row("8b-fsdp8-tp8-8k", "llama-3.1-8b", 8, 1, "fsdp", 8192, *CK, "--tensor-parallel", "8"),
    row("8b-fsdp8-sp4-32k", "llama-3.1-8b", 8, 1, "fsdp", 32768, *CK, "--sequence-parallel", "4"),
    row("8b-fsdp8-sp8-32k", "llama-3.1-8b", 8, 1, "fsdp", 32768, *CK, "--sequence-parallel", "8"),
    row("8b-fsdp8-sp8ring-32k", "llama-3.1-8b", 8, 1, "fsdp", 32768, *CK, "--sequence-parallel", "8", "--sp-mode",
        "ring"),
    row("8b-fsdp8-sp2-32k", "llama-3.1-8b", 8, 1, "fsdp", 32768, *CK, "--sequence-parallel", "2"),
    row("8b-fsdp8-tp2-32k", "llama-3.1-8b", 8, 1, "fsdp", 32768, *CK, "--tensor-parallel", "2"),
    row("8b-fsdp8-lora-32k", "llama-3.1-8b", 8, 1, "fsdp", 32768, *CK, *LORA),
    row("8b-fsdp64-lora-8k", "llama-3.1-8b", 8, 8, "fsdp", 8192, *CK, *LORA),
    row("8b-fsdp8-lora-nock-8k", "llama-3.1-8b", 8, 1, "fsdp", 8192, *NO_CK, *LORA),
    row("8b-fsdp8-nock-8k", "llama-3.1-8b", 8, 1, "fsdp", 8192, *NO_CK),  # planned at 80 GiB: the OOM line
    # the Llama-3.1-70B shape (published: torchtune's 70B LoRA on 8 x A100, 26.4 GiB per GPU)
    row("70b-fsdp8-lora-8k", "llama-3.1-70b", 8, 1, "fsdp", 8192, *CK, *LORA),
    row("70b-fsdp64-8k", "llama-3.1-70b", 8, 8, "fsdp", 8192, *CK),
    row("70b-fsdp-offload8-8k", "llama-3.1-70b", 8, 1, "fsdp-offload", 8192, *CK),
    row("70b-ddp8-qlora-8k", "llama-3.1-70b", 8, 1, "ddp", 8192, *CK, "--tuner", "qlora", "--lora-r", "16"),
    # Qwen2.5-7B and a mixture-of-experts shape under fsdp 8 and zero3 8
    row("qwen7b-fsdp8-8k", "qwen2.5-7b", 8, 1, "fsdp", 8192, *CK),
    row("qwen7b-zero3-8-8k", "qwen2.5-7b", 8, 1, "zero3", 8192, *CK),
    row("qwenmoe-fsdp8-8k", "qwen-moe", 8, 1, "fsdp", 8192, *CK),
    row("qwenmoe-zero3-8-8k", "qwen-moe", 8, 1, "zero3", 8192, *CK),
]

SMOKE = ["8b-fsdp8-8k", "8b-fsdp8-tp2-8k", "8b-fsdp8-sp2-8k", "qwen7b-zero3-8-8k"]  # their shapes as the tiny model


def model_arg(model: str, tmp: str | None, smoke: bool) -> str:
    """--model for a row: a preset, the tiny model (--smoke), or the MoE shape's directory written under `tmp`
    (None: only named, as --list shows it)."""
    if smoke:
        return "tiny"
    if model == "qwen-moe":
        if tmp is None:
            return "TMPDIR/qwen-moe"
        path = os.path.join(tmp, "qwen-moe")
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as fh:
            json.dump(QWEN_MOE, fh)
        return path
    return model


def plan_argv(r: dict, tmp: str | None, args) -> list[str]:
    seq = 256 if args.smoke else r["seq_len"]
    argv = ["plan", "--model", model_arg(r["model"], tmp, args.smoke), "--gpus", str(r["gpus"]), "--nodes",
            str(r["nodes"]), "--strategy", r["strategy"], "--seq-len", str(seq), "--micro-batch-size", "1",
            "--grad-accum", "1", "--mixed-precision", "bf16", "--param-dtype", "fp32",
            "--compile", "on" if args.compile else "off", *r["flags"], "--rehearse", "--json"]
    if args.smoke:  # a plan for GPUs, rehearsed on the CPU
        argv += ["--gpu-type", "H100", "--gpu-memory", "80"]
    return argv


def measure(r: dict, tmp: str, args, timeout_s: float) -> dict:
    argv = plan_argv(r, tmp, args)
    t0 = time.time()
    try:
        p = subprocess.run([sys.executable, "-m", "shardwise", *argv], capture_output=True, text=True,
                           timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {**r, "ok": False, "error": f"did not finish within {timeout_s:.0f} s", "seconds": round(timeout_s)}
    out = {**r, "argv": argv, "seconds": round(time.time() - t0, 1)}
    if p.returncode != 0:
        return {**out, "ok": False, "error": (p.stderr.strip().splitlines() or ["?"])[-1][:400]}
    d = json.loads(p.stdout)
    (rh,) = d["rehearsed"]["rows"]
    plan_row = next(s for s in d["strategies"] if s["strategy"] == r["strategy"])
    return {**out, "ok": rh["ok"], "rehearsed": rh, "device": d["rehearsed"]["device"],
            "plan": {"total_gib": plan_row["mem_gib"]["total"], "tensors_gib": plan_row["mem_gib"]["peak_tensors"],
                     "compute_s": plan_row["compute_s"], "exposed_comm_s": plan_row["exposed_comm_s"],
                     "other_s": plan_row["other_s"], "step_s": plan_row["step_time_s"], "fits": plan_row["fits"],
                     "peak_phase": plan_row["peak_phase"]},
            **({} if rh["ok"] else {"error": rh["error"]})}


def pct(plan: float, measured: float | None) -> str:
    return "—" if not measured else f"{100 * (plan - measured) / measured:+.0f}%"


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"# Planner grid by rehearsal, {meta['date']}", "",
             f"`python benchmarks/rehearse_grid.py {' '.join(meta['argv'])}` on {meta['device']}; {meta['versions']}",
             "", "One rank (rank 0) of each N-GPU job through torch's fake process group (`plan --rehearse`): the "
             "engine's wrapping, buffers and activations, no communication. Memory: the plan's total per rank "
             "against peak reserved + the CUDA context; tensors: the plan's tensor peak against peak allocated. "
             "Compute: the plan's forward/backward time against the measured compute-only step (optimizer "
             "included). Step: measured + the planner's exposed communication against the plan's step. "
             f"Blocks {'compiled' if meta['compile'] else 'eager'}; micro-batch 1, bf16 compute over fp32 weights. "
             "diff = (plan - measured) / measured.", "",
             "| row | plan GiB | rehearsed GiB | diff | plan tensors | allocated | diff | plan compute s | measured s "
             "| diff | comm s | predicted step s | plan step s | diff | s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r.get("ok"):
            lines.append(f"| {r['name']} | {r.get('plan', {}).get('total_gib', float('nan')):.2f} | "
                         f"{r.get('error', '?')} |  |  |  |  |  |  |  |  |  |  |  | {r.get('seconds', '')} |")
            continue
        p, m = r["plan"], r["rehearsed"]
        lines.append(f"| {r['name']} | {p['total_gib']:.2f} | {m['need_gib']:.2f} | "
                     f"{pct(p['total_gib'], m['need_gib'])} | {p['tensors_gib']:.2f} | {m['peak_allocated_gib']:.2f} | "
                     f"{pct(p['tensors_gib'], m['peak_allocated_gib'])} | {p['compute_s']:.3f} | {m['compute_s']:.3f} | "
                     f"{pct(p['compute_s'], m['compute_s'])} | {m['comm_s']:.3f} | {m['predicted_step_s']:.3f} | "
                     f"{p['step_s']:.3f} | {pct(p['step_s'], m['predicted_step_s'])} | {r['seconds']} |")
    return "\n".join(lines) + "\n"


def write(rows: list[dict], meta: dict, base: str) -> None:
    for path, text in ((base + ".json", json.dumps({"meta": meta, "rows": rows}, indent=1)),
                       (base + ".md", markdown(rows, meta))):
        with open(path + ".tmp", "w") as fh:
            fh.write(text)
        os.replace(path + ".tmp", path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", help="comma-separated row names (default: every row, in the grid's order)")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join("benchmarks", "results"))
    ap.add_argument("--tag", default="")
    ap.add_argument("--budget-s", type=float, default=420,
                    help="end by this many seconds: a row starts only where about 1.2 x the slowest row so far is "
                         "left, and is stopped at the end")
    ap.add_argument("--row-timeout", type=int, default=170)
    ap.add_argument("--compile", action="store_true", help="compiled blocks (the default job on a GPU)")
    ap.add_argument("--smoke", action="store_true", help="the tiny model on the CPU for a few rows' shapes")
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args(argv)
    names = args.rows.split(",") if args.rows else SMOKE if args.smoke else [r["name"] for r in GRID]
    by_name = {r["name"]: r for r in GRID}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        ap.error(f"unknown rows {unknown}; --list lists them")
    if args.list:
        for r in GRID:
            print(r["name"], " ".join(plan_argv(r, None, args)))
        return 0
    v = versions()
    device = v.get("gpu") or "cpu"
    meta = {"date": datetime.date.today().isoformat(), "argv": sys.argv[1:] if argv is None else argv,
            "device": device, "versions": ", ".join(f"{k} {val}" for k, val in v.items() if k != "gpu"),
            "compile": args.compile, "smoke": args.smoke}
    os.makedirs(args.out, exist_ok=True)
    gpu = "cpu" if args.smoke or device == "cpu" else device.split()[1].lower() if len(device.split()) > 1 else "gpu"
    base = os.path.join(args.out, f"rehearse-grid-{gpu}-{meta['date']}" + (f"-{args.tag}" if args.tag else ""))
    start, rows = time.time(), []
    with tempfile.TemporaryDirectory(prefix="rehearse-grid-") as tmp:
        for name in names:
            left = args.budget_s - (time.time() - start)
            slowest = max((r["seconds"] for r in rows), default=0)
            if left < max(20.0, 1.2 * slowest):
                print(f"budget: {args.budget_s - left:.0f} s spent; rows left for another call: "
                      f"{','.join(names[len(rows):])}", flush=True)
                break
            r = measure(by_name[name], tmp, args, min(args.row_timeout, left))
            rows.append(r)
            got = (f"{r['rehearsed']['need_gib']:.2f} GiB (plan {r['plan']['total_gib']:.2f}), compute "
                   f"{r['rehearsed']['compute_s']:.3f} s (plan {r['plan']['compute_s']:.3f})" if r["ok"]
                   else r.get("error"))
            print(f"{name}: {got} [{r.get('seconds')} s]", flush=True)
            write(rows, meta, base)
    print(f"wrote {base}.md and .json", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
