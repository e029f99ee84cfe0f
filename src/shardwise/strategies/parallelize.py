"""The steps that turn a loaded model (adapters added) into the one a strategy trains, each a
small function that does one thing to the module tree and says what it did. The strategy
composes them in a fixed order (`Strategy.parallelize`):

    tensor parallel -> activation checkpointing -> compile -> data-parallel wrapping

Tensor parallelism comes first because it replaces weights by DTensors over the `tp` mesh
dimension, and the later steps must see those; checkpointing wraps the (parallel) blocks;
compile traces each block with its checkpointing inside; the data-parallel wrapper (FSDP, DDP,
DeepSpeed) goes around the compiled blocks (FSDP's per-block units and DDP's buckets, see
strategies/ddp.py, are laid over whole compiled blocks). The order is torchtitan's.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from shardwise.models.speed import compile_blocks
from shardwise.strategies.parallel import ParallelDims

log = logging.getLogger(__name__)


def apply_tensor_parallel(model: nn.Module, dims: ParallelDims) -> str:
    """Placeholder until tensor parallelism lands: with dims.tp == 1 there is nothing to split
    (the config refuses tensor_parallel > 1 before launch)."""
    if dims.tp > 1:
        raise NotImplementedError("tensor parallelism is not implemented yet")
    return "tensor parallel: off"


def apply_activation_checkpointing(model: nn.Module, cfg) -> str:
    """Recompute each block's activations in backward (HF's non-reentrant checkpointing)."""
    if not cfg.gradient_checkpointing:
        return "activation checkpointing: off"
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return "activation checkpointing: every block"


def compile_enabled(cfg) -> bool:
    """--compile on, or auto on a machine with CUDA."""
    return cfg.compile == "on" or (cfg.compile == "auto" and torch.cuda.is_available())


def apply_compile(model: nn.Module, cfg) -> str:
    """torch.compile each decoder block in place (parameter names unchanged)."""
    if not compile_enabled(cfg):
        return "compile: off"
    return f"compile: {compile_blocks(model)} blocks"
