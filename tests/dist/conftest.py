"""Session-wide data and reference runs for the multi-rank tests (see shared.py)."""

import pytest

from tests.dist.shared import SESSION_RUNS, Run, train_args
from tests.helpers import ConcurrentRuns, chat_records, write_jsonl


@pytest.fixture(scope="session")
def chat_data(tmp_path_factory) -> str:
    return write_jsonl(str(tmp_path_factory.mktemp("data") / "chat.jsonl"), chat_records(96))


@pytest.fixture(scope="session")
def _session_runs(tmp_path_factory, chat_data):
    """Every SESSION_RUNS run, started together (two at a time) when the first is needed."""
    runs, outs = ConcurrentRuns(), {}
    for name, extra in SESSION_RUNS.items():
        outs[name] = tmp_path_factory.mktemp(f"session-{name}")
        runs.add(name, *train_args(outs[name], chat_data, *extra))

    def get(name: str) -> Run:
        return Run(outs[name], runs.get(name).stdout)

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
