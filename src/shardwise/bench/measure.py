"""Turn one run's metrics.jsonl (logged every step) into the numbers the report shows.

Pure functions over plain data, so the report can be tested from synthetic runs.
"""

from __future__ import annotations

import json
import math
import os
import statistics


def read_records(output_dir: str) -> list[dict]:
    """The per-step records of a run (empty when it wrote none)."""
    path = os.path.join(output_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    out = []
    with open(path) as fh:
        for line in fh:
            line = line.strip()
            if line:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:  # a run killed mid-write leaves a partial last line
                    continue
    return out


def percentile(xs: list[float], q: float) -> float | None:
    """Linear-interpolated percentile, q in [0, 100]; None for no data."""
    xs = sorted(x for x in xs if x is not None and not math.isnan(x))
    if not xs:
        return None
    k = (len(xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def spread(xs: list[float]) -> dict | None:
    """median, p10, p90, min, max, mean of the values (None when there are none)."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return {"median": percentile(xs, 50), "p10": percentile(xs, 10), "p90": percentile(xs, 90),
            "min": min(xs), "max": max(xs), "mean": statistics.fmean(xs), "n": len(xs)}


def summarize(records: list[dict], warmup: int, rank_peak_gib: dict[int, float] | None = None,
              world_size: int = 0) -> dict:
    """Statistics over the steps after `warmup`.

    Peak memory per rank: the loop logs `peak_mem_gib`, the max over ranks of a running peak,
    so its last counted value is the run's max. It does not log a per-rank minimum yet
    (`peak_mem_gib_min` is read when it does). On the CPU the bench samples each worker's
    own high-water mark (VmHWM) from /proc and passes it in `rank_peak_gib`; when it has
    every rank, that is used instead, because the loop's CPU figure (ru_maxrss) also counts the launcher's memory
    that the forked worker inherited before exec.
    """
    # Steps the loop profiled (`profiled: true`, train/profile.py) are slower: they count for
    # the communication times only, not for throughput or step time.
    after = [r for r in records if r.get("step", 0) > warmup]
    counted = [r for r in after if not r.get("profiled")]
    out: dict = {"steps_logged": len(records), "steps_counted": len(counted),
                 "last_step": records[-1]["step"] if records else 0}
    if not counted:
        return out

    def col(key):
        return [r[key] for r in counted if isinstance(r.get(key), (int, float))]

    out["tokens_per_s"] = spread(col("tokens_per_s"))
    out["step_time_s"] = spread(col("step_time_s"))
    # real (non-padding) tokens a step trains: the loop's tokens/s counts them, over its step time
    out["tokens_per_step"] = spread([r["tokens_per_s"] * r["step_time_s"] for r in counted
                                     if isinstance(r.get("tokens_per_s"), (int, float))
                                     and isinstance(r.get("step_time_s"), (int, float))])
    out["mfu"] = spread(col("mfu"))
    out["comm_exposed_s"] = spread([r["comm_exposed_s"] for r in after
                                    if isinstance(r.get("comm_exposed_s"), (int, float))])
    out["comm_total_s"] = spread([r["comm_total_s"] for r in after if isinstance(r.get("comm_total_s"), (int, float))])
    methods = sorted({r["comm_method"] for r in after if r.get("comm_method")})
    if methods:
        out["comm_method"] = "; ".join(methods)
    out["final_loss"] = counted[-1].get("loss")
    out["losses"] = [r.get("loss") for r in records]
    if rank_peak_gib and len(rank_peak_gib) >= world_size:
        out["peak_mem_gib"] = {"max": max(rank_peak_gib.values()), "min": min(rank_peak_gib.values()),
                               "per_rank": {str(k): v for k, v in sorted(rank_peak_gib.items())},
                               "source": "each worker's peak RSS (VmHWM), sampled by bench from /proc"}
    else:
        mx = col("peak_mem_gib")
        mn = col("peak_mem_gib_min")
        out["peak_mem_gib"] = {"max": max(mx) if mx else None,
                               "min": min(mn) if mn else (max(mx) if mx and world_size == 1 else None),
                               "source": "metrics.jsonl peak_mem_gib (max over ranks)"
                                         + (" and peak_mem_gib_min" if mn else "; the loop logs no minimum yet")}
    return out


def error_pct(predicted: float | None, measured: float | None) -> float | None:
    """(predicted - measured) / measured in %: positive = the planner over-estimated."""
    if predicted is None or measured is None or measured == 0:
        return None
    return (predicted - measured) / measured * 100.0


def measured_stat(row: dict, key: str, stat: str = "median"):
    """One statistic of a measured quantity in a report row (None when not measured)."""
    return (row["measured"].get(key) or {}).get(stat)


def model_label(model: str) -> str:
    """'tiny', or the model directory's name."""
    return model if model == "tiny" else os.path.basename(os.path.normpath(model)) or model
