"""benchmarks/rehearse_grid.py: every row of issue 41's grid is a job the planner takes (a typo in a row's flags
would cost a device call), and the rows' order and budget rule."""

from __future__ import annotations

import types

import pytest

from shardwise.cli import build_parser
from shardwise.plan.command import build
from tests.helpers import benchmark_module

grid = benchmark_module("rehearse_grid")


@pytest.mark.parametrize("row", grid.GRID, ids=lambda r: r["name"])
def test_every_row_plans(row, tmp_path):
    argv = grid.plan_argv(row, str(tmp_path), types.SimpleNamespace(smoke=False, compile=False))
    assert argv[-2:] == ["--rehearse", "--json"]
    plan, _ = build(build_parser().parse_args(argv[:-2]))
    sp = plan.for_strategy(row["strategy"])
    assert plan.setup.world == row["gpus"] * row["nodes"] and plan.job.seq_len == row["seq_len"]
    assert sp.memory.total > 0 and sp.timing.compute_s > 0


def test_the_8b_fsdp_rows_come_first_8k_before_32k():
    names = [r["name"] for r in grid.GRID]
    assert names[:2] == ["8b-fsdp8-8k", "8b-fsdp64-8k"]
    assert names.index("8b-fsdp8-8k") < names.index("8b-fsdp8-32k") < names.index("70b-fsdp8-lora-8k")
    assert set(grid.SMOKE) <= set(names)
