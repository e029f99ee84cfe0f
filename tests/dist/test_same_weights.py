"""The article's pitfall: ranks must start from identical weights."""

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, seed_by_rank: bool, q) -> None:
    from shardwise.strategies.base import DistEnv
    from shardwise.train.dist import ensure_same_weights

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(rank if seed_by_rank else 0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    env = DistEnv(rank, 2, rank, 2, torch.device("cpu"), "gloo")
    fixed = ensure_same_weights(model, env)
    flat = torch.cat([p.detach().flatten() for p in model.state_dict().values()])
    gathered = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(gathered, flat)
    q.put((rank, fixed, torch.equal(gathered[0], gathered[1])))
    dist.destroy_process_group()


def _run(seed_by_rank: bool):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    mp.start_processes(_worker, args=(_port(), seed_by_rank, q), nprocs=2, start_method="spawn")
    return sorted(q.get() for _ in range(2))


def test_different_initial_weights_are_detected_and_broadcast():
    assert _run(seed_by_rank=True) == [(0, True, True), (1, True, True)]


def test_identical_weights_are_left_alone():
    assert _run(seed_by_rank=False) == [(0, False, True), (1, False, True)]
