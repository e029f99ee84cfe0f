"""Strategy registry: a preset name -> its strategy class (imported lazily) + options.

Adding a strategy = one file + one line in STRATEGIES (and its presets in presets.py).
"""

from __future__ import annotations

import importlib
import importlib.util

from shardwise import presets
from shardwise.errors import ShardwiseError

# base strategy name -> "module:Class"
STRATEGIES = {
    "single": "shardwise.strategies.single:SingleStrategy",
    "ddp": "shardwise.strategies.ddp:DDPStrategy",
    "fsdp": "shardwise.strategies.fsdp:FSDPStrategy",
    "deepspeed": "shardwise.strategies.deepspeed:DeepSpeedStrategy",
}

# base strategy -> (module it needs, how to install it): checked before importing, so a
# missing optional backend is one line in the launcher, not a traceback in every worker.
REQUIRES = {
    "deepspeed": ("deepspeed", "pip install 'shardwise[deepspeed]'"),
}


def get(name: str):
    """The strategy class for a preset or strategy name."""
    if name not in presets.PRESETS:
        raise ShardwiseError(f"unknown strategy '{name}'; known: {', '.join(presets.known_names())}")
    base = presets.base_strategy(name)
    if base in REQUIRES:
        need, how = REQUIRES[base]
        if importlib.util.find_spec(need) is None:
            raise ShardwiseError(f"strategy '{name}' needs {need}, which is not installed; install it with: {how}")
    module, cls = STRATEGIES[base].split(":")
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and e.name.startswith("shardwise.strategies"):
            raise ShardwiseError(f"strategy '{name}' is not implemented yet in this version")
        raise
    return getattr(mod, cls)
