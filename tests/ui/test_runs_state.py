"""How the Runs page tells a run's state from what the launcher and the run directory leave."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil

from shardwise.ui import runs


def _record(run, proc) -> None:
    with open(os.path.join(run, runs.RECORD), "w") as fh:
        json.dump({"pid": proc.pid, "create_time": psutil.Process(proc.pid).create_time(), "started": time.time() - 1}, fh)


def _log(run, *lines) -> None:
    with open(os.path.join(run, runs.LOG), "a") as fh:
        fh.write("\n".join(lines) + "\n")


def test_state_follows_the_launcher_and_only_its_newest_attempt(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    # a stand-in launcher: its command line names `shardwise train` into this run directory, as the page's does
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "shardwise", "train",
                             f"--output-dir={run}"])
    try:
        _record(run, proc)
        _log(run, runs.ATTEMPT + "shardwise train ...")
        assert runs.state(str(run))[0] == "running"
    finally:
        proc.kill()
        proc.wait()
    assert runs.state(str(run)) == ("failed", "the launcher exited without a message (killed?); see ui-launch.log")
    _log(run, "shardwise: interrupted by signal 15; newest checkpoint: c; resume with: shardwise train ...")
    assert runs.state(str(run))[0] == "interrupted"
    # a resumed attempt: the old attempt's line no longer counts
    _log(run, runs.ATTEMPT + "shardwise train ... --resume=auto", "shardwise: error: out of memory on rank 1 (...)")
    assert runs.state(str(run)) == ("failed", "out of memory on rank 1 (...)")
    _log(run, runs.ATTEMPT + "shardwise train ... --resume=auto")
    (run / "summary.json").write_text("{}")
    assert runs.state(str(run)) == ("finished", "summary.json written")


def test_runs_started_from_a_terminal(tmp_path):
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "config.yaml").write_text("strategy: ddp\n")
    (tmp_path / "done" / "summary.json").write_text("{}")
    stopped = tmp_path / "stopped" / ".prep"
    stopped.mkdir(parents=True)
    (tmp_path / "stopped" / "config.yaml").write_text("strategy: fsdp\n")
    (stopped / "interrupted.json").write_text('{"step": 7, "checkpoint": "c"}')
    errs = tmp_path / "bad" / ".prep" / "errors"
    errs.mkdir(parents=True)
    (tmp_path / "bad" / "metrics.jsonl").write_text("")
    (errs / "rank1.txt").write_text("rank 1: a collective did not complete within --collective-timeout 60s\n")
    (tmp_path / "not-a-run").mkdir()
    found = {os.path.basename(p): runs.state(p) for p in runs.find(str(tmp_path))}
    assert set(found) == {"done", "stopped", "bad"}
    assert found["done"][0] == "finished"
    assert found["stopped"][0] == "interrupted" and "step 7" in found["stopped"][1]
    assert found["bad"] == ("failed", "rank 1: a collective did not complete within --collective-timeout 60s")
    assert [d["key"] for d in runs.diff(str(tmp_path / "done"), str(tmp_path / "stopped"))] == ["strategy"]


def test_commands_to_copy_survive_a_shell(tmp_path):
    """The resume and export commands shown for a run in a directory with a space and a quote
    split, in a shell, into the arguments they name."""
    import shlex

    run = tmp_path / "my runs" / "it's"
    (run / "checkpoints").mkdir(parents=True)
    c = runs.commands(str(run))
    assert shlex.split(c["resume"]) == ["shardwise", "train", f"{run}/config.yaml", "--output-dir", str(run),
                                        "--resume", "auto"]
    assert shlex.split(c["export"]) == ["shardwise", "export", str(run), "--out", f"{run}-export"]


def test_a_run_is_named_relative_to_a_linked_runs_directory(tmp_path):
    """A runs directory reached through a symlink: a run resolved by its name is named the same
    (not '../real/r')."""
    (tmp_path / "real" / "r").mkdir(parents=True)
    (tmp_path / "real" / "r" / "summary.json").write_text("{}")
    link = tmp_path / "runs"
    link.symlink_to(tmp_path / "real")
    assert runs.info(str(link), runs.resolve(str(link), "r"))["name"] == "r"
    assert [runs.info(str(link), p)["name"] for p in runs.find(str(link))] == ["r"]
