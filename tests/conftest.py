import os
import tempfile

import pytest

# One cache (the built tiny model) for the whole session, shared with every subprocess.
os.environ.setdefault("SHARDWISE_CACHE_DIR", tempfile.mkdtemp(prefix="shardwise-test-cache-"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One intra-op thread per torch process: this process, its spawned ranks and every `shardwise` it starts (which
# passes OMP_NUM_THREADS on to its workers). The suite runs processes side by side (two xdist workers, two
# ConcurrentRuns at a time) on 2 cores; the launcher's own default gives a one-process run cpu_count threads, and
# two such runs together (or one beside a 2-rank run) oversubscribe the cores, where OpenMP's spinning threads
# turned 12 steps of `single` from 0.8 s of training into 10-13 s each (two alone: 20.5 s wall, 39 CPU-s; with one
# thread: 7.4 s, 12 CPU-s) and, in a whole -n 2 run, into two minutes. The tiny models gain nothing from a
# second thread (0.84 vs 0.82 s alone). Set before torch is imported (OpenMP reads it once).
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_dir():
    from shardwise.models.tiny import tiny_dir as build

    return build(42)



# The suite runs on two pytest-xdist workers (pyproject's addopts: -n 2 --dist loadfile): a
# launch spends much of its time waiting (rendezvous, a collective timeout, a signal's
# grace), so one CPU core stays idle with one worker. Each test module stays whole on one
# worker (its module-scoped runs are made once). A --dist loadgroup with one group per
# module, made by a collection hook here, split modules across workers (the hook's marks
# came after xdist's); loadfile does it natively. tests/dist's session reference runs are
# made once per pytest run and shared by the workers (tests/helpers.py SharedRuns).
#
# Which worker finishes last sets the suite's wall time. xdist would hand the modules out by
# their number of tests, most first (its --loadscope-reorder), which leaves the multi-rank
# modules (few tests, minutes each) for the end: one worker is still in one while the other
# has nothing left. pyproject's --no-loadscope-reorder keeps the order below instead, longest
# first: _HEAVY (the slowest modules, by their wall time in a whole -n 2 run on 2 cores of
# 2026-12-01; a name missing here or there only moves that module back), then the rest of
# tests/dist, e2e, ui and inproc (one-rank runs in the pytest process, seconds to tens of
# seconds a module), then the many small unit modules that fill the gap at the end.
_HEAVY = ("dist/test_reliability", "dist/test_parity", "dist/test_ddp", "dist/test_sequence_parallel",
          "dist/test_moe", "dist/test_chat", "e2e/test_cli", "dist/test_security", "e2e/test_bench",
          "dist/test_tensor_parallel", "e2e/test_rundir", "ui/test_ui", "dist/test_fsdp",
          "dist/test_evaluate")
_FIRST = ("tests/dist/", "tests/e2e/", "tests/ui/", "tests/inproc/")


def pytest_collection_modifyitems(items):
    def rank(item):
        path = item.nodeid.split("::")[0]
        for i, name in enumerate(_HEAVY):
            if path == f"tests/{name}.py":
                return i
        return len(_HEAVY) + next((i for i, d in enumerate(_FIRST) if path.startswith(d)), len(_FIRST))

    items.sort(key=rank)  # stable: each module's tests stay together and in their order
