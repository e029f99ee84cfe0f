"""The long-context levers' arithmetic, torch-free: the MLP tile count `mlp_tiles auto` picks, the host memory that
offloaded checkpoints take, and the time of their copies against a block's compute. The engine
(models/tiles.py, models/offload.py) and the planner (plan/memory.py, plan/decide.py) both call these.
"""

from __future__ import annotations

import math

from shardwise.preflight.flags import parse_mlp_tiles  # noqa: F401 (the setting's reading, with its check)

# the smallest tile auto makes: below it the per-tile matmuls get narrow and the kernel launches add up
MIN_TILE_TOKENS = 1024
# auto leaves the MLP whole while its intermediates stay under this (short sequences: tiling only costs time)
AUTO_MLP_FLOOR_BYTES = 2**30


def mlp_intermediate_bytes(tokens: int, width: int, c: int) -> float:
    """What a gated MLP's interior holds for its backward over `tokens`: gate, up and silu(gate) (the down
    projection's input is their product, counted here as the third)."""
    return 3.0 * tokens * width * c


def auto_mlp_tiles(tokens: int, hidden: int, width: int, c: int) -> int:
    """`mlp_tiles auto`: the fewest tiles (a power of two) that bring one tile's MLP intermediates down to the size
    of the block's residual stream (tokens x hidden x c), the budget a block already spends on its input, so the
    MLP stops being the peak of a recomputed block; 1 while the whole MLP's intermediates are below 1 GiB (the budget is at least that), and
    never tiles shorter than 1024 tokens."""
    whole = mlp_intermediate_bytes(tokens, width, c)
    if tokens <= MIN_TILE_TOKENS or whole <= AUTO_MLP_FLOOR_BYTES:
        return 1
    budget = max(tokens * hidden * c, AUTO_MLP_FLOOR_BYTES)
    n = 1 << max(0, math.ceil(math.log2(whole / budget)))
    return max(1, min(n, tokens // MIN_TILE_TOKENS))


def resolve_mlp_tiles(value, tokens: int, hidden: int, width: int, c: int) -> int:
    """The tile count a run uses: the number given, or auto's for these tokens per rank."""
    parsed = parse_mlp_tiles(value)
    return auto_mlp_tiles(tokens, hidden, width, c) if parsed == "auto" else parsed


def offload_host_bytes(num_layers: int, tokens: int, hidden: int, r: int, pinned: bool = True) -> float:
    """Host bytes per rank that offloaded checkpointing holds at the end of forward: every block's input
    (tokens x hidden in the residual stream's dtype), in pinned memory on CUDA, where torch's pinned-memory cache
    rounds each allocation up to a power of two (CachingHostAllocator, by default: a 3 GiB input takes 4 GiB)."""
    block = tokens * hidden * r
    if pinned and block > 0:
        block = 1 << (int(block) - 1).bit_length()
    return float(num_layers) * block


def offload_copy_s(tokens: int, hidden: int, r: int, host_link_gbps: float) -> float:
    """Seconds of one block input's copy over the host link (one way): it runs on a side stream and is hidden
    while it is shorter than the block's compute."""
    return tokens * hidden * r / (host_link_gbps * 1e9)
