"""Speed-ups of the Hugging Face model that compose with every strategy: a chunked linear +
cross-entropy head that never holds the full logits (installed by `train.loop.build_model`),
and torch.compile of each decoder block (the `apply_compile` step of a strategy's
parallelize pipeline, strategies/parallelize.py, before the data-parallel wrapping).

With tensor parallelism the head's weight is a DTensor sharded over the vocabulary: the fused
head then computes a vocabulary-parallel cross-entropy (each tp rank its slice of every chunk's
logits, the log-sum-exp and the target logit combined by two all-reduces per chunk), and the
plain head returns logits sharded over the vocabulary, whose loss `token_loss_sum` takes under
torch's `loss_parallel` (the strategy's `loss_parallel` context). Neither gathers full logits."""

from __future__ import annotations

import types

import torch
from torch import nn

from shardwise.plan.facts import FUSED_LOSS_CHUNK, even_chunks

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
            # log-sum-exp in place (torch.logsumexp makes a chunk-sized fp32 temporary beside the logits): shift
            # by the row max, read the target, exponentiate, sum; the softmax is then one in-place division
            logits.sub_(logits.amax(dim=-1, keepdim=True))
            picked = logits.gather(1, tt[:, None]).squeeze(1)  # the target's logit minus the row max
            total = logits.exp_().sum(dim=-1, keepdim=True)
            loss += ((total.squeeze(1).log() - picked) * valid).sum()
            # d(sum CE)/d logits = softmax - onehot, zero where there is no target
            g = logits.div_(total)
            g.scatter_add_(1, tt[:, None], -torch.ones_like(picked)[:, None])
            g.mul_(valid[:, None])
            g = g.to(compute_dtype)
            grad_h[s:s + chunk] = (g @ w).to(hidden.dtype)
            if want_w:
                grad_w += (g.t() @ h).float()
            del logits, g  # before the next chunk's are made: one chunk alive at a time, not two
        ctx.save_for_backward(grad_h, grad_w.to(weight.dtype) if want_w else None)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_loss, None if grad_w is None else grad_w * grad_loss, None, None, None


class _VocabParallelLinearCrossEntropy(torch.autograd.Function):
    """_LinearCrossEntropy with the weight split by rows (the vocabulary) over `group`: this rank holds rows
    [v0, v0 + V_local). Every rank passes the same hidden rows and targets and gets the same summed loss; its
    weight gradient is its rows' (no communication), the hidden gradient is summed over the group once."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk: int, compute_dtype, group, v0: int):
        import torch.distributed as dist

        n, vl = hidden.shape[0], weight.shape[0]
        h_all = hidden.to(compute_dtype)
        w = weight.to(compute_dtype)
        grad_h = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        want_w = ctx.needs_input_grad[1]
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for s in range(0, n, chunk):
            h = h_all[s:s + chunk]
            t = targets[s:s + chunk]
            logits = (h @ w.t()).float()
            valid = t != IGNORE
            local = t - v0
            mine = valid & (local >= 0) & (local < vl)
            lt = torch.where(mine, local, 0)
            top = logits.max(dim=-1).values
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
            logits.sub_(top[:, None])
            target = logits.gather(1, lt[:, None]).squeeze(1) * mine
            # [sum of exp, the target's logit (on the rank holding it, 0 elsewhere)]: one all-reduce; exponentiated
            # in place (no chunk-sized temporary)
            parts = torch.stack([logits.exp_().sum(-1), target])
            dist.all_reduce(parts, group=group)
            loss += ((parts[0].log() - parts[1]) * valid).sum()
            g = logits.div_(parts[0][:, None])  # softmax over the whole vocabulary, this rank's columns
            g.scatter_add_(1, lt[:, None], -mine.to(g.dtype)[:, None])
            g.mul_(valid[:, None])
            g = g.to(compute_dtype)
            grad_h[s:s + chunk] = (g @ w).float()
            if want_w:
                grad_w += (g.t() @ h).float()
            del logits, g  # before the next chunk's are made: one chunk alive at a time, not two
        dist.all_reduce(grad_h, group=group)  # each rank's columns' share of d loss / d hidden
        ctx.save_for_backward(grad_h.to(hidden.dtype), grad_w.to(weight.dtype) if want_w else None)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        return (grad_h * grad_loss, None if grad_w is None else grad_w * grad_loss, None, None, None, None, None)


def vocab_parallel_cross_entropy(hidden, weight, targets, chunk: int = 4096, compute_dtype=None):
    """linear_cross_entropy for a head whose weight is a DTensor sharded by rows (the vocabulary) over a 1-D
    mesh, and whose input is the full (replicated) hidden states: each rank computes its vocabulary slice of
    the logits, never all of them. Returns the summed loss, the same plain tensor on every rank of the mesh."""
    from torch.distributed.tensor import DTensor

    if isinstance(hidden, DTensor):
        hidden = hidden.to_local()  # replicated: every rank the same rows
    mesh = weight.device_mesh
    rows = -(-weight.shape[0] // mesh.size())  # torch.chunk's split, as Shard(0) lays it
    v0 = min(mesh.get_local_rank() * rows, weight.shape[0])
    w = weight.to_local()
    if compute_dtype is None:
        compute_dtype = torch.get_autocast_dtype(hidden.device.type) if torch.is_autocast_enabled(hidden.device.type) \
            else w.dtype
    with torch.autocast(hidden.device.type, enabled=False):
        return _VocabParallelLinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), w, targets.reshape(-1),
                                                      chunk, compute_dtype, mesh.get_group(), v0)


def token_loss_sum(logits, targets) -> torch.Tensor:
    """Summed token cross-entropy in fp32 (targets are already shifted; IGNORE = no loss). Logits sharded over
    the vocabulary (a DTensor from a tensor-parallel head) are reduced under torch's `loss_parallel`, which the
    caller enters (Strategy.loss_parallel), and the loss comes back as a plain tensor."""
    import torch.nn.functional as F

    loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1), ignore_index=IGNORE,
                           reduction="sum")
    return loss.to_local() if hasattr(loss, "to_local") else loss


def linear_cross_entropy(hidden, weight, targets, chunk: int = 4096, compute_dtype=None):
    """Summed token cross-entropy of `hidden @ weight.T` against `targets` (IGNORE = none)."""
    if compute_dtype is None:
        compute_dtype = torch.get_autocast_dtype(hidden.device.type) if torch.is_autocast_enabled(hidden.device.type) \
            else weight.dtype
    with torch.autocast(hidden.device.type, enabled=False):
        return _LinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1),
                                         chunk, compute_dtype)


def _chunk_logp(h, w, t):
    """One chunk: (each token's target log-probability, 0 where IGNORE; each token's log-sum-exp), fp32. The fp32
    logits are made here and consumed in place (shift, exponentiate, sum), so no chunk-sized temporary exists
    beside them; compiled, the passes are one fused reduction over the matmul's output."""
    x = (h @ w.t()).float()
    valid = t != IGNORE
    top = x.amax(dim=-1)
    picked = x.gather(1, torch.where(valid, t, 0)[:, None]).squeeze(1)
    lse = x.sub_(top[:, None]).exp_().sum(dim=-1).log_().add_(top)
    return (picked - lse) * valid, lse


def _chunk_logp_grad(h, w, t, shift, scale):
    """One chunk's gradient of sum_t s_t logp_t with respect to its logits, up to each row's sign: |s| (softmax -
    onehot(target)) in the compute dtype, where `scale` is |s| and `shift` the forward's log-sum-exp minus log |s|,
    so exp(logits - shift) is |s| softmax in one pass, the scaling folded into the shift. The caller applies
    -sign(s) to the rows of the matmuls' small operands (the chunk's hidden states and its hidden gradient), not to
    the chunk x vocabulary matrix."""
    x = (h @ w.t()).float()
    tt = torch.where(t != IGNORE, t, 0)
    if torch.compiler.is_compiling():  # the target's term as a comparison: one fused kernel, no scatter pass
        hit = torch.arange(x.shape[1], device=x.device)[None, :] == tt[:, None]
        g = torch.exp(x - shift[:, None]) - torch.where(hit, scale[:, None], 0.0)
    else:  # in place over the logits: no chunk-sized temporary beside them
        g = x.sub_(shift[:, None]).exp_()
        g.scatter_add_(1, tt[:, None], -scale[:, None])
    return g.to(h.dtype)


_COMPILED: dict = {}


def _body(fn, compiled: bool):
    """`fn` itself, or its torch.compile'd form (made once per process: the policy's head and a reference's run
    the same compiled graphs, so their log-probabilities are bit-equal, as the first step's zero margin needs)."""
    if not compiled:
        return fn
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn)
    return _COMPILED[fn]


class _LinearTokenLogProbs(torch.autograd.Function):
    """log softmax(h_t W^T)[y_t] per token (0 where y_t is IGNORE), over chunks of tokens (even_chunks): peak memory
    holds one chunk's fp32 logits, and none are kept for backward, which computes each chunk's logits again (one
    more head matmul than _LinearCrossEntropy, whose gradients need no upstream value per token; these do). The
    forward keeps each token's log-sum-exp (one float per token) for the backward, which then makes the softmax in
    one pass instead of reducing the logits again. `compiled`: each chunk's passes over its logits run through
    torch.compile (_body), where the run compiles (strategies/parallelize.py compile_enabled)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk: int, compute_dtype, compiled: bool = False):
        n = hidden.shape[0]
        # detached: the compiled bodies then see the same inputs from a trained policy and a frozen reference
        h_all, w = hidden.detach().to(compute_dtype), weight.detach().to(compute_dtype)
        out = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        lse = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        body = _body(_chunk_logp, compiled)
        for s, e in even_chunks(n, chunk):
            out[s:e], lse[s:e] = body(h_all[s:e], w, targets[s:e])
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk, ctx.compute_dtype, ctx.compiled = chunk, compute_dtype, compiled
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, targets, lse = ctx.saved_tensors
        h_all, w = hidden.detach().to(ctx.compute_dtype), weight.detach().to(ctx.compute_dtype)
        want_w = ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden)
        grad_w = None
        # d logp_t / d logits = onehot(y_t) - softmax, times s_t, the upstream gradient of token t (0 where IGNORE)
        s = grad_out.float() * (targets != IGNORE)
        scale = s.abs()
        # rows with s = 0 (IGNORE, or no upstream gradient) keep the plain softmax (their sign, 0, removes them):
        # exp(-inf) for a whole row takes the CPU's slow path
        shift = torch.where(scale > 0, lse - scale.log(), lse)
        sign = -torch.sign(s)[:, None].to(ctx.compute_dtype)  # g = sign * |s| (softmax - onehot): exact in any dtype
        body = _body(_chunk_logp_grad, ctx.compiled)
        for a, b in even_chunks(hidden.shape[0], ctx.chunk):
            h = h_all[a:b]
            g = body(h, w, targets[a:b], shift[a:b], scale[a:b])
            grad_h[a:b] = ((g @ w) * sign[a:b]).to(hidden.dtype)
            if want_w:
                part = (g.t() @ (h * sign[a:b])).float()
                grad_w = part if grad_w is None else grad_w.add_(part)  # the first chunk's is the buffer: no zero fill
                del part  # before the next chunk's is made: a V x h fp32 matrix
            del g
        if want_w and grad_w is None:  # no tokens
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None


def linear_token_logprobs(hidden, weight, targets, chunk: int = 4096, compute_dtype=None, compile: bool = False):
    """Per-token log-probabilities of `targets` under `hidden @ weight.T` (shape of `targets`, fp32, 0 where
    IGNORE), never holding the full logits: what preference losses sum per sequence (train/objective.py). `compile`:
    each chunk's passes over its logits through torch.compile (one fused kernel each way instead of several)."""
    if compute_dtype is None:
        compute_dtype = torch.get_autocast_dtype(hidden.device.type) if torch.is_autocast_enabled(hidden.device.type) \
            else weight.dtype
    with torch.autocast(hidden.device.type, enabled=False):
        out = _LinearTokenLogProbs.apply(hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1), chunk,
                                         compute_dtype, compile)
    return out.view(targets.shape)


def token_logprobs(logits, targets) -> torch.Tensor:
    """Per-token log-probabilities of `targets` from full logits (the plain head's), fp32, 0 where IGNORE."""
    valid = targets != IGNORE
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, torch.where(valid, targets, 0).unsqueeze(-1)).squeeze(-1) * valid


def install_fused_loss(model: nn.Module, chunk: int = FUSED_LOSS_CHUNK, compile: bool = False) -> bool:
    """Make the output head return the summed loss instead of logits when targets are
    set on it (`model.lm_head.loss_targets = targets`). The head stays the same module
    with the same parameter names, so every strategy's wrapping and every checkpoint are
    unchanged; the loop clears the targets to get ordinary logits. `compile`: the per-token
    log-probability head (task dpo) runs its per-chunk passes compiled (linear_token_logprobs)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear) or head.bias is not None:
        return False
    cfg = getattr(model, "config", None)
    if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None):
        return False  # the model post-processes its logits: keep the plain head
    plain_forward = head.forward

    def forward(self, hidden_states):
        logp_targets = getattr(self, "logp_targets", None)
        if logp_targets is not None:  # per-token log-probabilities (task dpo), not their summed loss
            return linear_token_logprobs(hidden_states, self.weight, logp_targets, chunk, compile=compile)
        targets = getattr(self, "loss_targets", None)
        if targets is None:
            return plain_forward(hidden_states)
        placements = getattr(self.weight, "placements", None)  # a DTensor's
        if placements and placements[0].is_shard(0):  # sharded over the vocabulary (tensor parallel)
            return vocab_parallel_cross_entropy(hidden_states, self.weight, targets, chunk)
        return linear_cross_entropy(hidden_states, self.weight, targets, chunk)

    head.forward = types.MethodType(forward, head)
    head.loss_targets = head.logp_targets = None
    return True


def _no_split_names(model: nn.Module) -> set[str]:
    """The class names the model declares never-split (`_no_split_modules`: its decoder layer classes, the list
    accelerate's device map and the HF Trainer's FSDP auto-wrap read), from the first module in `model.modules()`
    that declares any: the model itself (a peft PeftModel forwards its base model's), else, for a wrapper that
    does not forward it, the outermost model inside. transformers keeps it as a list or a set (or None); one
    name alone (a string) is taken as that name."""
    for m in model.modules():
        names = getattr(m, "_no_split_modules", None)
        if names:
            return {names} if isinstance(names, str) else set(names)
    return set()


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks, in their order, by the first rule that finds any:

    1. the largest ModuleList whose members are all of classes the model names in `_no_split_modules`
       (a class matches by its own name or a base class's: FSDP2's `fully_shard` swaps a block's class for a
       subclass `FSDP<name>`); names of classes the model does not hold (a vision tower's) are ignored;
    2. the largest ModuleList whose members are all one class.

    Rule 2 alone would take a remote-code MoE's expert list (one class, 64 experts against 24 layers) for the
    blocks. Both rules keep the first of equally long lists, and find nothing ([]) outside ModuleLists."""
    named = _no_split_names(model)

    def declared(x: nn.Module) -> bool:
        return any(c.__name__ in named for c in type(x).__mro__)

    best: list[nn.Module] = []
    if named:
        for m in model.modules():
            if isinstance(m, nn.ModuleList) and len(m) > len(best) and all(declared(x) for x in m):
                best = list(m)
        if best:
            return best
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) > len(best) and len({type(x) for x in m}) == 1:
            best = list(m)
    return best


def unroute_hub_kernels(block: nn.Module) -> int:
    """Give the block's modules that the `kernels` package routes (transformers' `use_kernelized_func`, on the
    attention of Llama, Qwen2 and others) their own forward back. The routing wrapper sets a context variable on
    every call so that a `kernelize`d model can swap in hub kernels; shardwise never kernelizes, and inside a
    checkpointed block dynamo refuses that side effect in the checkpoint's higher-order op, so the compiled block
    breaks its graph there and its checkpointed body is no longer one compiled graph. The wrapped forward is the same
    computation (functools.wraps keeps it as `__wrapped__`). Returns how many modules it unwrapped."""
    n = 0
    for m in block.modules():
        own = getattr(type(m).forward, "__wrapped__", None)
        if own is not None and "_kernel_funcs" in m.__dict__:
            m.forward = types.MethodType(own, m)
            n += 1
    return n


def compile_blocks(model: nn.Module, hooks_eager: bool = False) -> int:
    """torch.compile each decoder block in place (parameter names unchanged): the whole call, its module hooks
    included, or with `hooks_eager` only its forward, the block's own hooks running eagerly around it. Tensor
    parallelism needs the latter: the first block's input hook (strategies/parallelize.py) cuts the replicated
    embedding output into this rank's sequence slice through DTensor, and traced inside the compiled call that
    cut loses its gradient (torch 2.13: the embedding then gets none, silently)."""
    blocks = decoder_blocks(model)
    for b in blocks:
        unroute_hub_kernels(b)
        if hasattr(b, "checkpointed_forward"):  # offloaded checkpointing (models/offload.py): its hooks stay eager
            b.checkpointed_forward = torch.compile(b.checkpointed_forward)
        elif hooks_eager:
            b.forward = torch.compile(b.forward)
        else:
            b.compile()
    return len(blocks)
