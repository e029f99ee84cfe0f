"""The host gradient norm (strategies/gradnorm.py) on real gloo ranks: DTensor gradients sharded over a 1-D mesh,
over one dimension of a 2-D mesh, replicated, strided (FSDP2 around TP) with a rank holding no rows, and plain
tensors beside them give the norm of the full gradients (float64 reference) and torch's DTensor norm; the clip scales
every rank's shard by the same coefficient. And one host tensor's square sum is as exact as float64 says, where
torch's single reduction is not."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers import forked_ranks

# sizes: a small tensor (torch's foreach norm); two whose shards reach the rows' threshold (gradnorm.SMALL), one
# with elements left over after its rows of 4,096, one that splits evenly
SIZES = [(6, 5), (2063, 1021), (2048, 1024)]


def _full_grads() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randn(*s, generator=g) * (i + 1) for i, s in enumerate(SIZES)]


def _case(rank: int, world: int, layout: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from shardwise.strategies.gradnorm import host_grad_norm, scale_grads_

    full = _full_grads()
    if layout == "1d":
        mesh = init_device_mesh("cpu", (world,))
        grads = [distribute_tensor(t, mesh, [Shard(0)]) for t in full[1:]] + [full[0].clone()]  # a plain one beside
    elif layout == "2d-shard-inner":
        mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("rep", "shard"))
        grads = [distribute_tensor(t, mesh, [Replicate(), Shard(0)]) for t in full]
    elif layout == "2d-shard-outer-and-replicated":
        mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("shard", "rep"))
        grads = [distribute_tensor(full[0].clone(), mesh, [Replicate(), Replicate()])]  # counted once, not world times
        grads += [distribute_tensor(t, mesh, [Shard(0), Replicate()]) for t in full[1:]]
    elif layout == "strided-and-an-empty-shard":
        # FSDP2 around tensor parallelism shards a TP Shard(0) weight's dp dimension as _StridedShard (whose
        # is_shard() is False); and FSDP's uneven sharding leaves a rank no rows (here rank 1 of a 1-row tensor)
        mesh = init_device_mesh("cpu", (world,))
        grads = [distribute_tensor(full[1], mesh, [Shard(0)]),
                 distribute_tensor(full[2], mesh, [_StridedShard(0, split_factor=2)])]
        grads += [distribute_tensor(full[0].reshape(1, -1), mesh, [Shard(0)])]
    else:
        raise ValueError(layout)
    want = torch.linalg.vector_norm(torch.cat([t.double().reshape(-1) for t in full]))
    # torch's own norm, one per mesh (it takes no mix), combined: base.Strategy.clip_grad_norm's GPU path
    meshes: dict = {}
    for t in grads:
        meshes.setdefault(getattr(t, "device_mesh", None), []).append(t)
    norms = [torch.nn.utils.get_total_norm(ts, foreach=True) for ts in meshes.values()]
    torch_norm = torch.linalg.vector_norm(torch.stack([n.full_tensor() if hasattr(n, "full_tensor") else n
                                                      for n in norms]))
    norm = host_grad_norm(grads)
    out = {"norm": float(norm), "want": float(want), "torch": float(torch_norm), "device": str(norm.device),
           "dtype": str(norm.dtype)}
    max_norm = float(want) / 4  # the clip fires: every gradient times about 1/4
    scale_grads_(grads, norm, max_norm)
    coef = max_norm / (float(norm) + 1e-6)
    # each rank's shard against the same shard of the scaled full gradient (no full_tensor: torch 2.11 cannot
    # redistribute a _StridedShard there)
    def scaled_shard(g, t):
        if not hasattr(g, "device_mesh"):
            return t * coef
        return distribute_tensor(t.reshape(g.shape) * coef, g.device_mesh, g.placements).to_local()

    out["clipped"] = all(
        torch.allclose(g.to_local() if hasattr(g, "to_local") else g, scaled_shard(g, t), rtol=1e-6, atol=1e-7)
        for g, t in zip(grads, full if layout.startswith("2d") else full[1:] + full[:1]))
    return out


def _worker(rank: int, world: int, init_file: str, layouts, q) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        q.put((rank, {lay: _case(rank, world, lay) for lay in layouts}))
    finally:
        dist.destroy_process_group()


def test_host_grad_norm_on_two_gloo_ranks_equals_the_full_gradients_norm(tmp_path):
    layouts = ["1d", "2d-shard-inner", "2d-shard-outer-and-replicated", "strided-and-an-empty-shard"]
    with forked_ranks("tests.dist.test_gradnorm", "shardwise.strategies.gradnorm") as ctx:
        q = ctx.Queue()
        mp.start_processes(_worker, args=(2, str(tmp_path / "init"), layouts, q), nprocs=2, start_method="forkserver")
    for _ in range(2):
        rank, results = q.get(timeout=120)
        for lay, r in results.items():
            assert abs(r["norm"] - r["want"]) <= 1e-6 * r["want"], (rank, lay, r)
            assert abs(r["torch"] - r["want"]) <= 1e-4 * r["want"], (rank, lay, r)  # the same semantics as torch's
            assert r["device"] == "cpu" and r["dtype"] == "torch.float32", (rank, lay, r)
            assert r["clipped"], (rank, lay, r)


def test_square_sum_of_a_large_host_tensor_is_as_exact_as_float64():
    from shardwise.strategies.gradnorm import ROW, square_sum

    g = torch.Generator().manual_seed(0)
    for n in (5, 2 * ROW - 1, 2 * ROW, 4_000_037):  # one reduction; the rows, even and with elements left over
        t = torch.randn(n, generator=g) + 0.5  # a mean: a long float32 running sum drifts
        want = float(t.double().square().sum())
        assert abs(float(square_sum(t)) - want) <= 1e-6 * want, n
    strided = torch.randn(3000, 40, generator=g)[:, ::2]  # not contiguous: measured in place, no copy
    assert abs(float(square_sum(strided)) - float(strided.double().square().sum())) <= 1e-6 * float(
        strided.double().square().sum())


def test_bf16_host_gradients_give_a_float32_norm():
    from shardwise.strategies.gradnorm import host_grad_norm

    g = torch.Generator().manual_seed(1)
    from shardwise.strategies.gradnorm import SMALL

    grads = [torch.randn(SMALL + 4099, generator=g).bfloat16(), torch.randn(7, generator=g).bfloat16()]  # rows; one
    norm = host_grad_norm(grads)
    want = torch.linalg.vector_norm(torch.cat([t.double() for t in grads]))
    assert norm.dtype == torch.float32 and abs(float(norm) - float(want)) <= 1e-6 * float(want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_host_grad_norm_leaves_accelerator_gradients_to_torch():
    from shardwise.strategies.gradnorm import host_grad_norm

    assert host_grad_norm([torch.ones(3, device="cuda")]) is None
    assert float(host_grad_norm([torch.ones(3, device="cuda"), torch.ones(1)])) == 2.0
