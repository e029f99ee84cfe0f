"""Ring attention over a group of N ranks, each holding a contiguous 1/N chunk of the
sequence (torch's `context_parallel` dispatches only the CUDA SDPA kernels and takes no mask,
so packed documents could not keep their boundaries; this one is ours, in plain torch).

Each rank keeps its query chunk and passes its key/value chunk around the ring (P2P
isend/irecv, which gloo and NCCL both have; the next chunk travels while the current one is
computed). Rank r meets the chunks r, r-1, ..., r-N+1 in turn and merges the partial results
by log-sum-exp (online softmax). Causal per block: its own chunk causally, earlier ranks'
chunks in full, later ranks' chunks not at all (skipped, but still passed on). Packed
documents: the block's mask also requires the query and key to be in the same document
(document ids of the whole sequence, models/sequence_parallel.py), so no token attends
across a boundary, whichever ranks the documents straddle.

Backward is its own ring pass (a custom autograd.Function): only the rank's q, k, v, output
and log-sum-exp are kept from the forward (O(chunk) memory, as flash attention), the scores
are recomputed block by block, and each key/value chunk travels round the ring again with
its gradient accumulators, arriving home after N hops with every rank's contribution.

The block kernel is exact math in fp32 (matmul, masked softmax), processed in query-row
pieces so that one piece's scores stay under ~256 MiB; it runs anywhere (the CPU tests run
the same code as CUDA), but is not a fused kernel. Load balancing: none; with the
contiguous split rank r computes r + 1/2 blocks' worth of causal work, so the last rank of
the ring does most of it (zig-zag sharding would even it out; not done).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

SCORE_BYTES = 256 << 20  # the fp32 scores of one query-row piece of one block stay under this


class Ring:
    """This rank's place in a ring over `group`: its index and its neighbours' global ranks."""

    def __init__(self, group):
        ranks = dist.get_process_group_ranks(group)
        self.group, self.n, self.index = group, len(ranks), dist.get_rank(group)
        self.next, self.prev = ranks[(self.index + 1) % self.n], ranks[(self.index - 1) % self.n]

    def shift(self, tensors: list[torch.Tensor]):
        """Start sending `tensors` to the next rank and receiving the previous rank's; returns
        (the receive buffers, a wait function)."""
        tensors = [t.contiguous() for t in tensors]
        bufs = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, b, self.prev, self.group) for b in bufs]
        reqs = dist.batch_isend_irecv(ops)

        def wait():
            for r in reqs:
                r.wait()
            return bufs

        return wait


# -- one block: queries of this rank's chunk against one key/value chunk --------------------


def _mask(docs, qi: int, kj: int, c: int, rows: slice, device) -> torch.Tensor | None:
    """(B, 1, 1, rows, c) bool, True where a query of chunk qi (rows of it) may see a key of chunk
    kj; None for all. Causal inside the own chunk; the same document when docs is given."""
    m = None
    if qi == kj:
        q = torch.arange(rows.start, rows.stop, device=device)[:, None]
        m = (q >= torch.arange(c, device=device)[None, :])[None, None, None]
    if docs is not None:
        dq = docs[:, qi * c + rows.start: qi * c + rows.stop]
        dk = docs[:, kj * c: (kj + 1) * c]
        same = (dq[:, :, None] == dk[:, None, :])[:, None, None]
        m = same if m is None else m & same
    return m


def _pieces(q5: torch.Tensor, c: int):
    b, hkv, rep, sq, _ = q5.shape
    step = max(1, SCORE_BYTES // (4 * b * hkv * rep * c))
    return [slice(i, min(i + step, sq)) for i in range(0, sq, step)]


def _scores(q5, k, rows, mask, scale):
    s = torch.matmul(q5[:, :, :, rows], k[:, :, None].transpose(-1, -2)) * scale  # (B, Hkv, rep, rows, c)
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def _block_forward(q5, k, v, docs, qi, kj, scale):
    """(out (B, Hkv, rep, sq, D), lse (B, Hkv, rep, sq)) of q against one chunk, fp32; rows
    that see no key of the chunk have lse -inf and out 0."""
    c = k.shape[2]
    outs, lses = [], []
    for rows in _pieces(q5, c):
        s = _scores(q5, k, rows, _mask(docs, qi, kj, c, rows, q5.device), scale)
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])  # masked -> 0
        outs.append(torch.matmul(p, v[:, :, None]))
        lses.append(lse)
    return torch.cat(outs, dim=3), torch.cat(lses, dim=3)


def _block_backward(q5, k, v, out, lse, dout, delta, docs, qi, kj, scale):
    """Gradients of q (this block's share), k and v of one chunk, given the *final* output and
    log-sum-exp of the whole row (so p is the row's true softmax restricted to the block)."""
    c = k.shape[2]
    dq = torch.zeros_like(q5)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for rows in _pieces(q5, c):
        s = _scores(q5, k, rows, _mask(docs, qi, kj, c, rows, q5.device), scale)
        p = torch.exp(s - lse[:, :, :, rows, None])  # (B, Hkv, rep, rows, c)
        do = dout[:, :, :, rows]
        dv += torch.matmul(p.transpose(-1, -2), do).sum(2)
        dp = torch.matmul(do, v[:, :, None].transpose(-1, -2))
        ds = p * (dp - delta[:, :, :, rows, None]) * scale
        dq[:, :, :, rows] = torch.matmul(ds, k[:, :, None])
        dk += torch.matmul(ds.transpose(-1, -2), q5[:, :, :, rows]).sum(2)
    return dq, dk, dv


def _merge(out, lse, blk_out, blk_lse):
    """Online softmax: combine two partial results of the same rows (lse finite on the left)."""
    new = torch.logaddexp(lse, blk_lse)
    return out * torch.exp(lse - new)[..., None] + blk_out * torch.exp(blk_lse - new)[..., None], new


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, docs, ring: Ring, scale: float):
        b, h, c, d = q.shape
        hkv = k.shape[1]
        me, n = ring.index, ring.n
        q5 = q.float().reshape(b, hkv, h // hkv, c, d)
        kv = [k.float(), v.float()]
        out = lse = None
        for t in range(n):
            j = (me - t) % n
            wait = ring.shift(kv) if t < n - 1 else None  # the next chunk travels meanwhile
            if j <= me:  # later ranks' chunks are all in the future: skipped
                bo, bl = _block_forward(q5, kv[0], kv[1], docs, me, j, scale)
                out, lse = (bo, bl) if out is None else _merge(out, lse, bo, bl)  # own chunk first: lse finite
            if wait is not None:
                kv = wait()
        ctx.save_for_backward(q, k, v, out, lse, docs)
        ctx.ring, ctx.scale = ring, scale
        return out.reshape(b, h, c, d).to(q.dtype)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, docs = ctx.saved_tensors
        ring, scale = ctx.ring, ctx.scale
        b, h, c, d = q.shape
        hkv = k.shape[1]
        me, n = ring.index, ring.n
        q5 = q.float().reshape(b, hkv, h // hkv, c, d)
        dout = grad.float().reshape(b, hkv, h // hkv, c, d)
        delta = (dout * out).sum(-1)
        dq = torch.zeros_like(q5)
        kv = [k.float(), v.float()]
        dkv = [torch.zeros_like(kv[0]), torch.zeros_like(kv[1])]
        for t in range(n):
            j = (me - t) % n
            wait_kv = ring.shift(kv) if t < n - 1 else None
            if j <= me:
                bq, bk, bv = _block_backward(q5, kv[0], kv[1], out, lse, dout, delta, docs, me, j, scale)
                dq += bq
                dkv[0] += bk
                dkv[1] += bv
            if wait_kv is not None:
                kv = wait_kv()
            # chunk j's gradient moves on after it (one exchange in flight at a time, so the
            # equal-shaped k and dk cannot be matched the wrong way round); after N hops it is
            # back at rank j with every rank's contribution
            dkv = ring.shift(dkv)()
        return dq.view(b, h, c, d).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(query, key, value, docs, ring: Ring, scale: float | None = None) -> torch.Tensor:
    """Causal attention of this rank's chunk: q (B, H, c, D), k/v (B, Hkv, c, D) with Hkv
    dividing H, chunk `ring.index` of a sequence of ring.n * c tokens; docs: (B, n * c)
    document ids of the whole sequence, or None for one document per row. -> (B, H, c, D)."""
    if scale is None:
        scale = query.shape[-1] ** -0.5
    if docs is not None:
        docs = docs.expand(query.shape[0], -1)
    return _RingAttention.apply(query, key, value, docs, ring, float(scale))
