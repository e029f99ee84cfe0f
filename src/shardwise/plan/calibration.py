"""The planner's fitted constants, read from calibration.json (installed beside this module).

Each entry holds its value, unit, the hardware and the measured rows it was fitted on, and its history; the code
that uses a constant says what it means. docs/planner.md's generated blocks come from here: `constants_block`
renders this file, and in a checkout the repository's benchmarks/plan_accuracy.py adds one accuracy table per set of
measured rows (today's predictions against the measurements, with the set's bounds) and the archived rows. Each
block sits between `begin(name)` and `end(name)` markers (tests/unit/test_plan_calibration.py checks the page
matches); to rewrite them all:

    PYTHONPATH=src python -m shardwise.plan.calibration docs/planner.md
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
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
    """The bounds a set of measured rows is held to: mem_tol, step_tol (None: memory only), and `wide` rows with their
    own step bound; and where the rows come from (source, hardware, date, test)."""
    return _load()["measured_sets"][name]


def wide_bounds(name: str) -> dict[tuple, float | None]:
    """A measured set's rows held to a wider step-time bound: row key (a tuple) -> its bound (None: no bound holds
    yet; the set's test marks the row a strict xfail with its `why`)."""
    return {tuple(w["row"]): w["step_tol"] for w in measured_set(name)["wide"]}


def row_name(m: dict, key: list) -> str:
    """A row of a measured set in words, from its key's values and the set's `row_key` (the fields they are)."""
    words = []
    for field, v in zip(m.get("row_key", [None] * len(key)), key):
        words.append(f"{field} {'on' if v else 'off'}" if isinstance(v, bool) else str(v))
    return " ".join(words)


def markdown_sets() -> str:
    """One row per set of measured rows the planner is checked against, with its bounds."""
    lines = ["| measured rows | hardware | peak within | step time within | rows with a wider bound | archived |",
             "|---|---|---|---|---|---|"]
    for name, m in _load()["measured_sets"].items():
        wide = "; ".join(f"{row_name(m, w['row'])}: "
                         f"{'not held' if w['step_tol'] is None else format(w['step_tol'], '.0%')} ({w['why']})"
                         for w in m["wide"])
        lines.append(f"| `{name}` ({_cell(m['source'])}; {_cell(m['test'])}) | {_cell(m['hardware'])} | "
                     f"{m['mem_tol']:.0%} | {'-' if m['step_tol'] is None else format(m['step_tol'], '.0%')} | "
                     f"{_cell(wide) or '-'} | "
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


REGENERATE = "PYTHONPATH=src python -m shardwise.plan.calibration docs/planner.md"


def begin(name: str) -> str:
    return f"<!-- generated: {name} ({REGENERATE}); do not edit -->"


def end(name: str) -> str:
    return f"<!-- end of generated: {name} -->"


BLOCK = re.compile(r"<!-- generated: (.+?) \(.*?\); do not edit -->.*?<!-- end of generated: \1 -->", re.S)


def constants_block() -> str:
    """The constants table, their history, and the measured sets' bounds."""
    return "\n\n".join([markdown_table(), "History of the fitted values:", markdown_history(),
                         "The measured rows the planner is checked against, and the bounds each set is held to "
                         "(archived rows: benchmarks/results/plan_measured_archived.json):", markdown_sets()])


def _repo_blocks(root: Path) -> dict[str, str]:
    """The accuracy blocks, from a checkout's benchmarks/plan_accuracy.py: the measured rows and the harness that maps
    them to planner inputs live in the repository, not in the installed package ({} without them)."""
    path = root / "benchmarks" / "plan_accuracy.py"
    if not path.is_file():
        return {}
    spec = importlib.util.spec_from_file_location("plan_accuracy", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.accuracy_blocks()


def doc_blocks(root: Path) -> dict[str, str]:
    """name -> the whole generated block (markers included) for a page of the checkout at `root`."""
    bodies = {"constants": constants_block(), **_repo_blocks(root)}
    return {name: f"{begin(name)}\n\n{body}\n\n{end(name)}" for name, body in bodies.items()}


def page_blocks(page: str) -> dict[str, str]:
    """name -> the generated block as the page has it."""
    return {m.group(1): m.group(0) for m in BLOCK.finditer(page)}


def rewrite_doc(path: str) -> None:
    """Replace every generated block of a Markdown file in docs/ of a checkout; a block the page lacks is an error
    (the page says where each table goes)."""
    root = Path(path).resolve().parents[1]
    with open(path, encoding="utf-8") as fh:
        page = fh.read()
    blocks, present = doc_blocks(root), page_blocks(page)
    missing = sorted(set(blocks) - set(present))
    if missing:
        raise SystemExit(f"{path}: no place for the generated block(s) {missing}: add "
                         + " and ".join(f"{begin(n)} ... {end(n)}" for n in missing))
    for name, text in blocks.items():
        page = page.replace(present[name], text)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(page)


if __name__ == "__main__":
    import sys

    rewrite_doc(sys.argv[1])
