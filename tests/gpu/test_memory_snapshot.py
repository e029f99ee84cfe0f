"""`--memory-snapshot N` on a GPU: the allocator's history of the first N steps lands in the run's
memory/rank0.pickle in torch's snapshot format (what pytorch.org/memory_viz reads), with the training's own
allocations in it. Skipped without a CUDA GPU; the CPU's refusal is tests/e2e/test_memory_snapshot.py."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from tests.helpers import run_cli

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_the_first_steps_history_is_written_and_recording_stops(tiny_dir, tmp_path):
    out = tmp_path / "run"
    p = run_cli("train", "--model", tiny_dir, "--data", "demo", "--max-steps", "3", "--memory-snapshot", "2",
                "--output-dir", str(out), "--no-save-final", "--report-to", "none", "--nproc-per-node", "1")
    path = out / "memory" / "rank0.pickle"
    assert f"is in {path}" in p.stdout + p.stderr
    with open(path, "rb") as fh:  # written by this test's own run
        snap = pickle.load(fh)
    events = [e for trace in snap["device_traces"] for e in trace]
    assert any(e["action"] == "alloc" for e in events) and snap["segments"]
    frames = [f.get("filename", "") for e in events for f in e.get("frames") or []]
    assert any("shardwise" in f for f in frames)  # Python stacks: the allocations are traced to our lines
    assert not [n for n in os.listdir(out / "memory") if n != "rank0.pickle"]  # no temporary left
