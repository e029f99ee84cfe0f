"""Workers forked from one process that has already imported what a worker needs, for a short time to first step.

A worker started as a fresh interpreter (`python -m shardwise.train.worker`) imports torch, transformers and the
model family's module itself, several CPU-seconds for every rank on the cores the launcher tokenizes on. Instead,
torchrun's elastic agent starts the workers with multiprocessing's `forkserver` start method: one server process,
started as the agent starts, imports all of that once (this module is its preload: `preload`), and every worker is
a fork of it that begins with the imports done. The agent itself is unchanged (the same LocalElasticAgent,
rendezvous, restarts, signals); only how its processes come to exist differs.

What a forked worker keeps from the plain start:
- its own session (os.setsid, as torch's subprocess start gives it): a terminal's Ctrl-C reaches the launcher,
  which stops the group, not the workers directly;
- death with the launcher (worker.die_with_launcher: its parent is the server, which leaves when the launcher's
  end of the server's pipe closes);
- the environment the launcher has when the group starts (the server's, started per run and stopped after it,
  plus what changed since: env_changes), unbuffered output, and the exit without the interpreter's teardown.

CUDA: the server never initialises CUDA (a forked child could not use it then). torch.cuda.is_available() would
count devices through the CUDA runtime and mark the process as one no child may use CUDA from, so the server asks
NVML instead (PYTORCH_NVML_BASED_CUDA_CHECK=1, torch's own switch for this). Packages that may initialise CUDA as
they are imported are hidden from the server's imports (hidden_from_server; SHARDWISE_FORKSERVER_HIDE names
them, torchao by default): where torchao is installed, transformers' model code
imports its torchao support, and that initialises CUDA on a GPU machine (torch.cuda.current_device()); a worker
that needs torchao (--float8) imports it itself after the fork. Whatever else might initialise CUDA in the server, a probe forked from it as it starts
(`start`, `cuda_trouble`) tells the launcher before any worker is forked, and the launcher then starts each worker
as its own interpreter with one note instead (launch.agent._agent); a worker still checks it was not marked.

On by default on Linux (`enabled`); SHARDWISE_FORKSERVER=0 starts each worker as its own interpreter.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

PRELOAD_ENV = "SHARDWISE_ZYGOTE_PRELOAD"  # what the server imports: {"model": DIR or "tiny" or "", "compile": bool}


def enabled() -> bool:
    """Whether the agent forks its workers from a preloaded server: on Linux, unless SHARDWISE_FORKSERVER=0 (then
    each worker is its own interpreter; docs/speed.md, "Workers forked from one preloaded server")."""
    import multiprocessing

    return (os.environ.get("SHARDWISE_FORKSERVER", "1") != "0" and sys.platform.startswith("linux")
            and "forkserver" in multiprocessing.get_all_start_methods())


def start(model: str = "", compile_blocks: bool = False) -> bool:
    """Start the server now, so that it imports while the launcher checks and prepares and the agent runs its
    rendezvous: torch, transformers and the engine, and the family module of `model` (a directory or "tiny"; ""
    for none) and inductor with `compile_blocks` (worker.preload). The workers take on what changes in this
    process's environment after it (env_changes). Nothing if it runs already; `stop` ends it. Returns False where
    the server could not start (the agent then starts each worker as its own interpreter)."""
    import multiprocessing
    from multiprocessing import forkserver, process

    fs = forkserver._forkserver
    if fs._forkserver_pid is not None:
        return True
    folder = _socket_folder()
    if not folder:
        return False
    multiprocessing.get_context("forkserver").set_forkserver_preload(["shardwise.train.zygote"])
    extra = {PRELOAD_ENV: json.dumps({"model": model, "compile": compile_blocks, "folder": folder}),
             "PYTHONUNBUFFERED": "1",  # as `python -u`: a worker's lines reach the log as they are printed
             "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}  # the server must not touch the CUDA runtime (module docstring)
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    config = process.current_process()._config
    had_tempdir, tempdir = "tempdir" in config, config.get("tempdir")
    config["tempdir"] = folder  # where multiprocessing puts the server's socket; this process's own is kept
    try:
        _server_env.clear()
        _server_env.update(os.environ)
        del _server_env[PRELOAD_ENV]  # the server drops it once preloaded (preload)
        forkserver.ensure_running()
    except OSError:
        _remove(folder)
        return False
    finally:
        if had_tempdir:
            config["tempdir"] = tempdir
        else:
            config.pop("tempdir", None)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    _folders[fs._forkserver_pid] = folder
    _start_probe()
    return True


HIDE_ENV = "SHARDWISE_FORKSERVER_HIDE"  # the packages hidden from the server's imports, comma-separated
HIDDEN_FROM_SERVER = "torchao"  # its default: packages whose import (or what imports them) initialises CUDA


def hidden_from_server() -> tuple[str, ...]:
    return tuple(n.strip() for n in os.environ.get(HIDE_ENV, HIDDEN_FROM_SERVER).split(",") if n.strip())


_probe: dict = {}  # the running server's probe: its thread, and once it is back, the probe's answer
PROBE_CUDA_MARKED = 3  # the probe's exit code where the server's imports initialised CUDA


def _start_probe() -> None:
    """Fork one short-lived child from the server, on a thread (the fork waits for the server's imports, which
    overlap the launcher's own work), to learn whether children of this server can use CUDA (cuda_trouble)."""
    import threading

    _probe.clear()

    def probe() -> None:
        import multiprocessing

        try:
            child = multiprocessing.get_context("forkserver").Process(target=_probe_child, daemon=True)
            child.start()
            child.join(PROBE_TIMEOUT_S)
            _probe["code"] = child.exitcode
        except Exception as e:  # noqa: BLE001 - a server that cannot fork is reported as such (cuda_trouble)
            _probe["code"], _probe["error"] = None, f"{type(e).__name__}: {e}"

    _probe["thread"] = threading.Thread(target=probe, name="shardwise-zygote-probe", daemon=True)
    _probe["thread"].start()


PROBE_TIMEOUT_S = 300.0  # the server's imports, on a slow shared filesystem


def _probe_child() -> None:
    """In the probe, a fork of the server: exit PROBE_CUDA_MARKED where the server had initialised CUDA (no child
    of it can use CUDA then), 0 otherwise, at once and without the interpreter's teardown."""
    torch = sys.modules.get("torch")
    marked = torch is not None and torch.cuda._is_in_bad_fork()
    os._exit(PROBE_CUDA_MARKED if marked else 0)


def cuda_trouble() -> str:
    """Why the workers should not be forked from the running server ("" where they can): its imports initialised
    CUDA, or it could not fork a child. Waits for the probe `start` began (the server's imports, at most)."""
    thread = _probe.get("thread")
    if thread is None:
        return ""
    thread.join(PROBE_TIMEOUT_S)
    code = _probe.get("code")
    if code == PROBE_CUDA_MARKED:
        return "its imports initialised CUDA, which no process forked from it could use"
    if code != 0:
        return f"it could not fork a process ({_probe.get('error') or f'exit code {code}'})"
    return ""


_folders: dict[int, str] = {}  # server pid: its socket's folder, removed when it is stopped (and by the server)


def _socket_folder() -> str:
    """A new folder (mode 0700) for one server's socket (mode 0600), under $TMPDIR, or under /tmp where $TMPDIR is
    too long for a Unix socket's path (108 bytes with the names multiprocessing adds); removed by `stop`, by the
    server as it leaves (a launcher killed with SIGKILL), else as this process exits. "" where neither can be
    used."""
    import tempfile

    base = tempfile.gettempdir()
    if len(os.fsencode(base)) > 64:
        base = "/tmp"
    try:
        folder = tempfile.mkdtemp(prefix="pymp-shardwise-", dir=base)
    except OSError:
        return ""
    from multiprocessing import util

    util.Finalize(None, _remove, args=[folder], exitpriority=-100)
    return folder


def _remove(folder: str) -> None:
    import shutil

    shutil.rmtree(folder, ignore_errors=True)


_server_env: dict[str, str] = {}  # the environment the running server started with (its children's, before theirs)


def env_changes() -> str:
    """This process's environment against the server's (JSON: [name, the server's value, this one's], None for
    unset), for the workers to take on (apply_env_changes): they see the environment of the moment the group
    starts, as a worker started as its own interpreter does, however early the server started."""
    names = sorted(set(_server_env) | set(os.environ))
    return json.dumps([[k, _server_env.get(k), os.environ.get(k)] for k in names
                       if _server_env.get(k) != os.environ.get(k) and k not in EXTRA_NAMES])


EXTRA_NAMES = ("PYTHONUNBUFFERED", "PYTORCH_NVML_BASED_CUDA_CHECK")  # the server's own, kept by the workers


def apply_env_changes(changes: str) -> None:
    """In a forked worker: env_changes taken on, except where the agent set the variable for this rank (RANK,
    MASTER_ADDR, ...: as when a worker's environment is the launcher's updated with the agent's), and the thread
    count torch took from the server's OMP_NUM_THREADS set again from this one's."""
    for name, server, now in json.loads(changes):
        if os.environ.get(name) != server:
            continue  # the agent's value for this rank
        if now is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = now
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        if torch.get_num_threads() != int(threads):
            torch.set_num_threads(int(threads))


def stop(timeout_s: float = 0.0) -> bool:
    """End the server (after the agent: its workers are gone), so the next run in this process starts one with
    that run's environment and preload. The server leaves once every holder of its pipe's write end has closed it
    (this process here, the workers when they start: let_the_server_go), but leaving, it tears down an interpreter
    that imported torch and transformers (0.2 s on the tiny CPU job), and it holds nothing: so it is killed, by
    default at once, else after `timeout_s` if still there. Returns whether it left by itself (True where none
    ran)."""
    import signal
    import time
    from multiprocessing import forkserver

    fs = forkserver._forkserver
    with fs._lock:
        pid, fd, address = fs._forkserver_pid, fs._forkserver_alive_fd, fs._forkserver_address
        if pid is None:
            return True
        fs._forkserver_pid = fs._forkserver_alive_fd = fs._forkserver_address = None
        try:
            os.close(fd)
        except OSError:
            pass
        deadline, left = time.monotonic() + timeout_s, True
        while True:
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                break
            if done:
                break
            if time.monotonic() >= deadline:
                left = False
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                os.waitpid(pid, 0)
                break
            time.sleep(0.02)
        if isinstance(address, str) and address and not address.startswith("\0"):
            try:
                os.unlink(address)
            except OSError:
                pass
        folder = _folders.pop(pid, "")
        if folder:
            _remove(folder)
        return left


def preload() -> None:
    """In the server, before it forks anything: the imports a worker needs (worker.wait_for_job's), then the
    objects alive frozen so that later collections in the workers skip them (phases.release_full_gc)."""
    from shardwise import phases

    # a session of its own: a signal to the launcher's whole process group (timeout, systemd, scancel, a terminal's
    # Ctrl-C or hang-up) must reach the launcher, which stops the workers with a checkpoint, not kill this server and
    # with it every worker (their death signal follows their parent)
    try:
        os.setsid()
    except OSError:
        pass
    phases.hold_full_gc()
    settings = json.loads(os.environ.pop(PRELOAD_ENV))
    _remove_at_exit(settings.get("folder") or "")
    before = dict(os.environ)
    from shardwise.train import worker

    with hidden(hidden_from_server()):
        worker.preload(settings.get("model", ""), bool(settings.get("compile")))
    restore_environment(before)
    phases.release_full_gc()


@contextlib.contextmanager
def hidden(names: tuple[str, ...]):
    """Within: the packages `names` look not installed (importlib.util.find_spec answers None and an import raises
    ImportError, as for a package that is not there), unless already imported; visible again after. What the
    server imports then checks for them and goes on without them: transformers keeps its torchao support off in
    the workers (shardwise's float8 imports torchao itself)."""
    hid = [name for name in names if name not in sys.modules]
    for name in hid:
        sys.modules[name] = None
    try:
        yield
    finally:
        for name in hid:
            if sys.modules.get(name, 0) is None:
                del sys.modules[name]


def restore_environment(before: dict) -> None:
    """The environment as it was in `before`: what the server's imports set (importing inductor sets
    TORCHINDUCTOR_CACHE_DIR to torch's default) is undone, so a forked worker's environment is the launcher's at
    the server's start plus the agent's per-rank variables, and apply_env_changes tells the two apart: the
    launcher's later values (its compile cache, hardware.use_compile_cache) reach the worker."""
    for name in [k for k in os.environ if k not in before]:
        del os.environ[name]
    for name, value in before.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


def _remove_at_exit(folder: str) -> None:
    """In the server: remove its socket's folder when it leaves. It leaves when the launcher is gone (its pipe
    closes), so a launcher killed with SIGKILL, whose own clean-up never runs, leaves no folder behind. Only in the
    server: its forked workers inherit the handler."""
    if not folder or not os.path.basename(folder).startswith("pymp-shardwise-"):
        return
    import atexit

    server = os.getpid()
    atexit.register(lambda: os.getpid() == server and _remove(folder))


def let_the_server_go() -> None:
    """In a forked worker: close this process's copy of the pipe end whose closing, in every holder, ends the
    server. Left open, the server outlives a killed launcher for as long as the workers run, and the workers, whose
    parent it is, never receive their death signal (worker.die_with_launcher)."""
    from multiprocessing import forkserver

    fs = forkserver._forkserver
    fd, fs._forkserver_alive_fd = fs._forkserver_alive_fd, None
    fs._forkserver_pid = fs._forkserver_address = None
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass


NAME_PREFIX = "shardwise-r"  # a forked worker's process name (/proc/PID/comm, `ps -o comm`, top): shardwise-rRANK


def name_process(rank: str) -> None:
    """Name this forked worker shardwise-rRANK (its command line is the server's): what ps and top show, and how
    bench's memory sampler and the tests find a rank's process (worker_rank)."""
    import ctypes

    pr_set_name = 15
    try:
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_name, (NAME_PREFIX + rank).encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


def worker_rank(pid: int) -> int | None:
    """The rank of a training worker process (Linux /proc), forked (its name) or started as
    `python -m shardwise.train.worker` (RANK in its environment); None for any other process."""
    try:
        with open(f"/proc/{pid}/comm") as fh:
            name = fh.read().strip()
        if name.startswith(NAME_PREFIX) and name[len(NAME_PREFIX):].isdigit():
            return int(name[len(NAME_PREFIX):])
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            if b"shardwise.train.worker" not in fh.read():
                return None
        with open(f"/proc/{pid}/environ", "rb") as fh:
            env = dict(kv.split(b"=", 1) for kv in fh.read().split(b"\0") if b"=" in kv)
        return int(env[b"RANK"])
    except (OSError, KeyError, ValueError):
        return None


def check_cuda_usable() -> None:
    """In a forked worker: the server did not mark this process unable to use CUDA (module docstring)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda._is_in_bad_fork():
        raise RuntimeError("the worker's fork server initialised CUDA before forking; run with "
                           "SHARDWISE_FORKSERVER=0 and report it")


def worker_main(env_changes: str, *argv: str) -> None:
    """The entry point of a forked worker, called by the elastic agent with the launcher's environment changes
    since the server started (env_changes) and the worker's arguments (worker.main's). It runs in its own session
    and leaves as `python -m shardwise.train.worker` would: main's exit code, and after a clean run the atexit
    handlers with no interpreter teardown (multiprocessing ends a forked process with os._exit once the agent has
    its result)."""
    os.setsid()  # as torch's subprocess start: a terminal's signal goes to the launcher, which stops the group
    from shardwise import phases

    phases.forked()  # this process starts now, not as the server did
    let_the_server_go()
    apply_env_changes(env_changes)
    name_process(os.environ.get("RANK", ""))
    hand_result_before_exit()
    from shardwise.train import worker

    worker.die_with_launcher(forked=True)
    from shardwise.phases import hold_full_gc, stop_compile_workers

    hold_full_gc()  # released after the first step (phases.py)
    check_cuda_usable()
    try:
        code = worker.main(list(argv))
    except Exception:  # noqa: BLE001 - printed as the plain worker's interpreter would, then exit 1
        # torch's wrapper would put the traceback in a pickle under $TMPDIR for the agent: into the worker's output
        # instead, as a worker started as its own interpreter prints it
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        code = 1
    if code:
        sys.exit(code)
    import atexit
    import logging

    stop_compile_workers()
    atexit._run_exitfuncs()
    logging.shutdown()
    # torch's wrapper now hands the agent this rank's result and waits for the agent's word that every rank's is in,
    # then the process ends; an agent that is shutting down (a signal to the launcher) never gives it and would
    # SIGKILL this finished worker after 30 s: it leaves on its own a moment later instead
    import threading

    leave = threading.Timer(LEAVE_AFTER_S, os._exit, args=(0,))
    leave.daemon = True
    leave.start()


LEAVE_AFTER_S = 1.0  # a finished worker's wait for the agent (it polls every 0.1 s), at most


def hand_result_before_exit() -> None:
    """In a forked worker: where the process leaves before worker_main returns (phases.exit_deadline: a finished
    run whose teardown hangs), first hand the agent this rank's result, as torch's wrapper does after the return.
    The agent counts a rank done by its result, not by its exit: without it, it would wait forever for a rank
    that is gone. The result queue is a local of torch's wrapper (elastic's multiprocessing `_wrap`), found up the
    stack; where it is not there (another torch), nothing is added."""
    from shardwise import phases

    frame = sys._getframe(1)
    while frame is not None:
        queue = frame.f_locals.get("ret_val_") if frame.f_code.co_name == "_wrap" else None
        if queue is not None and hasattr(queue, "put"):
            phases.before_exit.append(lambda: queue.put(None))
            return
        frame = frame.f_back


if os.environ.get(PRELOAD_ENV) and __name__ == "shardwise.train.zygote" and "multiprocessing.forkserver" in sys.modules \
        and sys.argv[:1] == ["-c"]:
    preload()  # imported by the fork server as its preload (start)
