"""Strategy lookup: a preset name -> its strategy class, imported lazily.

Every family is declared once in `shardwise.presets` (class path, presets, requirements,
planner rules); adding a strategy = one file here + one `register(StrategySpec(...))` there.
"""

from __future__ import annotations

import importlib
import importlib.util

from shardwise import presets
from shardwise.errors import ShardwiseError


def missing_requirement(name: str) -> str | None:
    """Why a preset's optional backend cannot be imported here (one line), or None; imports nothing."""
    spec = presets.spec_of(name)
    if spec.requires:
        need, how = spec.requires
        if importlib.util.find_spec(need) is None:
            return f"strategy '{name}' needs {need}, which is not installed; install it with: {how}"
    return None


def get(name: str):
    """The strategy class for a preset or strategy name."""
    if name not in presets.PRESETS:
        raise ShardwiseError(f"unknown strategy '{name}'; known: {', '.join(presets.known_names())}")
    missing = missing_requirement(name)
    if missing:
        raise ShardwiseError(missing)
    module, cls = presets.spec_of(name).cls.split(":")
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and e.name.startswith("shardwise.strategies"):
            raise ShardwiseError(f"strategy '{name}' is not implemented yet in this version")
        raise
    return getattr(mod, cls)
