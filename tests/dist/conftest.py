"""Session-wide data and reference runs for the multi-rank tests (see shared.py)."""

import os
from pathlib import Path

import pytest

from tests.dist.shared import SESSION_RUNS, Run, train_args
from tests.helpers import SharedRuns, chat_records, shared_tmp_root, write_jsonl


@pytest.fixture(scope="session")
def chat_data(tmp_path_factory) -> str:
    """One file for every xdist worker (the session runs below name it in their flags)."""
    d = shared_tmp_root(tmp_path_factory) / "dist-data"
    d.mkdir(exist_ok=True)
    path = d / "chat.jsonl"
    if not path.is_file():  # the same bytes from either worker: the last replace wins, whole
        tmp = write_jsonl(str(d / f".chat-{os.getpid()}.jsonl"), chat_records(96))
        os.replace(tmp, path)
    return str(path)


@pytest.fixture(scope="session")
def _session_runs(tmp_path_factory, chat_data):
    """Every SESSION_RUNS run, made once per pytest invocation: the xdist workers that need
    them split them and read each other's (tests/helpers.py SharedRuns). They cost about a
    minute of both cores, which each worker spent again when it made its own."""
    runs = SharedRuns(shared_tmp_root(tmp_path_factory) / "dist-session-runs",
                      {name: (lambda out, extra=extra: train_args(out, chat_data, *extra))
                       for name, extra in SESSION_RUNS.items()})

    def get(name: str) -> Run:
        r = runs.get(name)
        return Run(Path(r["out"]), r["stdout"], r["stderr"])

    return get


@pytest.fixture(scope="session")
def ddp_ref(_session_runs) -> Run:
    return _session_runs("ddp")


@pytest.fixture(scope="session")
def single_ref(_session_runs) -> Run:
    return _session_runs("single")


@pytest.fixture(scope="session")
def lora_single_ref(_session_runs) -> Run:
    return _session_runs("lora_single")


@pytest.fixture(scope="session")
def ddp_gc_timed(_session_runs) -> Run:
    return _session_runs("ddp_gc_timed")
