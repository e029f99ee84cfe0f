"""Long context on one GPU: offloaded checkpointing and MLP tiles, through the real `shardwise train`, with the
planner's prediction beside every row.

Rows (`ROWS`, run in the order given, most important first): a random-init model of a published shape (the
Llama-3.1-8B shape for LoRA and QLoRA, the Qwen2.5-1.5B shape for full fine-tuning), strategy single, one sequence
per step, bf16 compute, compiled blocks (the CUDA default), and the row's levers: plain full checkpointing, or
`--activation-checkpointing offload`, `--mlp-tiles auto`, or both. A ladder row (`length` 0) asks `shardwise plan` for
the longest of 64K, 128K, 256K, 384K and 512K tokens that it predicts fits and runs that (and, where the time is
left and it failed, the next shorter one).

Per row: tokens/s (median of the steps after the first, which holds compilation; "1st" marks a row that finished
only its first step), step time, the device peak (`torch.cuda.max_memory_allocated`, as metrics.jsonl reports it),
the host memory the run takes (the machine's used memory, MemTotal - MemAvailable, at its peak over its level before
the run, which counts the pinned checkpoints; beside it the peak RssAnon of the run's processes, which does not;
sampled every 0.5 s), exit status (OOM shown), and the plan's tensor peak, host bytes per rank and tokens/s for the same flags.
Rows at 64K also give the ratio to the plain checkpointed row of the same call (else to the landed figure, 4,341
tokens/s on one H100, docs/long-context.md).

The whole call keeps to `--budget-s`: before each row the time it needs is estimated from the plan's step time
(load + first step + steps) and a row that cannot finish is skipped (said in the report); each run's own timeout is
what is left, and a run stopped there still reports the steps it logged. OUT/long-context-1gpu-DATE[-TAG].{md,json}
is rewritten after every row.

    python benchmarks/long_context_one_gpu.py --rows lora-256k,lora-64k-levers --budget-s 470 --out $OUT
    python benchmarks/long_context_one_gpu.py --rows lora-64k-plain,lora-64k-levers,lora-128k-levers,full-1.5b-ladder \
        --budget-s 470 --out $OUT
    python benchmarks/long_context_one_gpu.py --layers 2 --rows lora-256k-nodrop --flags="--mlp-tiles 16" \
        --lengths 131072,196608,262144 --snapshot --gpu-gib 80 --budget-s 470 --out $OUT  # where a block's peak goes
    python benchmarks/long_context_one_gpu.py --smoke --out /tmp/lc  # the CPU, the tiny model: the script's own check

QLoRA rows need bitsandbytes (carried in .whl/, benchmarks/run.py). Needs one CUDA GPU (not with --smoke).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SHAPES = {
    "llama3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=524288,
                        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
    "qwen2.5-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=524288,
                         rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
}
LADDER = (65536, 131072, 262144, 393216, 524288)
LANDED_64K = 4341  # tokens/s, Llama-3.1-8B shape, LoRA, full checkpointing, one H100 (landed main, issue 42)
OFFLOAD = ("--activation-checkpointing", "offload")
TILES = ("--mlp-tiles", "auto")
FULL_AC = ("--activation-checkpointing", "full")
LORA = ("--tuner", "lora", "--lora-r", "16")


@dataclass(frozen=True)
class Row:
    shape: str
    flags: tuple  # train flags of the row (tuner, levers)
    length: int  # 0: the ladder's longest predicted to fit
    steps: int
    what: str


ROWS = {
    "lora-256k": Row("llama3.1-8b", (*LORA, *OFFLOAD, *TILES), 262144, 2, "LoRA at 256K, offload + tiles auto"),
    # without adapter dropout: each dropped-out adapter input is its own saved tensor (7 of them a block, 28.5 GiB
    # at 256K); without dropout the adapters share the projections' inputs
    "lora-256k-nodrop": Row("llama3.1-8b", (*LORA, "--lora-dropout", "0", *OFFLOAD, *TILES), 262144, 2,
                            "LoRA at 256K, dropout 0, offload + tiles auto"),
    "lora-64k-plain": Row("llama3.1-8b", (*LORA, *FULL_AC), 65536, 3, "LoRA at 64K, full checkpointing"),
    # at 64K the run fits without tiles, so auto takes none: the cost rows name the size rule's count
    "lora-64k-levers": Row("llama3.1-8b", (*LORA, *OFFLOAD, "--mlp-tiles", "8"), 65536, 3,
                           "LoRA at 64K, offload + 8 tiles"),
    "lora-64k-offload": Row("llama3.1-8b", (*LORA, *OFFLOAD), 65536, 3, "LoRA at 64K, offload"),
    "lora-64k-tiles": Row("llama3.1-8b", (*LORA, *FULL_AC, "--mlp-tiles", "8"), 65536, 3,
                          "LoRA at 64K, full + 8 tiles"),
    "lora-128k-levers": Row("llama3.1-8b", (*LORA, *OFFLOAD, *TILES), 131072, 2,
                            "LoRA at 128K, offload + tiles auto"),
    "lora-ladder": Row("llama3.1-8b", (*LORA, *OFFLOAD, *TILES), 0, 1, "LoRA, longest planned to fit"),
    "qlora-256k": Row("llama3.1-8b", ("--tuner", "qlora", "--lora-r", "16", *OFFLOAD, *TILES), 262144, 2,
                      "QLoRA at 256K, offload + tiles"),
    "qlora-ladder": Row("llama3.1-8b", ("--tuner", "qlora", "--lora-r", "16", *OFFLOAD, *TILES), 0, 1,
                        "QLoRA, longest planned to fit"),
    "full-1.5b-ladder": Row("qwen2.5-1.5b", ("--tuner", "full", *OFFLOAD, *TILES), 0, 2,
                            "full fine-tune, longest planned to fit"),
}
# --smoke: the same code paths on the CPU with the built-in tiny model (its context limit is 2048)
SMOKE_ROWS = {
    "tiny-plain": Row("tiny", FULL_AC, 1024, 2, "full checkpointing"),
    "tiny-levers": Row("tiny", (*OFFLOAD, "--mlp-tiles", "4"), 1024, 2, "offload + 4 tiles"),
    "tiny-lora-ladder": Row("tiny", (*LORA, *OFFLOAD, *TILES), 0, 2, "LoRA, ladder"),
}
SMOKE_LADDER = (512, 1024, 2048)


def common_flags(smoke: bool) -> list[str]:
    return ["--strategy", "single", "--nproc-per-node", "1", "--micro-batch-size", "1", "--grad-accum", "1",
            "--mixed-precision", "no" if smoke else "bf16"]


def plan(model: str, length: int, flags: tuple, smoke: bool, hardware: tuple = (), extra: tuple = ()) -> dict:
    """`shardwise plan --json` for one row: its fit, tensor peak, host bytes per rank, step time and tokens/s, on the
    machine's GPU and host RAM as detected (`hardware`: plan flags that say them instead; --smoke: one 80 GiB GPU)."""
    hardware = hardware or (("--gpus", "1", "--gpu-memory", "80") if smoke else ())
    cmd = [sys.executable, "-m", "shardwise", "plan", "--model", model, "--seq-len", str(length), "--json",
           *common_flags(smoke), *flags, *extra, *hardware]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        return {"plan_error": (p.stderr or p.stdout).strip()[-300:]}
    out = json.loads(p.stdout)
    row = next(s for s in out["strategies"] if s["strategy"] == "single")
    mem = row["mem_gib"]
    return {"plan_tiles": out["job"].get("mlp_tiles_resolved"), "plan_fits": row["fits"],
            "plan_gib": round(mem["peak_tensors"], 2),
            "plan_total_gib": round(mem["total"], 2), "plan_host_gib": round(mem["host_peak_per_rank"], 2),
            "plan_host_kept_gib": round(mem["host_per_rank"], 2),
            "plan_step_s": row["step_time_s"], "plan_tokens_per_s": row["tokens_per_s"]}


class HostPeak(threading.Thread):
    """Two host-memory peaks of a run: the largest sum of RssAnon over the processes of its process group (the
    launcher, its worker and the compiler's workers), and the largest growth of the machine's used memory (MemTotal -
    MemAvailable) over the level before the run, which also counts pinned memory (cudaHostAlloc's pages are not
    RssAnon)."""

    def __init__(self, pgid: int):
        super().__init__(daemon=True)
        self.pgid, self.peak, self.done = pgid, 0, threading.Event()
        self.base = self.used = used_bytes()
        self.grew = 0

    def _sample(self) -> int:
        total = 0
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                if os.getpgid(int(pid)) != self.pgid:
                    continue
                with open(f"/proc/{pid}/status") as fh:
                    total += next((int(x.split()[1]) * 1024 for x in fh if x.startswith("RssAnon:")), 0)
            except (OSError, ProcessLookupError, StopIteration):
                continue
        return total

    def run(self):
        while not self.done.wait(0.5):
            self.peak = max(self.peak, self._sample())
            self.grew = max(self.grew, used_bytes() - self.base)


def used_bytes() -> int:
    with open("/proc/meminfo") as fh:
        info = {x.split(":")[0]: int(x.split()[1]) * 1024 for x in fh}
    return info["MemTotal"] - info["MemAvailable"]


def train(model: str, data: str, name: str, length: int, row: Row, timeout: float, work: str, smoke: bool,
          tiles: int | None = None, extra: tuple = ()) -> dict:
    """One `shardwise train` run of a row; `tiles`: the count to run in place of the row's `--mlp-tiles auto` (the
    plan's choice for the GPU size of --gpu-gib, where the card is larger)."""
    out = os.path.join(work, name)
    flags = [*row.flags, *extra]
    at = flags.index("--mlp-tiles") + 1 if "--mlp-tiles" in flags else 0
    if tiles and at and flags[at] == "auto":
        flags[at] = str(tiles)
    shutil.rmtree(out, ignore_errors=True)  # never report an earlier run's metrics
    cmd = [sys.executable, "-m", "shardwise", "train", "--model", model, "--data", data, "--data-format", "text",
           *common_flags(smoke), "--seq-len", str(length), "--max-steps", str(row.steps), "--log-every", "1",
           "--lr", "1e-5", "--warmup-steps", "0", "--no-save-final", "--output-dir", out, "--overwrite", "--force",
           *flags]
    rec = {"length": length, "command": " ".join(cmd[1:])}
    t0 = time.time()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    host = HostPeak(p.pid)
    host.start()
    try:
        output, _ = p.communicate(timeout=max(1.0, timeout))
        rec["exit_code"] = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)  # the launcher and its worker (holding the GPU)
        output, _ = p.communicate()
        rec["exit_code"] = "timeout"
    host.done.set()
    rec["wall_s"] = round(time.time() - t0, 1)
    rec["host_peak_gib"] = round(host.peak / 2**30, 2)
    rec["host_used_gib"] = round(host.grew / 2**30, 2)
    snap = os.path.join(out, "memory", "rank0.pickle")  # --snapshot: the allocator's history of the first step
    if os.path.isfile(snap):
        rec["peak_breakdown"] = breakdown(snap)
    metrics = os.path.join(out, "metrics.jsonl")
    rows = [json.loads(x) for x in open(metrics)] if os.path.isfile(metrics) else []
    rows = [r for r in rows if "tokens_per_s" in r]
    steady = rows[1:] or rows
    if steady:
        rec["steps_logged"] = len(rows)
        rec["tokens_per_s"] = round(statistics.median(r["tokens_per_s"] for r in steady))
        rec["step_s"] = round(statistics.median(r["step_time_s"] for r in steady), 2)
        rec["peak_gib"] = round(max(r["peak_mem_gib"] for r in rows), 2)
    compiler = [ln for ln in (output or "").splitlines() if "Graph break" in ln or "Recompiling" in ln]
    if compiler:  # TORCH_LOGS=recompiles,graph_breaks in the environment: what the compiler said, kept with the row
        rec["compiler_log"] = compiler[:40]
    if rec["exit_code"] != 0:
        text = output or ""
        rec["oom"] = "OutOfMemoryError" in text or "CUDA out of memory" in text
        rec["error_tail"] = text[-1500:]
    shutil.rmtree(out, ignore_errors=True)
    return rec


def breakdown(path: str) -> dict:
    """What was alive at the largest total of a run's allocator history (`--memory-snapshot`), grouped by the
    line that made it (benchmarks/plan_accuracy.py peak_breakdown); the history is the run's own file."""
    import pickle

    from plan_accuracy import peak_breakdown

    with open(path, "rb") as fh:
        return peak_breakdown(pickle.load(fh))


def status(r: dict) -> str:
    if r.get("skipped"):
        return f"skipped: {r['skipped']}"
    if r.get("exit_code") == 0:
        return "ok"
    if r.get("oom"):
        return "OOM"
    if r.get("exit_code") == "timeout":
        return f"stopped at the budget after {r.get('steps_logged', 0)} step(s)"
    return f"exit {r.get('exit_code')}"


def write_report(base: str, meta: dict, results: list[dict]) -> None:
    with open(base + ".json.tmp", "w") as fh:
        json.dump({**meta, "results": results}, fh, indent=1)
    os.replace(base + ".json.tmp", base + ".json")
    v = meta["versions"]
    plain = next((r.get("tokens_per_s") for r in results if r["row"] == "lora-64k-plain" and r.get("tokens_per_s")),
                 None)
    lines = [f"# Long context on one GPU: offloaded checkpointing and MLP tiles — {meta['date']}", "",
             f"{v.get('gpu', 'no GPU')}, CUDA {v.get('cuda')}; torch {v.get('torch')}, transformers "
             f"{v.get('transformers')}, bitsandbytes {v.get('bitsandbytes')}; host RAM {meta['host_gib']} GiB.", "",
             "strategy single, one sequence per step, bf16 compute (fp32 master weights for the trained ones), "
             f"{'eager' if any('--compile off' in r.get('levers', '') for r in results) else 'compiled'} blocks, "
             "random init. tok/s: median of the steps after the first (1st: only the first step "
             "finished, compilation included). Device GiB: max_memory_allocated; host GiB: the growth of the machine's "
             "used memory over its level before the run, at its peak (in brackets: the peak RssAnon of the run's "
             "processes, which leaves out pinned pages). Plan: `shardwise plan` for the same flags (tensor peak; host per rank; tokens/s). "
             f"x plain: tokens/s over {'this call' if plain else 'the landed'} plain 64K row ({plain or LANDED_64K:,}).",
             "", "| row | shape | what | tokens | status | tok/s | x plain | step s | device GiB | plan GiB | "
             "host GiB | plan host GiB | plan tok/s |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        tps = r.get("tokens_per_s")
        first = " (1st)" if r.get("steps_logged") == 1 else ""
        ratio = f"{tps / (plain or LANDED_64K):.2f}" if tps and r.get("length") == 65536 else ""
        lines.append(f"| {r['row']} | {r['shape']} | {r['levers']} | {r.get('length', 0):,} | {status(r)} | "
                     f"{tps if tps else '—'}{first} | {ratio} | {r.get('step_s', '—')} | {r.get('peak_gib', '—')} | "
                     f"{r.get('plan_gib', '—')} | {r.get('host_used_gib', '—')} ({r.get('host_peak_gib', '—')}) | "
                     f"{r.get('plan_host_gib', '—')} | "
                     f"{round(r['plan_tokens_per_s']) if r.get('plan_tokens_per_s') else '—'} |")
    lines += ["", "Commands (from the repository root):", ""]
    lines += [f"- {r['row']}: `python {r['command']}`" for r in results if r.get("command")]
    for r in results:
        if r.get("peak_breakdown"):
            b = r["peak_breakdown"]
            lines += ["", f"## {r['row']} at {r.get('length', 0):,}: alive at the first step's peak "
                      f"({b['peak_bytes_in_trace'] / 2**30:.2f} GiB above the start of the record)", ""]
            lines += [f"- {x['bytes'] / 2**30:.2f} GiB in {x['blocks']} block(s): {x['where']}" for x in b["top"]]
            lines += [f"- reached in: {' <- '.join(b['at'])}"] if b.get("at") else []
            lines += ["", "largest blocks alive there:"] + [
                f"- {x['bytes'] / 2**30:.3f} GiB: {' <- '.join(x['made_in'])} ({' <- '.join(x['own'])})"
                for x in b.get("largest", [])]
    for r in results:
        if r.get("error_tail") and not r.get("oom"):
            lines += ["", f"## {r['row']}: last output", "", "```", r["error_tail"].strip()[-1200:], "```"]
    with open(base + ".md.tmp", "w") as fh:
        fh.write("\n".join(lines) + "\n")
    os.replace(base + ".md.tmp", base + ".md")


def make_data(work: str, length: int, records: int, vocab: int) -> str:
    """`records` text records of length + 16 words of the word-level tokenizer (one token each; the tiny model's
    BPE makes more), so every sequence is full."""
    import random

    path = os.path.join(work, f"text-{length}-{records}.jsonl")
    if not os.path.isfile(path):
        rng = random.Random(0)
        with open(path + ".tmp", "w") as fh:
            for _ in range(records):
                fh.write(json.dumps({"text": " ".join(f"w{rng.randrange(vocab - 6)}" for _ in range(length + 16))})
                         + "\n")
        os.replace(path + ".tmp", path)
    return path


def in_child(code: str) -> str:
    """Run `code` in a child Python (CUDA never starts in this process: its context would hold GPU memory that
    the runs need); its last stdout line."""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.abspath(__file__)))
    if p.returncode != 0:
        raise SystemExit(f"long_context_one_gpu: {p.stderr.strip()[-800:]}")
    return p.stdout.strip().splitlines()[-1]


def host_gib() -> float:
    with open("/proc/meminfo") as fh:
        kb = next(int(x.split()[1]) for x in fh if x.startswith("MemTotal:"))
    return round(kb / 2**20, 1)


def lengths_for(model: str, row: Row, smoke: bool, hardware: tuple = (), extra: tuple = ()) -> list[int]:
    """The lengths to try for a row: its own, or the ladder's longest planned to fit (the process's planned host
    peak within 90% of the host's RAM), then the shorter ones."""
    if row.length:
        return [row.length]
    ladder = SMOKE_LADDER if smoke else LADDER

    def planned(n: int) -> bool:
        p = plan(model, n, row.flags, smoke, hardware, extra)
        return bool(p.get("plan_fits")) and p.get("plan_host_gib", 0) <= 0.9 * host_gib()

    fits = [n for n in ladder if planned(n)]
    top = max(fits) if fits else ladder[0]
    return [n for n in reversed(ladder) if n <= top]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="lora-256k,lora-64k-plain,lora-64k-levers",
                    help=f"comma-separated, in order (of {', '.join(ROWS)})")
    ap.add_argument("--budget-s", type=float, default=470, help="seconds for every row together")
    ap.add_argument("--smoke", action="store_true", help="the tiny model on the CPU (the script's own check)")
    ap.add_argument("--gpu-gib", type=float, default=0,
                    help="plan for a GPU of this many GiB (e.g. 80 on a 141 GiB H200) and run `--mlp-tiles auto` rows "
                         "with the count that plan chooses for it; the report gives the card's own size beside it")
    ap.add_argument("--layers", type=int, default=0,
                    help="build each shape with this many decoder blocks instead of its own (a probe of one block's "
                         "memory at a length in a fraction of the time; the plan is of the same model)")
    ap.add_argument("--flags", default="", help="more train flags for every row, one string (plan gets them too), "
                    "e.g. --flags='--lora-dropout 0'")
    ap.add_argument("--lengths", default="", help="comma-separated token counts to run every row at, in place of "
                    "the rows' own (with --layers 2: where along the lengths a block's peak departs from the plan)")
    ap.add_argument("--snapshot", action="store_true",
                    help="record the allocator's history of each run's first step (--memory-snapshot 1) and report "
                         "what was alive at its peak, by the line that made it (the JSON's peak_breakdown); with torch 2.11 "
                         "and later give --flags='... --compile off': train refuses a compiled checkpointed snapshot "
                         "there (pytorch/pytorch#179536)")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "shardwise-long-context-1gpu"))
    a = ap.parse_args()
    start = time.time()
    table = SMOKE_ROWS if a.smoke else ROWS
    extra = tuple(a.flags.split())
    snapshot = ("--memory-snapshot", "1") if a.snapshot and not a.smoke else ()  # train's only: plan has no such flag
    names = list(SMOKE_ROWS) if a.smoke else [n.strip() for n in a.rows.split(",") if n.strip()]
    unknown = [n for n in names if n not in table]
    if unknown:
        print(f"long_context_one_gpu: unknown rows {unknown}; rows: {', '.join(table)}", file=sys.stderr)
        return 2
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.work, exist_ok=True)
    if not a.smoke and in_child("import torch; print(torch.cuda.device_count())") == "0":
        print("long_context_one_gpu: needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    versions = json.loads(in_child("import json, common\nv = common.versions()\ntry:\n import bitsandbytes\n"
                                   " v['bitsandbytes'] = bitsandbytes.__version__\nexcept Exception:\n pass\n"
                                   "print(json.dumps(v))"))
    date = datetime.date.today().isoformat()
    hardware = ("--gpus", "1", "--gpu-memory", f"{a.gpu_gib:g}") if a.gpu_gib else ()
    meta = {"date": date, "versions": versions, "host_gib": host_gib(), "budget_s": a.budget_s, "gpu_gib": a.gpu_gib,
            "layers": a.layers or "the shape's", "flags": a.flags,
            "rows": {n: asdict(table[n]) for n in names}}
    base = os.path.join(a.out, f"long-context-1gpu-{date}" + (f"-{a.tag}" if a.tag else ""))
    load_s = 15.0 if a.smoke else 60.0  # launch, imports, model load, data; then the first step's compilation
    models: dict[str, str] = {}
    results: list[dict] = []
    for name in names:
        row = table[name]
        if row.shape not in models:
            if a.smoke:
                models[row.shape] = "tiny"
            else:
                shape = {**SHAPES[row.shape], **({"num_hidden_layers": a.layers} if a.layers else {})}
                path = os.path.join(a.work, row.shape.replace(".", "") + (f"-{a.layers}l" if a.layers else ""))
                models[row.shape] = in_child(f"import common\nprint(common.build_model_dir({path!r}, "
                                             f"{shape!r}, disk_dtype='bfloat16'))")
        model = models[row.shape]
        for length in ([int(x) for x in a.lengths.split(",")] if a.lengths else
                       lengths_for(model, row, a.smoke, hardware, extra)):
            rec = {"row": name, "shape": row.shape + (f" ({a.layers} layers)" if a.layers else ""),
                   "levers": row.what + (f" {a.flags}" if a.flags else ""), "length": length,
                   **plan(model, length, row.flags, a.smoke, hardware, extra)}
            left = a.budget_s - (time.time() - start)
            one_step = load_s + (0 if a.smoke else 60.0) + rec.get("plan_step_s", 0.0)
            if one_step > left:
                rec["skipped"] = f"{one_step:.0f} s for one step, {left:.0f} s left"
            else:
                vocab = 512 if a.smoke else SHAPES[row.shape]["vocab_size"]
                data = make_data(a.work, length, row.steps + 2, vocab)
                print(f"long_context_one_gpu: {name} at {length} tokens ({left:.0f} s left) ...", flush=True)
                rec.update(train(model, data, f"{name}-{length}", length, row, left - 5, a.work, a.smoke,
                                 rec.get("plan_tiles") if a.gpu_gib else None, extra + snapshot))
                print(f"long_context_one_gpu: {name} {length}: {status(rec)}, {rec.get('tokens_per_s')} tok/s, "
                      f"{rec.get('peak_gib')} GiB (plan {rec.get('plan_gib')}), host {rec.get('host_used_gib')} "
                      f"GiB (plan {rec.get('plan_host_gib')}), {rec['wall_s']} s", flush=True)
            results.append(rec)
            write_report(base, meta, results)
            if not a.lengths and (rec.get("exit_code") == 0 or rec.get("skipped") or rec.get("exit_code") == "timeout"):
                break  # a ladder tries a shorter length only after a failure; --lengths runs each
    print(f"long_context_one_gpu: wrote {base}.md and .json")
    return 0 if all(r.get("exit_code") in (0, "timeout") or r.get("oom") or r.get("skipped") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
