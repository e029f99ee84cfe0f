"""Fixtures of the in-process tier (trainer.py): one-rank runs of the real Trainer in the pytest process."""

import pytest

from tests.helpers import chat_records, write_jsonl
from tests.inproc.trainer import worker_process


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory) -> str:
    """The multi-rank tiers' data (tests/dist/conftest.py): 96 chat records of varied lengths."""
    return write_jsonl(str(tmp_path_factory.mktemp("data") / "chat.jsonl"), chat_records(96))


@pytest.fixture
def one_rank_group():
    """A one-rank gloo group in this process, made as a torchrun worker makes it (train/dist.py init_distributed:
    rank 0 serves the store at MASTER_ADDR:MASTER_PORT); destroyed after the test. Yields the DistEnv."""
    from shardwise.train import dist as sdist

    with worker_process():
        yield sdist.init_distributed(60.0)
