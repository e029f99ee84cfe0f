"""The plan page's Rehearse button, driven in a real headless Chromium against a real `shardwise ui` server: the
tiny model's fsdp job on a fake world of 8 rehearses on the CPU (plan/rehearse.py), and the measured memory and
compute fill the strategy table beside the plan; editing the form clears them."""

from __future__ import annotations

import os
import shutil

import pytest

pytestmark = [pytest.mark.timeout(400),
              pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="the CPU rehearsal of the tiny model")]


def test_rehearse_button_shows_the_rehearsal_beside_the_plan(server, page, shots):
    page.goto(server.base + "/")
    page.wait_for_selector("#f-model")
    for field, value in (("gpus", "8"), ("seq_len", "256"), ("micro_batch_size", "2")):
        page.fill(f"#f-{field}", value)
    page.select_option("#f-strategy", "fsdp")
    page.wait_for_function("() => { const p = window.shardwise.plan; return p && p.hardware.world_size === 8 "
                           "&& p.job.seq_len === 256 && p.configured === 'fsdp'; }")
    row = page.locator('#strategies tr[data-strategy="fsdp"]')
    assert row.locator("td.rh").inner_text().strip() == ""  # nothing rehearsed yet
    page.click("#rehearse")
    page.wait_for_function("() => window.shardwise.rehearsed !== null", timeout=300_000)
    rh = page.evaluate("window.shardwise.rehearsed")
    assert rh["accelerator"] == "cpu" and [r["strategy"] for r in rh["rows"]] == ["fsdp"]
    (r,) = rh["rows"]
    assert r["ok"] and r["world"] == 8, r
    cells = [c.inner_text() for c in row.locator("td.rh").all()]
    assert len(cells) == 4
    assert cells[0].endswith(" MiB")  # the tiny model's memory
    assert float(cells[0].split()[0].replace(",", "")) == pytest.approx(r["peak_allocated_gib"] * 1024, abs=0.01)
    assert cells[1].endswith("%") and f"{abs(r['memory_diff_pct']):.0f}" in cells[1]
    assert float(cells[2]) == pytest.approx(r["compute_s"], abs=1e-3)
    notes = page.locator("#rehearse-notes").inner_text()
    assert "rehearsed on cpu" in notes and "rank 0" in notes
    assert ("disagree" in notes) == r["disagrees"]
    assert page.locator("#rehearse-error").inner_text() == ""
    page.screenshot(path=os.path.join(shots, "plan-rehearse.png"), full_page=True)
    # another job: the rehearsal no longer describes it
    page.fill("#f-seq_len", "512")
    page.wait_for_function("() => window.shardwise.plan.job.seq_len === 512")
    assert page.evaluate("window.shardwise.rehearsed") is None
    assert row.locator("td.rh").inner_text().strip() == ""
    assert page.locator("#rehearse-notes").inner_text() == ""
