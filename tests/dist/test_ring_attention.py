"""Ring attention (and the Ulysses x ring split of --sp-mode auto) on real gloo ranks, as the
attention function the model calls: each rank holds its contiguous slice of q, k, v; the
output slice and the gradients of q, k and v (each rank's own slice) equal plain SDPA over
the whole sequence in one process, for causal rows, packed rows whose documents straddle the
ranks' chunks, GQA and a single KV head. The whole training path is in
test_sequence_parallel.py (ring with packing through the CLI).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers import forked_ranks

B, S, D = 2, 48, 8


def _positions(packed: bool) -> torch.Tensor:
    if not packed:
        return torch.arange(S).repeat(B, 1)
    # row 0: documents of 5, 30 and 13 tokens (the long one spans every chunk of 4 ranks);
    # row 1: 24 and 24 (a boundary exactly on the 2-rank split)
    return torch.stack([torch.cat([torch.arange(5), torch.arange(30), torch.arange(13)]),
                        torch.cat([torch.arange(24), torch.arange(24)])])


_meshes: dict = {}


def _dims(rank: int, world: int, ulysses: int):
    """The run's mesh as the trainer builds it: one sequence group of the whole world, split into
    ring x Ulysses (the attention takes its three groups from it); one per split, reused."""
    from shardwise.strategies.parallel import ParallelDims

    if ulysses not in _meshes:
        _meshes[ulysses] = ParallelDims(1, 1, world, 1, world_size=world, rank=rank, sp_ulysses=ulysses)
    return _meshes[ulysses]


def _case(rank: int, world: int, heads: int, kv: int, packed: bool, mode: str) -> tuple[bool, ...]:
    from shardwise.models import sequence_parallel as sp

    g = torch.Generator().manual_seed(heads * 10 + kv + packed)
    q, k, v = (torch.randn(B, h, S, D, generator=g) for h in (heads, kv, kv))
    w = torch.randn(B, S, heads, D, generator=g)  # the loss weights every output element differently
    pos = _positions(packed)

    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = sp.doc_attention(*full, sp.document_ids(pos), None, gqa=kv != heads).transpose(1, 2)
    (ref * w).sum().backward()

    sp.configure(_dims(rank, world, sp.split_degree(world, heads, mode)[0]))
    part = slice(rank * S // world, (rank + 1) * S // world)
    mine = [t[:, :, part].clone().requires_grad_() for t in (q, k, v)]
    out, _ = sp.ulysses_attention(None, *mine, None, position_ids=pos[:, part].clone())
    (out * w[:, part]).sum().backward()
    close = [torch.allclose(out, ref[:, part], rtol=1e-5, atol=1e-5)]
    close += [torch.allclose(m.grad, f.grad[:, :, part], rtol=1e-4, atol=1e-5) for m, f in zip(mine, full)]
    return tuple(close)


def _worker(rank: int, world: int, init_file: str, cases, q) -> None:
    # a file rendezvous: no port to pick, so nothing another test's processes could take first
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    q.put((rank, {c: _case(rank, world, *c) for c in cases}))
    dist.destroy_process_group()


def _spawn(tmp_path, world: int, cases) -> None:
    with forked_ranks("tests.dist.test_ring_attention", "shardwise.models.sequence_parallel") as ctx:
        q = ctx.Queue()
        mp.start_processes(_worker, args=(world, str(tmp_path / "init"), cases, q),
                           nprocs=world, start_method="forkserver")
    for _ in range(world):
        rank, results = q.get(timeout=120)
        for case, close in results.items():
            assert all(close), (rank, case, "output, dq, dk, dv close:", close)


def test_ring_attention_on_two_ranks_matches_sdpa(tmp_path):
    # (heads, kv heads, packed, mode)
    _spawn(tmp_path, 2, [(4, 2, False, "ring"), (4, 2, True, "ring"), (4, 1, True, "ring"), (4, 4, False, "ring")])


def test_ring_of_four_and_ulysses_times_ring_match_sdpa(tmp_path):
    """Four ranks: a ring of 4 (chunks two hops away, blocks skipped by causality), and auto
    with 2 heads = Ulysses 2 x ring 2 (the 2-D split inside the group; 1 KV head replicated)."""
    from shardwise.models.sequence_parallel import split_degree

    assert split_degree(4, 2, "auto") == (2, 2) and split_degree(4, 4, "auto") == (4, 1)
    _spawn(tmp_path, 4, [(2, 1, True, "ring"), (2, 2, False, "auto"), (2, 1, True, "auto")])
