"""Process-group setup and the small collectives the loop needs."""

from __future__ import annotations

import errno
import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from shardwise.errors import ShardwiseError
from shardwise.strategies.base import DistEnv


def init_distributed(timeout_s: float = 1800.0, host_collectives: bool = False) -> DistEnv:
    """Join the process group torchrun's agent prepared (RANK, WORLD_SIZE, MASTER_ADDR ...),
    or make a one-rank group in this process. NCCL with one GPU per rank when CUDA is
    available, gloo otherwise. `host_collectives` (FSDP's CPU offload on GPUs): gloo beside NCCL
    in the same group, for the collectives torch runs on host DTensors (their shards live on the
    CPU; NCCL takes none), as torchtune and torchtitan do there."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    cuda = torch.cuda.is_available()
    backend = ("cpu:gloo,cuda:nccl" if host_collectives else "nccl") if cuda else "gloo"
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        if "MASTER_ADDR" in os.environ:
            kw = {"device_id": device} if cuda else {}
            store = worker_store(rank, world, timeout, other_hosts=world > local_world)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout, **kw)
        else:
            keep_on_loopback()
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return DistEnv(rank, world, local_rank, local_world, device, backend)


def keep_on_loopback() -> None:
    """A group of one rank in this process: no other rank will ever connect, yet gloo's device (and NCCL's
    bootstrap) listen on the address the host name resolves to, which on many machines is a network address.
    Point both at the loopback interface, as the launcher does for a one-node group (launch.agent.loopback_only); a
    GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME of the user's own is kept. Set for the rest of the process (and what it
    starts): NCCL reads it when it makes its communicator, at the first collective, not in init_process_group."""
    try:
        names = {name for _, name in socket.if_nameindex()}
    except OSError:
        return
    lo = next((n for n in ("lo", "lo0") if n in names), None)  # Linux, macOS
    if lo:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", lo)


def tcp_store(host: str, port: int, is_master: bool, timeout: timedelta, other_hosts: bool = False,
              **kw) -> dist.TCPStore:
    """A TCPStore whose server listens on `host`'s address only. torch's binds every
    interface; here the listening socket is made and bound first, then handed over. With
    `other_hosts` (ranks on other machines) a host name that resolves to a loopback address
    here (a common /etc/hosts entry) cannot serve them: then every interface, as torch does."""
    if not is_master:
        wait_reachable(host, port, timeout)
        return dist.TCPStore(host, port, is_master=False, timeout=timeout, **kw)
    family, kind, proto, _, addr = _address(host, port)
    if other_hosts and addr[0].startswith(("127.", "::1")):
        family, addr = socket.AF_INET, ("0.0.0.0", port)
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise PortInUse(f"port {port} on {host} is in use by another program: choose another port") from None
            if e.errno == errno.EADDRNOTAVAIL:
                raise StoreUnreachable(f"{host} is not an address of this machine, so it cannot serve the store "
                                       f"on it: give this machine's own address") from None
            raise
        sock.listen(socket.SOMAXCONN)
        port = sock.getsockname()[1]
        store = dist.TCPStore(host, port, is_master=True, timeout=timeout, master_listen_fd=sock.fileno(), **kw)
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the descriptor now
    return store


class PortInUse(ShardwiseError):
    """The store's port is taken on this machine."""


class StoreUnreachable(ShardwiseError):
    """No store answers at the address (or the address is not one of this machine's, for the one that serves it)."""


def _address(host: str, port: int) -> tuple:
    try:
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror:
        raise StoreUnreachable(f"cannot resolve the host name {host!r}: check the address") from None


def wait_reachable(host: str, port: int, timeout: timedelta) -> None:
    """Wait until something listens at host:port, for at most `timeout`. torch's own client would wait as long,
    then fail with a C++ stack dump; probed here, a store that never comes is one line. A store that comes later
    (node 0 started after this one) is waited for, as torchrun waits for it."""
    *_, addr = _address(host, port)
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        left = deadline - time.monotonic()
        try:
            socket.create_connection(addr[:2], timeout=max(0.1, min(5.0, left))).close()
            return
        except OSError:
            if time.monotonic() >= deadline:
                raise StoreUnreachable(f"nothing answered at {host}:{port} within {timeout.total_seconds():.0f} s")
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


def worker_store(rank: int, world: int, timeout: timedelta, other_hosts: bool = False) -> dist.Store:
    """The store at MASTER_ADDR:MASTER_PORT that torchrun's agent prepared: rank 0 serves it
    (listening on MASTER_ADDR only), unless the agent shares its own rendezvous store."""
    agent_serves = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = tcp_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=rank == 0 and not agent_serves,
                      world_size=world, timeout=timeout, other_hosts=other_hosts)
    if agent_serves:  # one key space per attempt, as torch's env:// rendezvous does
        return dist.PrefixStore(f"/worker/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    return store


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def all_reduce(t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=op)
    return t


@torch.no_grad()
def ensure_same_weights(model: torch.nn.Module, env: DistEnv) -> bool:
    """The article's pitfall: ranks must start from identical weights. Compare a cheap
    fingerprint of every tensor across ranks; if any rank differs, broadcast rank 0's
    weights to all. Returns True when a broadcast was needed."""
    if env.world_size == 1:
        return False
    tensors = list(model.state_dict().values())
    fp = torch.stack([t.detach().double().sum() + t.detach().double().abs().sum() * 1e-3 if t.numel() else
                      torch.zeros((), dtype=torch.float64) for t in tensors]).to(env.device)
    ref = fp.clone()
    dist.broadcast(ref, src=0)
    differs = torch.tensor([float(not torch.equal(fp, ref))], device=env.device)
    all_reduce(differs, dist.ReduceOp.MAX)
    if differs.item() == 0:
        return False
    for t in tensors:
        buf = t.detach().to(env.device)
        dist.broadcast(buf, src=0)
        t.copy_(buf.to(t.device))
    return True
