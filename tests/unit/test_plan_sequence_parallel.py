"""The planner's view of sequence parallelism (Ulysses): per-rank activations divided by the
degree, four all-to-alls per layer in forward and in backward (again in the recomputed
forward), nothing hiding them, the global token count unchanged, and one `plan` row per
degree the ranks and the heads allow."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from shardwise.plan import plan_model, resolve_model
from shardwise.plan.comm import ulysses_exchanges
from shardwise.plan.decide import sequence_parallel_rows
from shardwise.plan.inputs import make_setup
from shardwise.plan.memory import Job, Opts, activations
from tests.unit.test_plan import parse, plan_cmd


@pytest.fixture(autouse=True)
def _no_doctor_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDWISE_CACHE_DIR", str(tmp_path / "cache"))


def setup_and_job(gpus=2, seq_len=65536, **kw):
    setup = make_setup(gpus=gpus, gpu_memory=141.0, gpu_type="H200", use_doctor=False)
    job = Job(world=setup.world, micro_batch=1, seq_len=seq_len, device_mem_gib=141.0, compute="bf16",
              fused_loss=True, **kw)
    return setup, job


def test_block_activations_divide_by_the_degree():
    spec = resolve_model("llama-3.1-8b")
    _, job = setup_and_job()
    o = Opts("fsdp")
    one = activations(spec, job, o)[1]
    for n in (2, 4):
        assert activations(spec, replace(job, sp=n), o)[1] == pytest.approx(one / n, rel=1e-3)


def test_exchanges_are_four_all_to_alls_per_layer_each_way_and_exposed():
    spec = resolve_model("llama-3.1-8b")  # 32 heads of 128, 8 KV heads
    setup, job = setup_and_job(checkpointing=True)
    ex = ulysses_exchanges(spec, replace(job, sp=2))
    per_layer = 32768 * 2 * (2 * 4096 + 2 * 1024)  # tokens per rank x bf16 x (q + out + k + v)
    assert [(c.op, c.phase, c.ranks) for c in ex] == [("all_to_all", "fwd", 2), ("all_to_all", "bwd", 2)]
    assert ex[0].bytes == 32 * per_layer and ex[1].bytes == 2 * ex[0].bytes  # backward + recomputed forward
    assert ex[0].wire() == ex[0].bytes / 2  # each rank keeps its own part
    assert ulysses_exchanges(spec, job) == []
    # KV heads fewer than the degree are replicated up to it before the exchange
    wide = ulysses_exchanges(spec, replace(job, sp=16, world=16))
    assert wide[0].bytes == 32 * (65536 // 16) * 2 * (2 * 4096 + 2 * 16 * 128)
    # nothing overlaps them: the step is slower by at least their time
    plain = plan_model(spec, job, setup, configured="fsdp").for_strategy("fsdp").timing
    sp = plan_model(spec, replace(job, sp=2), setup, configured="fsdp").for_strategy("fsdp").timing
    assert sp.exposed_comm_s > plain.exposed_comm_s
    # tokens/s counts every token once: 2 ranks x 1 row at SP 1 against 1 row at SP 2, about half the compute
    assert sp.tokens_per_s == pytest.approx(job.seq_len / sp.step_s)
    assert plain.tokens_per_s == pytest.approx(2 * job.seq_len / plain.step_s)


def test_rows_for_every_degree_the_ranks_and_heads_allow():
    spec = resolve_model("qwen2.5-7b")  # 28 heads
    setup, job = setup_and_job(gpus=8, seq_len=131072, checkpointing=True)
    rows = sequence_parallel_rows(spec, job, setup, "fsdp")
    assert [r["sp"] for r in rows] == [1, 2, 4]  # 7 and 14 do not divide 8 ranks, 8 does not divide 28 heads
    mem = [r["mem_gib"] for r in rows]
    assert mem == sorted(mem, reverse=True) and mem[0] - mem[-1] > 1  # more SP, less memory per rank
    assert rows[0]["exchange_gb_per_step"] == 0 < rows[1]["exchange_gb_per_step"]


def test_plan_command_shows_the_rows_and_takes_the_flag(capsys):
    argv = ["--model", "llama-3.1-8b", "--gpus", "2", "--gpu-memory", "120", "--gpu-type", "H200",
            "--strategy", "fsdp", "--seq-len", "262144", "--micro-batch-size", "1", "--gradient-checkpointing"]
    assert plan_cmd.run(parse(*argv, "--sequence-parallel", "2", "--json")) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["job"]["sp"] == 2
    rows = {r["sp"]: r for r in d["sequence_parallel"]}
    assert set(rows) == {1, 2} and not rows[1]["fits"] and rows[2]["fits"]
    fsdp = next(s for s in d["strategies"] if s["strategy"] == "fsdp")
    assert fsdp["fits"] and any(c["op"] == "all_to_all" for c in fsdp["collectives"])
    assert plan_cmd.run(parse(*argv)) == 0
    text = capsys.readouterr().out
    assert "sequence parallel (Ulysses; degrees dividing the ranks and the 32 heads), fsdp:" in text


def test_a_degree_the_ranks_or_heads_cannot_take_is_one_line():
    from shardwise.errors import ShardwiseError

    for gpus, n in (("2", "4"), ("8", "8")):  # 4 does not divide 2 ranks; 8 does not divide qwen2.5-7b's 28 heads
        with pytest.raises(ShardwiseError, match=f"sequence_parallel {n} must divide the {gpus} ranks and the "
                                                 "model's 28 attention heads"):
            plan_cmd.run(parse("--model", "qwen2.5-7b", "--gpus", gpus, "--sequence-parallel", n))
