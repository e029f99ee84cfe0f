"""Workers forked from a preloaded server (train/zygote.py, opt-in: SHARDWISE_FORKSERVER=1): what the fork server
gives a worker, and that a run through it trains exactly as one whose workers are their own interpreters."""

import multiprocessing
import os
import sys

import pytest
import torch

from shardwise.train import zygote
from tests.dist.shared import DDP, RTOL
from tests.dist.shared import train_args as args_of
from tests.helpers import read_metrics, run_cli


def _child(changes: str, queue, inbox) -> None:
    """In a fork of the server: what was imported before this process began, then the launcher's later
    environment taken on."""
    preloaded = sorted(m for m in ("torch", "transformers", "shardwise.train.loop") if m in sys.modules)
    zygote.let_the_server_go()
    os.environ["RANK"] = "7"  # as the agent sets it for this rank, before the entry point runs
    zygote.apply_env_changes(changes)
    import torch as t

    queue.put({"preloaded": preloaded, "late": os.environ.get("SW_ZYGOTE_LATE"), "gone": os.environ.get("SW_ZYGOTE_GONE"),
               "rank": os.environ["RANK"], "threads": t.get_num_threads()})
    queue.put(None if inbox.get() == "go" else "no")  # alive until the parent has stopped the server


@pytest.fixture
def server_env(monkeypatch):
    monkeypatch.setenv("SW_ZYGOTE_GONE", "set before the server")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setenv("RANK", "0")
    yield
    zygote.stop()


def test_a_forked_worker_starts_preloaded_with_the_launchers_environment_of_the_group_start(server_env, monkeypatch):
    assert zygote.start("", False)
    # after the server started: what the launcher sets (worker_environment), unsets and changes
    monkeypatch.setenv("SW_ZYGOTE_LATE", "set after")
    monkeypatch.delenv("SW_ZYGOTE_GONE")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("RANK", "3")  # the launcher's own; the agent's value for the rank wins
    ctx = multiprocessing.get_context("forkserver")
    to_child, from_child = ctx.SimpleQueue(), ctx.SimpleQueue()
    proc = ctx.Process(target=_child, args=(zygote.env_changes(), from_child, to_child))
    proc.start()
    got = from_child.get()
    assert got == {"preloaded": ["shardwise.train.loop", "torch", "transformers"], "late": "set after", "gone": None,
                   "rank": "7", "threads": 1}, got
    # the worker closed its end of the server's pipe: with the launcher's closed too the server leaves on its own
    # while the worker still runs (else a killed launcher's workers would outlive it)
    assert zygote.stop(timeout_s=60) is True
    os.kill(proc.pid, 0)  # still there (multiprocessing learns exit codes from the server, gone now)
    to_child.put("go")
    assert from_child.get() is None  # it answered after the server left


def test_a_long_tmpdir_still_gets_a_server(tmp_path, monkeypatch):
    """A Unix socket's path is at most 108 bytes: with a long $TMPDIR the server's socket goes under /tmp."""
    from multiprocessing import process

    long_dir = tmp_path / ("d" * 90)
    long_dir.mkdir()
    monkeypatch.setenv("TMPDIR", str(long_dir))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    monkeypatch.setitem(process.current_process()._config, "tempdir", None)
    try:
        assert zygote.start("", False)
        folder = process.current_process()._config["tempdir"]
        assert folder.startswith("/tmp/pymp-")
        # only this user can ask the server to fork: the socket 0600 in a folder 0700
        from multiprocessing import forkserver

        sock = forkserver._forkserver._forkserver_address
        assert os.path.dirname(sock) == folder
        assert os.stat(folder).st_mode & 0o777 == 0o700 and os.stat(sock).st_mode & 0o777 == 0o600
    finally:
        zygote.stop()


def test_a_run_through_the_fork_server_trains_as_one_with_its_own_interpreters(tmp_path, chat_data, ddp_ref):
    """The session's 2-rank ddp run started each worker as its own interpreter (the default); the same run through
    the fork server (SHARDWISE_FORKSERVER=1) gives the same losses, and its workers were forks of it."""
    out = tmp_path / "forked"
    p = run_cli(*args_of(out, chat_data, *DDP, "--no-save-final"), env={"SHARDWISE_FORKSERVER": "1"})
    assert p.returncode == 0, p.stderr
    torch.testing.assert_close(torch.tensor([r["loss"] for r in read_metrics(str(out))]),
                               torch.tensor(ddp_ref.losses), rtol=RTOL, atol=0)
    # the phases show it: both ranks joined the group at once (a fork starts with the imports done)
    assert "shardwise: phases:" in p.stdout


def test_it_is_opt_in(monkeypatch):
    monkeypatch.delenv("SHARDWISE_FORKSERVER", raising=False)
    assert not zygote.enabled()
    monkeypatch.setenv("SHARDWISE_FORKSERVER", "1")
    assert zygote.enabled()


def test_a_signal_to_the_launchers_process_group_still_checkpoints_and_the_workers_leave(tmp_path, chat_data):
    """SIGTERM to the whole process group (timeout, systemd, scancel) reaches the launcher, not the fork server (a
    session of its own): the workers checkpoint, the launcher leaves with 128 + 15, and the finished workers do not
    wait out the shutting-down agent's 30 s before its SIGKILL (they leave on their own)."""
    import signal
    import subprocess
    import time

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "shardwise", *args_of(out, chat_data, *DDP, "--max-steps", "5000", "--no-save-final")]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                         env={**os.environ, "SHARDWISE_FORKSERVER": "1"})
    try:
        deadline = time.monotonic() + 300
        while not ((out / "metrics.jsonl").is_file() and len((out / "metrics.jsonl").read_text().splitlines()) >= 3):
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()[1][-3000:]
            time.sleep(0.2)
        from tests.helpers import worker_processes

        workers = worker_processes(p.pid)
        assert len(workers) == 2 and all(w.name().startswith(zygote.NAME_PREFIX) for w in workers)
        os.killpg(p.pid, signal.SIGTERM)
        _, err = p.communicate(timeout=25)  # 30 s and more when finished workers waited for the agent's SIGKILL
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 128 + signal.SIGTERM, err
    assert "interrupted by signal 15; newest checkpoint: " + str(out / "checkpoints") in err, err
    assert list((out / "checkpoints").glob("step_*/meta.json"))
    assert not [w for w in workers if w.is_running() and w.status() != "zombie"]
