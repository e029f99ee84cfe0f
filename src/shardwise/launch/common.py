"""What every part of the launcher shares: its one-line messages, the prepared run, the signal that stopped it."""

from __future__ import annotations

import dataclasses
import os

from shardwise import rundir
from shardwise.config import Config


@dataclasses.dataclass
class Prepared:
    cfg: Config
    output_dir: str
    job_path: str
    world_size: int
    lock: rundir.RunLock | None = None  # held by node 0's launcher for the run's life

def say(msg: str) -> None:
    print(f"shardwise: {msg}", flush=True)


class Interrupted(Exception):
    def __init__(self, signum: int):
        self.signum = signum

def _say_run_dir(p: Prepared) -> None:
    say(f"run directory: {p.output_dir} ({p.cfg.strategy}, {p.world_size} process(es), "
        f"mixed precision {p.cfg.mixed_precision})")
    note = oversubscribed(p.cfg.nproc_per_node)
    if note:
        say(note)

def oversubscribed(nproc: int) -> str | None:
    """A note when this node's ranks outnumber the CPU cores this process may use (torchrun starts them without a
    word): every rank then shares a core, and each step waits for the slowest."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    if nproc <= cores:
        return None
    return (f"note: {nproc} ranks on this node's {cores} CPU core(s): they share cores, so each step is slower than "
            f"with --nproc-per-node {cores} or fewer")
