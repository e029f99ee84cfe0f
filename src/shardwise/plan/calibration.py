"""The planner's fitted constants, read from calibration.json (installed beside this module).

Each entry holds its value, unit, the hardware and the measured rows it was fitted on, and its history; the code
that uses a constant says what it means. `doc_block` renders the file for docs/planner.md, between the BEGIN and
END markers (tests/unit/test_plan_costs.py checks the page matches it); to rewrite that block:

    PYTHONPATH=src python -m shardwise.plan.calibration docs/planner.md
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

FILE = Path(__file__).with_name("calibration.json")


@functools.lru_cache(maxsize=1)
def _load() -> dict:
    with open(FILE, encoding="utf-8") as fh:
        return json.load(fh)


def entries() -> dict[str, dict]:
    """name -> entry (value, unit, used_by, means, hardware, fitted_on, rows, history)."""
    return _load()["constants"]


def measured_set(name: str) -> dict:
    """The bounds a set of measured rows is held to: mem_tol, step_tol, and `wide` rows with their own step bound."""
    return _load()["measured_sets"][name]


def wide_bounds(name: str) -> dict[tuple, float]:
    """A measured set's rows held to a wider step-time bound: row key (a tuple) -> its bound."""
    return {tuple(w["row"]): w["step_tol"] for w in measured_set(name)["wide"]}


def markdown_sets() -> str:
    """One row per set of measured rows the planner is checked against, with its bounds."""
    lines = ["| measured rows | hardware | peak within | step time within | rows with a wider bound | archived |",
             "|---|---|---|---|---|---|"]
    for name, m in _load()["measured_sets"].items():
        wide = "; ".join(f"{' '.join(map(str, w['row']))}: {w['step_tol']:.0%} ({w['why']})" for w in m["wide"])
        lines.append(f"| `{name}` ({_cell(m['source'])}; {_cell(m['test'])}) | {_cell(m['hardware'])} | "
                     f"{m['mem_tol']:.0%} | {m['step_tol']:.0%} | {_cell(wide) or '-'} | "
                     f"{'`' + m['archived'] + '`' if m['archived'] else '-'} |")
    return "\n".join(lines)


def value(name: str) -> float:
    return entries()[name]["value"]


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown_table() -> str:
    """One row per constant: name, value, unit, hardware, what it was fitted on (the rows and their files)."""
    lines = ["| constant | value | unit | hardware | fitted on |", "|---|---|---|---|---|"]
    for name, e in entries().items():
        where = e["rows"] or "not fitted: an assumption or allowance"
        files = ", ".join(f"`{f}`" if f.endswith((".json", ".md", ".py")) and " " not in f else f
                          for f in e["fitted_on"])
        lines.append(f"| `{name}` | {e['value']:g} | {_cell(e['unit'])} | {_cell(e['hardware'])} | "
                     f"{_cell(where)}{' (' + files + ')' if files else ''} |")
    return "\n".join(lines)


def markdown_history() -> str:
    """Each constant's history, one bullet per constant that has one."""
    return "\n".join(f"* `{name}`: " + "; ".join(e["history"]) for name, e in entries().items() if e["history"])


BEGIN = "<!-- generated from src/shardwise/plan/calibration.json by shardwise.plan.calibration: do not edit -->"
END = "<!-- end of the generated block -->"


def doc_block() -> str:
    """docs/planner.md's generated block: the constants table, their history, and the measured sets' bounds."""
    return "\n\n".join([BEGIN, markdown_table(), "History of the fitted values:", markdown_history(),
                        "The measured rows the planner is checked against, and the bounds each set is held to "
                        "(archived rows: benchmarks/results/plan_measured_archived.json):", markdown_sets(), END])


def rewrite_doc(path: str) -> None:
    """Replace the generated block of a Markdown file (between BEGIN and END) with doc_block()."""
    with open(path, encoding="utf-8") as fh:
        page = fh.read()
    start, end = page.index(BEGIN), page.index(END) + len(END)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(page[:start] + doc_block() + page[end:])


if __name__ == "__main__":
    import sys

    rewrite_doc(sys.argv[1])
