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


# The decoder families whose blocks carry these linears (transformers' Llama-style attention and
# SwiGLU MLP; the attention reshapes with -1 heads, so it runs on each rank's local heads).
TP_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")


def tp_plan() -> dict:
    """The per-block plan (Megatron's): q/k/v and gate/up split by output features (each rank
    computes its own heads / MLP columns from the replicated input, no communication), o and down
    split by input features (each rank's partial sum, all-reduced into a replicated output).
    Forward: one all-reduce after attention and one after the MLP; backward: one each for the
    input gradients of the column-wise linears. Outputs are plain local tensors, so the
    attention code sees heads / N heads."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {**{n: ColwiseParallel() for n in COLWISE}, **{n: RowwiseParallel() for n in ROWWISE}}


def apply_tensor_parallel(model: nn.Module, dims: ParallelDims) -> str:
    """Split each decoder block's attention and MLP linears over the `tp` mesh dimension
    (torch's DTensor `parallelize_module`); their weights become DTensors sharded over the tp
    ranks. Embeddings, norms and the output head stay replicated plain tensors: every tp rank
    computes the same (full) logits and loss, whose gradients are the same on every tp rank.
    A parallel loss over a vocabulary-sharded head (`loss_parallel`) is not built yet."""
    if dims.tp == 1:
        return "tensor parallel: off"
    from torch.distributed.tensor.parallel import parallelize_module

    from shardwise.errors import ShardwiseError
    from shardwise.models.speed import decoder_blocks

    blocks = decoder_blocks(model)
    plan = tp_plan()
    for block in blocks:
        missing = [n for n in plan if _find(block, n) is None]
        if missing:
            raise ShardwiseError(f"tensor_parallel {dims.tp}: the model's decoder block {type(block).__name__} has "
                                 f"no {', '.join(missing)}; tensor parallelism knows the Llama-style families "
                                 f"({', '.join(TP_FAMILIES)}); use tensor_parallel 1")
    tp_mesh = dims.mesh["tp"]
    for block in blocks:
        parallelize_module(block, tp_mesh, plan)
    return (f"tensor parallel: {len(blocks)} blocks' q/k/v/gate/up column-wise, o/down row-wise over {dims.tp} "
            "ranks; embeddings, norms and head replicated")


def _find(module: nn.Module, name: str):
    try:
        return module.get_submodule(name)
    except AttributeError:
        return None


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
