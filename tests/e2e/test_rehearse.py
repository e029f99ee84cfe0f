"""`shardwise plan --rehearse` through the CLI on the CPU: rank 0 of a fake world of N runs the tiny model's real
steps (the engine's own wrapping under torch's fake process group) and its measured memory stands beside the plan."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.helpers import run_cli

pytestmark = pytest.mark.skipif(shutil.which("nvidia-smi") is not None,
                                reason="the CPU rehearsal (tests/gpu/test_rehearse.py rehearses on the GPU)")

JOB = ["--model", "tiny", "--seq-len", "256", "--micro-batch-size", "2"]


def rehearse(tmp_path, *args: str) -> dict:
    """The plan's JSON with its rehearsal; run in an empty directory, which must stay empty (nothing written)."""
    cwd = tmp_path / "cwd"
    cwd.mkdir(exist_ok=True)
    p = run_cli("plan", *JOB, *args, "--rehearse", "--json", cwd=str(cwd))
    assert os.listdir(cwd) == []
    return json.loads(p.stdout)


TP_SP = ("--gpus", "8", "--strategy", "fsdp", "--tensor-parallel", "2", "--sequence-parallel", "2")


@pytest.fixture(scope="module")
def tp_sp(tmp_path_factory):
    """fsdp x TP 2 x SP 2 on a fake world of 8, rehearsed once for the tests below."""
    return rehearse(tmp_path_factory.mktemp("tp-sp"), *TP_SP)


def test_rehearses_rank0_of_fsdp_with_tensor_and_sequence_parallel_on_a_fake_world_of_8(tp_sp):
    d = tp_sp
    rh = d["rehearsed"]
    assert rh["accelerator"] == "cpu" and [r["strategy"] for r in rh["rows"]] == ["fsdp"]
    (row,) = rh["rows"]
    assert row["ok"], row
    # the one mesh with the real world: FSDP over the 2 data-parallel x 2 sequence ranks, tensor parallel 2
    assert row["world"] == 8 and row["rank"] == 0
    assert row["dims"] == "dp_replicate 1 x dp_shard 2 x sp 2 x tp 2"
    assert any(a.startswith("tensor parallel: 4 blocks") for a in row["applied"])
    assert row["describe"].startswith("fsdp (full shard")
    assert 0 < row["peak_allocated_gib"] < 1 and row["compute_s"] > 0
    assert row["predicted_step_s"] == pytest.approx(row["compute_s"] + row["comm_s"])
    assert row["step_diff_pct"] is None  # planned for H100s, rehearsed on the CPU: times are not compared
    plan_row = next(s for s in d["strategies"] if s["strategy"] == "fsdp")
    assert row["analytic_tensors_gib"] > 0 and plan_row["fits"] == row["fits"]
    assert row["disagrees"] == (abs(row["memory_diff_pct"]) > 10)


def test_where_they_disagree_the_plan_says_so_and_fits_is_the_rehearsals(tp_sp, tmp_path):
    """The same job on a GPU sized between the plan's total and the rehearsal's: the plan alone would say it fits;
    the rehearsal measured more (the analytic TP x SP peak of the tiny model is under the measured one by more
    than 10%), so the row says so and does not fit."""
    (row,) = tp_sp["rehearsed"]["rows"]
    assert row["disagrees"] and row["need_gib"] > row["analytic_total_gib"], row
    between = (row["need_gib"] + row["analytic_total_gib"]) / 2
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    out = run_cli("plan", *JOB, *TP_SP, "--gpu-memory", f"{between:.6f}", "--rehearse", cwd=str(cwd)).stdout
    assert os.listdir(cwd) == []
    assert "fsdp: rehearsal and plan disagree by" in out and "fits is the rehearsal's: NO" in out
    table = next(ln for ln in out.splitlines() if ln.startswith((">fsdp ", "*fsdp ", " fsdp ")))
    assert " NO " in table
    assert "fits by the rehearsal" in out


def test_rehearsed_memory_falls_as_the_shards_get_smaller(tmp_path):
    """fsdp on 8 ranks holds less than fsdp on 2, which holds less than one process with the whole model."""
    peaks = {}
    for gpus, strategy in (("8", "fsdp"), ("2", "fsdp"), ("1", "single")):
        (row,) = rehearse(tmp_path, "--gpus", gpus, "--strategy", strategy)["rehearsed"]["rows"]
        assert row["ok"] and row["world"] == int(gpus), row
        peaks[(gpus, strategy)] = row["peak_allocated_gib"]
    assert peaks[("8", "fsdp")] < peaks[("2", "fsdp")] < peaks[("1", "single")]


def test_a_real_model_on_a_cpu_only_machine_is_one_line(tmp_path):
    p = run_cli("plan", "--model", "llama-3.1-8b", "--gpus", "8", "--rehearse", check=False, cwd=str(tmp_path))
    assert p.returncode != 0 and p.stdout == ""
    assert p.stderr.count("\n") == 1 and "--rehearse: this machine has no GPU" in p.stderr
    assert "--model tiny" in p.stderr


@pytest.mark.parametrize("strategy,wrapped", [("ddp", "ddp"), ("zero3", "deepspeed ZeRO-3")])
def test_ddp_and_deepspeed_run_on_the_fake_group(tmp_path, strategy, wrapped):
    """DDP's reducer under the fake group needs the rehearsal's hand-back hook; DeepSpeed's engine runs as it is
    (its bucket buffers are real, so the plan's DeepSpeed buffers are checked too)."""
    (row,) = rehearse(tmp_path, "--gpus", "8", "--strategy", strategy)["rehearsed"]["rows"]
    assert row["ok"], row
    assert row["world"] == 8 and row["describe"].startswith(wrapped)
    assert abs(row["memory_diff_pct"]) <= 10, row


def test_task_dpo_rehearses_its_pairs_and_its_reference(tmp_path):
    """task dpo rehearses its own step: two rows a pair, the reference's forward first (a frozen copy sharded like
    the policy under fsdp, the base with the adapters off under LoRA), the planner's figures beside it. The frozen
    copy is memory the precomputed table does not hold."""
    rows, planned = {}, {}
    for name, extra in (("dpo", ()), ("pre", ("--precompute-ref",)), ("lora", ("--tuner", "lora"))):
        d = rehearse(tmp_path, "--gpus", "2", "--strategy", "ddp" if name != "lora" else "zero3", "--task", "dpo",
                     *extra)
        (row,) = d["rehearsed"]["rows"]
        assert row["ok"], row
        assert abs(row["memory_diff_pct"]) <= 10, row
        rows[name], planned[name] = row, next(x for x in d["strategies"] if x["strategy"] == row["strategy"])
    # the frozen copy's weights, whole under ddp, are held through the step: what the plan counts for them
    ref = planned["dpo"]["mem_gib"]["buffers"] - planned["pre"]["mem_gib"]["buffers"]
    assert ref > 0
    measured = rows["dpo"]["peak_allocated_gib"] - rows["pre"]["peak_allocated_gib"]
    assert measured == pytest.approx(ref, rel=0.05), (measured, ref)
    assert rows["lora"]["describe"].startswith("deepspeed ZeRO-3")
