"""The planner's view of sequence parallelism (Ulysses and ring attention): per-rank activations divided by the
degree, four all-to-alls per layer in forward and in backward (again in the recomputed
forward), nothing hiding them; ring's N-1 KV exchanges per layer, hidden behind the attention
they overlap; the global token count unchanged; one `plan` row per degree the ranks (and, for
Ulysses alone, the heads) allow; `--strategy auto` picking the smallest degree that fits."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from shardwise.plan import plan_model, resolve_model
from shardwise.plan.comm import attention_flops, coll_time, ring_exchanges, sp_split, ulysses_exchanges
from shardwise.plan.decide import TREE_SP, sequence_parallel_rows
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
    rows = sequence_parallel_rows(spec, replace(job, sp_mode="ulysses"), setup, "fsdp")
    assert [r["sp"] for r in rows] == [1, 2, 4]  # 7 and 14 do not divide 8 ranks, 8 does not divide 28 heads
    mem = [r["mem_gib"] for r in rows]
    assert mem == sorted(mem, reverse=True) and mem[0] - mem[-1] > 1  # more SP, less memory per rank
    assert rows[0]["exchange_gb_per_step"] == 0 < rows[1]["exchange_gb_per_step"]
    # auto: Ulysses over gcd(28, 8) = 4 ranks and ring attention over the other 2
    auto = sequence_parallel_rows(spec, job, setup, "fsdp")
    assert [(r["sp"], r["mode"]) for r in auto] == [(1, "-"), (2, "ulysses"), (4, "ulysses"),
                                                     (8, "ulysses 4 x ring 2")]
    assert auto[3]["mem_gib"] < auto[2]["mem_gib"]
    j8 = replace(job, sp=8)  # all-to-alls over the 4 Ulysses ranks, KV exchanges around the ring of 2
    assert [c.ranks for c in ulysses_exchanges(spec, j8)] == [4, 4]
    assert [c.ranks for c in ring_exchanges(spec, j8)] == [2, 2]
    assert ring_exchanges(spec, j8)[0].bytes == 28 * 2 * (131072 // 8) * 4 * 128 * 2  # 28 layers, 4 KV heads


def test_ring_exchanges_follow_the_kv_formula_and_hide_behind_attention():
    spec = resolve_model("llama-3.1-8b")  # 32 layers, 8 KV heads of 128
    setup, job = setup_and_job(gpus=4, seq_len=131072)
    ring = replace(job, sp=4, sp_mode="ring")
    assert sp_split(spec, ring) == (1, 4) and ulysses_exchanges(spec, ring) == []
    kv = 2 * (131072 // 4) * 8 * 128 * 2  # K and V of the local tokens, bf16
    fwd, bwd = ring_exchanges(spec, ring)
    assert (fwd.op, fwd.ranks, fwd.phase, fwd.kind) == ("ring", 4, "fwd", "sp")
    assert fwd.bytes == 32 * kv and fwd.wire() == 3 * 32 * kv  # N-1 exchanges per layer
    assert bwd.bytes == 2 * fwd.bytes  # K, V and their gradients
    assert ring_exchanges(spec, replace(ring, checkpointing=True))[1].bytes == 3 * fwd.bytes  # + recomputed forward
    assert ring_exchanges(spec, replace(job, sp=4)) == []  # auto at 4: 32 heads take Ulysses whole
    # on NVLink the exchanges hide behind the attention at 128k tokens; on a slow link only the excess shows
    for gbps in (3600.0, 1.0):
        s = make_setup(gpus=4, gpu_memory=141.0, gpu_type="H200", intra_gbps=gbps, use_doctor=False)
        t = plan_model(spec, ring, s, configured="fsdp", escalate=False).for_strategy("fsdp").timing
        plain = plan_model(spec, replace(ring, sp_mode="ulysses"), s, configured="fsdp", escalate=False)
        ul = plain.for_strategy("fsdp").timing
        links = s.links()
        attn = attention_flops(spec, ring) / (s.peak_flops * s.mfu_for(ring, spec))
        hidden = {"fwd": attn, "bwd": 2 * attn}
        ring_exposed = sum(max(0.0, coll_time(c, links) - hidden[c.phase]) for c in (fwd, bwd))
        ul_exposed = sum(coll_time(c, links) for c in ulysses_exchanges(spec, replace(ring, sp_mode="ulysses")))
        # the same job otherwise: the difference in exposed time is ring's exposed part against Ulysses's all
        assert t.exposed_comm_s - ul.exposed_comm_s == pytest.approx(ring_exposed - ul_exposed, rel=1e-9, abs=1e-9)
        if gbps > 1000:
            assert ring_exposed == 0
        else:
            assert ring_exposed > 0


def test_auto_picks_the_smallest_sequence_parallel_degree_that_fits(capsys):
    argv = ["--model", "llama-3.1-8b", "--gpus", "8", "--gpu-memory", "80", "--gpu-type", "H100",
            "--seq-len", "524288", "--micro-batch-size", "1", "--gradient-checkpointing", "--json"]
    assert plan_cmd.run(parse(*argv)) == 0
    d = json.loads(capsys.readouterr().out)
    par = d["parallel"]
    rows = {r["sp"]: r for r in d["sequence_parallel"]}
    assert not rows[1]["fits"] and not rows[2]["fits"] and rows[4]["fits"]
    assert par["chosen"] and (par["sequence_parallel"], par["tensor_parallel"]) == (4, 1)
    assert d["recommended"] == par["strategy"] == rows[4]["strategy"]
    assert "the sequence (1 x 524288 tokens) is what does not fit" in d["reasons"][0]
    assert "sequence parallel 4 (ulysses) fits" in d["reasons"][1] and "no smaller degree fits" in d["reasons"][1]
    assert d["decision_tree"]["parallel"]["path"] == TREE_SP
    assert plan_cmd.run(parse(*argv[:-1], "--strategy", "fsdp")) == 0  # configured: the advice names the degree
    assert "Cheapest change that fits: --sequence-parallel 4 " in capsys.readouterr().out
    # at a length that fits, nothing is chosen
    assert plan_cmd.run(parse(*[("65536" if a == "524288" else a) for a in argv])) == 0
    assert not json.loads(capsys.readouterr().out)["parallel"]["chosen"]
    # several sequences per micro-batch: a smaller micro-batch is the lever, and splitting each sequence would
    # shrink the data-parallel degree and so the global batch; auto keeps to the presets (here the offload one)
    argv = ["--model", "7B", "--gpus", "8", "--gpu-memory", "40", "--seq-len", "2048", "--micro-batch-size", "4",
            "--json"]
    assert plan_cmd.run(parse(*argv)) == 0
    d = json.loads(capsys.readouterr().out)
    assert not d["parallel"]["chosen"] and d["recommended"] == "fsdp-offload"


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
    assert "sequence parallel (--sp-mode auto: degrees dividing the ranks), fsdp:" in text


def test_a_degree_the_ranks_or_heads_cannot_take_is_one_line():
    from shardwise.errors import ShardwiseError

    with pytest.raises(ShardwiseError, match="sequence_parallel 4 must divide the 2 ranks$"):
        plan_cmd.run(parse("--model", "qwen2.5-7b", "--gpus", "2", "--sequence-parallel", "4"))
    # 8 does not divide qwen2.5-7b's 28 heads: refused for Ulysses alone, auto takes it (Ulysses 4 x ring 2)
    with pytest.raises(ShardwiseError, match="sequence_parallel 8 must divide the 8 ranks and the model's 28 "
                                             "attention heads .Ulysses.; --sp-mode auto or ring takes any degree"):
        plan_cmd.run(parse("--model", "qwen2.5-7b", "--gpus", "8", "--sequence-parallel", "8", "--sp-mode", "ulysses"))
    assert plan_cmd.run(parse("--model", "qwen2.5-7b", "--gpus", "8", "--sequence-parallel", "8", "--json")) == 0
