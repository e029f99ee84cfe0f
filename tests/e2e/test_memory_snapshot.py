"""`--memory-snapshot N` where it cannot run: one line, exit 2, no run directory (the GPU's snapshot is
tests/gpu/test_memory_snapshot.py)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import run_cli


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without a CUDA GPU")
def test_memory_snapshot_without_a_gpu_is_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "run"
    p = run_cli("train", "--model", "tiny", "--data", "demo", "--max-steps", "2", "--memory-snapshot", "1",
                "--output-dir", str(out), check=False)
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0  # stdout: the demo's settings line
    assert "flag --memory-snapshot: the memory snapshot records the CUDA allocator" in p.stderr
    assert not out.exists()


def test_memory_snapshot_past_the_last_step_is_one_line(tmp_path):
    out = tmp_path / "run"
    p = run_cli("train", "--model", "tiny", "--data", "demo", "--max-steps", "2", "--memory-snapshot", "3",
                "--output-dir", str(out), check=False)
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0
    assert "memory_snapshot 3 is more than max_steps 2" in p.stderr
    assert not out.exists()
