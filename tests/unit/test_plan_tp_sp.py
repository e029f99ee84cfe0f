"""The planner's view of tensor x sequence parallelism (issue 20, "sequence parallelism where the mesh allows
both"): each tp rank holds heads / tp, which Ulysses splits over the sequence ranks (and auto's gcd is taken
on them); the all-to-alls carry that rank's heads only; activations divide by tp x sp; `plan` accepts the pair,
refuses a Ulysses degree the heads per tp rank cannot take with the model's numbers, and lists SP rows at the
configured TP and TP rows at the configured SP (the fsdp presets, and single where tp x sp is every rank, which
single averages its gradients over the sequence ranks: test_plan_single_tp_sp.py)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from shardwise.errors import ShardwiseError
from shardwise.plan import resolve_model
from shardwise.plan.comm import ring_exchanges, sp_split, ulysses_exchanges
from shardwise.plan.memory import Opts, activations, estimate
from tests.unit.test_plan import parse, plan_cmd
from tests.unit.test_plan_sequence_parallel import setup_and_job


@pytest.fixture(autouse=True)
def _no_doctor_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDWISE_CACHE_DIR", str(tmp_path / "cache"))


def test_auto_splits_the_heads_each_tensor_rank_holds():
    spec = resolve_model("qwen2.5-7b")  # 28 heads, 4 KV heads
    _, job = setup_and_job(gpus=8)
    assert sp_split(spec, replace(job, sp=4)) == (4, 1)  # gcd(28, 4)
    assert sp_split(spec, replace(job, sp=4, tp=2)) == (2, 2)  # 14 heads per tp rank: gcd(14, 4) = 2, a ring of 2


def test_ulysses_exchanges_carry_one_tensor_ranks_heads():
    spec = resolve_model("llama-3.1-8b")  # 32 heads of 128, 8 KV heads
    _, job = setup_and_job(gpus=8)
    one = ulysses_exchanges(spec, replace(job, sp=2))
    two = ulysses_exchanges(spec, replace(job, sp=2, tp=2))
    assert two[0].bytes == one[0].bytes / 2 and two[0].ranks == 2  # q, out 2048 wide; k, v 4 heads of 128
    # 8 KV heads / tp 4 = 2 per rank, fewer than Ulysses 4: replicated to 4 before the exchange
    four = ulysses_exchanges(spec, replace(job, sp=4, tp=4, sp_mode="ulysses"))
    assert four[0].bytes == 32 * (65536 // 4) * 2 * (2 * 1024 + 2 * 4 * 128)
    ring = ring_exchanges(spec, replace(job, sp=2, tp=2, sp_mode="ring"))
    assert ring[0].bytes == ring_exchanges(spec, replace(job, sp=2, sp_mode="ring"))[0].bytes / 2


def test_activations_divide_by_tensor_times_sequence():
    spec = resolve_model("llama-3.1-8b")
    _, job = setup_and_job(gpus=8, checkpointing=False)
    o = Opts("fsdp")
    one, tp2 = (activations(spec, replace(job, tp=t), o)[1] for t in (1, 2))
    # SP halves everything TP 2 leaves per rank (the tokens); TP divides the block interiors (not the whole head)
    assert activations(spec, replace(job, sp=2, tp=2), o)[1] == pytest.approx(tp2 / 2, rel=1e-9)
    assert activations(spec, replace(job, sp=2, tp=2), o)[1] < 0.28 * one
    # and the memory of the pair is below either alone
    pair = estimate(spec, replace(job, sp=2, tp=2), o).total
    assert pair < estimate(spec, replace(job, sp=2), o).total and pair < estimate(spec, replace(job, tp=2), o).total


def test_plan_accepts_tp_with_sp_and_lists_rows_at_the_other_degree(capsys):
    assert plan_cmd.run(parse("--model", "llama-3.1-8b", "--gpus", "8", "--gpu-memory", "80", "--seq-len", "65536",
                              "--micro-batch-size", "1", "--tensor-parallel", "2", "--sequence-parallel", "2",
                              "--strategy", "fsdp", "--json")) == 0
    d = json.loads(capsys.readouterr().out)
    sp_rows, tp_rows = d["sequence_parallel"], d["tensor_parallel"]
    assert [r["sp"] for r in sp_rows] == [1, 2, 4]  # at tp 2: 2 x sp divides 8, 16 heads per tp rank
    assert tp_rows and {r["tp"] for r in tp_rows} == {1, 2, 4} and all(r["strategy"].startswith("fsdp") or
                                                                          r["strategy"] == "hybrid" for r in tp_rows
                                                                          if r["strategy"] != "single")
    # single only at tp 4: 4 x sp 2 is all 8 ranks (launch runs single on tp x sp ranks, no more)
    assert [r["tp"] for r in tp_rows if r["strategy"] == "single"] == [4]
    by = {r["sp"]: r for r in sp_rows}
    assert by[2]["mem_gib"] < by[1]["mem_gib"] and by[2]["exchange_gb_per_step"] > 0 == by[1]["exchange_gb_per_step"]


def test_a_ulysses_degree_the_heads_per_tensor_rank_cannot_take_is_one_line():
    with pytest.raises(ShardwiseError) as e:  # 28 heads / tp 2 = 14 per rank; 4 does not divide 14
        plan_cmd.run(parse("--model", "qwen2.5-7b", "--gpus", "8", "--strategy", "fsdp", "--tensor-parallel", "2",
                           "--sequence-parallel", "4", "--sp-mode", "ulysses"))
    msg = str(e.value)
    assert "\n" not in msg and ("sequence_parallel 4 x tensor_parallel 2 must divide the 8 ranks and the model's 28 "
                                "attention heads / tensor_parallel 2 = 14 per tensor rank (Ulysses)") in msg, msg
    assert plan_cmd.run(parse("--model", "qwen2.5-7b", "--gpus", "8", "--strategy", "fsdp", "--tensor-parallel", "2",
                              "--sequence-parallel", "4", "--json")) == 0  # auto: Ulysses 2 x ring 2
