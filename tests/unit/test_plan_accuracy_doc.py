"""The measured sets whose rows only docs/planner.md's generated tables print (memory only: the CPU presets and the
one-rank H200 presets, calibration.json's measured_sets), held to their bounds here; and the generated tables read
the same rows as the measured-row tests."""

from __future__ import annotations

import pytest

from shardwise.plan import calibration
from tests.helpers import benchmark_module
from tests.unit import test_plan_measured


@pytest.fixture(scope="module")
def pa():
    return benchmark_module("plan_accuracy")


@pytest.mark.parametrize("name", ["cpu_presets", "h200_presets_one_rank"])
def test_memory_only_sets_within_their_bound(pa, name):
    m = calibration.measured_set(name)
    rows, archived = pa.set_rows(name)
    assert rows and not archived and m["step_tol"] is None
    for r in rows:
        sp = pa.plan_case(r, r["world"], "cuda" if r.get("device") == "cuda" else "cpu")
        # on CPU ranks offloaded state stays in the measured memory (host = device)
        pred = sp.memory.peak_tensors + (sp.memory.host if r.get("device", "cpu") == "cpu" else 0.0)
        assert abs(pred / r["measured"] - 1) <= m["mem_tol"], (pa.label(r), pred / r["measured"] - 1)


def test_the_tables_rows_are_the_tests_rows(pa):
    """The page's table of the presets x tuners set is the rows test_plan_measured checks, planned as it plans them."""
    rows, archived = pa.set_rows("h200_presets_tuners_checkpointing")
    assert rows == test_plan_measured._h200_rows()
    assert len(archived) == len(test_plan_measured._archive()["h200_head_two_chunks"]["keys"])
    rows, archived = pa.set_rows("h200_zero3_whole_blocks")
    assert len(rows) + len(archived) == 15 and len(archived) == 1
