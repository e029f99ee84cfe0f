"""Shared test helpers: run the real CLI in a subprocess, read what a run wrote."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def benchmark_module(name: str):
    """benchmarks/NAME.py as a module (the scripts are not a package), for tests that predict through its helpers."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# What the fork server of forked_ranks imports as it starts, beside the first caller's own modules: what the
# tests/dist modules that fork ranks import (so a later module's ranks import only the test module itself), DeepSpeed
# included (3 CPU-s in every rank that imported it itself), its accelerator chosen as those ranks choose it
# (DS_ACCELERATOR=cpu, set for the server's start: every forked rank runs on the CPU, over gloo).
FORKED_PRELOAD = ("torch", "transformers", "pytest", "deepspeed", "shardwise.strategies",
                  "shardwise.strategies.gradnorm", "shardwise.strategies.parallelize", "shardwise.train.loop",
                  "shardwise.train.dist", "shardwise.train.evaluate", "shardwise.models.sequence_parallel",
                  "tests.helpers")
_parked: dict = {}  # forked_ranks' fork server between uses (_server_fields)


@contextlib.contextmanager
def forked_ranks(*preload: str):
    """A multiprocessing context (yielded) whose processes are forks of one server that has imported torch,
    transformers, FORKED_PRELOAD and the modules `preload` (multiprocessing's forkserver; start them with
    `torch.multiprocessing.start_processes(..., start_method="forkserver")`). A spawned rank is a fresh interpreter
    that imports all of that itself, 2-5 CPU-s a rank on the suite's 2 cores; here the server imports it once and
    every rank begins with it imported.

    The server is started by the first use in this process and kept for the later ones (a start is 5-8 CPU-s of
    imports, and a suite run has a dozen uses): the ranks set their own RANK and the rest, multiprocessing sends
    each process the working directory and sys.path, and a test module no earlier use preloaded is imported by the
    ranks whose target it holds. The fork server is one per process and shardwise's launcher uses it too
    (train/zygote.py, as in-process CLI calls may), so one left running is stopped on the way in; this one is in
    multiprocessing's slot only inside the context, and is taken out of it (still running) on the way out, with the
    preload put back: outside, multiprocessing finds no server, as after zygote.stop."""
    import multiprocessing
    from multiprocessing import forkserver

    from shardwise.train import zygote

    zygote.stop()  # one an earlier test left would fork from its own preload and environment
    fs = forkserver._forkserver
    saved = list(fs._preload_modules)
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([*FORKED_PRELOAD, *preload])  # read where a server starts: none parked, or it died
    parked = _parked.pop("server", None)
    if parked is not None and not _alive_child(parked["_forkserver_pid"]):
        os.close(parked["_forkserver_alive_fd"])
        parked = None  # gone: a new one is started below
    try:
        with fs._lock:
            for key in _server_fields(fs):
                setattr(fs, key, (parked or {}).get(key))
        if parked is None:  # started here, with the environment its ranks get
            before = os.environ.get("DS_ACCELERATOR")
            os.environ["DS_ACCELERATOR"] = "cpu"
            try:
                forkserver.ensure_running()
            finally:
                if before is None:
                    del os.environ["DS_ACCELERATOR"]
                else:
                    os.environ["DS_ACCELERATOR"] = before
        yield ctx
    finally:
        with fs._lock:
            if fs._forkserver_pid is not None:
                _parked["server"] = {key: getattr(fs, key) for key in _server_fields(fs)}
            for key in _server_fields(fs):
                setattr(fs, key, None)
        ctx.set_forkserver_preload(saved)


def _server_fields(fs) -> list[str]:
    """The running server's fields of a multiprocessing ForkServer: pid, "alive" pipe end, socket address (and, in
    the Pythons that have one, its authentication key); all None where none runs."""
    return [key for key in vars(fs) if key.startswith("_forkserver_")]


def _alive_child(pid: int) -> bool:
    """Whether `pid`, a child of this process, still runs (multiprocessing's own check, which raises where the child
    was reaped by someone else)."""
    try:
        return os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:
        return False


def free_port() -> int:
    """A free TCP port on the loopback interface (as torchrun's standalone rendezvous picks one)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(pids, descendants: bool = False) -> list[str]:
    """"ip:port" of every TCP socket in LISTEN state owned by these processes (and, with `descendants`, by their
    children's children too); processes gone meanwhile are skipped."""
    import psutil

    procs = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            procs += [p, *(p.children(recursive=True) if descendants else [])]
        except psutil.NoSuchProcess:
            continue
    found = []
    for p in procs:
        try:
            conns = p.net_connections(kind="tcp")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        found += [f"{c.laddr.ip}:{c.laddr.port}" for c in conns if c.status == psutil.CONN_LISTEN]
    return found


def worker_processes(launcher_pid: int) -> list:
    """A launcher's training workers (psutil processes): forks of its fork server (train/zygote.py, named
    shardwise-rRANK), or with SHARDWISE_FORKSERVER=0 interpreters running shardwise.train.worker."""
    import psutil

    from shardwise.train.zygote import worker_rank

    try:
        procs = psutil.Process(launcher_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    return [p for p in procs if worker_rank(p.pid) is not None]


def run_cli(*args: str, timeout: float = 600, env: dict | None = None, cwd: str | None = None,
            check: bool = True) -> subprocess.CompletedProcess:
    """`python -m shardwise ARGS` with captured output; raises with the output on failure."""
    full_env = {**os.environ, **(env or {})}
    try:
        p = subprocess.run([sys.executable, "-m", "shardwise", *args], capture_output=True, text=True,
                           timeout=timeout, env=full_env, cwd=cwd)
    except subprocess.TimeoutExpired as e:  # show what the run printed before it was stopped
        out, err = (x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (e.stdout, e.stderr))
        raise AssertionError(f"shardwise {' '.join(args)} did not finish within {timeout:g} s\n"
                             f"--- stdout\n{out[-6000:]}\n--- stderr\n{err[-6000:]}") from None
    if check and p.returncode != 0:
        raise AssertionError(f"shardwise {' '.join(args)} exited {p.returncode}\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}")
    return p


class ConcurrentRuns:
    """Independent `shardwise` runs started together, `jobs` at a time (the first `get` starts
    every run added so far). A launch spends much of its time in one process (the launcher's
    imports and tokenization, one-process runs), so two at a time use both cores of a small
    CI machine. Only for runs whose results do not depend on timing; a run's failure is
    raised by the `get` of that run only. A run added with `after=NAME` (a run added before
    it) starts once that one has finished."""

    def __init__(self, jobs: int | None = None):
        # under pytest-xdist the other worker's tests use the second core: one run at a time here
        self.jobs = jobs or (1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)
        self.pending: dict[str, tuple[tuple, dict]] = {}
        self.results: dict[str, subprocess.CompletedProcess | AssertionError] = {}

    def add(self, name: str, *args: str, after: str | None = None, **kwargs) -> None:
        """A run of `run_cli(*args, **kwargs)`."""
        assert name not in self.pending and name not in self.results, name
        assert after is None or after in self.pending, f"{name}: add {after} first"
        self.pending[name] = (args, after, kwargs)

    def _start(self) -> None:
        batch, self.pending = list(self.pending.items()), {}
        futures = {}

        def one(name, args, after, kwargs):
            if after is not None:
                # submitted earlier, so it is running or done: waiting cannot starve the pool
                if isinstance(futures[after].result(), AssertionError):
                    return AssertionError(f"{name} not run: {after} failed")
            try:
                return run_cli(*args, **kwargs)
            except AssertionError as e:
                return e

        with ThreadPoolExecutor(max_workers=self.jobs) as pool:
            for name, (args, after, kwargs) in batch:  # in order: a run's `after` is submitted first
                futures[name] = pool.submit(one, name, args, after, kwargs)
            self.results.update({name: f.result() for name, f in futures.items()})

    def get(self, name: str) -> subprocess.CompletedProcess:
        if name not in self.results:
            self._start()
        r = self.results[name]
        if isinstance(r, AssertionError):
            raise r
        return r


def read_metrics(out_dir: str) -> list[dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def losses(out_dir: str) -> list[float]:
    return [r["loss"] for r in read_metrics(out_dir)]


def write_jsonl(path: str, records: list) -> str:
    with open(path, "w") as fh:
        for r in records:
            fh.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def chat_records(n: int = 64) -> list[dict]:
    """Chat examples whose lengths and numbers of loss tokens differ."""
    out = []
    for i in range(n):
        q = " ".join(["apple", "river", "stone", "cloud"][: 1 + i % 4]) * (1 + i % 3)
        a = " ".join(["green", "quiet", "music"][: 1 + (i * 7) % 3]) * (1 + (i * 5) % 4)
        out.append({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
    return out


def shared_tmp_root(tmp_path_factory):
    """The base temporary directory of the whole pytest run: under pytest-xdist every worker's
    own base (popen-gwN) lies in it, so the workers can share what they make there."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


class SharedRuns:
    """Runs made once per pytest invocation and read by every xdist worker that needs them.

    Each run has a lock file in `root`; a worker that needs the runs claims the unclaimed ones
    one at a time (a non-blocking flock), runs each into a directory of its own and records the
    outcome (output directory and stdout, or the failure) in NAME.json before it lets go, then
    waits for the runs the other worker claimed. Both workers arriving together split the runs;
    one arriving later only reads. A worker that died mid-run leaves no record: the next one
    that needs the run makes it again."""

    def __init__(self, root, runs: dict):
        self.root, self.runs = root, runs  # name -> (make_args(out) -> tuple of CLI args)
        os.makedirs(root, exist_ok=True)
        # as ConcurrentRuns: one at a time under xdist (the other worker uses the other core)
        self.jobs = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2

    def _record(self, name: str) -> dict | None:
        path = os.path.join(self.root, f"{name}.json")
        if os.path.isfile(path):
            with open(path) as fh:
                return json.load(fh)
        return None

    def _make(self, name: str) -> None:
        import tempfile

        out = tempfile.mkdtemp(prefix=f"{name}-", dir=self.root)
        try:
            p = run_cli(*self.runs[name](os.path.join(out, "run")))
            record = {"out": os.path.join(out, "run"), "stdout": p.stdout, "stderr": p.stderr}
        except AssertionError as e:
            record = {"error": str(e)}
        tmp = os.path.join(self.root, f".{name}.json.tmp")
        with open(tmp, "w") as fh:
            json.dump(record, fh)
        os.replace(tmp, os.path.join(self.root, f"{name}.json"))

    def _with_lock(self, name: str, blocking: bool) -> bool:
        """Make `name` under its lock unless it is recorded; False when another holds the lock."""
        import fcntl

        fd = os.open(os.path.join(self.root, f"{name}.lock"), os.O_RDWR | os.O_CREAT)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            except BlockingIOError:
                return False
            if self._record(name) is None:
                self._make(name)
            return True
        finally:
            os.close(fd)  # releases the lock

    def get(self, name: str) -> dict:
        """{"out", "stdout", "stderr"} of the run; its failure is raised here."""
        if self._record(name) is None:
            def claim_free():  # the unclaimed ones, this one included when free
                for other in self.runs:
                    self._with_lock(other, blocking=False)

            with ThreadPoolExecutor(max_workers=self.jobs) as pool:  # flock: each thread's own open
                for f in [pool.submit(claim_free) for _ in range(self.jobs)]:
                    f.result()
            self._with_lock(name, blocking=True)  # the other worker's, when it holds it
        record = self._record(name)
        if "error" in record:
            raise AssertionError(record["error"])
        return record
