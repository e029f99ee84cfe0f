"""DeepSpeed takes its process groups from the run's one device mesh (strategies/ds_mpu.py), not groups of its own.

On a real 2-rank gloo group (torch.multiprocessing), real DeepSpeed, the tiny HF model, through shardwise's own
path (load_config -> build_model -> DeepSpeedStrategy.setup -> deepspeed.initialize(mpu=MeshGroups(dims))), for
ZeRO-1, -2 and -3 and ZeRO-3 with sequence parallelism 2 (data-parallel degree 1: the sequence ranks are the
ranks gradients are averaged over): the engine's data-parallel group, the group it broadcasts the weights and
averages gradients over, ZeRO's partitioning group (per parameter group at stages 1/2, per parameter at stage 3)
and the group the gradient norm is summed over are the very group objects dims holds (`is`, not only the same
ranks), and DeepSpeed made no group (without an mpu it clones the world group into groups._WORLD_GROUP).
Same numbers as before: tests/dist/test_parity.py (zero*) and test_sequence_parallel.py (zero3-from-single).
"""

import importlib.util
import json
import os

import pytest
import torch
import torch.multiprocessing as mp

from tests.helpers import forked_ranks

# (find_spec: importing DeepSpeed here would cost every process that imports this module seconds)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")

CASES = {
    "zero1": {"strategy": "zero1"},
    "zero2": {"strategy": "zero2"},
    "zero3": {"strategy": "zero3"},
    "zero3/sp2": {"strategy": "zero3", "sequence_parallel": 2},
}


def _groups_of(rank, world, model_dir, flags) -> dict:
    import deepspeed.utils.groups as ds_groups
    import torch.distributed as dist

    from shardwise import strategies
    from shardwise.config import load_config
    from shardwise.launch.preflight import resolve_runtime
    from shardwise.strategies.base import DistEnv
    from shardwise.strategies.ds_mpu import MeshGroups
    from shardwise.train.loop import build_model

    over = {"model": model_dir, "nproc_per_node": world, **flags}
    cfg = resolve_runtime(load_config(None, {k: (v, "test") for k, v in over.items()}))
    env = DistEnv(rank, world, rank, world, torch.device("cpu"), "gloo")
    strategy = strategies.get(cfg.strategy)(cfg, env)
    model, _ = strategy.setup(build_model(cfg, model_dir))
    dims, zero = strategy.dims, model.optimizer
    grad, tp = dims.grad_group, dims.tp_group
    if cfg.deepspeed.stage == 3:
        partition = [p.ds_process_group for p in model.module.parameters()]
    else:
        partition = list(zero.real_dp_process_group)
    report = {
        "mpu_is_the_runs_dims": isinstance(model.mpu, MeshGroups) and model.mpu.dims is dims,
        "data_parallel_group": model.data_parallel_group is grad,
        "seq_data_parallel_group": model.seq_data_parallel_group is grad,  # broadcast, gradient reduction
        "zero_dp_process_group": zero.dp_process_group is grad,
        "zero_partition_groups": bool(partition) and all(g is grad for g in partition),
        "zero_model_parallel_group": zero.model_parallel_group is tp,
        "deepspeed_made_no_world_clone": ds_groups._WORLD_GROUP is None,
        "dp_world_size": model.dp_world_size,
        "grad_size": dims.grad_size,
        "grad_ranks": dist.get_process_group_ranks(grad),
        "tp_ranks": dist.get_process_group_ranks(tp),
        "model_parallel_world_size": model.mp_world_size,
        "sequence_parallel_size": model.sequence_parallel_size,
    }
    return report


def _worker(rank, world, init_file, model_dir, out_dir):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", DS_ACCELERATOR="cpu")
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    reports = {name: _groups_of(rank, world, model_dir, flags) for name, flags in CASES.items()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(reports, fh)
    dist.destroy_process_group()


def test_deepspeed_takes_the_meshs_groups(tmp_path, tiny_dir):
    with forked_ranks("tests.dist.test_deepspeed_groups", "shardwise.strategies", "shardwise.train.loop"):
        mp.start_processes(_worker, args=(2, str(tmp_path / "init"), tiny_dir, str(tmp_path)),
                           nprocs=2, start_method="forkserver")
    for rank in range(2):
        reports = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert set(reports) == set(CASES)
        for case, r in reports.items():
            where = f"rank {rank}, {case}: {r}"
            for key in ("mpu_is_the_runs_dims", "data_parallel_group", "seq_data_parallel_group",
                        "zero_dp_process_group", "zero_partition_groups", "zero_model_parallel_group",
                        "deepspeed_made_no_world_clone"):
                assert r[key] is True, f"{key}: {where}"
            # both ranks average gradients (with sp 2 they are the sequence ranks); tp is this rank alone
            assert r["grad_ranks"] == [0, 1] and r["dp_world_size"] == r["grad_size"] == 2, where
            assert r["tp_ranks"] == [rank] and r["model_parallel_world_size"] == 1, where
            # DeepSpeed's own sequence parallelism stays off: it would average gradients over dp, not dp x sp
            assert r["sequence_parallel_size"] == 1, where
