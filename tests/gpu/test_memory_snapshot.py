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


def test_compiled_checkpointed_blocks_are_refused_in_one_line_where_torch_breaks_the_recording(tiny_dir, tmp_path):
    """torch from 2.11 fails the first backward of compiled blocks under checkpointing while the history is recorded
    (pytorch/pytorch#179536): the launch refuses it before anything is written."""
    from shardwise.train.memsnap import BROKEN_UNDER_CHECKPOINTED_COMPILE

    if torch.__version__ < BROKEN_UNDER_CHECKPOINTED_COMPILE:
        pytest.skip("this torch records compiled checkpointed blocks")
    out = tmp_path / "run"
    p = run_cli("train", "--model", tiny_dir, "--data", "demo", "--max-steps", "2", "--memory-snapshot", "1",
                "--compile", "on", "--gradient-checkpointing", "--output-dir", str(out), "--nproc-per-node", "1",
                check=False)
    assert p.returncode == 2 and "pytorch/pytorch#179536" in p.stderr, p.stderr[-2000:]
    assert not out.exists()
