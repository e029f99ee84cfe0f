"""The bench report: one dict (report.json) from which the Markdown table + verdict, the
PNG (plot.py) and the terminal table are all drawn, so they cannot disagree.

Errors are (predicted - measured) / measured: +20% means the planner expected 20% more
than it got.
"""

from __future__ import annotations

import json
import os
import platform
import re
import time

from shardwise.bench.measure import error_pct, measured_stat, model_label, read_records, summarize
from shardwise.rundir import atomic_write

SCHEMA = "shardwise-bench/1"
RESULT_TEXT = {"ok": "ok", "oom": "does not fit", "failed": "failed", "unavailable": "cannot run here",
               "interrupted": "not run (interrupted)"}
# Config keys that differ between the strategies of one bench by design.
PER_STRATEGY_KEYS = ("strategy", "output_dir", "fsdp", "deepspeed")
LOSS_AGREE_REL = 1e-3
SAME_MEM_REL = 0.05  # peaks within 5% (or 50 MiB) of each other read as "about the same"
SAME_MEM_ABS_GIB = 0.05


# ----------------------------------------------------------------------------- environment


def versions() -> dict:
    from importlib import metadata

    from shardwise import __version__

    out = {"python": platform.python_version(), "shardwise": __version__}
    for pkg in ("torch", "transformers", "deepspeed", "peft"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    try:
        import torch

        out["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:
        pass
    return out


def hardware() -> dict:
    from shardwise.hardware import detect

    hw = detect()
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {"accelerator": hw.accelerator, "device_name": hw.device_name, "device_count": hw.device_count,
            "device_memory_gib": round(hw.memory_gib, 2), "host_memory_gib": round(hw.host_memory_gib, 2),
            "cpu": cpu, "cpu_count": os.cpu_count(), "platform": platform.platform()}


def _tag(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9.+-]+", "-", s).strip("-") or "x"


def report_stem(model: str, hw: dict, world_size: int, date: str) -> str:
    """<model>_<hardware>_<date>, e.g. Llama-3.2-1B_8xH200_2026-12-01 or tiny_cpu-2ranks_2026-11-29."""
    m = model_label(model)
    if hw.get("accelerator") == "cuda":
        name = hw.get("device_name", "gpu").replace("NVIDIA", "").strip().split(" ")[0]
        h = f"{world_size}x{name}"
    else:
        h = f"cpu-{world_size}ranks"
    return f"{_tag(m)}_{_tag(h)}_{date}"


# ----------------------------------------------------------------------------- building


def build(spec, outcomes: list, hw: dict, vers: dict, command: str, started: float) -> dict:
    rows = [_row(spec, o) for o in outcomes]
    _loss_agreement(rows)
    configs = [r["config"] for r in rows if r.get("config")]
    common = {k: v for k, v in configs[0].items() if k not in PER_STRATEGY_KEYS} if configs else {}
    planned = [r["predicted"] for r in rows]
    planner = ({"available": True, "note": ""} if any(p.get("available") for p in planned) else
               {"available": False, "note": next((p.get("note") for p in planned if p.get("note")), "")})
    rep = {
        "schema": SCHEMA,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "duration_s": round(time.time() - started, 1),
        "command": command,
        "settings": {"strategies": spec.strategies, "steps": spec.steps, "warmup": spec.warmup,
                     "profile_steps": getattr(spec, "profile_steps", 0), "repeat": getattr(spec, "repeat", 1),
                     "config_file": spec.config_path, "flags": {k: v for k, (v, _) in spec.flags.items()},
                     "timeout_s": spec.timeout_s, "runs_dir": os.path.abspath(spec.runs_dir)},
        "hardware": hw,
        "versions": vers,
        "config": common,
        "planner": planner,
        "results": rows,
    }
    rep["verdict"] = verdict(rep)
    return rep


def real_tokens_per_s(pred: dict, measured: dict) -> float | None:
    """The predicted throughput in the unit the loop measures, real (non-padding) tokens: the measured tokens per
    step over the predicted step time. The planner's own tokens/s counts sequence slots, padding included
    (`slot_tokens_per_s`); comparing that with real tokens read padding as a planner error (+55…305% on short
    chat records). So the throughput error is the step-time error seen from the other side: measured / predicted
    step time - 1. Without a measured step, the slot figure."""
    per_step = (measured.get("tokens_per_step") or {}).get("median")
    step = pred.get("step_time_s")
    if per_step and step:
        return per_step / step
    return pred.get("slot_tokens_per_s", pred.get("tokens_per_s"))


def _row(spec, o) -> dict:
    measured = {}
    if o.output_dir:  # a run that failed late may have logged steps; the tables show ok rows only
        recs = read_records(o.output_dir)
        if recs:
            measured = summarize(recs, spec.warmup, o.rank_peak_gib or None, o.world_size)
    pred = o.prediction or {"available": False}
    med = lambda d, k="median": (d or {}).get(k)  # noqa: E731
    err = {}
    if pred.get("available"):
        pred = {**pred, "tokens_per_s": real_tokens_per_s(pred, measured)}
    if o.status == "ok" and pred.get("available"):
        err = {"tokens_per_s": error_pct(pred.get("tokens_per_s"), med(measured.get("tokens_per_s"))),
               "step_time_s": error_pct(pred.get("step_time_s"), med(measured.get("step_time_s"))),
               "peak_mem_gib": error_pct(pred.get("peak_mem_gib"), med(measured.get("peak_mem_gib"), "max")),
               "comm_exposed_s": error_pct(pred.get("exposed_comm_s"), med(measured.get("comm_exposed_s")))}
    return {"strategy": o.strategy, "status": o.status, "result": RESULT_TEXT.get(o.status, o.status),
            "reason": o.reason, "world_size": o.world_size, "wall_s": round(o.wall_s, 1),
            "returncode": o.returncode, "run_dir": o.output_dir, "log": o.log,
            "measured": measured, "predicted": pred, "error_pct": err, "config": o.config,
            **({"repeats": o.repeats} if getattr(o, "repeats", None) else {})}


def _loss_agreement(rows: list) -> None:
    ok = [r for r in rows if r["status"] == "ok" and r["measured"].get("final_loss") is not None]
    if len(ok) < 2:
        return
    ref = ok[0]
    ok = [r for r in ok if r["world_size"] == ref["world_size"]]  # same global batch only
    for r in ok:
        a, b = r["measured"]["losses"], ref["measured"]["losses"]
        n = min(len(a), len(b))
        diffs = [abs(x - y) for x, y in zip(a[:n], b[:n]) if x is not None and y is not None]
        fl, rl = r["measured"]["final_loss"], ref["measured"]["final_loss"]
        r["measured"]["loss_vs_reference"] = {
            "reference": ref["strategy"], "final_rel_diff": abs(fl - rl) / abs(rl) if rl else None,
            "max_abs_diff_over_steps": max(diffs) if diffs else None}


# ----------------------------------------------------------------------------- verdict


def verdict(rep: dict) -> list[str]:
    rows = rep["results"]
    ok = [r for r in rows if r["status"] == "ok" and measured_stat(r, "tokens_per_s") is not None]
    out = []
    if not ok:
        out.append("No strategy completed, so there is nothing to compare; the rows say why each did not run.")
    else:
        fast = max(ok, key=lambda r: measured_stat(r, "tokens_per_s"))
        slow = min(ok, key=lambda r: measured_stat(r, "tokens_per_s"))
        line = f"Fastest: **{fast['strategy']}** at {_fmt_tps(measured_stat(fast, 'tokens_per_s'))} tokens/s (median over steps)"
        if slow is not fast:
            ratio = measured_stat(fast, "tokens_per_s") / measured_stat(slow, "tokens_per_s")
            line += f", {ratio:.2f}x the slowest, {slow['strategy']} ({_fmt_tps(measured_stat(slow, 'tokens_per_s'))})"
        out.append(line + ".")
        with_mem = [r for r in ok if measured_stat(r, "peak_mem_gib", "max") is not None]
        if with_mem:
            lean = min(with_mem, key=lambda r: measured_stat(r, "peak_mem_gib", "max"))
            fat = max(with_mem, key=lambda r: measured_stat(r, "peak_mem_gib", "max"))
            lo, hi = measured_stat(lean, "peak_mem_gib", "max"), measured_stat(fat, "peak_mem_gib", "max")
            same_mem = hi <= lo * (1 + SAME_MEM_REL) or hi - lo < SAME_MEM_ABS_GIB
            if same_mem and fat is not lean:
                out.append(f"Memory: about the same for all ({lo:.2f}–{hi:.2f} GiB per rank, peak, max over ranks): "
                           "at this size the sharded states are small next to what every rank holds anyway.")
            else:
                line = f"Least memory: **{lean['strategy']}** at {lo:.2f} GiB per rank (peak, max over ranks)"
                if fat is not lean:
                    line += f", {1 - lo / hi:.0%} below {fat['strategy']} ({hi:.2f} GiB)"
                out.append(line + ".")
            if len(ok) > 1:
                states = _states_gib(fast)
                why = (f" The planner puts the model states that sharding divides (parameters, gradients, "
                       f"optimizer) at {states:.3g} GiB per rank under {fast['strategy']}, too little for "
                       "sharding to pay for its extra communication." if states is not None and (same_mem or lean is fast)
                       and states < 0.1 * hi else "")
                if same_mem:
                    if why:
                        out.append("Trade-off: none here; the fastest strategy costs no memory." + why)
                elif lean is fast:
                    out.append(f"Trade-off: none here; {fast['strategy']} is both the fastest and the leanest "
                               "at this model size and batch on this hardware." + why)
                else:
                    cost = 1 - measured_stat(lean, "tokens_per_s") / measured_stat(fast, "tokens_per_s")
                    saved = 1 - measured_stat(lean, "peak_mem_gib", "max") / measured_stat(fast, "peak_mem_gib", "max")
                    out.append(f"Trade-off: {lean['strategy']} needs {saved:.0%} less memory per rank than "
                               f"{fast['strategy']} and gives up {cost:.0%} of its throughput; pick it when "
                               f"{fast['strategy']} does not fit or the memory buys a larger batch.")
        if len(ok) > 1 and all(r["world_size"] == 1 for r in ok):
            out.append("With one rank there is nothing to divide across ranks: the differences here are each "
                       "wrapper's own costs, not sharding; bench on 2 or more GPUs to see what sharding buys.")
        if rep["hardware"].get("accelerator") == "cpu":
            out.append("On the CPU, memory is each worker's peak RSS, which includes the Python/torch runtime "
                       "(a few hundred MiB), while the planner counts tensors only; the memory errors mostly "
                       "measure that runtime, not the planner.")
        agree = [r for r in ok if "loss_vs_reference" in r["measured"] and r is not ok[0]]
        other_batch = [r for r in ok if r["world_size"] != ok[0]["world_size"]]
        if other_batch:
            out.append("Not compared for loss (another world size, so another global batch): "
                       + ", ".join(f"{r['strategy']} ({r['world_size']} rank(s))" for r in other_batch) + ".")
        if agree:
            worst = max(agree, key=lambda r: r["measured"]["loss_vs_reference"]["final_rel_diff"] or 0)
            d = worst["measured"]["loss_vs_reference"]["final_rel_diff"] or 0
            losses = ", ".join(f"{r['strategy']} {r['measured']['final_loss']:.4f}" for r in ok)
            if d <= LOSS_AGREE_REL:
                out.append(f"Final losses agree (largest relative difference {d:.1e}): {losses}.")
            else:
                out.append(f"Final losses DISAGREE (up to {d:.1%} relative): {losses}; the strategies should "
                           "train the same model on the same data, so this is worth a bug report.")
        with_comm = [r for r in ok if measured_stat(r, "comm_exposed_s") is not None]
        if with_comm:
            out.append("Communication per step (profiled steps, median; max over ranks): " + "; ".join(
                f"{r['strategy']} {_fmt('comm_exposed_s', measured_stat(r, 'comm_exposed_s'))} exposed"
                + (f" of {_fmt('comm_exposed_s', measured_stat(r, 'comm_total_s'))}" if measured_stat(r, "comm_total_s") is not None else "")
                for r in with_comm) + ".")
    out += _planner_lines(rep)
    bad = [r for r in rows if r["status"] != "ok"]
    if bad:
        out.append("Not measured: " + "; ".join(f"{r['strategy']}: {r['result']} ({r['reason']})" for r in bad) + ".")
    return out


def _states_gib(r: dict) -> float | None:
    mem = (r["predicted"] or {}).get("mem_gib") or {}
    parts = [mem.get(k) for k in ("params", "grads", "optimizer")]
    return sum(parts) if all(isinstance(x, (int, float)) for x in parts) else None


def _planner_lines(rep: dict) -> list[str]:
    if not rep["planner"]["available"]:
        return [f"Planner: no predictions ({rep['planner']['note'] or 'not available'}); those columns are n/a."]
    out = []
    worst = None
    for r in rep["results"]:
        for k, e in r["error_pct"].items():
            if e is not None and (worst is None or abs(e) > abs(worst[2])):
                worst = (r, k, e)
    if worst:
        r, k, e = worst
        label = {"tokens_per_s": "throughput", "step_time_s": "step time", "peak_mem_gib": "peak memory",
                 "comm_exposed_s": "exposed communication"}[k]
        pred = r["predicted"].get({"peak_mem_gib": "peak_mem_gib", "comm_exposed_s": "exposed_comm_s"}.get(k, k))
        meas = measured_stat(r, k, "max" if k == "peak_mem_gib" else "median")
        out.append(f"Planner: furthest off on {label} for {r['strategy']}: predicted {_fmt(k, pred)}, measured "
                   f"{_fmt(k, meas)} ({_err(e)}).")
        for k, label in (("tokens_per_s", "throughput"), ("peak_mem_gib", "peak memory")):
            es = [r["error_pct"][k] for r in rep["results"] if r["error_pct"].get(k) is not None]
            if not es:
                continue
            lo, hi = min(es), max(es)
            span = _err(lo) if lo == hi else f"{_err(lo)} to {_err(hi)}"
            way = "over-estimated" if lo > 0 else "under-estimated" if hi < 0 else "was off on"
            out.append(f"Planner {way} {label} ({span} across strategies).")
    for r in rep["results"]:
        fits = r["predicted"].get("fits") if r["predicted"].get("available") else None
        if r["status"] == "oom" and fits is True:
            out.append(f"Planner said {r['strategy']} fits ({_fmt('peak_mem_gib', r['predicted'].get('peak_mem_gib'))} "
                       "per rank) but it ran out of memory.")
        if r["status"] == "ok" and fits is False:
            out.append(f"Planner said {r['strategy']} does not fit, but it ran.")
    return out


# ----------------------------------------------------------------------------- formatting


def _fmt_tps(x):
    return "n/a" if x is None else f"{x:,.0f}"


def _fmt(kind: str, x) -> str:
    if x is None:
        return "n/a"
    if kind in ("tokens_per_s",):
        return _fmt_tps(x)
    if kind in ("step_time_s", "comm_exposed_s"):
        if x == 0:
            return "0"
        if x < 1e-3:
            return f"{x * 1e6:.0f} µs"
        if x < 0.01:
            return f"{x * 1e3:.1f} ms"
        return f"{x * 1e3:.0f} ms" if x < 10 else f"{x:.1f} s"
    if kind == "peak_mem_gib":
        return f"{x:.2f} GiB" if x < 100 else f"{x:.0f} GiB"
    if kind == "mfu":
        return f"{x:.1%}"
    return f"{x:.4g}"


def _err(e) -> str:
    """+12% / -40%; past +1000% the ratio predicted/measured reads better (e.g. 180x)."""
    if e is None:
        return "n/a"
    if e >= 1000:
        return f"{e / 100 + 1:,.0f}x"
    return f"{e:+.0f}%"


def table_cells(r: dict) -> dict:
    """Display strings of one row (shared by the Markdown and terminal tables)."""
    p = r["predicted"] if r["predicted"].get("available") else {}
    e = r["error_pct"]
    tps, st, mem = r["measured"].get("tokens_per_s"), r["measured"].get("step_time_s"), r["measured"].get("peak_mem_gib")
    ok = r["status"] == "ok"
    c = {"strategy": r["strategy"], "result": r["result"]}
    c["tps"] = f"{_fmt_tps(tps['median'])} ({_fmt_tps(tps['p10'])}–{_fmt_tps(tps['p90'])})" if ok and tps else "—"
    c["tps_pred"] = _fmt_tps(p.get("tokens_per_s")) if p else "n/a"
    c["tps_err"] = _err(e.get("tokens_per_s"))
    c["step"] = f"{_fmt('step_time_s', st['median'])} / {_fmt('step_time_s', st['p90'])}" if ok and st else "—"
    c["step_pred"] = _fmt("step_time_s", p.get("step_time_s")) if p else "n/a"
    c["step_err"] = _err(e.get("step_time_s"))
    if ok and mem and mem.get("max") is not None:
        c["mem"] = f"{mem['max']:.2f} / " + (f"{mem['min']:.2f}" if mem.get("min") is not None else "n/a")
    else:
        c["mem"] = "—"
    if p:
        c["mem_pred"] = f"{p['peak_mem_gib']:.2f}" + ("" if p.get("fits", True) else " (won't fit)")
    else:
        c["mem_pred"] = "n/a"
    c["mem_err"] = _err(e.get("peak_mem_gib"))
    comm, comm_total = r["measured"].get("comm_exposed_s"), r["measured"].get("comm_total_s")
    if ok and comm:
        c["comm"] = _fmt("comm_exposed_s", comm["median"]) + (
            f" of {_fmt('comm_exposed_s', comm_total['median'])}" if comm_total else "")
    else:
        c["comm"] = "n/a" if ok else "—"
    c["comm_pred"] = _fmt("comm_exposed_s", p.get("exposed_comm_s")) if p else "n/a"
    c["comm_err"] = _err(e.get("comm_exposed_s"))
    mfu = r["measured"].get("mfu")
    c["mfu"] = _fmt("mfu", mfu["median"]) if ok and mfu else ("n/a" if ok else "—")
    fl = r["measured"].get("final_loss")
    c["loss"] = f"{fl:.4f}" if ok and fl is not None else "—"
    return c


MD_COLUMNS = [("strategy", "strategy"), ("result", "result"), ("tps", "tokens/s median (p10–p90)"),
              ("tps_pred", "predicted"), ("tps_err", "error"), ("step", "step time p50 / p90"),
              ("step_pred", "predicted"), ("step_err", "error"), ("mem", "peak GiB/rank max / min"),
              ("mem_pred", "predicted"), ("mem_err", "error"), ("comm", "exposed comm/step (of total)"),
              ("comm_pred", "predicted"), ("comm_err", "error"), ("mfu", "MFU"), ("loss", "final loss")]
TERM_COLUMNS = [("strategy", "strategy"), ("result", "result"), ("tps", "tok/s p50 (p10-p90)"),
                ("tps_pred", "pred"), ("tps_err", "err"), ("step", "step p50/p90"), ("step_pred", "pred"),
                ("mem", "GiB max/min"), ("mem_pred", "pred"), ("mem_err", "err"), ("comm", "comm exposed"),
                ("mfu", "MFU"), ("loss", "loss")]


def terminal_table(rep: dict) -> str:
    cells = [table_cells(r) for r in rep["results"]]
    head = [h for _, h in TERM_COLUMNS]
    body = [[c[k] for k, _ in TERM_COLUMNS] for c in cells]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    line = lambda xs: "  ".join(x.ljust(w) for x, w in zip(xs, widths)).rstrip()  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(b) for b in body])


def markdown(rep: dict, png_name: str) -> str:
    hw, v, s = rep["hardware"], rep["versions"], rep["settings"]
    world = max((r["world_size"] for r in rep["results"]), default=0)
    dev = (f"{hw['device_count']}x {hw['device_name']} ({hw['device_memory_gib']:.0f} GiB each)"
           if hw["accelerator"] == "cuda" else f"CPU only: {hw['cpu']} ({hw['cpu_count']} logical CPUs)")
    cfg = rep["config"]
    where = (f"{world}x {hw['device_name']}" if hw["accelerator"] == "cuda"
             else f"{world} CPU rank{'s' if world != 1 else ''}")
    lines = [
        f"# shardwise bench: {model_label(str(cfg.get('model', '?')))} on {where}, {rep['created'][:10]}", "",
        f"`{rep['command']}`", "",
        f"- **Hardware:** {dev}; host RAM {hw['host_memory_gib']:.0f} GiB; {world} rank(s) per strategy",
        "- **Versions:** " + ", ".join(f"{k} {val}" for k, val in v.items() if val),
        f"- **Job:** model `{cfg.get('model')}`, data `{cfg.get('data')}`, seq_len {cfg.get('seq_len')}, "
        f"micro-batch {cfg.get('micro_batch_size')} x grad_accum {cfg.get('grad_accum')} per rank, "
        f"mixed precision {cfg.get('mixed_precision')}, params {cfg.get('param_dtype')}, "
        f"gradient checkpointing {'on' if cfg.get('gradient_checkpointing') else 'off'}, tuner {cfg.get('tuner')}, seed {cfg.get('seed')}",
        f"- **Measured:** {s['steps']} steps after {s['warmup']} uncounted warm-up steps"
        + (f", then {s['profile_steps']} profiled steps (communication only)" if s.get("profile_steps") else "")
        + ", each strategy in fresh processes through `shardwise train` (same data, seed and config); "
        f"took {rep['duration_s']:.0f} s in all",
        "", "## Verdict", "",
    ]
    lines += [f"- {x}" for x in rep["verdict"]]
    lines += ["", "## Results", "",
              "Errors are (predicted − measured) / measured. Throughput is compared in real (non-padding) "
              "tokens: the predicted figure is the measured tokens per step over the predicted step time (the "
              "planner's own tokens/s counts padded slots), so its error mirrors the step-time error. Peak "
              "memory is per rank: the largest and the "
              "smallest over the ranks. \"n/a\": not measured or not predicted on this setup (see below).", ""]
    lines.append("| " + " | ".join(h for _, h in MD_COLUMNS) + " |")
    lines.append("|" + "|".join("---" for _ in MD_COLUMNS) + "|")
    for r in rep["results"]:
        c = table_cells(r)
        lines.append("| " + " | ".join(c[k].replace("|", "\\|") for k, _ in MD_COLUMNS) + " |")
    lines += ["", f"![throughput and peak memory per strategy, measured vs predicted]({png_name})", ""]
    why = [r for r in rep["results"] if r["status"] != "ok"]
    if why:
        lines += ["## Strategies that did not complete", ""]
        lines += [f"- **{r['strategy']}**: {r['result']}: {r['reason']}" + (f" (log: `{r['log']}`)" if r["returncode"] is not None else "")
                  for r in why]
        lines.append("")
    src = next((r["measured"]["peak_mem_gib"]["source"] for r in rep["results"]
                if r["measured"].get("peak_mem_gib")), "")
    lines += ["## How these were measured", "",
              "- tokens/s and step time: the training loop's own per-step records (`metrics.jsonl`, logged every "
              "step), warm-up steps dropped; the spread is the 10th–90th percentile over steps.",
              f"- peak memory: {src or 'n/a'}.",
              *([_repeats_line(rep)] if s.get("repeat", 1) > 1 else []),
              "- exposed communication: " + _comm_how(rep),
              "- MFU: the loop's `mfu` (GPU only; 6N + 12·L·H·T FLOPs per token against the GPU's dense peak).",
              "- predictions: `shardwise plan` for the same config and world size.",
              f"- every number: `{os.path.basename(png_name)[:-4]}.json`; run directories: `{s['runs_dir']}`.", ""]
    return "\n".join(lines)


def _repeats_line(rep: dict) -> str:
    per = []
    for r in rep["results"]:
        speeds = [x["tokens_per_s"] for x in r.get("repeats", [])]
        if any(x is not None for x in speeds):
            per.append(f"{r['strategy']} " + " / ".join(_fmt_tps(x) if x is not None else "failed" for x in speeds))
    return (f"- repeats: the strategies ran {rep['settings']['repeat']} times round-robin (a, b, …, a, b, …); each "
            "row is the run with the median tokens/s. Every run's tokens/s, in run order: " + "; ".join(per) + ".")


def _comm_how(rep: dict) -> str:
    methods = sorted({r["measured"]["comm_method"] for r in rep["results"] if r["measured"].get("comm_method")})
    n = rep["settings"].get("profile_steps", 0)
    if methods:
        return (f"the last {n} steps of each run ran under torch.profiler (`profile_steps`; left out of "
                "tokens/s and step time); per step, the communication time no compute overlaps "
                "(`comm_exposed_s`, max over ranks) and all communication time (`comm_total_s`), median over "
                "those steps. Method: " + "; ".join(methods) + ". See docs/bench.md.")
    if not n:
        return "n/a: no profiled steps (`--profile-steps 0`)."
    return "n/a: no run logged a profiled step."


def write_all(rep: dict, report_dir: str, stem: str) -> dict:
    """report_dir/stem.{json,md,png}, each written to a temp file and renamed into place."""
    os.makedirs(report_dir, exist_ok=True)
    paths = {k: os.path.join(report_dir, f"{stem}.{k}") for k in ("json", "md", "png")}
    rep["files"] = {k: os.path.basename(p) for k, p in paths.items()}
    from shardwise.bench.plot import write_png

    write_png(rep, paths["png"])
    _atomic(paths["md"], markdown(rep, os.path.basename(paths["png"])))
    _atomic(paths["json"], json.dumps(rep, indent=1, default=str))
    return paths


_atomic = atomic_write
