"""Speed-ups of the Hugging Face model that compose with every strategy: a chunked linear +
cross-entropy head that never holds the full logits (installed by `train.loop.build_model`),
and torch.compile of each decoder block (the `apply_compile` step of a strategy's
parallelize pipeline, strategies/parallelize.py, before the data-parallel wrapping)."""

from __future__ import annotations

import types

import torch
from torch import nn

IGNORE = -100


class _LinearCrossEntropy(torch.autograd.Function):
    """sum_t CE(h_t W^T, y_t) over chunks of tokens, with the gradients computed in the
    forward pass chunk by chunk: peak memory holds one chunk's logits (fp32) instead of
    all of them, and no logits are kept for backward."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk: int, compute_dtype):
        n = hidden.shape[0]
        h_all = hidden.to(compute_dtype)
        w = weight.to(compute_dtype)
        grad_h = torch.empty_like(hidden)
        # a frozen head (LoRA, QLoRA) needs no weight gradient: no fp32 V x h buffer, no g^T h matmuls
        want_w = ctx.needs_input_grad[1]
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for s in range(0, n, chunk):
            h = h_all[s:s + chunk]
            t = targets[s:s + chunk]
            logits = (h @ w.t()).float()
            valid = t != IGNORE
            tt = torch.where(valid, t, 0)
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, tt[:, None]).squeeze(1)
            loss += ((lse - picked) * valid).sum()
            # d(sum CE)/d logits = softmax - onehot, zero where there is no target
            g = logits.sub_(lse[:, None]).exp_()
            g.scatter_add_(1, tt[:, None], -torch.ones_like(lse)[:, None])
            g.mul_(valid[:, None])
            g = g.to(compute_dtype)
            grad_h[s:s + chunk] = (g @ w).to(hidden.dtype)
            if want_w:
                grad_w += (g.t() @ h).float()
        ctx.save_for_backward(grad_h, grad_w.to(weight.dtype) if want_w else None)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_loss, None if grad_w is None else grad_w * grad_loss, None, None, None


def linear_cross_entropy(hidden, weight, targets, chunk: int = 4096, compute_dtype=None):
    """Summed token cross-entropy of `hidden @ weight.T` against `targets` (IGNORE = none)."""
    if compute_dtype is None:
        compute_dtype = torch.get_autocast_dtype(hidden.device.type) if torch.is_autocast_enabled(hidden.device.type) \
            else weight.dtype
    with torch.autocast(hidden.device.type, enabled=False):
        return _LinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1),
                                         chunk, compute_dtype)


def install_fused_loss(model: nn.Module, chunk: int = 4096) -> bool:
    """Make the output head return the summed loss instead of logits when targets are
    set on it (`model.lm_head.loss_targets = targets`). The head stays the same module
    with the same parameter names, so every strategy's wrapping and every checkpoint are
    unchanged; the loop clears the targets to get ordinary logits."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear) or head.bias is not None:
        return False
    cfg = getattr(model, "config", None)
    if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None):
        return False  # the model post-processes its logits: keep the plain head
    plain_forward = head.forward

    def forward(self, hidden_states):
        targets = getattr(self, "loss_targets", None)
        if targets is None:
            return plain_forward(hidden_states)
        return linear_cross_entropy(hidden_states, self.weight, targets, chunk)

    head.forward = types.MethodType(forward, head)
    head.loss_targets = None
    return True


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks: the largest ModuleList of identical classes."""
    best: list[nn.Module] = []
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) > len(best) and len({type(x) for x in m}) == 1:
            best = list(m)
    return best


def compile_blocks(model: nn.Module) -> int:
    """torch.compile each decoder block in place (parameter names unchanged)."""
    blocks = decoder_blocks(model)
    for b in blocks:
        b.compile()
    return len(blocks)
