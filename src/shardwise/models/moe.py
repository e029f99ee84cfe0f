"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE, ...): what the rest of the engine needs
to know about them, in one place.

- The sparse MoE block is the module holding the routed experts (an `experts` child beside its
  router). FSDP wraps per decoder block as for a dense model, so the experts are sharded and
  gathered with their block (strategies/fsdp.py block_units); ZeRO-3 marks each sparse block a
  DeepSpeed "leaf" (`moe_leaf_modules`), so the whole block's parameters are fetched at its
  forward whichever experts the tokens pick: with experts as separate submodules, an expert no
  token reached on one rank would never be fetched there while the other rank waits for it.
- The router's load-balancing loss: `aux_loss_weight` is the model config's
  router_aux_loss_coef when its output_router_logits is on (as Hugging Face adds it to the loss
  when labels are given), else 0; the loop adds weight x aux_loss to what it back-propagates.
"""

from __future__ import annotations

from torch import nn


def sparse_moe_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules that route tokens to experts: those with a child named `experts`."""
    return [m for m in model.modules() if isinstance(getattr(m, "experts", None), nn.Module)]


def moe_leaf_classes(model: nn.Module) -> list[type]:
    """Classes of the sparse MoE blocks, for deepspeed.utils.set_z3_leaf_modules (empty for a dense model)."""
    return sorted({type(m) for m in sparse_moe_blocks(model)}, key=lambda c: c.__name__)


def aux_loss_weight(model: nn.Module) -> float:
    """The router load-balancing loss's coefficient, 0.0 when the model does not compute it."""
    cfg = getattr(model, "config", None)
    if cfg is None or not getattr(cfg, "output_router_logits", False):
        return 0.0
    return float(getattr(cfg, "router_aux_loss_coef", 0.0) or 0.0)
