"""What every part of the launcher shares: its one-line messages, the signal that stopped it."""

from __future__ import annotations

import os


def say(msg: str) -> None:
    print(f"shardwise: {msg}", flush=True)


class Interrupted(Exception):
    def __init__(self, signum: int):
        self.signum = signum


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
