"""report.png: throughput and peak memory per strategy, measured against predicted, drawn
from the report dict with matplotlib's Agg backend (no display needed)."""

from __future__ import annotations

from shardwise.bench.measure import measured_stat, model_label
from shardwise.rundir import atomic_path

MEASURED_COLOR, PREDICTED_COLOR = "#2b6cb0", "#ed8936"
BAR_W = 0.38


def write_png(rep: dict, path: str) -> None:
    """Two panels: tokens/s and peak memory per rank, measured (bars) vs predicted (hatched)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = rep["results"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.8), dpi=110)
    hw = rep["hardware"]
    world = max((r["world_size"] for r in rows), default=0)
    where = (f"{world}x {hw['device_name']}" if hw["accelerator"] == "cuda"
             else f"CPU, {world} rank{'s' if world != 1 else ''}")
    fig.suptitle(f"shardwise bench — {model_label(str(rep['config'].get('model', '?')))} on {where} — {rep['created'][:10]}",
                 fontsize=13, fontweight="bold")
    labelled = {"m": False, "p": False}  # each series labelled once, for the shared legend
    _panel(a1, rows, labelled, "Throughput (median; whisker: p10–p90 over steps)", "tokens/s (all ranks)", _tps,
           _tps_range, lambda p: p.get("tokens_per_s"))
    _panel(a2, rows, labelled, "Peak memory per rank (bar: max; whisker: min over ranks)", "GiB", _mem, _mem_range,
           lambda p: p.get("peak_mem_gib"))
    _legend(fig, (a1, a2))
    fig.tight_layout(rect=(0, 0, 1, 0.88))
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp)
    plt.close(fig)


def _tps(r):
    return measured_stat(r, "tokens_per_s")


def _tps_range(r):
    return measured_stat(r, "tokens_per_s", "p10"), measured_stat(r, "tokens_per_s", "p90")


def _mem(r):
    return measured_stat(r, "peak_mem_gib", "max")


def _mem_range(r):
    mn = measured_stat(r, "peak_mem_gib", "min")
    return (mn if mn is not None else _mem(r)), _mem(r)


def _panel(ax, rows: list[dict], labelled: dict, title: str, unit: str, get_meas, get_lo_hi, get_pred) -> None:
    """One panel: each strategy's measured bar (with its whisker) beside its predicted one."""
    from matplotlib.ticker import FuncFormatter

    preds = [(i, get_pred(r["predicted"]) if r["predicted"].get("available") else None) for i, r in enumerate(rows)]
    meas = [(i, r) for i, r in enumerate(rows) if r["status"] == "ok" and get_meas(r) is not None]
    tops = [max(get_meas(r), get_lo_hi(r)[1] or 0) for _, r in meas]
    pvals = [v for _, v in preds if v is not None]
    # A prediction far above every measurement would flatten the measured bars: cut the axis
    # at the measurements and mark the predictions that go past it.
    limit = max(tops) * 1.3 if tops and pvals and max(pvals) > 3 * max(tops) else None
    ymax = max(tops + pvals, default=0.0) if limit is None else limit
    _predicted_bars(ax, preds, limit, labelled)
    _measured_bars(ax, meas, get_meas, get_lo_hi, labelled)
    for i, r in enumerate(rows):
        if r["status"] != "ok" or get_meas(r) is None:
            ax.text(i - BAR_W / 2, 0, "\n".join(r["result"].split(" ", 1)) if r["status"] != "ok" else "n/a",
                    rotation=90, ha="center", va="bottom", fontsize=9, color="#c53030", fontweight="bold")
    off_scale = limit is not None and any(v is not None and v > limit for v in pvals)
    ax.set_title(title + ("\n↑: prediction off the scale, its value printed" if off_scale else ""), fontsize=12)
    ax.set_ylabel(unit)
    ax.set_xticks(list(range(len(rows))))
    ax.set_xticklabels([r["strategy"] for r in rows], fontsize=10)
    ax.set_ylim(0, ymax * 1.15 if ymax > 0 else 1)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: _short_num(v) if v >= 1e4 else f"{v:,.4g}"))
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)


def _predicted_bars(ax, preds: list, limit: float | None, labelled: dict) -> None:
    """Hatched bars of the planner's predictions; one past `limit` is drawn to it and its value printed."""
    w = BAR_W
    for i, pv in preds:
        if pv is None:
            continue
        shown = pv if limit is None else min(pv, limit)
        ax.bar(i + w / 2, shown, w, color="white", edgecolor=PREDICTED_COLOR, hatch="///", linewidth=1.5,
               label="predicted (planner)" if not labelled["p"] else None)
        labelled["p"] = True
        off = limit is not None and pv > limit
        ax.annotate(_short_num(pv) + (" ↑" if off else ""), (i + w / 2, shown),
                    textcoords="offset points", xytext=(0, -12 if off else 3), ha="center", va="bottom",
                    fontsize=8, color=PREDICTED_COLOR, fontweight="bold" if off else "normal",
                    bbox={"facecolor": "white", "edgecolor": "none", "pad": 1} if off else None)


def _measured_bars(ax, meas: list, get_meas, get_lo_hi, labelled: dict) -> None:
    w = BAR_W
    for i, r in meas:
        mv = get_meas(r)
        lo, hi = get_lo_hi(r)
        yerr = [[mv - lo], [hi - mv]] if lo is not None and hi is not None else None
        ax.bar(i - w / 2, mv, w, color=MEASURED_COLOR, yerr=yerr, capsize=4, ecolor="#1a365d",
               label="measured" if not labelled["m"] else None)
        labelled["m"] = True
        ax.annotate(_short_num(mv), (i - w / 2, max(mv, hi if hi is not None else mv)), textcoords="offset points",
                    xytext=(0, 3), ha="center", va="bottom", fontsize=9, fontweight="bold")


def _legend(fig, axes) -> None:
    """One legend for both panels, measured first."""
    handles, labels = [], []
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    order = sorted(range(len(labels)), key=lambda i: labels[i] != "measured")
    handles, labels = [handles[i] for i in order], [labels[i] for i in order]
    if handles:
        fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.93), ncol=len(handles),
                   fontsize=10, frameon=False)


def _short_num(v: float) -> str:
    if v >= 1e6:
        return f"{v / 1e6:.3g}M"
    if v >= 1e4:
        return f"{v / 1e3:.3g}k"
    if v >= 100:
        return f"{v:,.0f}"
    return f"{v:.2f}" if v >= 0.1 else f"{v:.2g}"
