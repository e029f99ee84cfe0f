"""Where a run's time goes before and around training: the phases that make up its time to first step.

Timestamps are wall-clock epoch seconds so the launcher's and the workers' marks (one
machine) line up: the launcher passes its own in the job (`timeline`), rank 0 adds the
workers' and writes the durations into summary.json as `phases_s`, and the launcher adds
the exit and prints them on one line. Imports nothing heavy: it runs before torch is loaded.
"""

from __future__ import annotations

import os
import sys
import time

_IMPORTED = time.time()

# (phase, start mark, end mark), in the order they happen
PHASES = (
    ("imports", "process_start", "prepare_start"),         # launcher: interpreter, CLI and config
    ("prepare", "prepare_start", "prepared"),              # imports, checks, tokenizer, records, tokenised data
    ("worker_start", "prepared", "worker_start"),          # rendezvous agent, spawning the workers
    ("worker_imports", "worker_start", "setup_start"),     # each worker's interpreter and imports (rank 0's)
    ("init", "setup_start", "initialized"),                # process group
    ("model_load", "initialized", "model_loaded"),         # tokenizer, weights, adapters, same weights on all ranks
    ("wrap", "model_loaded", "wrapped"),                   # the strategy's parallelize (wrap, compile wrapper) + optimizer
    ("data_load", "wrapped", "ready"),                     # tokenised data, sampler, resume
    ("first_step", "ready", "first_step"),                 # the first optimizer step (compiles when compile is on)
    ("training", "first_step", "trained"),                 # the other steps (and their checkpoints)
    ("save", "trained", "saved"),                          # the final model
    ("exit", "saved", "exited"),                           # summary, process group, workers and agent gone
)


# Full garbage collections while a process starts. CPython runs a full pass (every tracked object) whenever the
# oldest generation has grown by a quarter since the last one, and importing torch, transformers and inductor grows
# it many times over: on the tiny CPU job's launcher 7 full passes, 0.74-0.98 s together, which found 142 objects
# to free (docs/speed.md, "Time to first step"). `hold_full_gc` stops the full passes
# until `release_full_gc`; the young generations are still collected, so cyclic garbage made and dropped while
# starting is freed as before. The release freezes what is alive then (gc.freeze: the imported modules' objects
# move to a permanent generation that later full passes skip) and puts the thresholds back.
_HELD_GC: list = []


def hold_full_gc() -> None:
    """No full garbage collection until release_full_gc (young generations still collected)."""
    import gc

    if not _HELD_GC:
        _HELD_GC.append(gc.get_threshold())
        t0, t1, _t2 = _HELD_GC[0]
        gc.set_threshold(t0, t1, 1 << 30)


def release_full_gc() -> None:
    """Freeze the objects alive now and collect as before (idempotent; nothing if never held)."""
    import gc

    if _HELD_GC:
        gc.freeze()
        gc.set_threshold(*_HELD_GC.pop())


def forked() -> None:
    """In a process forked from one that imported this module (train/zygote.py): it starts now (process_start
    would otherwise take the parent's import time)."""
    global _IMPORTED
    _IMPORTED = time.time()


before_exit: list = []  # called by exit_deadline before it ends the process (train/zygote.hand_result_before_exit)


def process_start() -> float:
    """When this process started (epoch seconds): from /proc on Linux, else when this module
    was first imported."""
    try:
        with open("/proc/self/stat") as fh:
            ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
        t = time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
        return min(t, _IMPORTED)
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORTED


def durations(marks: dict) -> dict:
    """Seconds per phase for the marks present (a phase whose marks are missing is left out),
    plus `time_to_first_step` and `total` where their marks exist."""
    out = {}
    for name, a, b in PHASES:
        if a in marks and b in marks:
            out[name] = round(max(marks[b] - marks[a], 0.0), 3)
    first = marks.get("process_start", marks.get("setup_start"))
    if first is not None and "first_step" in marks:
        out["time_to_first_step"] = round(max(marks["first_step"] - first, 0.0), 3)
    last = marks.get("exited", marks.get("saved"))
    if first is not None and last is not None:
        out["total"] = round(max(last - first, 0.0), 3)
    return out


def line(phases: dict) -> str:
    parts = [f"{name} {phases[name]:.2f}s" for name, _, _ in PHASES if name in phases]
    tail = [f"{k.replace('_', ' ')} {phases[k]:.2f}s" for k in ("time_to_first_step", "total") if k in phases]
    return "phases: " + ", ".join(parts) + ("; " + ", ".join(tail) if tail else "")


def exit_without_teardown(rc: int) -> None:
    """Leave a process that has finished cleanly (a worker: process group destroyed, summary,
    metrics and trackers closed; the launcher: its command returned 0) without the
    interpreter's teardown: the atexit handlers run (the libraries' own, e.g. a tracker's,
    and weakref finalizers such as temporary directories), logging and the standard streams
    are flushed, then os._exit. Tearing down the modules and collecting a torch process's
    objects took 1.5-1.8 s per rank on the tiny CPU job, all of it after the run was
    complete. Everything shardwise writes went through closed files or
    os-level writes, which a process exit keeps."""
    import atexit
    import logging

    try:
        stop_compile_workers()
        atexit._run_exitfuncs()
        logging.shutdown()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(rc)


def exit_deadline(seconds: float, what: str, backstop_s: float = 15.0) -> None:
    """A worker whose run is complete (final model, summary and metrics written) leaves with 0 at the latest
    `seconds` from now, whatever its teardown (the closing barrier, destroying the process group, the libraries'
    atexit handlers) is waiting for: a finished run must not hold its launcher, and a teardown can hang (a CPU CI
    run has had a finished 2-rank run still alive three minutes after its `done` line).

    That timer is a Python thread: it cannot run while the teardown holds the GIL inside a C++ call (a destructor
    joining a stuck thread holds it): a finished 2-rank run under heavy load can outlive the timer by a minute,
    with no line from it. So faulthandler's watchdog, a C thread that needs no GIL,
    backs it up `backstop_s` later: it prints every thread's stack (where the teardown hangs) and ends the
    process with 1. The run's outputs are complete either way."""
    import faulthandler
    import threading

    def leave():
        try:
            for hook in before_exit:
                try:
                    hook()
                except Exception:  # noqa: BLE001 - leaving regardless
                    pass
            print(f"shardwise: {what}: the finished run's process was still in its teardown after {seconds:.0f} s; "
                  "leaving (everything of the run is written)", file=sys.stderr, flush=True)
            sys.stdout.flush()
        finally:
            os._exit(0)

    t = threading.Timer(seconds, leave)
    t.daemon = True
    t.start()
    try:
        faulthandler.dump_traceback_later(seconds + backstop_s, exit=True, file=sys.stderr)
    except (AttributeError, OSError, ValueError):  # a standard error with no file descriptor: the timer alone
        pass


def stop_compile_workers() -> None:
    """Kill inductor's compile workers, if this process started them (torch.compile starts a sidecar process,
    torch/_inductor/compile_worker, at its first compile). torch's atexit handler shuts them down by asking and
    waiting; after a short run whose workers were still starting that wait was 6-10 s on the H200 with 16 of them,
    against 0.3 s with compile_threads 1 (docs/speed.md, "Time to first step"). Only for a
    process whose run is complete: nothing is waiting on a compile."""
    try:
        import psutil
    except ImportError:
        return
    import logging

    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return
    killed = []
    for child in children:
        try:
            if any("compile_worker" in part for part in child.cmdline()[:3]):
                child.kill()
                killed.append(child)
        except psutil.Error:
            pass
    if killed:
        psutil.wait_procs(killed, timeout=5)  # gone (the sidecar reaped here) before its shutdown is asked for
        # the shutdown then writes to a closed pipe; it ignores that, with a warning we do not need
        logging.getLogger("torch._inductor.compile_worker.subproc_pool").setLevel(logging.ERROR)
