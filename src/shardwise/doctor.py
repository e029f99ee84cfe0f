"""`shardwise doctor`: measure what the planner needs on this machine.

Devices, memory, versions, a matmul rate per rank, and collective bandwidth (all-reduce,
all-gather, reduce-scatter over message sizes) between the ranks of this node, reported
as nccl-tests does: algbw = bytes / time, busbw = algbw * 2(n-1)/n for all-reduce and
algbw * (n-1)/n for all-gather / reduce-scatter (bytes = the full, unsharded buffer).

The ranks are started by torch's elastic launcher (`elastic_launch`) with a fresh Python
per rank (`python -m shardwise.doctor --worker OUT`), over NCCL on GPUs and gloo on CPU.
The report is saved atomically to $SHARDWISE_CACHE_DIR/doctor.json (default
~/.cache/shardwise/doctor.json), where `shardwise plan` reads it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import uuid

from shardwise import hardware
from shardwise.errors import ShardwiseError
from shardwise.rundir import atomic_write_json

OPS = ("all_reduce", "all_gather", "reduce_scatter")
CPU_SIZES = (2**12, 2**16, 2**20, 2**22)
GPU_SIZES = (2**16, 2**20, 2**24, 2**27, 2**30)


def bus_factor(op: str, n: int) -> float:
    """nccl-tests: busbw = algbw * factor."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("doctor", help="Measure devices, versions and collective bandwidth for the planner.",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", metavar="N", help="Ranks to measure with (default: GPUs of this node, or 2 on CPU).")
    p.add_argument("--sizes", metavar="LIST", help="Message sizes in bytes, comma-separated, e.g. 4096,1048576 "
                   "(default: 4 KiB-4 MiB on CPU, 64 KiB-1 GiB on GPU).")
    p.add_argument("--iters", metavar="N", default="5", help="Timed repetitions per size (default 5).")
    p.add_argument("--json", action="store_true", help="Print the report as JSON.")
    p.add_argument("--no-save", action="store_true", help="Do not write doctor.json.")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.set_defaults(func=run)


def _int(v, flag: str, lo: int = 1) -> int:
    try:
        x = int(v)
    except (TypeError, ValueError):
        raise ShardwiseError(f"{flag} must be an integer, got '{v}'")
    if x < lo:
        raise ShardwiseError(f"{flag} must be >= {lo}, got {x}")
    return x


def versions() -> dict:
    from importlib import metadata

    out = {"python": platform.python_version(), "platform": platform.platform()}
    for pkg in ("torch", "transformers", "deepspeed", "peft", "bitsandbytes", "shardwise"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def run(args) -> int:
    import torch

    hw = hardware.detect()
    cuda = hw.accelerator == "cuda"
    nproc = _int(args.nproc, "--nproc") if getattr(args, "nproc", None) else (hw.device_count if cuda else 2)
    if cuda and nproc > hw.device_count:
        raise ShardwiseError(f"--nproc {nproc} is more than the {hw.device_count} GPUs of this node")
    sizes = CPU_SIZES if not cuda else GPU_SIZES
    if getattr(args, "sizes", None):
        try:
            sizes = tuple(int(s) for s in str(args.sizes).split(",") if s.strip())
        except ValueError:
            raise ShardwiseError(f"--sizes must be comma-separated byte counts, got '{args.sizes}'")
        if not sizes or min(sizes) < 4:
            raise ShardwiseError("--sizes: each size must be at least 4 bytes")
    iters = _int(getattr(args, "iters", 5) or 5, "--iters")
    report = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "accelerator": hw.accelerator, "device": hw.device_name, "device_count": hw.device_count,
        "memory_gib": round(hw.memory_gib, 2), "host_memory_gib": round(hw.host_memory_gib, 2),
        "nvlink": hardware.detect_light().nvlink if cuda else None,
        "cpu_count": os.cpu_count(), "versions": versions(),
        "bf16_supported": hardware.bf16_supported(), "torch_cuda": torch.version.cuda,
        "world_size": nproc, "backend": "nccl" if cuda else "gloo",
    }
    report.update(measure(nproc, sizes, iters))
    if not getattr(args, "no_save", False):
        report["saved_to"] = save(report)
    if getattr(args, "json", False):
        print(json.dumps(report, indent=2))
    else:
        print(render(report))
    return 0


def save(report: dict) -> str:
    path = hardware.doctor_path()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    atomic_write_json(path, report, indent=2)
    return path


def measure(nproc: int, sizes, iters: int) -> dict:
    """Launch nproc ranks through the elastic agent; rank 0's measurements."""

    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from shardwise.launch.agent import loopback_only, quiet_agent

    quiet_agent()

    lc = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"doctor-{uuid.uuid4().hex[:8]}",
                      max_restarts=0, monitor_interval=0.1, start_method="spawn", **loopback_only())
    env_threads = os.environ.get("OMP_NUM_THREADS")
    if env_threads is None:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    with tempfile.TemporaryDirectory(prefix="shardwise-doctor-") as d:
        out = os.path.join(d, "rank0.json")
        try:
            elastic_launch(lc, sys.executable)("-u", "-m", "shardwise.doctor", "--worker", out,
                                               ",".join(map(str, sizes)), str(iters))
        except SignalException as e:  # SIGTERM/SIGINT/SIGHUP while the ranks measured: the agent stopped them
            err = ShardwiseError(f"doctor: interrupted by signal {int(e.sigval)}; nothing was saved")
            err.exit_code = 128 + int(e.sigval)
            raise err from None
        except ChildFailedError as e:
            raise ShardwiseError(f"doctor: a measuring rank failed ({str(e).splitlines()[0][:200]}); "
                                 f"rerun with SHARDWISE_DEBUG=1 to see the agent's log")
        finally:
            if env_threads is None:
                os.environ.pop("OMP_NUM_THREADS", None)
        with open(out) as fh:
            return json.load(fh)


# ----------------------------------------------------------------------------- per rank


def worker(out: str, sizes: list[int], iters: int) -> None:
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    from datetime import timedelta

    from shardwise.train.dist import worker_store

    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = worker_store(rank, n, timedelta(seconds=300))  # listens on MASTER_ADDR only
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=n)
    rank, n = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda") if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32

    def sync():
        if cuda:
            torch.cuda.synchronize()

    # newer torch renames the tensor collectives (the old names warn)
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    result: dict = {"collectives": {}, "unsupported": []}
    for op in OPS:
        rows = []
        for size in sizes:
            numel = max(n, size // torch.tensor([], dtype=dtype).element_size() // n * n)
            full = torch.ones(numel, dtype=dtype, device=dev)
            part = torch.empty(numel // n, dtype=dtype, device=dev)

            def call():
                if op == "all_reduce":
                    dist.all_reduce(full)
                elif op == "all_gather":
                    all_gather(full, part)
                else:
                    reduce_scatter(part, full)

            try:
                call()
            except (RuntimeError, NotImplementedError, ValueError) as e:
                result["unsupported"].append(f"{op}: {str(e).splitlines()[0][:120]}")
                break
            call()
            sync()
            dist.barrier()
            t = time.perf_counter()
            for _ in range(iters):
                call()
            sync()
            dt = (time.perf_counter() - t) / iters
            nbytes = full.numel() * full.element_size()
            # the slowest rank sets the time
            tt = torch.tensor([dt], dtype=torch.float64, device=dev)
            dist.all_reduce(tt, op=dist.ReduceOp.MAX)
            dt = float(tt.item())
            algbw = nbytes / dt
            rows.append({"bytes": nbytes, "time_us": round(dt * 1e6, 2), "algbw_gbps": round(algbw * 8 / 1e9, 3),
                         "busbw_gbps": round(algbw * bus_factor(op, n) * 8 / 1e9, 3)})
        if rows:
            result["collectives"][op] = rows
    result["matmul_gflops"] = matmul_rate(dev, dtype, sync)
    dist.barrier()
    if rank == 0:
        atomic_write_json(out, result, indent=None)
    dist.destroy_process_group()


def matmul_rate(dev, dtype, sync, seconds: float = 0.3) -> float:
    """Dense matmul GFLOP/s of one rank while every rank runs one (the CPU cores are shared)."""
    import torch

    n = 4096 if dev.type == "cuda" else 512
    a = torch.randn(n, n, dtype=dtype, device=dev)
    b = torch.randn(n, n, dtype=dtype, device=dev)
    a @ b
    sync()
    t, k = time.perf_counter(), 0
    while time.perf_counter() - t < seconds:
        a @ b
        k += 1
        if dev.type == "cuda" and k % 10:
            continue
        sync()
    sync()
    return round(2 * n**3 * k / (time.perf_counter() - t) / 1e9, 1)


def render(r: dict) -> str:
    v = r["versions"]
    gpus = (f"{r['device_count']} x {r['device']} ({r['memory_gib']} GiB)" if r["device_count"] else "no GPU")
    lines = [f"device    {gpus}; host {r['host_memory_gib']} GiB RAM, {r['cpu_count']} CPUs",
             "versions  " + ", ".join(f"{k} {val}" for k, val in v.items() if k != "platform" and val),
             f"matmul    {r['matmul_gflops']:,.0f} GFLOP/s per rank ({'bf16' if r['accelerator'] == 'cuda' else 'fp32'}, "
             f"{r['world_size']} ranks at once)",
             f"collectives over {r['backend']}, {r['world_size']} ranks (busbw as nccl-tests defines it):",
             f"  {'op':15s}{'bytes':>12s}{'time us':>12s}{'algbw Gb/s':>12s}{'busbw Gb/s':>12s}"]
    for op, rows in r["collectives"].items():
        for row in rows:
            lines.append(f"  {op:15s}{row['bytes']:12,d}{row['time_us']:12,.1f}{row['algbw_gbps']:12.2f}"
                         f"{row['busbw_gbps']:12.2f}")
    for u in r.get("unsupported", []):
        lines.append(f"  not supported: {u}")
    if r.get("saved_to"):
        lines.append(f"saved to {r['saved_to']} (read by `shardwise plan`)")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        worker(sys.argv[2], [int(s) for s in sys.argv[3].split(",")], int(sys.argv[4]))
    else:
        from shardwise.cli import main

        sys.exit(main(["doctor", *sys.argv[1:]]))
