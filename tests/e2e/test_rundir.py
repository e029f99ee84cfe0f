"""The run directory through the real CLI (issue 14 items 2, 5, 7, 12): what --overwrite may
delete, the lock that keeps two runs apart, the interrupted-run record, and the agent's temp
directory. (Which rank a failure report blames: tests/dist/test_reliability.py's kill-during-save.)"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from shardwise import rundir
from tests.dist.shared import COMMON
from tests.helpers import (
    chat_records,
    read_metrics,
    run_cli,
    worker_processes,
    write_jsonl,
)

ONE = ("--strategy", "single", "--nproc-per-node", "1", "--micro-batch-size", "2", "--no-save-final")


def one_line_error(p, pattern):
    assert p.returncode == 2, (p.stdout, p.stderr)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("shardwise: error: "), p.stderr
    assert re.search(pattern, lines[0]), lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory) -> str:
    return write_jsonl(str(tmp_path_factory.mktemp("data") / "chat.jsonl"), chat_records(96))


def user_files(d):
    """A directory of the user's own, with the names a run writes."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.yaml").write_text("my: own config\n")
    for sub in ("checkpoints", "tensorboard", "final"):
        (d / sub).mkdir(exist_ok=True)
        (d / sub / "keep.txt").write_text(sub)
    return d


def fake_marked_run(d):
    """A marked run directory that trained (as far as the launcher can tell), plus a user file."""
    d.mkdir(parents=True, exist_ok=True)
    (d / rundir.MARKER).write_text(json.dumps({"run_id": "r1"}))
    (d / "metrics.jsonl").write_text('{"step": 1}\n')
    (d / "notes.txt").write_text("mine")
    return d


def snapshot(d):
    return {os.path.relpath(os.path.join(b, f), d): open(os.path.join(b, f), "rb").read()
            for b, _, fs in os.walk(d) for f in fs}


@pytest.fixture
def refuse(monkeypatch, capsys):
    """`shardwise ARGS` in this process (these refusals come before any worker or write):
    returns the one error line."""
    from shardwise import cli

    def run(*argv, cwd=None, home=None):
        argv = argv if "--strategy" in argv else (*ONE, *argv)
        with monkeypatch.context() as m:
            if cwd:
                m.chdir(cwd)
            if home:
                m.setenv("HOME", str(home))
            capsys.readouterr()
            rc = cli.main(["train", *argv])
            out, err = capsys.readouterr()
        return one_line_error(subprocess.CompletedProcess([], rc, out, err), "")

    return run


def test_overwrite_never_deletes_a_directory_shardwise_did_not_mark(tmp_path, refuse):
    """14.2: the user's config.yaml, checkpoints/, tensorboard/ and final/ survive --overwrite;
    the refusal points to another --output-dir and never suggests --overwrite."""
    d = user_files(tmp_path / "user")
    before = snapshot(d)
    for extra in (("--overwrite",), ()):
        line = refuse("--output-dir", str(d), *extra)
        assert re.search(r"holds config\.yaml, checkpoints, final, tensorboard that shardwise did not mark as its "
                         r"own .*choose another --output-dir$", line), line
        assert "--overwrite to" not in line and "pass --overwrite" not in line
    assert snapshot(d) == before


def test_output_dir_dot_in_a_project_keeps_its_config(tmp_path, refuse):
    project = user_files(tmp_path / "project")
    (project / "src").mkdir()
    before = snapshot(project)
    assert re.search(r"project holds config\.yaml.*choose another --output-dir", refuse("--output-dir", ".", cwd=project))
    assert "--overwrite only replaces a run directory shardwise created" in refuse("--output-dir", ".", "--overwrite",
                                                                                    cwd=project)
    assert snapshot(project) == before
    assert sorted(os.listdir(project)) == ["checkpoints", "config.yaml", "final", "src", "tensorboard"]


def test_root_home_and_the_current_directorys_parents_are_never_cleared(tmp_path, refuse):
    assert re.search(r"flag --output-dir: / is a filesystem root; .*choose another --output-dir",
                     refuse("--output-dir", "/", "--overwrite"))
    home = fake_marked_run(tmp_path / "home")
    parent = fake_marked_run(tmp_path / "parent")
    (parent / "sub").mkdir()
    before = snapshot(tmp_path)
    assert re.search(r"home is the home directory; .*choose another --output-dir",
                     refuse("--output-dir", str(home), "--overwrite", home=home))
    assert re.search(r"parent is a parent of the current directory; --overwrite never clears it",
                     refuse("--output-dir", str(parent), "--overwrite", cwd=parent / "sub"))
    assert re.search(r"parent is the current directory; --overwrite never clears it",
                     refuse("--output-dir", ".", "--overwrite", cwd=parent))
    assert snapshot(tmp_path) == before


def test_a_failure_before_training_does_not_block_a_rerun_and_overwrite_clears_only_own_entries(
        tmp_path, chat_data, refuse):
    """14.12: a model error found only when the worker builds the model leaves no run that
    blocks a plain rerun; 14.2: clearing a marked run (that rerun, then --overwrite) removes
    shardwise's own entries and nothing else."""
    from shardwise import config, launch
    from shardwise.models.tiny import tiny_dir

    bad = tmp_path / "bad-model"
    shutil.copytree(tiny_dir(0), bad)
    weights = bad / "model.safetensors"  # a dtype safetensors does not know: found only when the worker loads it
    raw = bytearray(weights.read_bytes())
    at = raw.find(b'"F32"')
    raw[at:at + 5] = b'"F33"'
    weights.write_bytes(bytes(raw))
    out = tmp_path / "out"
    args = (*COMMON, *ONE, "--max-steps", "2", "--output-dir", str(out), "--data", chat_data)
    one_line_error(run_cli("train", *args, "--model", str(bad), check=False), r"cannot load the model")
    first_id = rundir.run_id(str(out))
    assert first_id and not rundir.has_trained(str(out))
    (out / "notes.txt").write_text("mine")

    run_cli("train", *args)  # a plain rerun: not refused
    assert [r["step"] for r in read_metrics(str(out))] == [1, 2]
    assert (out / "notes.txt").read_text() == "mine"
    assert "holds another run; pass --resume auto to continue it, --overwrite" in refuse(*args)

    (out / "mine").mkdir()
    (out / "mine" / "data.bin").write_bytes(b"\0" * 10)
    p = launch.prepare(config.load_config(None, {"output_dir": (str(out), "flag"), "overwrite": (True, "flag"),
                                                 "data": (chat_data, "flag"), "seq_len": (64, "flag")}))
    p.lock.release()
    assert not any((out / e).exists() for e in ("metrics.jsonl", "summary.json", "checkpoints", "tensorboard"))
    assert (out / "notes.txt").read_text() == "mine" and (out / "mine" / "data.bin").stat().st_size == 10
    assert rundir.run_id(str(out)) not in (None, first_id)


def _popen(*args, env=None, **kw):
    return subprocess.Popen([sys.executable, "-m", "shardwise", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})}, **kw)


def _wait_for(cond, procs, timeout=300):
    t0 = time.monotonic()
    while not cond():
        assert any(p.poll() is None for p in procs), "the runs ended before the state the test waits for"
        assert time.monotonic() - t0 < timeout, "timed out waiting"
        time.sleep(0.05)


def _sigterm_when(p, ready, timeout=600) -> str:
    """Wait until `ready()`, send SIGTERM to the launcher `p` and return its stderr once it has left; `p` is killed
    if anything before that fails."""
    try:
        _wait_for(ready, [p])
        p.send_signal(signal.SIGTERM)
        return p.communicate(timeout=timeout)[1]
    finally:
        if p.poll() is None:
            p.kill()


def test_two_runs_into_one_directory_one_runs_the_other_is_refused_naming_its_pid(tmp_path, chat_data, refuse):
    """14.7: two real runs started together into one directory; --overwrite into the live one
    is refused too and deletes nothing; the first completes normally."""
    out = tmp_path / "out"
    args = ("train", *COMMON, *ONE, "--max-steps", "40", "--save-every", "10", "--output-dir", str(out),
            "--data", chat_data)
    a, b = _popen(*args), _popen(*args)
    try:
        _wait_for(lambda: rundir.holder(str(out)) in (a.pid, b.pid) and (out / "checkpoints").is_dir()
                  and any(not n.endswith(".tmp") for n in os.listdir(out / "checkpoints")), [a, b])
        winner, loser = (a, b) if rundir.holder(str(out)) == a.pid else (b, a)
        winner.send_signal(signal.SIGSTOP)  # the live run stays live while the others try
        assert winner.poll() is None
        _, err = loser.communicate(timeout=600)
        one_line_error(subprocess.CompletedProcess([], loser.returncode, "", err),
                       rf"is in use by another shardwise run \(PID {winner.pid}\); wait for it to finish or "
                       "choose another --output-dir")
        saved = sorted(os.listdir(out / "checkpoints"))
        assert f"in use by another shardwise run (PID {winner.pid})" in refuse(*args[1:], "--overwrite")
        assert sorted(os.listdir(out / "checkpoints")) == saved
        winner.send_signal(signal.SIGCONT)
        _, err = winner.communicate(timeout=600)
        assert winner.returncode == 0, err
    finally:
        for p in (a, b):
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
    assert [r["step"] for r in read_metrics(str(out))] == list(range(1, 41))
    assert sorted(os.listdir(out / "checkpoints"))[-1] == "step_00000040"


def test_resume_after_sigterm_to_the_launcher_exits_0_and_leaves_no_agent_temp_dir(tmp_path, chat_data):
    """14.5: SIGTERM to the launcher of a 2-rank run (the agent forwards it), then a resume to
    completion exits 0 (it used to exit 143 on the old run's record). 14.12: neither run leaves
    a temporary directory of the agent's in $TMPDIR."""
    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    out = tmp_path / "out"
    args = ("train", *COMMON, "--data", chat_data, "--strategy", "ddp", "--nproc-per-node", "2",
            "--micro-batch-size", "2", "--max-steps", "100", "--output-dir", str(out))
    env = {"TMPDIR": str(tmp)}
    p = _popen(*args, env=env)
    err = _sigterm_when(p, lambda: (out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text().strip())
    assert p.returncode == 128 + signal.SIGTERM, err
    assert "resume with: shardwise train" in err
    assert rundir.read_interrupted(str(out))  # kept for `shardwise ui` until the next run starts
    step = len(read_metrics(str(out)))
    assert 1 <= step < 100
    done = run_cli(*args, "--resume", "auto", env=env)
    assert done.returncode == 0 and "interrupted" not in done.stderr
    assert rundir.read_interrupted(str(out)) is None
    assert [r["step"] for r in read_metrics(str(out))] == list(range(1, 101))
    assert not [n for n in os.listdir(tmp) if n.startswith(("torchelastic_", "shardwise-agent-", "shardwise-job-"))], \
        os.listdir(tmp)


def test_a_signal_while_the_launcher_still_prepares_stops_the_early_workers_and_writes_nothing(tmp_path):
    """The agent starts the workers while the launcher checks and tokenizes (launch.early._Early). SIGTERM in that window
    (the workers are up, the data still being tokenized): the launcher leaves with 128 + 15; no worker is left and
    the output directory was never made."""
    import psutil

    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    data = write_jsonl(str(tmp_path / "big.jsonl"), chat_records(6000) * 20)  # seconds of tokenizing
    out = tmp_path / "out"
    p = _popen("train", *COMMON, "--data", data, "--no-data-cache", "--strategy", "ddp", "--nproc-per-node", "2",
               "--micro-batch-size", "2", "--max-steps", "2", "--output-dir", str(out), env={"TMPDIR": str(tmp)})

    def workers():
        return worker_processes(p.pid)

    started = []

    def both_up() -> bool:
        started[:] = workers()
        if len(started) != 2:
            return False
        assert not out.exists()  # still preparing: nothing written yet
        return True

    err = _sigterm_when(p, both_up, timeout=120)
    assert p.returncode == 128 + signal.SIGTERM, err
    assert "interrupted by signal 15" in err and "Traceback" not in err, err
    assert not out.exists(), "a run cancelled while preparing wrote its directory"
    # a signal while the agent is still starting the group leaves it no PIDs to stop: such workers end on their
    # own (worker.die_with_launcher) within moments, before importing torch; none may outlive that
    _, alive = psutil.wait_procs(started, timeout=30)
    assert not [w for w in alive if w.is_running() and w.status() != psutil.STATUS_ZOMBIE], alive
    assert not [n for n in os.listdir(tmp) if n.startswith(("shardwise-job-", "shardwise-agent-"))], os.listdir(tmp)
