"""Sequence parallelism around attention (DeepSpeed-Ulysses), as a transformers attention
function, so every Hugging Face decoder that dispatches through `ALL_ATTENTION_FUNCTIONS`
(Llama, Qwen2, Mistral, ...) gets it without any change to its modelling code.

Each rank of a sequence-parallel (SP) group of N ranks holds a contiguous 1/N slice of
every sequence (data/batches.py cuts it). Everything but attention works token by token,
so it runs on the slice as it is. Around attention, one all-to-all turns the
sequence-sharded q/k/v (B, H, S/N, D) into head-sharded ones (B, H/N, S, D): each rank
then attends over the whole sequence for its H/N heads, with any mask, and a second
all-to-all brings the output back to the sequence slice. Backward is the same exchange in
reverse (an all-to-all's adjoint is the all-to-all the other way).

The mask is built here from the *global* position ids (gathered once per forward over the
group): causal, and block-diagonal where positions restart (packed documents), so packing
keeps its document boundaries. The model builds no mask of its own for this attention
function (one for the local slice would be useless here).
Long packed sequences use FlexAttention's block mask instead of a dense (B, 1, S, S) one
(`doc_attention`), on one rank or many.

Ring attention (models/ring_attention.py) takes over where the heads run out: the SP group of
N = U x R ranks is split into Ulysses groups of U consecutive ranks (together a contiguous
1/R chunk of the sequence) and rings of R ranks (one per head shard). Ulysses exchanges
within its group, to (B, H/U, S/R, D); the ring then attends that chunk's queries to the
whole sequence's keys, chunk by chunk; Ulysses brings the output back. `split_degree` says
how N splits: ulysses = (N, 1), ring = (1, N), auto = (gcd(heads, N), N / gcd); the run's mesh
(strategies/parallel.py) is built with that split, as dimensions sp_ring x sp_ulysses, and
`configure` takes the three groups from it. With tensor parallelism each rank holds H / tp heads,
and Ulysses splits those.
"""

from __future__ import annotations

import math
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardwise.errors import ShardwiseError
from shardwise.models.ring_attention import Ring, ring_attention
from shardwise.plan.facts import DENSE_MASK_MAX_SEQ

NAME = "shardwise_ulysses"
# Above this many (query x key) pairs a packed sequence uses FlexAttention's block mask
# (on CUDA) instead of a dense boolean mask: 8192^2 is a 64 MiB boolean mask per sequence.
DENSE_MASK_LIMIT = DENSE_MASK_MAX_SEQ ** 2


class _State:
    group: dist.ProcessGroup | None = None  # the SP group of this process (one model per process)
    degree: int = 1
    ulysses: int = 1  # degree x = ulysses x ring
    ulysses_group: dist.ProcessGroup | None = None
    ring: Ring | None = None  # None: no ring (ring degree 1)
    # per forward: the local position ids the entries below belong to, the documents of the
    # whole sequence, and (long packed sequences on CUDA) their block mask
    cached_local: torch.Tensor | None = None
    cached_docs: torch.Tensor | None = None
    cached_block_mask = None


_state = _State()


# -- the exchange ---------------------------------------------------------------------------


class _AllToAll(torch.autograd.Function):
    """all_to_all_single over dim 0 (N equal chunks) of a contiguous tensor; gloo has it, so
    the CPU tests run the same exchange as NCCL does."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # the incoming gradient may have any strides; the exchange reads and writes flat memory
        grad = grad.contiguous()
        out = torch.empty_like(grad, memory_format=torch.contiguous_format)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def seq_to_heads(x: torch.Tensor, group, n: int) -> torch.Tensor:
    """(B, H, S/N, D) sequence slice -> (B, H/N, S, D): this rank's heads, whole sequence."""
    b, h, s, d = x.shape
    chunks = x.reshape(b, n, h // n, s, d).permute(1, 0, 2, 3, 4)  # (N, B, H/N, s, D): chunk j -> rank j
    got = _AllToAll.apply(chunks.contiguous(), group)  # got[j] = rank j's sequence slice of my heads
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def heads_to_seq(x: torch.Tensor, group, n: int) -> torch.Tensor:
    """(B, S, H/N, D) this rank's heads -> (B, S/N, H, D): every head, this rank's slice."""
    b, full, hn, d = x.shape
    chunks = x.reshape(b, n, full // n, hn, d).permute(1, 0, 2, 3, 4)  # chunk j: rank j's slice
    got = _AllToAll.apply(chunks.contiguous(), group)  # got[j] = my slice of rank j's heads
    return got.permute(1, 2, 0, 3, 4).reshape(b, full // n, n * hn, d)


def replicate_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    """(B, Hkv, s, D) -> (B, lcm(Hkv, N), s, D), each KV head repeated in place, so N divides
    the KV heads and query head i still meets KV head i // (H / Hkv) after the exchange."""
    hkv = x.shape[1]
    rep = math.lcm(hkv, n) // hkv
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


# -- the mask ------------------------------------------------------------------------------


def document_ids(position_ids: torch.Tensor) -> torch.Tensor | None:
    """(B, S) -> document index of each token (a new document wherever the position does
    not continue the previous one by 1), or None when every row is one document."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    if not bool(starts[:, 1:].any()):
        return None
    return starts.to(torch.int32).cumsum(dim=1)


def documents(local: torch.Tensor) -> torch.Tensor | None:
    """Document ids (B, S) of the whole sequence from this rank's position ids (B, S/N),
    or None for one document per row. The positions are gathered over the SP group once per
    forward: every layer passes the same tensor object (a recomputed checkpointed layer
    too), on every rank alike, so the cache hits and misses identically on all ranks."""
    if _state.cached_local is local:
        return _state.cached_docs
    full = local
    if _state.group is not None and _state.degree > 1:
        parts = [torch.empty_like(local) for _ in range(_state.degree)]
        dist.all_gather(parts, local.contiguous(), group=_state.group)
        full = torch.cat(parts, dim=1)
    _state.cached_local, _state.cached_docs, _state.cached_block_mask = local, document_ids(full), None
    return _state.cached_docs


def doc_attention(query, key, value, docs: torch.Tensor | None, scaling: float | None, gqa: bool) -> torch.Tensor:
    """Causal attention (B, H, S, D) -> (B, H, S, D) that never crosses a document (docs:
    (B, S) ids, or None for one document per row). Short sequences and the CPU use SDPA with
    a dense boolean mask; long packed ones on CUDA a FlexAttention block mask, which holds
    one entry per 128 x 128 tile instead of one per pair of tokens."""
    s = query.shape[2]
    if docs is None:
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=gqa)
    if s * s > DENSE_MASK_LIMIT and query.is_cuda:
        return _flex_doc_attention(query, key, value, docs, scaling, gqa)
    causal = torch.ones(s, s, dtype=torch.bool, device=query.device).tril()
    mask = (docs[:, None, :, None] == docs[:, None, None, :]) & causal
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=gqa)


_compiled_flex = None


def _flex_doc_attention(query, key, value, docs, scaling, gqa):
    global _compiled_flex
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    if _state.cached_block_mask is None or _state.cached_docs is not docs:

        b, _, s, _ = query.shape
        ids = docs.expand(b, -1)

        def doc_causal(bi, h, q, k):
            return (q >= k) & (ids[bi, q] == ids[bi, k])

        # compiled: the mask is evaluated tile by tile, never as S x S
        _state.cached_block_mask = create_block_mask(doc_causal, b, None, s, s, device=query.device, _compile=True)
        _state.cached_docs = docs
    return _compiled_flex(query, key, value, block_mask=_state.cached_block_mask, scale=scaling, enable_gqa=gqa)


# -- the transformers attention function ---------------------------------------------------


@torch.compiler.disable  # a compiled block runs up to here; the exchange and the attention kernel run eagerly
def ulysses_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """A transformers attention function: q (B, H, S/N, D), k/v (B, Hkv, S/N, D) for this
    rank's slice -> (attention output (B, S/N, H, D), None)."""
    if dropout:
        raise ShardwiseError("attention dropout is not supported with sequence parallelism; "
                             "set the model's attention_dropout to 0")
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        raise ShardwiseError("sequence-parallel attention needs position_ids (the loop always passes them)")
    docs = documents(position_ids)
    u, ug = _state.ulysses, _state.ulysses_group
    if u > 1:
        if key.shape[1] % u:
            key, value = replicate_kv(key, u), replicate_kv(value, u)
        query, key, value = (seq_to_heads(t, ug, u) for t in (query, key, value))
    if _state.ring is not None:  # this chunk's queries against the whole sequence, round the ring
        out = ring_attention(query, key, value, docs, _state.ring, scaling)
    else:
        out = doc_attention(query, key, value, docs, scaling, gqa=key.shape[1] != query.shape[1])
    out = out.transpose(1, 2)  # (B, S/R, H/U, D)
    if u > 1:
        out = heads_to_seq(out, ug, u)
    return out.contiguous(), None


def register() -> str:
    """Make NAME an attn_implementation transformers accepts (idempotent). No mask function
    is registered for it, so the model builds no mask of its own (it would cover only this
    rank's slice); the attention function builds the right one from the global positions."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, ulysses_attention)
    return NAME


def heads_of(hf_config) -> tuple[int, int]:
    """(attention heads, KV heads) of a transformers config."""
    text = getattr(hf_config, "text_config", None) or hf_config
    heads = getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None) or heads
    return heads, kv


def model_heads(model_dir: str) -> int | None:
    """The attention heads named in a model directory's config.json (None: none named, or no such
    file, as for the built-in random-init model), read without loading the model."""
    import json
    import os

    try:
        with open(os.path.join(model_dir, "config.json")) as fh:
            hf = json.load(fh)
    except (OSError, ValueError):
        return None
    return heads_of(types.SimpleNamespace(**hf.get("text_config", hf)))[0]


def check_degree(degree: int, heads: int | None, where: str = "sequence_parallel") -> None:
    """Ulysses needs the query heads divisible by the degree (KV heads are replicated)."""
    if degree > 1 and heads is not None and heads % degree:
        ok = [d for d in range(2, heads + 1) if heads % d == 0]
        raise ShardwiseError(f"{where}: Ulysses sequence parallelism splits the {heads} attention heads over "
                             f"{degree} ranks, which does not divide them; use a degree that divides {heads} "
                             f"({', '.join(map(str, ok[:8]))})")


def split_degree(degree: int, heads: int | None, mode: str = "ulysses") -> tuple[int, int]:
    """(Ulysses degree, ring degree) of a sequence-parallel degree: ulysses all Ulysses (the
    heads must divide by it), ring all ring, auto Ulysses for the largest degree the query
    heads allow (KV heads fewer are replicated, as in plain Ulysses) and ring for the rest."""
    if mode == "ring":
        return 1, degree
    if mode == "auto":
        u = math.gcd(heads, degree) if heads else degree
        return u, degree // u
    check_degree(degree, heads)
    return degree, 1


def configure(dims) -> tuple[int, int]:
    """Set this process's sequence-parallel attention from the run's mesh (strategies/parallel.py's
    ParallelDims): the whole group mesh["sp"], its Ulysses subgroup mesh["sp_ulysses"] and its ring
    mesh["sp_ring"]; the mesh is the one place the subgroups are made. Returns (Ulysses degree, ring
    degree)."""
    u, r = (dims.sp_ulysses, dims.sp_ring) if dims is not None and dims.sp > 1 else (1, 1)
    _state.group = dims.sp_group if u * r > 1 else None
    _state.degree, _state.ulysses = u * r, u
    _state.ulysses_group = dims.ulysses_group if u > 1 else None
    _state.ring = Ring(dims.ring_group) if r > 1 else None
    _state.cached_local = _state.cached_docs = _state.cached_block_mask = None
    return u, r


def describe_split(u: int, r: int, heads: int | None) -> str:
    if r == 1:
        return f"Ulysses over {u} ranks ({heads} heads -> {heads // u} per rank)"
    if u == 1:
        return f"ring attention over {r} ranks"
    return f"Ulysses over {u} ranks ({heads} heads -> {heads // u} per rank) x ring attention over {r}"


def apply_sequence_parallel(model, dims, mode: str = "ulysses") -> str:
    """Route the model's attention through `ulysses_attention` over the sequence group of `dims`
    (the run's ParallelDims; None: one rank), split into Ulysses and ring as the mesh is
    (ParallelDims.from_config took `mode`'s split_degree; checked here against the model's heads,
    per tensor-parallel rank). Returns a line saying what was done. Degree 1 with packing still
    helps: long packed sequences get a block mask instead of a dense one."""
    heads, _kv = heads_of(model.config)
    degree, tp = (dims.sp, dims.tp) if dims is not None else (1, 1)
    local = heads // tp if heads else heads
    if degree > 1 and split_degree(degree, local, mode) != (dims.sp_ulysses, dims.sp_ring):
        raise ShardwiseError(f"sequence_parallel {degree}: the mesh splits it as Ulysses {dims.sp_ulysses} x ring "
                             f"{dims.sp_ring}, but --sp-mode {mode} with the model's {local} heads per rank gives "
                             f"{split_degree(degree, local, mode)}; build the ParallelDims with the model's heads")
    u, r = configure(dims)
    heads = local
    register()
    model.set_attn_implementation(NAME)
    dropout = getattr(model.config, "attention_dropout", 0.0) or 0.0
    if dropout and model.training:
        raise ShardwiseError(f"the model's attention_dropout is {dropout}; sequence-parallel attention runs "
                             "without dropout: set attention_dropout 0 in its config.json")
    return ("sequence parallel: " + describe_split(u, r, heads)
            if degree > 1 else "attention: document-masked (packed sequences)")
