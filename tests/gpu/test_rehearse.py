"""`shardwise plan --rehearse` on a CUDA GPU: rank 0 of an 8- and a 64-GPU job of a real model shape rehearses on
this one GPU (meta build, only the rank's shards made real), with the allocator's peak beside the plan; a job whose
one rank does not fit the GPU is one line with the plan's prediction.

Skipped where there is no CUDA GPU; on the device: `python benchmarks/run.py gpu-tests tests/gpu/test_rehearse.py`.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import run_cli

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# the Llama-3.2-1B shape: small enough for seconds a row, large enough that sharding shows in GiB
JOB = ["--model", "llama-3.2-1b", "--seq-len", "2048", "--micro-batch-size", "1", "--mixed-precision", "bf16",
       "--gradient-checkpointing", "--compile", "off"]


def rehearse(tmp_path, *args: str) -> dict:
    cwd = tmp_path / "cwd"
    cwd.mkdir(exist_ok=True)
    p = run_cli("plan", *JOB, *args, "--rehearse", "--json", cwd=str(cwd), timeout=400)
    assert list(cwd.iterdir()) == []  # nothing written where it ran
    return json.loads(p.stdout)


def test_rank0_of_8_and_64_gpus_rehearses_on_this_gpu(tmp_path):
    rows = {}
    for gpus, nodes in (("8", "1"), ("8", "8"), ("2", "1")):
        d = rehearse(tmp_path, "--gpus", gpus, "--nodes", nodes, "--strategy", "fsdp")
        rh = d["rehearsed"]
        assert rh["accelerator"] == "cuda" and rh["same_device"], rh
        (row,) = rh["rows"]
        assert row["ok"], row
        assert row["world"] == int(gpus) * int(nodes) and row["device"] == torch.cuda.get_device_name(0)
        assert row["peak_reserved_gib"] >= row["peak_allocated_gib"] > 0
        assert row["need_gib"] > row["peak_reserved_gib"]  # + the CUDA context the plan counts
        assert row["step_diff_pct"] is not None and row["compute_s"] > 0
        assert row["predicted_step_s"] == pytest.approx(row["compute_s"] + row["comm_s"])
        rows[row["world"]] = row
    # each rank holds 1/N of the weights, gradients and optimizer states: more ranks, less memory
    assert rows[64]["peak_allocated_gib"] < rows[8]["peak_allocated_gib"] < rows[2]["peak_allocated_gib"]


def test_tensor_and_sequence_parallel_rehearse_on_the_gpu(tmp_path):
    d = rehearse(tmp_path, "--gpus", "8", "--strategy", "fsdp", "--tensor-parallel", "2", "--sequence-parallel", "2")
    (row,) = d["rehearsed"]["rows"]
    assert row["ok"], row
    assert row["dims"] == "dp_replicate 1 x dp_shard 2 x sp 2 x tp 2"


def test_compiled_blocks_rehearse_as_the_default_gpu_job_runs_them(tmp_path):
    """compile on (the GPU default): the first step compiles, the measured ones run the compiled blocks."""
    d = rehearse(tmp_path, "--gpus", "8", "--strategy", "fsdp", "--compile", "on")
    (row,) = d["rehearsed"]["rows"]
    assert row["ok"], row
    assert any(a.startswith("compile: 16 blocks") for a in row["applied"])
    assert row["first_step_s"] > row["compute_s"]


def test_a_rank_too_large_for_this_gpu_is_one_line_with_the_plans_prediction(tmp_path):
    """The 70B shape on one process: its full model cannot be made on any one GPU."""
    p = run_cli("plan", "--model", "llama-3.1-70b", "--gpus", "1", "--strategy", "single", "--seq-len", "2048",
                "--rehearse", cwd=str(tmp_path), timeout=400)
    line = next(ln for ln in p.stdout.splitlines() if ln.strip().startswith("single ") and "does not fit" in ln)
    assert "out of memory; the plan predicts" in line and "GiB per rank" in line
    assert torch.cuda.get_device_name(0) in line


def test_qlora_rehearses_a_4bit_base_smaller_than_loras(tmp_path):
    """QLoRA under ddp: each 4-bit linear is made and quantised on the GPU one at a time (the 70B base in bf16 would
    not fit a host), so the rank holds the NF4 base, and less than LoRA's bf16 one."""
    pytest.importorskip("bitsandbytes")
    rows = {}
    for tuner in ("lora", "qlora"):
        d = rehearse(tmp_path, "--gpus", "8", "--strategy", "ddp", "--tuner", tuner, "--lora-r", "16")
        (row,) = d["rehearsed"]["rows"]
        assert row["ok"], row
        rows[tuner] = row
    # the 1B shape's ~1.0e9 block weights: 2 bytes each in bf16, about half a byte in NF4
    assert rows["qlora"]["peak_allocated_gib"] < rows["lora"]["peak_allocated_gib"] - 0.8
