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


# The suite runs on two pytest-xdist workers (pyproject's addopts: -n 2 --dist loadgroup): a
# launch spends much of its time waiting (rendezvous, a collective timeout, a signal's
# grace), so one CPU core stays idle with one worker. Each test module stays on one worker
# (its module-scoped runs are made once); modules that read tests/dist's session-wide
# reference runs share one group, so those runs are made once too.
SESSION_RUN_GROUP = "dist-session-runs"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            path = item.nodeid.split("::", 1)[0]
            # the GPU tests share the machine's GPUs: one at a time, on one worker
            item.add_marker(pytest.mark.xdist_group("gpu" if path.startswith("tests/gpu/") else path))
