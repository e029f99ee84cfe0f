import os
import tempfile

import pytest

# One cache (the built tiny model) for the whole session, shared with every subprocess.
os.environ.setdefault("SHARDWISE_CACHE_DIR", tempfile.mkdtemp(prefix="shardwise-test-cache-"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_dir():
    from shardwise.models.tiny import tiny_dir as build

    return build(42)
