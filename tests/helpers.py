"""Shared test helpers: run the real CLI in a subprocess, read what a run wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
