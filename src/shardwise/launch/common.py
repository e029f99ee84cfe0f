"""What every part of the launcher shares: its one-line messages, the signal that stopped it."""

from __future__ import annotations

import os


def say(msg: str) -> None:
    print(f"shardwise: {msg}", flush=True)


class Progress:
    """How far a long phase of the launcher is (tokenizing): on a terminal one line redrawn in place, at once and then
    at most five times a second, and erased at the end (the phase's own summary line follows); elsewhere (a log
    file, a pipe) a plain line every 10 s, so a phase shorter than that prints nothing."""

    def __init__(self, what: str, total: int, unit: str, stream=None, clock=None):
        import sys
        import time

        self.what, self.total, self.unit = what, total, unit
        self.stream = stream or sys.stdout
        self.clock = clock or time.monotonic
        self.tty = self.stream.isatty()
        self.start = self.last = self.clock()
        self.drawn = False

    def __call__(self, done: int) -> None:
        now = self.clock()
        if self.drawn and now - self.last < (0.2 if self.tty else 10.0) or not self.tty and now - self.start < 10.0:
            return
        self.last, self.drawn = now, True
        rate = done / max(now - self.start, 1e-9)
        left = (self.total - done) / rate if rate > 0 else 0.0
        text = (f"shardwise: {self.what}: {done:,}/{self.total:,} {self.unit} ({done / max(self.total, 1):.0%}), "
                f"{rate:,.0f} {self.unit}/s, ETA {int(left) // 60}:{int(left) % 60:02d}")
        self.stream.write(f"\r{text}\x1b[K" if self.tty else text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self.drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


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
