"""Config -> prepared run -> workers.

Everything a user can get wrong is checked here, in the launching process, before any
worker runs the job and before anything is written: config, hardware fit, model directory,
every data record. Then the run directory is written (config.yaml, the tokenized data, the
job) and the workers train: in this process for a one-process `single` run, otherwise through
torchrun's elastic agent (`torch.distributed.launcher.api.elastic_launch`) with c10d
rendezvous, so the same command works on one machine, across machines and under Slurm. On
one node the agent starts the workers while the checks run (_Early): they import, then wait
for the job, or leave when a check failed.

One concern per module: preflight (the checks before anything is written), prep (reading and
tokenizing the data, writing the run directory under its lock), early (the fork server and the
workers started before the job is written), agent (torchrun's agent and rendezvous), failures
(one line for a failed worker group). This module runs them in order: train, prepare, launch.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
import time

from shardwise import phases, rundir
from shardwise.config import Resolved
from shardwise.launch.agent import _agent
from shardwise.launch.common import Interrupted, say
from shardwise.launch.early import _Early, _start_zygote_early, _stop_zygote, early_preload, early_workers, first_checks
from shardwise.launch.prep import Prepared, _begin, _prepare, _say_run_dir
from shardwise.rundir import quiet_libraries

__all__ = ["Interrupted", "Prepared", "launch", "prepare", "train"]


def train(res: Resolved, force: bool = False) -> int:
    forked = _start_zygote_early(res.cfg)  # before this process imports torch (_begin)
    try:
        cfg, lock, t0 = _begin(res)
        if not early_workers(cfg):
            _stop_zygote(forked)  # it trains in this process after all, or its workers start once it is prepared
            forked = False
    except BaseException:
        _stop_zygote(forked)
        raise
    try:
        if early_workers(cfg):
            try:
                loaded = first_checks(cfg, res)
            except BaseException:
                _stop_zygote(forked)
                raise
            return _train(None, _Early(res, cfg, lock, force, t0, loaded))
        return _train(_prepare(res, cfg, lock, force, t0))
    finally:
        if lock is not None:
            lock.release()


def prepare(res: Resolved, force: bool = False) -> Prepared:
    """Validate everything, then write the run directory. Returns what to launch."""
    cfg, lock, t0 = _begin(res)
    try:
        return _prepare(res, cfg, lock, force, t0)
    except BaseException:
        if lock is not None:
            lock.release()
        raise


def launch(p: Prepared) -> dict | None:
    cfg = p.cfg
    if p.plan.in_process:
        quiet_libraries()
        import signal

        from shardwise.train.loop import Preempted
        from shardwise.train.worker import run_job

        try:
            return run_job(p.job_path)
        except Preempted as e:
            raise Interrupted(e.signum or signal.SIGTERM) from None
    phases.release_full_gc()  # prepared: this process only runs the agent from here (phases.py)
    shutil.rmtree(rundir.error_dir(p.output_dir), ignore_errors=True)
    _agent(cfg, [p.job_path])
    return _after_agent(p)


def _after_agent(p: Prepared) -> dict | None:
    if rundir.read_interrupted(p.output_dir) is not None:  # a worker received the signal; the agent did not
        import signal

        raise Interrupted(signal.SIGTERM)
    summary = os.path.join(p.output_dir, "summary.json")
    if p.cfg.node_rank == 0 and os.path.isfile(summary):
        with open(summary) as fh:
            return json.load(fh)
    return None


def _add_exit_phase(p: Prepared, summary: dict) -> dict:
    """Rank 0 wrote its marks (.prep/timeline.json); add the exit (workers and agent gone),
    rewrite summary.json's phases_s and print them on one line."""
    path = os.path.join(p.output_dir, ".prep", "timeline.json")
    try:
        with open(path) as fh:
            marks = json.load(fh)
    except (OSError, ValueError):
        return summary
    marks["exited"] = time.time()
    summary = dict(summary, phases_s=phases.durations(marks))
    rundir.atomic_write(os.path.join(p.output_dir, "summary.json"), json.dumps(summary, indent=1))
    say(phases.line(summary["phases_s"]))
    return summary


def _train(p: Prepared | None, early: _Early | None = None) -> int:
    try:
        if early is None:
            _say_run_dir(p)
            summary = launch(p)
        else:
            early.marks["agent_start"] = time.time()
            early.thread.start()
            try:
                _agent(early.cfg, early.worker_args(), early_preload(early.cfg))
            except BaseException:
                early.finish(failed=True)  # the prepare's own error first: the workers only waited for it
                raise
            p = early.finish()
            summary = _after_agent(p)
    except Interrupted as e:
        from shardwise.train import checkpoint as ckpt

        out = p.output_dir if p is not None else early.cfg.output_dir
        last = ckpt.latest(out)
        print(f"shardwise: interrupted by signal {e.signum}; newest checkpoint: {last or 'none'}; resume with: "
              f"shardwise train {shlex.quote(out + '/config.yaml')} --output-dir {shlex.quote(out)} --resume auto",
              file=sys.stderr, flush=True)
        return 128 + e.signum
    if summary:
        summary = _add_exit_phase(p, summary)
        kind = "PEFT adapter directory" if p.cfg.tuner != "full" else "Hugging Face directory"
        final = f", final/ ({kind})" if summary.get("final_model") else ""
        say(f"outputs: {p.output_dir}/metrics.jsonl, summary.json{final}; "
            f"repeat with: shardwise train {shlex.quote(p.output_dir + '/config.yaml')}")
    return 0
