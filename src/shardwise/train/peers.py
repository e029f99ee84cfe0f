"""Which ranks never reached a collective that failed on this rank (timed out, or lost its peer).

A rank's collective cannot tell which peer it waits for. Every rank whose collective fails says so in a file of the
run's error directory (`.prep/errors/rankN.waiting`, holding the phase it was in); after a short wait, the ranks
with no such file are the ones that never got there: hung (a deadlock, a stuck data read, SIGSTOP) or dead. The
files are on the run directory's filesystem, which several nodes share (docs/reliability.md), and never through the
process group's store, which a hung rank 0 may host."""

from __future__ import annotations

import os
import shlex
import time

from shardwise.rundir import atomic_write, error_dir

WAITING = ".waiting"
WAIT_S = 5.0  # the longest a failed rank waits for the others to report theirs
SETTLE_S = 1.0  # no new report for this long: every rank that fails with this one has reported
POLL_S = 0.1


def _reported(d: str) -> set[int]:
    try:
        names = os.listdir(d)
    except OSError:
        return set()
    return {int(n[4:-len(WAITING)]) for n in names
            if n.startswith("rank") and n.endswith(WAITING) and n[4:-len(WAITING)].isdigit()}


def not_arrived(output_dir: str, rank: int, world_size: int, phase: str, wait_s: float = WAIT_S,
                settle_s: float = SETTLE_S) -> list[int]:
    """Report this rank's failed collective, then the ranks that reported none once the reports settle (or wait_s
    has passed): those that never reached it. [] where every rank reported, or the reports cannot be written."""
    d = error_dir(output_dir)
    try:
        os.makedirs(d, exist_ok=True)
        atomic_write(os.path.join(d, f"rank{rank}{WAITING}"), phase)
    except OSError:
        return []
    start = last_change = time.monotonic()
    seen: set[int] = set()
    while True:
        now = _reported(d)
        if now != seen:
            seen, last_change = now, time.monotonic()
        missing = sorted(set(range(world_size)) - seen)
        t = time.monotonic()
        if not missing or t - last_change >= settle_s or t - start >= wait_s:
            return missing
        time.sleep(POLL_S)


def named(ranks: list[int]) -> str:
    """"; rank 1 never reached it (...)" for the ranks that did not arrive, or ""."""
    if not ranks:
        return ""
    who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
    return f"; {who} never reached it (hung, or dead; {'its' if len(ranks) == 1 else 'their'} output says more)"


def resume_command(output_dir: str) -> str:
    """The command that resumes the run in output_dir from its newest complete checkpoint."""
    return (f"shardwise train {shlex.quote(os.path.join(output_dir, 'config.yaml'))} --output-dir "
            f"{shlex.quote(output_dir)} --resume auto")


def resume_hint(output_dir: str, newest: str | None) -> str:
    """Where to pick the run up: the newest complete checkpoint and the command that resumes from it."""
    if not newest:
        return "; no checkpoint was saved yet (--save-every N keeps one)"
    return f"; newest checkpoint: {newest}; resume with: {resume_command(output_dir)}"
