"""The run's one device mesh on a real 2-rank gloo group: its named dimensions, the groups
strategies read from it, and the sampler reading the data-parallel rank and degree from it
(not the world rank). A sequence-parallel layout (sp = 2, built directly: the config still
refuses it) must give both ranks the same batch, where pure data parallelism splits it."""

import json
import os

import torch
import torch.multiprocessing as mp

from tests.helpers import forked_ranks


def _sampled_rows(dims) -> list[list[int]]:
    """The token rows this rank's sampler hands it at step 1, read with dims' rank and degree."""
    from shardwise.data.batches import DataPosition, StepSampler
    from shardwise.data.encode import Encoded

    rows = [[i + 1] * 8 for i in range(16)]
    data = Encoded(rows, rows, [list(range(8))] * 16, [""] * 16)
    sampler = StepSampler(data, 2, 1, dims.dp_size, dims.dp_rank, 0, 0)
    batch, _ = sampler.next(DataPosition())
    return [mb.input_ids[:, 0].tolist() for mb in batch.micro]


def _worker(rank, init_file, out_dir):
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    from shardwise import strategies
    from shardwise.config import load_config
    from shardwise.strategies.parallel import ParallelDims
    from shardwise.train import dist as sdist

    env = sdist.init_distributed()  # joins the group above
    res = {}
    for preset in ("ddp", "fsdp"):
        cfg = load_config(None, {"strategy": (preset, "test"), "nproc_per_node": (2, "test")}).cfg
        dims = strategies.get(preset).parallel_dims(cfg, env)
        mesh = dims.mesh
        total = torch.tensor([float(rank + 1)])
        dist.all_reduce(total, group=dims.dp_group)
        res[preset] = {"names": list(mesh.mesh_dim_names), "shape": list(mesh.shape),
                       "dp": [dims.dp_size, dims.dp_rank], "sp_group": dist.get_world_size(dims.sp_group),
                       "dp_sum": total.item(), "rows": _sampled_rows(dims)}
        if preset == "fsdp":  # the mesh FSDP shards over
            res[preset].update(shard_mesh=list(dims.dp_shard_mesh.shape),
                               shard_rank=dims.dp_shard_mesh.get_local_rank())
    sp = ParallelDims(1, 1, 2, 1, world_size=2, rank=rank)
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total, group=sp.dp_group)  # a group of one: nothing added
    seq = torch.tensor([float(rank + 1)])
    dist.all_reduce(seq, group=sp.sp_group)
    res["sp2"] = {"dp": [sp.dp_size, sp.dp_rank], "sp_rank": [sp.sp_rank, sp.mesh["sp"].get_local_rank()],
                  "sp_group": dist.get_world_size(sp.sp_group), "dp_sum": total.item(), "sp_sum": seq.item(),
                  "rows": _sampled_rows(sp)}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(res, fh)
    dist.destroy_process_group()


def test_one_mesh_gives_groups_ranks_and_the_samplers_share(tmp_path):
    with forked_ranks("tests.dist.test_mesh", "shardwise.strategies", "shardwise.train.dist"):
        mp.start_processes(_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, start_method="forkserver")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, r in enumerate(ranks):
        for preset, shape in (("ddp", [2, 1, 1, 1, 1]), ("fsdp", [1, 2, 1, 1, 1])):
            got = r[preset]
            assert got["names"] == ["dp_replicate", "dp_shard", "sp_ring", "sp_ulysses", "tp"] and got["shape"] == shape
            assert got["dp"] == [2, rank] and got["dp_sum"] == 3.0 and got["sp_group"] == 1
        assert r["fsdp"]["shard_mesh"] == [2] and r["fsdp"]["shard_rank"] == rank
        # sequence peers: one data-parallel rank, so nothing to average over it; the sp group is both ranks
        assert r["sp2"]["dp"] == [1, 0] and r["sp2"]["sp_rank"] == [rank, rank]
        assert r["sp2"]["sp_group"] == 2 and r["sp2"]["sp_sum"] == 3.0 and r["sp2"]["dp_sum"] == rank + 1
    # data parallel: the two ranks read disjoint halves of the global batch; sequence parallel: the same rows
    for preset in ("ddp", "fsdp"):
        a, b = (sum(r[preset]["rows"], []) for r in ranks)
        assert len(a) == len(b) == 2 and not set(a) & set(b)
    a, b = (sum(r["sp2"]["rows"], []) for r in ranks)
    assert a == b and len(a) == 2
