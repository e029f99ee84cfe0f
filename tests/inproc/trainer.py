"""The in-process tier: the real Trainer of one rank, run in this pytest process.

`shardwise train` through torchrun's agent costs seconds of process start-up (the launcher, the agent, a worker
importing torch and transformers) around well under a second of training on the tiny model. For behaviour one rank
shows (what the Trainer logs, saves, resumes and writes in summary.json) that start-up buys nothing. Here:

1. the run's config is resolved from command-line arguments as `shardwise train` resolves it (the CLI's own parser,
   then config.load_config);
2. the launcher prepares the run directory as it does for every run (launch.prepare: the checks, the tokenized data,
   config.yaml, the job file);
3. the job runs on rank 0 of a one-rank group in this process: the environment torchrun's agent gives a worker
   (MASTER_ADDR/MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK ...) is set, and the worker's own entry (train/worker.py
   run_job) makes the group through train/dist.py as a worker does (rank 0 serves the store at MASTER_ADDR) and
   destroys it at the end of the run.

What a run changes in this process is put back afterwards: the environment, the working directory, the signal
handlers the Trainer installs (SIGTERM/SIGINT), the warning filters, and the process group if the run failed before
its end. Multi-rank behaviour, the launcher, torchrun, the CLI's error lines and signals stay in the real tiers.
Call it from the main thread (the Trainer installs signal handlers), one run at a time.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

from tests.dist.shared import Run as LaunchedRun
from tests.helpers import free_port


def torchrun_env(port: int | None = None) -> dict[str, str]:
    """The variables torchrun's elastic agent sets for the one worker of a one-node, one-rank group."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port or free_port()), "RANK": "0", "LOCAL_RANK": "0",
            "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_RANK": "0",
            "ROLE_WORLD_SIZE": "1", "ROLE_NAME": "default", "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "inproc",
            # the launcher's worker_environment on one node
            "GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}


@contextlib.contextmanager
def worker_process(env: dict | None = None, cwd: str | os.PathLike | None = None):
    """This process as a one-rank worker for the duration: torchrun's variables (plus `env`), `cwd`; everything
    put back on the way out, the process group included."""
    import torch.distributed as dist

    # a group left by an earlier test of this process would be taken for the run's own (init_distributed keeps one)
    assert not dist.is_initialized(), "a process group is still initialised in this process"
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    os.environ.update(torchrun_env())
    os.environ.pop("SHARDWISE_LAUNCHER_PID", None)  # a worker of this process, not of a launcher's agent
    os.environ.update({k: str(v) for k, v in (env or {}).items()})
    try:
        if cwd is not None:
            os.chdir(cwd)
        with warnings.catch_warnings():  # the worker's set-up dedupes warnings; not for the rest of the session
            yield
    finally:
        if dist.is_initialized():  # a run that failed before its end
            dist.destroy_process_group()
        for s, h in handlers.items():
            signal.signal(s, h)
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)


@dataclass
class Run(LaunchedRun):
    summary: dict | None = None
    error: BaseException | None = None  # what the run raised (a ShardwiseError: the line the CLI would print)

    def summary_file(self) -> dict:
        return json.loads((self.out / "summary.json").read_text())


def resolve(argv) -> object:
    """`shardwise train ARGV`'s resolved config (config.Resolved), as the CLI makes it."""
    from shardwise import cli, config

    args = cli.build_parser().parse_args(["train", *map(str, argv)])
    return config.load_config(args.config, config.flags_from_namespace(args))


def train(*argv, env: dict | None = None, cwd=None, check: bool = True) -> Run:
    """`shardwise train ARGV` on one rank in this process: resolved and prepared by the launcher's own code, trained by
    the worker's. With `check`, a run that raises fails the test with what it printed; else the exception is
    returned in Run.error."""
    from shardwise import launch
    from shardwise.train.worker import run_job

    out, err = io.StringIO(), io.StringIO()
    summary, error, prepared = None, None, None
    with worker_process(env, cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            prepared = launch.prepare(resolve(argv))
            assert prepared.world_size == 1, f"the in-process tier runs one rank, not {prepared.world_size}"
            summary = run_job(prepared.job_path)
        except Exception as e:  # noqa: BLE001 - returned or raised below, with the output
            error = e
        finally:
            if prepared is not None and prepared.lock is not None:
                prepared.lock.release()
    run = Run(Path(prepared.output_dir) if prepared else Path(), out.getvalue(), err.getvalue(), summary, error)
    sys.stdout.write(run.stdout)  # pytest shows it with a failure
    sys.stderr.write(run.stderr)
    if check and error is not None:
        raise AssertionError(f"shardwise train {' '.join(map(str, argv))} (in process) raised "
                             f"{type(error).__name__}: {error}\n--- stdout\n{run.stdout}\n--- stderr\n{run.stderr}"
                             ) from error
    return run
