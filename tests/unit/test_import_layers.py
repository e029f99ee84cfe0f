"""The package's imports follow its layers (docs/design.md, "The layers"; docs/architecture.md): no circle, nothing
imported from a floor above, and the planner (and what it stands on) imports no torch.distributed.

The rule, as this test reads the source (ast, nothing is imported):
- every `import shardwise.x` / `from shardwise.x import y` counts, at module level and inside functions alike
  (a function-level import still runs, only later); `from pkg import name` counts as an import of the submodule
  `pkg.name` when that file exists, else of `pkg`;
- a module imported by name (a string constant in a function or module that calls `__import__` or
  `importlib.import_module`, as cli.py does for its subcommands) counts too;
- imports under `if __name__ == "__main__":` do not: that block runs only when the file is the program;
- a module may import modules of its own floor or below, never above; every module must have a floor here.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

# floor -> module name patterns ("x.*" is every module under package x); lower floors are imported by higher ones
FLOORS: list[tuple[str, tuple[str, ...]]] = [
    ("ground", ("shardwise", "shardwise.errors", "shardwise.presets", "shardwise.rundir", "shardwise.phases")),
    ("preflight rules", ("shardwise.preflight", "shardwise.preflight.*")),  # judged on settings; config reads them
    ("config and hardware", ("shardwise.config", "shardwise.foreign", "shardwise.hardware")),
    ("planner, models, data (no process group)", ("shardwise.plan", "shardwise.plan.*", "shardwise.models",
                                                   "shardwise.models.*", "shardwise.data", "shardwise.data.*")),
    ("backend adapters", ("shardwise.strategies", "shardwise.strategies.*",
                          "shardwise.plan.simulate")),  # --simulate runs the strategies' own wrapping (opt-in)
    ("training engine", ("shardwise.train", "shardwise.train.*")),
    ("launch and tools", ("shardwise.launch", "shardwise.launch.*", "shardwise.export", "shardwise.doctor", "shardwise.chat",
                          "shardwise.bench", "shardwise.bench.*")),
    ("user interface", ("shardwise.cli", "shardwise.__main__", "shardwise.plan.command", "shardwise.ui",
                        "shardwise.ui.*")),
]
# never import torch.distributed: the planner needs no process group (plan/simulate, on the adapters' floor, is
# its opt-in exception), and neither do the floors under it (models/ may: sequence parallelism's attention wrapper)
NO_TORCH_DISTRIBUTED = ("shardwise", "shardwise.errors", "shardwise.presets", "shardwise.rundir", "shardwise.phases",
                        "shardwise.preflight", "shardwise.preflight.*", "shardwise.config", "shardwise.foreign", "shardwise.hardware", "shardwise.plan", "shardwise.plan.*")

# Known exceptions, each named with why it is allowed and when it goes.
KNOWN_CIRCLES: set[frozenset] = set()
KNOWN_UPWARD: set[tuple[str, str]] = set()


def modules() -> dict[str, Path]:
    out = {}
    for p in (SRC / "shardwise").rglob("*.py"):
        name = ".".join(p.relative_to(SRC).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


def _is_main_block(node: ast.AST) -> bool:
    if not isinstance(node, ast.If):
        return False
    t = node.test
    return (isinstance(t, ast.Compare) and isinstance(t.left, ast.Name) and t.left.id == "__name__"
            and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in t.comparators))


def _walk(node: ast.AST):
    """ast.walk without `if __name__ == "__main__":` blocks."""
    for child in ast.iter_child_nodes(node):
        if _is_main_block(child):
            continue
        yield child
        yield from _walk(child)


def _imports_by_name(scope: ast.AST) -> bool:
    for n in _walk(scope):
        if isinstance(n, ast.Call):
            f = n.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            if name in ("__import__", "import_module"):
                return True
    return False


def imports(name: str, path: Path, known: dict) -> set[str]:
    """shardwise modules (and 'torch.distributed') that module `name` imports."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for n in _walk(tree):
        if isinstance(n, ast.Import):
            for a in n.names:
                if a.name == "torch.distributed" or a.name.startswith("torch.distributed."):
                    out.add("torch.distributed")
                elif a.name.split(".")[0] == "shardwise":
                    out.add(a.name)
        elif isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:
                parts = pkg.split(".")
                parts = parts[: len(parts) - (n.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            if base == "torch.distributed" or base.startswith("torch.distributed."):
                out.add("torch.distributed")
            elif base.split(".")[0] == "shardwise":
                for a in n.names:
                    out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and _imports_by_name(n):
            out |= {c.value for c in _walk(n) if isinstance(c, ast.Constant) and c.value in known}
    if _imports_by_name(tree):
        out |= {c.value for c in _walk(tree) if isinstance(c, ast.Constant) and c.value in known}
    out.discard(name)
    return out


def floor_of(name: str) -> int | None:
    best = None
    for i, (_, patterns) in enumerate(FLOORS):
        for p in patterns:
            if p == name:
                return i  # an exact name wins over a package pattern
            if p.endswith(".*") and name.startswith(p[:-1]):
                best = i
    return best


@functools.lru_cache(maxsize=1)
def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: imports(m, p, known) for m, p in known.items()}


def circles(g: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in g:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_every_module_has_a_floor():
    assert not [m for m in modules() if floor_of(m) is None], "add these modules to FLOORS"


def test_no_import_circle():
    found = [c for c in circles(graph()) if frozenset(c) not in KNOWN_CIRCLES]
    assert not found, f"import circles: {[sorted(c) for c in found]}"


def test_no_import_up_a_floor():
    bad = []
    for m, deps in graph().items():
        for d in deps - {"torch.distributed"}:
            if (m, d) not in KNOWN_UPWARD and floor_of(d) > floor_of(m):
                bad.append(f"{m} ({FLOORS[floor_of(m)][0]}) imports {d} ({FLOORS[floor_of(d)][0]})")
    assert not bad, "\n".join(sorted(bad))


def test_the_planner_and_the_floors_under_it_import_no_torch_distributed():
    def barred(m):
        return m != "shardwise.plan.simulate" and any(
            m == p or (p.endswith(".*") and m.startswith(p[:-1])) for p in NO_TORCH_DISTRIBUTED)

    bad = sorted(m for m, deps in graph().items() if "torch.distributed" in deps and barred(m))
    assert not bad, f"import torch.distributed where no process group may be needed: {bad}"
    assert barred("shardwise.plan.memory") and not barred("shardwise.plan.simulate")


def test_the_checker_sees_each_kind_of_import(tmp_path):
    """The walk finds module-level, function-level, relative and by-name imports, and skips the __main__ block."""
    pkg = tmp_path / "shardwise"
    (pkg / "sub").mkdir(parents=True)
    for f in ("__init__.py", "a.py", "b.py", "c.py", "d.py", "sub/__init__.py", "sub/e.py"):
        (pkg / f).write_text("")
    (pkg / "a.py").write_text("import shardwise.b\n\ndef f():\n    from shardwise.sub import e\n")
    (pkg / "sub" / "e.py").write_text("from .. import c\nfrom torch.distributed import fsdp\n")
    (pkg / "c.py").write_text("def f():\n    for n in ('shardwise.d',):\n        __import__(n)\n"
                              "if __name__ == '__main__':\n    import shardwise.a\n")
    known = {k: v for k, v in ((".".join(p.relative_to(tmp_path).with_suffix("").parts).removesuffix(".__init__"), p)
                               for p in pkg.rglob("*.py"))}
    assert imports("shardwise.a", known["shardwise.a"], known) == {"shardwise.b", "shardwise.sub.e"}
    assert imports("shardwise.sub.e", known["shardwise.sub.e"], known) == {"shardwise.c", "torch.distributed"}
    assert imports("shardwise.c", known["shardwise.c"], known) == {"shardwise.d"}
    assert circles({"x": {"y"}, "y": {"x"}, "z": {"x"}}) == [{"x", "y"}]


def test_the_ui_bench_and_doctor_take_the_launchers_checks_and_agent_not_the_launcher():
    """They call the preflight checks (the UI's model check, bench's runtime values) and the agent's pieces
    (doctor's loopback group); the launcher's run (shardwise.launch: prepare, train) is the CLI's."""
    g = graph()
    users = [m for m in g if m.startswith(("shardwise.ui", "shardwise.bench")) or m == "shardwise.doctor"]
    used = {d for m in users for d in g[m] if d == "shardwise.launch" or d.startswith("shardwise.launch.")}
    assert used and used <= {"shardwise.launch.preflight", "shardwise.launch.agent"}, sorted(used)
