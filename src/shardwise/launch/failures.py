"""Failure forensics: one line for a failed worker group, naming the rank that failed first and why, from what
each rank left in the run directory (train/worker.py) and the agent's failures."""

from __future__ import annotations

import json
import os

from shardwise import rundir
from shardwise.config import Config


def _failure_report(output_dir: str, e, cfg: Config) -> str:
    """One line for a failed worker group: the rank that failed first and why. A rank that
    died (a signal, an exception, or an exit without a ShardwiseError) is the cause; the errors the other
    ranks then raise (a collective with a dead peer) are consequences and are only counted.

    What each rank left (train/worker.py) says more than the agent's failures: with forked workers the agent
    reports only the first failed process it finds, often a rank whose collective failed because another died.
    A rank's exception (rankN.exc), its one-line error (rankN.txt), or only its life mark (rankN.alive: it ended
    without a word, killed by a signal) name the cause."""
    errors, crashes = _worker_errors(output_dir), _worker_errors(output_dir, ".exc")
    failures = sorted(e.failures.items(), key=lambda kv: (kv[1].timestamp or 0, kv[0]))
    restarts = f" (after {cfg.max_restarts} restart(s), the --max-restarts limit)" if cfg.max_restarts else ""

    def blame(rank: int, line: str, also=()) -> str:
        others = sorted((set(errors) | set(crashes) | {r for r, _ in failures} | set(also)) - {rank})
        if others:
            line += f"; rank(s) {', '.join(map(str, others))} stopped after it"
        return line + restarts

    dead = [(r, f) for r, f in failures if r not in errors and r not in crashes and not _stopped_by_agent(f)]
    if dead:
        return blame(dead[0][0], _failure_line(*dead[0]))
    if crashes:
        rank = min(crashes)
        return blame(rank, _crash_line(rank, crashes[rank], None))
    own = {r: t for r, t in errors.items() if not _consequence(t)}
    if own:
        return own[min(own)]
    silent = sorted(_silent_ranks(output_dir) - set(errors))
    if silent and all(_consequence(t) == "died" for t in errors.values()):
        return blame(silent[0], f"training failed: rank {silent[0]} ended without an error of its own: killed by a "
                     "signal (SIGKILL, the out-of-memory killer) or crashed; its output above says more", silent[1:])
    if errors:
        return errors[min(errors)]
    return _failure_line(*failures[0])


def _consequence(error: str) -> str:
    """Whether a rank's one-line error is another rank's doing: "died" where a collective lost its peer (its
    connection reset or closed: the peer is gone), "hung" where it timed out (the peer may be alive), "" where the
    error is the rank's own."""
    text = error.lower()
    if LOST_PEER in error or "connection reset by peer" in text or "connection closed by peer" in text:
        return "died"
    return "hung" if "another rank is hung or dead" in text else ""


def _stopped_by_agent(f) -> bool:
    """A rank the agent terminated (SIGTERM) because another rank failed."""
    import signal

    return f.exitcode is not None and f.exitcode == -signal.SIGTERM


def _worker_errors(output_dir: str, kind: str = ".txt") -> dict[int, str]:
    """{rank: the one-line ShardwiseError it left} (kind .txt), the first line of the exception it raised (.exc), or
    its PID where its life mark is still there (.alive; train/worker.py)."""
    d = rundir.error_dir(output_dir)
    out = {}
    if not os.path.isdir(d):
        return out
    for name in os.listdir(d):
        if not name.endswith(kind):
            continue
        digits = "".join(c for c in name if c.isdigit())
        with open(os.path.join(d, name)) as fh:
            text = fh.read().strip()
        if text and digits:
            out[int(digits)] = text
    return out


LOST_PEER = "a collective lost its peer"  # a rank's error when a peer died (train/loop.py), not when one hung


def _silent_ranks(output_dir: str) -> set[int]:
    """The ranks whose life mark (its PID) is still there (train/worker.life_marker): they ended without a word."""
    return set(_worker_errors(output_dir, ".alive"))


def _failure_line(rank: int, f) -> str:
    """One line for a rank that died without a ShardwiseError."""
    import signal

    msg = f.message
    if isinstance(msg, str) and msg.startswith("{"):
        try:
            msg = json.loads(msg)
        except ValueError:
            pass
    if isinstance(msg, dict):
        msg = msg.get("message", "")
    detail = str(msg or "").strip().splitlines()[0][:300] if msg else ""
    if f.exitcode is not None and f.exitcode < 0:
        try:
            name = signal.Signals(-f.exitcode).name
        except ValueError:
            name = "?"
        return f"training failed: rank {rank} was killed by signal {-f.exitcode} ({name}); its output above says more"
    return _crash_line(rank, detail, f.exitcode)


def _crash_line(rank: int, detail: str, exitcode) -> str:
    """One line for a rank that raised (`detail`: the exception's first line) or exited with `exitcode`."""
    if "OutOfMemoryError" in detail or "out of memory" in detail.lower():
        return (f"out of memory on rank {rank} ({detail}); lower --micro-batch-size or --seq-len, enable "
                "--gradient-checkpointing, or shard more (--strategy fsdp / zero3); `shardwise plan` estimates it")
    how = f"exited with code {exitcode}" if exitcode is not None else "raised an exception"
    return f"training failed: rank {rank} {how} ({detail or 'no message'}); its output above says more"
