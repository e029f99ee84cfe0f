"""Workers forked from a preloaded server (train/zygote.py, the default; SHARDWISE_FORKSERVER=0 turns it off): what
the fork server gives a worker, that a run through it trains exactly as one whose workers are their own interpreters,
and how it fails, stops and cleans up."""

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

    from shardwise import phases

    phases.forked()
    queue.put({"preloaded": preloaded, "late": os.environ.get("SW_ZYGOTE_LATE"), "gone": os.environ.get("SW_ZYGOTE_GONE"),
               "rank": os.environ["RANK"], "threads": t.get_num_threads(), "started": phases.process_start(),
               "inductor_cache": os.environ.get("TORCHINDUCTOR_CACHE_DIR")})
    queue.put(None if inbox.wait(120) else "no")  # alive until the parent has stopped the server (or gone)


@pytest.fixture
def server_env(monkeypatch):
    monkeypatch.setenv("SW_ZYGOTE_GONE", "set before the server")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setenv("RANK", "0")
    yield
    zygote.stop()


def test_a_forked_worker_starts_preloaded_with_the_launchers_environment_of_the_group_start(server_env, monkeypatch):
    import time

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert zygote.start("", True)  # with inductor, whose import sets TORCHINDUCTOR_CACHE_DIR in the server
    # after the server started: what the launcher sets (worker_environment, its compile cache), unsets and changes
    monkeypatch.setenv("SW_ZYGOTE_LATE", "set after")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/the/launchers/compile/cache")
    monkeypatch.delenv("SW_ZYGOTE_GONE")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("RANK", "3")  # the launcher's own; the agent's value for the rank wins
    ctx = multiprocessing.get_context("forkserver")
    to_child, from_child = ctx.Event(), ctx.SimpleQueue()
    proc = ctx.Process(target=_child, args=(zygote.env_changes(), from_child, to_child))
    before = time.time()
    proc.start()
    got = from_child.get()
    # the worker's start is its fork, not the server's (summary.json's worker phases)
    assert got.pop("started") >= before - 0.05, "process_start is the server's"
    assert got == {"preloaded": ["shardwise.train.loop", "torch", "transformers"], "late": "set after", "gone": None,
                   "rank": "7", "threads": 1, "inductor_cache": "/the/launchers/compile/cache"}, got
    # the worker closed its end of the server's pipe: with the launcher's closed too the server leaves on its own
    # while the worker still runs (else a killed launcher's workers would outlive it)
    assert zygote.stop(timeout_s=60) is True
    os.kill(proc.pid, 0)  # still there (multiprocessing learns exit codes from the server, gone now)
    to_child.set()
    assert from_child.get() is None  # it answered after the server left


def test_a_long_tmpdir_still_gets_a_server(tmp_path, monkeypatch):
    """A Unix socket's path is at most 108 bytes: with a long $TMPDIR the server's socket goes under /tmp."""
    from multiprocessing import process

    long_dir = tmp_path / ("d" * 90)
    long_dir.mkdir()
    monkeypatch.setenv("TMPDIR", str(long_dir))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    # multiprocessing caches its temporary folder for the whole process on first use: one made under the long
    # $TMPDIR here would outlive the test, and any later forkserver's socket in it would be too long to bind
    config = process.current_process()._config
    monkeypatch.setitem(config, "tempdir", config.get("tempdir"))
    if config["tempdir"] is None:
        del config["tempdir"]
    try:
        assert zygote.start("", False)
        # only this user can ask the server to fork: the socket 0600 in a folder 0700, of its own
        from multiprocessing import forkserver

        sock = forkserver._forkserver._forkserver_address
        folder = os.path.dirname(sock)
        assert folder.startswith("/tmp/pymp-shardwise-") and process.current_process()._config.get("tempdir") != folder
        assert os.stat(folder).st_mode & 0o777 == 0o700 and os.stat(sock).st_mode & 0o777 == 0o600
    finally:
        zygote.stop()
    assert not os.path.exists(folder)  # stop removes it


def test_a_run_through_the_fork_server_trains_as_one_with_its_own_interpreters(tmp_path, chat_data, ddp_ref):
    """The session's 2-rank ddp run forked its workers (the default); the same run with each worker its own
    interpreter (SHARDWISE_FORKSERVER=0) gives the same losses."""
    out = tmp_path / "own-interpreters"
    p = run_cli(*args_of(out, chat_data, *DDP, "--no-save-final"), env={"SHARDWISE_FORKSERVER": "0"})
    assert p.returncode == 0, p.stderr
    torch.testing.assert_close(torch.tensor([r["loss"] for r in read_metrics(str(out))]),
                               torch.tensor(ddp_ref.losses), rtol=RTOL, atol=0)
    assert "shardwise: phases:" in p.stdout


def test_it_is_on_by_default_and_can_be_turned_off(monkeypatch):
    monkeypatch.delenv("SHARDWISE_FORKSERVER", raising=False)
    assert zygote.enabled() == sys.platform.startswith("linux")
    monkeypatch.setenv("SHARDWISE_FORKSERVER", "0")
    assert not zygote.enabled()


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
                         env={k: v for k, v in os.environ.items() if k != "SHARDWISE_FORKSERVER"})
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


def _finishes_then_hangs_in_teardown() -> str:
    """A forked worker's entry point whose run is complete and whose teardown then hangs: exit_deadline ends it
    (as loop.finish arms it) while it is still inside the entry point."""
    import time

    from shardwise import phases

    zygote.hand_result_before_exit()
    phases.exit_deadline(0.5, "test rank", backstop_s=60)
    time.sleep(120)
    return "never"


def test_a_worker_ended_by_its_exit_deadline_still_counts_as_done(tmp_path):
    """torch's elastic multiprocessing counts a forked rank done by the result it hands over, not by its exit: a
    worker the deadline ends inside its entry point hands it first, so the agent does not wait forever."""
    import time

    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

    pc = start_processes("zygote-test", _finishes_then_hangs_in_teardown, args={0: (), 1: ()},
                         envs={0: {"RANK": "0"}, 1: {"RANK": "1"}}, start_method="forkserver",
                         logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path)))
    try:
        deadline, result = time.monotonic() + 60, None
        while result is None and time.monotonic() < deadline:
            result = pc.wait(timeout=1)
        assert result is not None, "the agent still waits for ranks that are gone"
        assert not result.is_failed() and result.return_values == {0: None, 1: None}
    finally:
        pc.close()


def test_a_launcher_killed_with_sigkill_leaves_no_socket_folder(tmp_path):
    """The server leaves when its launcher is gone and takes its socket's folder with it (the launcher's own
    clean-up never runs after SIGKILL)."""
    import signal
    import subprocess
    import time

    code = ("import os, time; from multiprocessing import forkserver; from shardwise.train import zygote; "
            "assert zygote.start('', False); print(os.path.dirname(forkserver._forkserver._forkserver_address), "
            "flush=True); time.sleep(600)")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        folder = p.stdout.readline().strip()
        assert os.path.basename(folder).startswith("pymp-shardwise-") and os.path.isdir(folder)
        p.send_signal(signal.SIGKILL)
        p.wait(30)
        deadline = time.monotonic() + 60
        while os.path.exists(folder) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not os.path.exists(folder), os.listdir(folder)
    finally:
        if p.poll() is None:
            p.kill()


def test_a_forked_workers_exception_is_in_its_output_and_the_line_names_it(tmp_path, chat_data):
    """A worker's exception (an injected out-of-memory at step 2) prints its traceback to the run's output, as a
    worker started as its own interpreter does, not into a pickle under $TMPDIR; the one line says what it was."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    out = tmp_path / "oom"
    p = run_cli(*args_of(out, chat_data, *DDP, "--no-save-final"),
                env={"SHARDWISE_FAULT": "oom@2:rank1", "TMPDIR": str(tmp)}, check=False)
    assert p.returncode != 0
    assert "Traceback (most recent call last)" in p.stderr and "injected out-of-memory at step 2" in p.stderr, p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith("shardwise: error: out of memory on rank 1"), p.stderr[-2000:]
    assert not list(tmp.rglob("*.pickle"))


def _stand_in_torchao(root) -> None:
    """A package installed as torchao 0.17.0 (its metadata included, so transformers takes it for torchao, as it
    imports it whenever it is installed) whose import leaves a mark naming the importing process: what the real
    one does at that moment (initialise CUDA on a GPU machine) would leave every child of the server unable to use
    CUDA."""
    pkg = root / "torchao"
    (pkg / "prototype" / "safetensors").mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "import os\n__version__ = '0.17.0'\n"
        "with open(os.path.join(os.environ['SW_TORCHAO_MARKS'], str(os.getpid())), 'w'):\n    pass\n")
    (pkg / "prototype" / "__init__.py").write_text("")
    (pkg / "prototype" / "safetensors" / "__init__.py").write_text("")
    (pkg / "prototype" / "safetensors" / "safetensors_support.py").write_text(
        "def flatten_tensor_state_dict(*a, **k):\n    raise NotImplementedError\n")
    info = root / "torchao-0.17.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torchao\nVersion: 0.17.0\n")


def _fork_child_imports(queue) -> None:
    """In a fork of the server: whether the server had imported torchao, then torchao imported here, as a worker
    that runs --float8 imports it (models/float8.py)."""
    before = "torchao" in sys.modules
    try:
        import torchao

        queue.put({"server_had_it": before, "imported_here": torchao.__version__, "pid": os.getpid()})
    except Exception as e:  # noqa: BLE001 - the test shows it
        queue.put({"error": repr(e)})


def test_the_server_imports_no_package_that_may_initialise_cuda_and_its_workers_still_can(tmp_path, monkeypatch):
    """The preload (torch, transformers, the engine, the tiny model's family) with torchao installed: transformers
    would import its torchao support, which initialises CUDA on a GPU machine (every launched run failed there);
    the server hides it, a forked worker imports it itself, and the probe finds the server usable."""
    marks = tmp_path / "marks"
    marks.mkdir()
    _stand_in_torchao(tmp_path / "site")
    site = str(tmp_path / "site")
    monkeypatch.syspath_prepend(site)  # a forked child's sys.path is this process's
    # the server's is its own interpreter's, from the environment
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [site, os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("SW_TORCHAO_MARKS", str(marks))
    monkeypatch.delenv(zygote.HIDE_ENV, raising=False)
    zygote.stop()  # a server an earlier test left (multiprocessing starts a plain one on demand) has another sys.path
    try:
        assert zygote.start("tiny", False)
        from multiprocessing import forkserver

        server = forkserver._forkserver._forkserver_pid
        assert zygote.cuda_trouble() == ""  # waits for the server's imports
        ctx = multiprocessing.get_context("forkserver")
        queue = ctx.Queue()
        proc = ctx.Process(target=_fork_child_imports, args=(queue,))
        proc.start()
        got = queue.get(timeout=120)
        proc.join(60)
    finally:
        zygote.stop()
    assert str(server) not in os.listdir(marks), "the fork server imported torchao"
    assert got == {"server_had_it": False, "imported_here": "0.17.0", "pid": got["pid"]}
    assert os.listdir(marks) == [str(got["pid"])]


def test_hidden_packages_look_not_installed_within_and_come_back_after(tmp_path, monkeypatch):
    import importlib.util

    _stand_in_torchao(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("SW_TORCHAO_MARKS", str(tmp_path))
    monkeypatch.delitem(sys.modules, "torchao", raising=False)
    monkeypatch.setenv(zygote.HIDE_ENV, " torchao, other ,")
    assert zygote.hidden_from_server() == ("torchao", "other")
    with zygote.hidden(zygote.hidden_from_server()):
        assert importlib.util.find_spec("torchao") is None
        with pytest.raises(ImportError):
            import torchao  # noqa: F401
    assert importlib.util.find_spec("torchao") is not None and "torchao" not in sys.modules
    monkeypatch.setenv(zygote.HIDE_ENV, "")
    assert zygote.hidden_from_server() == ()

