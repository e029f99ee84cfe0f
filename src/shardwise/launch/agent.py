"""torchrun's elastic agent in this process: the workers' environment, the c10d rendezvous with its store on the
rendezvous address only, the agent's own logging. `shardwise doctor` starts its ranks through the same pieces."""

from __future__ import annotations

import os
import shutil
import sys
import uuid

from shardwise.config import Config, checkpointing_mode
from shardwise.errors import ShardwiseError
from shardwise.launch.common import Interrupted, say
from shardwise.launch.failures import _failure_report


def _agent(cfg: Config, worker_args: list[str], preload: tuple[str, bool] = ("", False)) -> None:
    """The workers `python -m shardwise.train.worker WORKER_ARGS`, through torchrun's elastic agent in this
    process; a failed group becomes one ShardwiseError line, a signal Interrupted. `preload` is what the fork
    server imports before a job is known (launch.early.early_preload, for workers that wait for their job)."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    worker_environment(cfg)
    multi = cfg.nnodes > 1
    import tempfile

    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs

    if multi:
        register_rendezvous()
        where = dict(rdzv_backend=RDZV_BACKEND, rdzv_endpoint=cfg.rdzv_endpoint,
                     rdzv_configs={"is_host": cfg.node_rank == 0, "join_timeout": 300})
    else:
        where = loopback_only(int(cfg.rdzv_endpoint.rpartition(":")[2] or 0))
    # the agent's per-rank error files go to a temporary directory of this run's own, removed
    # after it (left to itself the agent leaves a $TMPDIR/torchelastic_* behind every run)
    agent_tmp = tempfile.mkdtemp(prefix="shardwise-agent-")
    from shardwise.train import zygote

    forked = zygote.enabled() and zygote.start(*preload)
    trouble = zygote.cuda_trouble() if forked else ""
    if trouble:  # the run goes on, its workers started as their own interpreters
        zygote.stop()
        forked = False
        say(f"note: the workers' fork server cannot be used ({trouble}); each worker starts as its own interpreter "
            "instead, a slower start (SHARDWISE_FORKSERVER_HIDE=torchao,PACKAGE hides a package that initialises "
            "CUDA as it is imported; SHARDWISE_FORKSERVER=0 skips the server)")
    lc = LaunchConfig(
        min_nodes=cfg.nnodes, max_nodes=cfg.nnodes, nproc_per_node=cfg.nproc_per_node,
        run_id=f"shardwise-{cfg.rdzv_endpoint}" if multi else f"shardwise-{uuid.uuid4().hex[:8]}",
        max_restarts=cfg.max_restarts, monitor_interval=0.1, start_method="forkserver" if forked else "spawn",
        logs_specs=DefaultLogsSpecs(log_dir=agent_tmp), **where,
    )

    quiet_agent()
    from shardwise.train.signals import hold_further_signals

    try:
        with hold_further_signals():  # a second Ctrl-C must not cut the agent's wait for the stopping checkpoint
            if forked:  # each worker a fork of one server that imported torch, transformers and the model
                elastic_launch(lc, zygote.worker_main)(zygote.env_changes(), *worker_args)
            else:
                elastic_launch(lc, sys.executable)("-u", "-m", "shardwise.train.worker", *worker_args)
    except ChildFailedError as e:
        raise ShardwiseError(_failure_report(cfg.output_dir, e, cfg)) from None
    except SignalException as e:
        raise Interrupted(int(e.sigval)) from None
    finally:
        if forked:
            zygote.stop()
        shutil.rmtree(agent_tmp, ignore_errors=True)


def worker_environment(cfg: Config) -> None:
    """The environment the workers start with, beyond the agent's per-rank variables: threads per rank, the
    launcher they die with, on one node gloo's and NCCL's sockets on the loopback interface, and the CUDA
    allocator's expandable segments under offloaded checkpoints (forked workers take it on too:
    train/zygote.env_changes)."""
    if checkpointing_mode(cfg) == "offload" and not {"PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"} & set(os.environ):
        # The runs offloaded checkpoints are for take and free buffers of a whole sequence's width (GiBs each, of
        # several sizes) every block; fixed segments leave GiBs of them reserved and unusable. Expandable segments
        # map more pages into one segment instead. A variable the user sets is theirs.
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // cfg.nproc_per_node))
    os.environ["SHARDWISE_LAUNCHER_PID"] = str(os.getpid())  # workers die with this process
    if cfg.nnodes == 1:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")


RDZV_BACKEND = "shardwise-c10d"


def register_rendezvous() -> None:
    """torchrun's c10d rendezvous, with its store listening on the rendezvous endpoint's
    address only (torch's own binds every interface): 127.0.0.1 on one node, the given
    --rdzv-endpoint host on several (a network the user must trust, as with torchrun)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as registry

    if RDZV_BACKEND not in getattr(registry, "_registry", {}):
        registry.register(RDZV_BACKEND, _rendezvous_handler)


def quiet_agent() -> None:
    """The elastic agent's own warnings ("Received 15 death signal, shutting down workers", a failed rank's report)
    repeat what shardwise's one line says; SHARDWISE_DEBUG=1 keeps them. torch gives each of its elastic modules'
    loggers a level of its own (LOGLEVEL, default WARNING), so a level on their parent logger is not enough."""
    import logging

    if os.environ.get("SHARDWISE_DEBUG"):
        return
    prefix = "torch.distributed.elastic"
    for name in [prefix, *(n for n in list(logging.root.manager.loggerDict) if n.startswith(prefix + "."))]:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    # forked workers (train/zygote.py) are torch.multiprocessing's: "Terminating process N via signal SIGTERM" when
    # one failed and the others are stopped
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.CRITICAL)


def loopback_only(port: int = 0) -> dict:
    """LaunchConfig arguments (and the environment) for a one-machine group that listens
    on 127.0.0.1 only: the rendezvous store, the workers' store (MASTER_ADDR) and gloo's or
    NCCL's own sockets."""
    register_rendezvous()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # as worker_environment, for doctor's group
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    return dict(rdzv_backend=RDZV_BACKEND, rdzv_endpoint=f"127.0.0.1:{port}", rdzv_configs={"is_host": True},
                local_addr="127.0.0.1")


def _rendezvous_handler(params):
    from datetime import timedelta

    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    from shardwise.train.dist import PortInUse, StoreUnreachable, tcp_store

    class Backend(C10dRendezvousBackend):
        name = RDZV_BACKEND

    # The agent's store is never shared into the workers (torch's default shares it), for two reasons:
    # - torch makes that shared store with a plain TCPStore server, which listens on every interface;
    # - a group restarted by --max-restarts reads the previous attempt's unprefixed keys in it, and its gloo mesh
    #   hangs or is refused. The workers make their own store (train/dist.worker_store, on MASTER_ADDR only).
    # torch reads this at each rendezvous round; set here, it holds for train and doctor, one node or several, whatever
    # the environment said.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=29400)
    serves = bool(params.get_as_bool("is_host", True))
    try:
        store = tcp_store(host, port, is_master=serves, multi_tenant=True,
                          timeout=timedelta(seconds=params.get_as_int("read_timeout", 60)))
    except PortInUse as e:
        raise ShardwiseError(f"--rdzv-endpoint {host}:{port}: {e} (node 0 serves the rendezvous there)") from None
    except StoreUnreachable as e:
        if serves:
            raise ShardwiseError(f"--rdzv-endpoint {host}:{port}: {e}") from None
        raise ShardwiseError(f"cannot reach node 0 at {host}:{port} (--rdzv-endpoint; {e}): start node 0 first, "
                             "or check the address") from None
    return create_handler(store, Backend(store, params.run_id), params)
