"""train/profile.py on a CUDA GPU: kernels are what is measured, not the profiler's own
annotations, and a profiled `shardwise train` run logs the CUDA method. Skipped without CUDA;
run on the GPU machine with `python -m pytest -q tests/gpu`."""

from __future__ import annotations

import time

import pytest
import torch

from tests.helpers import read_metrics, run_cli

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_gpu_annotations_are_not_compute_kernels():
    """The step's record_function range is mirrored onto the GPU timeline; counted as a kernel
    it would cover the whole step. Here the GPU idles between two matmuls (the host sleeps)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from shardwise.train.profile import MARK, measure, split_cuda

    dev = torch.device("cuda", torch.cuda.current_device())
    a = torch.randn(4096, 4096, device=dev)
    (a @ a).sum().item()  # warm-up: cuBLAS handle, kernel selection
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        with record_function(MARK):
            t0 = time.perf_counter()
            (a @ a).sum().item()
            time.sleep(0.2)
            (a @ a).sum().item()
            step_us = (time.perf_counter() - t0) * 1e6
    comm, compute = split_cuda(p.events(), dev.index)
    assert comm == [] and compute
    assert measure(compute) < 0.5 * step_us


def test_profiled_train_run_logs_cuda_communication(tmp_path):
    n = torch.cuda.device_count()
    out = tmp_path / "run"
    run_cli("train", "--strategy", "ddp", "--nproc-per-node", str(n), "--max-steps", "5", "--log-every", "5",
            "--seq-len", "128", "--profile-steps", "2", "--no-save-final", "--output-dir", str(out), timeout=600)
    recs = read_metrics(str(out))
    assert [(r["step"], r.get("profiled", False)) for r in recs] == [(3, False), (4, True), (5, True)]
    for r in recs[1:]:
        assert r["comm_method"].startswith("cuda: nccl kernels") and 0 <= r["comm_exposed_s"] <= r["comm_total_s"]
        if n > 1:  # DDP all-reduces gradients with NCCL kernels
            assert r["comm_total_s"] > 0
    table = (out / "profile" / "step-4-rank0.txt").read_text()
    assert "operators by their own time on the GPU" in table and "operators by their own time on the host" in table
    assert (out / "profile" / f"step-5-rank{n - 1}.json.gz").stat().st_size > 0
