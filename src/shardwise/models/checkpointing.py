"""Activation checkpointing of the decoder blocks, full, selective or offload (the `apply_activation_checkpointing`
step of a strategy's parallelize pipeline, strategies/parallelize.py).

Full: a block keeps only its input and runs forward again in backward (transformers' own non-reentrant
checkpointing). Selective works per operator inside each block: the outputs of the expensive operators (the
matmuls, the attention kernels, float8's abs-max reductions and tensor parallelism's reduce-scatters) are kept, and
everything between them (norms, rotary embedding, SiLU and the gating product, dtype casts) is recomputed from
them in backward. The memory lands between full and none, and the recompute costs memory-bound passes but
almost no FLOPs. It is torch's `create_selective_checkpoint_contexts` under a non-reentrant
`torch.utils.checkpoint`, installed as the block's `forward` so parameter names stay as they are and
torch.compile of the block (the next step) traces the checkpoint into its graph, where the partitioner
follows the same save/recompute choice. Offload is full checkpointing whose kept block inputs live in host memory
(models/offload.py).
"""

from __future__ import annotations

import functools

import torch
from torch import nn


def _ops(*names: str) -> set:
    """The OpOverloads of these `namespace.op.overload` names that this torch build has."""
    out = set()
    for name in names:
        ns, op, overload = name.split(".")
        packet = getattr(getattr(torch.ops, ns), op, None) if hasattr(torch.ops, ns) else None
        if packet is not None and hasattr(packet, overload):
            out.add(getattr(packet, overload))
    return out


@functools.cache
def kept_ops() -> frozenset:
    """Operators whose outputs selective checkpointing keeps for backward."""
    return frozenset(_ops(
        "aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten._scaled_mm.default",
        "aten._scaled_dot_product_flash_attention.default", "aten._scaled_dot_product_efficient_attention.default",
        "aten._scaled_dot_product_cudnn_attention.default",
        "aten._scaled_dot_product_flash_attention_for_cpu.default", "aten._flash_attention_forward.default",
        "aten._efficient_attention_forward.default", "aten.max.default",
        "_c10d_functional.reduce_scatter_tensor.default"))


def _policy(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in kept_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def _contexts():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_policy)


def checkpoint_selectively(block: nn.Module) -> None:
    """Make `block.forward` run under selective checkpointing (parameters and their names untouched)."""
    from torch.utils.checkpoint import checkpoint

    forward = block.forward

    def checkpointed_forward(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, context_fn=_contexts, **kwargs)

    block.forward = checkpointed_forward


def enable_full(model: nn.Module) -> None:
    """transformers' own non-reentrant checkpointing of every decoder block, by its current name
    (`activation_checkpointing_enable`; transformers before it, e.g. 5.17 on the GPU machines, has only
    `gradient_checkpointing_enable`, which later versions keep as a deprecated alias)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def is_checkpointing(model: nn.Module) -> bool:
    """Whether transformers' block checkpointing is on (`is_activation_checkpointing`, or its older name)."""
    if hasattr(model, "is_activation_checkpointing"):
        return model.is_activation_checkpointing
    return model.is_gradient_checkpointing


def checkpoint_blocks(model: nn.Module, mode: str) -> str:
    """Apply `mode` (off, full, selective, offload) to the model's decoder blocks; returns what was done."""
    from shardwise.models.speed import decoder_blocks

    if mode == "off":
        return "activation checkpointing: off"
    if mode == "full":
        enable_full(model)
        return "activation checkpointing: every block (full)"
    blocks = decoder_blocks(model)
    if mode == "offload":
        from shardwise.models.offload import offload_blocks

        model.host_checkpoints = offload_blocks(blocks)
        return f"activation checkpointing: every block (full), inputs offloaded to host memory, in {len(blocks)} blocks"
    if mode != "selective":
        raise ValueError(mode)
    for block in blocks:
        checkpoint_selectively(block)
    return f"activation checkpointing: selective (matmul and attention outputs kept) in {len(blocks)} blocks"
