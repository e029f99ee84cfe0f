"""The article's pitfall: ranks must start from identical weights."""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers import forked_ranks



def _worker(rank: int, init_file: str, seed_by_rank: bool, q) -> None:
    from shardwise.strategies.base import DistEnv
    from shardwise.train.dist import ensure_same_weights

    # a file rendezvous: no port to pick, so nothing another test's processes could take first
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    torch.manual_seed(rank if seed_by_rank else 0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    env = DistEnv(rank, 2, rank, 2, torch.device("cpu"), "gloo")
    fixed = ensure_same_weights(model, env)
    flat = torch.cat([p.detach().flatten() for p in model.state_dict().values()])
    gathered = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(gathered, flat)
    q.put((rank, fixed, torch.equal(gathered[0], gathered[1])))
    dist.destroy_process_group()


def _run(tmp_path, seed_by_rank: bool):
    with forked_ranks("tests.dist.test_same_weights", "shardwise.train.dist") as ctx:
        q = ctx.Queue()
        mp.start_processes(_worker, args=(str(tmp_path / "init"), seed_by_rank, q), nprocs=2, start_method="forkserver")
    return sorted(q.get(timeout=60) for _ in range(2))


def test_different_initial_weights_are_detected_and_broadcast(tmp_path):
    assert _run(tmp_path, seed_by_rank=True) == [(0, True, True), (1, True, True)]


def test_identical_weights_are_left_alone(tmp_path):
    assert _run(tmp_path, seed_by_rank=False) == [(0, False, True), (1, False, True)]
