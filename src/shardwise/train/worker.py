"""Per-rank entry point: `python -m shardwise.train.worker JOB.json` (started by torchrun's
elastic agent), or `run_job(path)` in-process for a single process."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys


def die_with_launcher(forked: bool = False) -> None:
    """SIGKILL this worker when its parent dies, even by kill -9: workers start in sessions of their own, so
    nothing else would stop them. What they leave is the last complete checkpoint.

    The parent is the launcher (which runs torchrun's elastic agent in-process), or with `forked` the fork server
    the launcher started (train/zygote.py), which leaves as soon as the launcher is gone. Called first thing:
    before torch is imported in a fresh interpreter, so a launcher stopped by a signal while the agent was still
    starting the group (it then never learns the workers' PIDs) leaves workers that end here."""
    launcher = int(os.environ.get("SHARDWISE_LAUNCHER_PID", "0"))
    if not launcher or not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if forked:
        try:
            os.kill(launcher, 0)
        except ProcessLookupError:  # the launcher died before the line above (the server is leaving too)
            os.kill(os.getpid(), signal.SIGKILL)
        except PermissionError:
            pass
    elif os.getppid() != launcher:  # the launcher died before the line above
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    die_with_launcher()
    from shardwise.phases import hold_full_gc

    hold_full_gc()  # while the worker imports; released after its first step (phases.py)

from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402

from shardwise.errors import ShardwiseError  # noqa: E402
from shardwise.rundir import atomic_write, error_dir, quiet_libraries  # noqa: E402


def warnings_once_on_rank0() -> None:
    """Library warnings (deprecations from inside ZeRO-3's collectives come every step) are
    printed once per distinct message, by rank 0 only: a long run's log stays one line per
    logged step. Filters alone do not hold: libraries reset them (catch_warnings), which
    re-arms 'default'; the display hook below dedupes whatever gets through."""
    import logging
    import warnings

    rank0 = os.environ.get("RANK", "0") == "0"
    seen: set[tuple] = set()
    show = warnings.showwarning

    def once(message, category, filename, lineno, file=None, line=None):
        key = (category, str(message))
        if rank0 and key not in seen:
            seen.add(key)
            show(message, category, filename, lineno, file, line)

    warnings.showwarning = once
    if not rank0:
        warnings.simplefilter("ignore")
        logging.getLogger("DeepSpeed").setLevel(logging.ERROR)


_process_set_up = False


def set_up_process() -> None:
    global _process_set_up
    if not _process_set_up:
        quiet_libraries()
        warnings_once_on_rank0()
        _process_set_up = True


def run_job(path: str) -> dict:
    set_up_process()
    from shardwise.train.loop import Job, run

    with open(path) as fh:
        job = Job(**json.load(fh))
    return run(job)


def preload_model_classes(model: str) -> None:
    """Import the transformers module of the model's family (its config.json's model_type; `tiny` is Llama), as
    loading it would. Only transformers' own classes (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES): nothing from the model
    directory runs. A model the launcher will refuse is simply not preloaded."""
    try:
        from shardwise.models.load import lean_transformers, model_family

        lean_transformers()
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        model_type = "llama" if model == "tiny" else model_family(model)
        name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type) if model_type else None
        if isinstance(name, str):
            import transformers

            getattr(transformers, name)
    except Exception:  # noqa: BLE001 - a preload only; loading the model reports what is wrong
        pass


def preload(model: str, compile_blocks: bool = False) -> None:
    """The imports a job needs, before it is known: torch, transformers and the engine, the model family's module,
    and with `compile_blocks` inductor's (torch.compile imports it when the blocks are wrapped, 1.6 s on the H200).
    Run by a worker started early (wait_for_job) or once by the fork server its workers come from (zygote)."""
    import shardwise.train.loop  # noqa: F401 - torch, transformers and the engine

    preload_model_classes(model)
    if compile_blocks:
        import torch._inductor.compile_fx  # noqa: F401


def wait_for_job(pointer: str, model: str, compile_blocks: bool = False, poll_s: float = 0.01) -> str | None:
    """A worker started before its launcher finished checking and tokenizing (launch.early._Early): do the imports a
    job needs (preload), then wait for `pointer` to name the job (None: the launcher's checks failed, nothing to
    run)."""
    import time

    set_up_process()
    preload(model, compile_blocks)
    while not os.path.exists(pointer):
        time.sleep(poll_s)
    with open(pointer) as fh:
        return json.load(fh)["job"]


@record
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--wait":  # started early: the job is being prepared (--wait POINTER MODEL [--compile])
        job = wait_for_job(argv[1], argv[2] if len(argv) > 2 else "", "--compile" in argv[3:])
        if job is None:
            return 0  # the launcher reports why, in one line
        argv = [job]
    from shardwise.train.loop import Preempted

    with open(argv[0]) as fh:
        out = json.load(fh)["output_dir"]
    rank = os.environ.get("RANK", "0")
    alive = life_marker(out, rank)
    try:
        run_job(argv[0])
    except Preempted:
        return 0  # the checkpoint is written; the launcher says how to resume
    except ShardwiseError as e:
        # no traceback: leave the one line where the launcher reports it from
        os.makedirs(error_dir(out), exist_ok=True)
        atomic_write(os.path.join(error_dir(out), f"rank{rank}.txt"), str(e))
        return 2
    except Exception as e:
        # the traceback goes to the output; the launcher's one line names this rank and the exception's first line,
        # whichever rank the agent reports first (launch.failures._failure_report)
        first = (str(e).strip().splitlines() or [""])[0][:300]
        with contextlib.suppress(OSError):  # a full disk must not hide the exception itself
            os.makedirs(error_dir(out), exist_ok=True)
            atomic_write(os.path.join(error_dir(out), f"rank{rank}.exc"), f"{type(e).__name__}: {first}".rstrip(": "))
        raise
    finally:
        alive()
    return 0


def life_marker(output_dir: str, rank: str):
    """Mark this rank as running (error_dir/rankN.alive, its PID) until the returned function removes the mark:
    on every way out of main that Python sees (and phases.exit_deadline's). A mark left behind names a rank that
    ended without a word, killed by a signal (SIGKILL, the out-of-memory killer) or crashed: the launcher's failure
    report blames it, not a rank that then raised "a collective lost its peer" (launch.failures._failure_report; the agent
    of forked workers reports only the first failed rank it finds)."""
    from shardwise import phases

    path = os.path.join(error_dir(output_dir), f"rank{rank}.alive")
    try:
        os.makedirs(error_dir(output_dir), exist_ok=True)
        for stale in (f"rank{rank}.txt", f"rank{rank}.exc", f"rank{rank}.waiting"):  # an earlier attempt's (--max-restarts)
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(error_dir(output_dir), stale))
        atomic_write(path, str(os.getpid()))
    except OSError:
        return lambda: None

    def remove():
        try:
            os.remove(path)
        except OSError:
            pass

    phases.before_exit.append(remove)
    return remove


if __name__ == "__main__":
    code = main()
    if code == 0:
        from shardwise.phases import exit_without_teardown

        exit_without_teardown(0)
    sys.exit(code)
