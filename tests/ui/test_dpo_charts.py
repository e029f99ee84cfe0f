"""The runs page charts a DPO run's reward margin and accuracy beside its loss (a real run of the tiny model in this
process, a real `shardwise ui` server, a real headless Chromium); an SFT run's page shows no such charts."""

from __future__ import annotations

import json
import os

import pytest

from tests.inproc.trainer import train
from tests.ui.conftest import UIServer

pytestmark = pytest.mark.timeout(300)

ARGS = ("--strategy", "single", "--data", "demo", "--seq-len", "48", "--micro-batch-size", "4", "--max-steps", "4",
        "--log-every", "1", "--report-to", "none", "--no-save-final")


@pytest.fixture(scope="module")
def ui(runs_dir):
    train(*ARGS, "--task", "dpo", "--output-dir", os.path.join(runs_dir, "dpo"))
    train(*ARGS, "--output-dir", os.path.join(runs_dir, "sft"))
    s = UIServer(runs_dir).start()
    yield s
    s.stop()


def test_a_dpo_runs_page_charts_its_reward_margin_and_accuracy(ui, runs_dir, page, shots):
    with open(os.path.join(runs_dir, "dpo", "metrics.jsonl")) as fh:
        recs = [json.loads(line) for line in fh]
    page.goto(ui.base + "/runs?run=dpo")
    page.wait_for_function("() => window.shardwise.charts.margin.data.labels.length === 4")
    for chart, key in (("margin", "rewards/margins"), ("acc", "rewards/accuracies"), ("loss", "loss")):
        got = page.evaluate(f"window.shardwise.charts.{chart}.data.datasets[0].data")
        assert got == pytest.approx([r[key] for r in recs])
    assert page.locator("#c-margin").is_visible() and page.locator("#c-acc").is_visible()
    page.screenshot(path=os.path.join(shots, "runs-dpo.png"), full_page=True)

    page.goto(ui.base + "/runs?run=sft")
    page.wait_for_function("() => window.shardwise.charts.loss.data.labels.length === 4")
    assert not page.locator("#c-margin").is_visible() and not page.locator("#c-acc").is_visible()
