"""The Runs page overlays the loss curves of the runs a user ticks: two real training runs (one rank, 6 and 8 steps,
different learning rates, made by the Trainer in this process: tests/inproc/trainer.py), a real `shardwise ui` server
and a headless Chromium; the chart holds one curve per ticked run, each the run's own logged losses."""

from __future__ import annotations

import os

import pytest

from tests.helpers import read_metrics
from tests.inproc.trainer import train
from tests.ui.conftest import UIServer

pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    runs_dir = tmp_path_factory.mktemp("overlay-runs")
    common = ("--strategy", "single", "--nproc-per-node", "1", "--log-every", "1", "--no-save-final",
              "--report-to", "none")
    # one rank each, in this process: a launched one-process run adds only an interpreter's start and torch's imports
    train(*common, "--max-steps", "6", "--lr", "1e-4", "--output-dir", runs_dir / "slow")
    train(*common, "--max-steps", "8", "--lr", "3e-3", "--output-dir", runs_dir / "fast")
    return str(runs_dir)


def test_two_ticked_runs_show_two_loss_curves(two_runs, page, shots):
    server = UIServer(two_runs).start()
    try:
        page.goto(server.base + "/runs")
        page.wait_for_selector("input.tick[value='fast']")
        assert page.is_disabled("#overlay-btn")
        page.check("input.tick[value='slow']")
        page.check("input.tick[value='fast']")
        page.click("#overlay-btn")
        page.wait_for_function("() => window.shardwise.charts.overlay && "
                               "window.shardwise.charts.overlay.data.datasets.length === 2")
        got = page.evaluate("window.shardwise.charts.overlay.data.datasets.map(d => ({label: d.label, "
                            "points: d.data.map(p => [p.x, p.y])}))")
        assert page.is_visible("#c-overlay")
        page.screenshot(path=os.path.join(shots, "runs-overlay.png"), full_page=True)
    finally:
        server.stop()
    want = {name: [[r["step"], r["loss"]] for r in read_metrics(os.path.join(two_runs, name))]
            for name in ("slow", "fast")}
    assert {d["label"]: d["points"] for d in got} == want
    assert [len(want["slow"]), len(want["fast"])] == [6, 8]
