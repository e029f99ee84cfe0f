"""The decoder blocks' MLP over sequence tiles (`--mlp-tiles N|auto`, the parallelize pipeline's step between
tensor parallelism and activation checkpointing, strategies/parallelize.py).

A gated MLP's interior is 3 x tokens x intermediate size (gate, up, their product): for the Llama-3.1-8B shape 3.5
times the residual stream, and at long lengths the largest thing a block makes, forward and (recomputed under
checkpointing) backward. Here the MLP's input is split along the sequence into N tiles and each runs under torch's
non-reentrant `checkpoint`: the forward keeps only the tile's input (a view of the MLP input, no copy), and the
backward recomputes one tile's interior at a time. The MLP is position-wise, so the result is the same function;
parameters receive the sum of the tiles' gradients through autograd's own accumulation (one gradient hook call per
parameter, as DDP, FSDP and DeepSpeed expect). Nested inside a block's full or offloaded checkpoint, the block's
recompute runs the tiles again, each still one at a time.
"""

from __future__ import annotations

import torch
from torch import nn


def tile_mlp(mlp: nn.Module, tiles: int) -> None:
    """Make `mlp.forward` run over `tiles` sequence tiles (dimension 1 of its (batch, seq, hidden) input)."""
    from torch.utils.checkpoint import checkpoint

    whole = mlp.forward

    def tiled_forward(x, *args, **kwargs):
        n = min(tiles, x.shape[1]) if x.dim() == 3 else 1
        if n <= 1 or args or kwargs:
            return whole(x, *args, **kwargs)
        # the first (length mod n) tiles one token longer; an aten op, so a compiled block with dynamic sequence
        # lengths (a recompile after the length changes) traces it instead of falling back to eager
        pieces = torch.tensor_split(x, n, dim=1)
        if not torch.is_grad_enabled():
            return torch.cat([whole(p) for p in pieces], dim=1)
        return torch.cat([checkpoint(whole, p, use_reentrant=False) for p in pieces], dim=1)

    mlp.forward = tiled_forward
    mlp.sequence_tiles = tiles


def tile_blocks(model: nn.Module, value, tokens: int, c: int) -> str:
    """Apply `mlp_tiles` (a count or auto, resolved for `tokens` per rank and `c` compute-dtype bytes) to every
    decoder block's `mlp`."""
    from shardwise.models.speed import decoder_blocks
    from shardwise.plan.long_context import resolve_mlp_tiles

    cfg = model.config
    n = resolve_mlp_tiles(value, tokens, cfg.hidden_size, getattr(cfg, "intermediate_size", 0) or 0, c)
    if n <= 1:
        return "mlp tiles: off"
    blocks = [b for b in decoder_blocks(model) if isinstance(getattr(b, "mlp", None), nn.Module)]
    for block in blocks:
        tile_mlp(block.mlp, n)
    how = "auto: " if str(value).strip() == "auto" else ""
    return f"mlp tiles: {how}{n} sequence tiles of ~{tokens // n} tokens in {len(blocks)} blocks"
