"""The planner's view of tensor parallelism (plan/memory.py, plan/comm.py, plan/decide.py), for the TP design of
issue 20: q/k/v/gate/up column-wise, o/down row-wise, norms sequence-parallel, embedding vocabulary-sharded and the
head column-wise with loss_parallel. Parameters, gradients, optimizer states, FSDP's gathered units and activations
divide by tp where they are split; per layer two all-gathers and two reduce-scatters each way, exposed; FLOPs per
rank divide by tp; degrees that do not divide are not offered; `--strategy auto` picks TP where data parallelism
alone does not fit, and launch applies it."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import replace

import pytest

from shardwise import config
from shardwise.errors import ShardwiseError
from shardwise.plan import plan_model, resolve_model
from shardwise.plan.comm import flops_per_microbatch, tensor_parallel_exchanges
from shardwise.plan.decide import TREE_TP, tensor_parallel_rows
from shardwise.plan.inputs import job_from_config, make_setup
from shardwise.plan.memory import Job, Opts, estimate, head_activations, layer_activations, tp_degrees
from tests.unit.test_plan import parse, plan_cmd


@pytest.fixture(autouse=True)
def _no_doctor_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDWISE_CACHE_DIR", str(tmp_path / "cache"))


def _job(**kw):
    base = dict(micro_batch=1, seq_len=4096, device_mem_gib=141.0, compute="bf16", param_dtype="bf16",
                fused_loss=True)
    return Job(**{**base, **kw})


def _split_params(spec):
    """By hand: what the TP plan splits (every block linear, the embedding, the untied head)."""
    h, q, kv, i, V, L = (spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim,
                         spec.intermediate_size, spec.vocab_size, spec.num_layers)
    return L * (h * q + 2 * h * kv + q * h + 3 * h * i) + V * h * (1 if spec.tied_embeddings else 2)


def test_tp2_against_fsdp_on_two_gpus_states_divide_as_designed():
    spec = resolve_model("llama-3.1-8b")
    fsdp = estimate(spec, _job(world=2), Opts("fsdp"))  # FSDP over 2 ranks
    tp2 = estimate(spec, _job(world=2, tp=2), Opts("fsdp"))  # TP 2, FSDP over 1
    assert (fsdp.detail["shard_ranks"], tp2.detail["shard_ranks"]) == (2, 1)
    P = spec.total_params
    local = P - _split_params(spec) / 2  # the norms (replicated) are the only difference from P / 2
    assert 0 < local - P / 2 < 1e-3 * P
    for key in ("params", "grads", "optimizer"):
        per_param = getattr(fsdp, key) * 2 / P  # bytes per parameter of this state
        assert getattr(tp2, key) == pytest.approx(per_param * local, rel=1e-12), key
    assert tp2.detail["trainable_params"] == P and tp2.detail["tp_local_params"] == pytest.approx(local)
    # FSDP's gathered units are the tp-local shards: a block is 1/2 its linears + its norms
    layer = spec.layer_params - spec.layer_linear_params / 2
    assert tp2.buffers < fsdp.buffers
    assert tp2.detail["buffer.gathered_units"] == pytest.approx(2 * 2 * layer)  # two units, bf16


def test_tp2_activations_divide_except_the_gathered_linear_inputs():
    spec = resolve_model("llama-3.1-8b")
    job = _job(world=2, fused_loss=False)
    o = Opts("fsdp")
    one, two = layer_activations(spec, job, o), layer_activations(spec, replace(job, tp=2), o)
    T, h, c = job.tokens, spec.hidden_size, job.c
    for key in ("norms", "attention", "mlp"):  # by sequence, heads, columns
        assert two[key] == pytest.approx(one[key] / 2, rel=1e-12), key
    gathered = 2 * T * h * c  # the all-gathered inputs of q/k/v and of gate/up (bf16, one saved copy each)
    assert two["linear_inputs"] == pytest.approx((one["linear_inputs"] - gathered) / 2 + gathered, rel=1e-12)
    # logits sharded over the vocabulary (loss_parallel): the head's fp32 loss tensors halve
    h1, h2 = head_activations(spec, job, o), head_activations(spec, replace(job, tp=2), o)
    assert h2["logits"] == pytest.approx(h1["logits"] / 2, rel=1e-12)
    # the fused chunked head runs vocabulary-parallel under TP (models/speed.py): no T x V logits, its chunk and
    # head-gradient terms over V/tp rows, the gathered hidden states' gradient whole
    f1 = head_activations(spec, replace(job, fused_loss=True), o)
    f2 = head_activations(spec, replace(job, tp=2, fused_loss=True), o)
    assert "logits" not in f2 and f2["loss_grad_hidden"] == f1["loss_grad_hidden"]
    assert f2["loss_grad_head"] == pytest.approx(f1["loss_grad_head"] / 2, rel=1e-12)
    assert f2["loss_transient"] < f1["loss_transient"]
    # checkpointed: each block's (sequence-sharded) input
    ck1 = estimate(spec, replace(job, checkpointing=True), o).detail["act.layers_kept"]
    ck2 = estimate(spec, replace(job, checkpointing=True, tp=2), o).detail["act.layers_kept"]
    assert ck2 == pytest.approx(ck1 / 2)


def test_tp_comm_bytes_per_step_equal_the_hand_formula_and_flops_divide():
    spec = resolve_model("llama-3.1-8b")
    setup = make_setup(gpus=2, gpu_memory=141.0, gpu_type="H200", use_doctor=False)
    for ck in (False, True):
        job = _job(world=2, tp=2, grad_accum=2, checkpointing=ck)
        L, M = spec.num_layers, 4096 * 4096 * 2  # tokens x hidden x bf16
        fwd = 2 * (2 * L + 1) * M  # 2 all-gathers + 2 reduce-scatters per layer, + embedding/head pair
        bwd = 2 * (2 * L + 1) * M + (2 * 2 * L * M if ck else 0)  # + the recomputed forward's
        hand = 2 * (fwd + bwd) * (2 - 1) / 2  # grad-accum 2; each rank sends (n-1)/n
        colls = tensor_parallel_exchanges(spec, job)
        assert {(c.op, c.ranks, c.where, c.kind) for c in colls} == {("all_gather", 2, "intra", "tp"),
                                                                    ("reduce_scatter", 2, "intra", "tp")}
        assert sum(c.wire() * c.per_step for c in colls) == pytest.approx(hand)
        # the whole step: FSDP over one rank moves nothing, so the plan's bytes are TP's alone, all exposed
        t = plan_model(spec, job, setup, configured="fsdp", escalate=False).for_strategy("fsdp").timing
        assert t.comm_bytes == pytest.approx(hand)
        link_s = hand / setup.links().intra_busbw
        assert t.exposed_comm_s >= link_s
    assert tensor_parallel_exchanges(spec, _job(world=2)) == []
    f1, b1 = flops_per_microbatch(spec, _job(world=2))
    f2, b2 = flops_per_microbatch(spec, _job(world=2, tp=2))
    assert (f2, b2) == (pytest.approx(f1 / 2), pytest.approx(b1 / 2))


def test_degrees_that_do_not_divide_are_not_offered():
    # Qwen2.5-7B: 28 heads, 4 KV heads, MLP 18944 -> 8 divides neither heads; 3 is not a divisor of 8 GPUs
    assert tp_degrees(resolve_model("qwen2.5-7b"), 8) == [2, 4]
    assert tp_degrees(resolve_model("llama-3.1-8b"), 8) == [2, 4, 8]
    assert tp_degrees(resolve_model("llama-3.1-8b"), 6) == [2]  # 3 and 6 do not divide 32 heads
    assert tp_degrees(resolve_model("qwen2.5-0.5b"), 8) == [2]  # 14 heads, 2 KV heads
    spec = resolve_model("qwen2.5-7b")
    setup = make_setup(gpus=8, gpu_memory=80.0, use_doctor=False)
    rows = tensor_parallel_rows(spec, _job(world=8), setup)
    assert sorted({r["tp"] for r in rows}) == [1, 2, 4]
    assert {r["strategy"] for r in rows} >= {"fsdp", "fsdp-grad-op"}
    assert all(r["tp_comm_gb_per_step"] > 0 for r in rows if r["tp"] > 1)
    assert tensor_parallel_rows(spec, _job(world=8, tuner="lora"), setup) == []  # TP with LoRA is refused
    with pytest.raises(ShardwiseError, match="tensor_parallel 8 must divide the 8 GPUs per node, the model's 28 "
                                             "attention heads, 4 KV heads and MLP width 18944; degrees that do: 2, 4"):
        plan_cmd.run(parse("--model", "qwen2.5-7b", "--gpus", "8", "--strategy", "fsdp", "--tensor-parallel", "8"))


AUTO_70B = ["--model", "llama-3.1-70b", "--gpus", "8", "--gpu-memory", "80", "--gpu-type", "H100",
            "--param-dtype", "bf16", "--seq-len", "4096", "--micro-batch-size", "1", "--gradient-checkpointing"]


def test_auto_picks_fsdp_with_tp_for_70b_on_one_node_and_says_why(capsys):
    assert plan_cmd.run(parse(*AUTO_70B, "--json")) == 0
    d = json.loads(capsys.readouterr().out)
    par = d["parallel"]
    assert par["chosen"] and par["sequence_parallel"] == 1 and par["tensor_parallel"] > 1
    assert d["recommended"] == par["strategy"] and par["strategy"].startswith("fsdp")
    # no data-parallel preset without offload fits; the chosen degree is the smallest TP row that fits
    assert not any(s["fits"] for s in d["strategies"] if "offload" not in s["strategy"])
    fitting = [r["tp"] for r in d["tensor_parallel"] if r["strategy"] == par["strategy"] and r["fits"]]
    assert par["tensor_parallel"] == min(fitting) and par["mem_gib"] <= 80
    assert "data parallelism alone does not fit" in d["reasons"][0] and "the model is what does not fit" in d["reasons"][0]
    assert f"tensor parallel {par['tensor_parallel']} fits" in d["reasons"][1]
    assert d["decision_tree"]["parallel"]["path"] == TREE_TP
    assert "the numbers agree: the model is above 70B" in d["decision_tree"]["parallel"]["why"]
    assert plan_cmd.run(parse(*AUTO_70B, "--explain")) == 0
    text = capsys.readouterr().out
    assert f"recommended: {par['strategy']} with --tensor-parallel {par['tensor_parallel']}" in text
    assert "and further down: model > 70B -> Megatron / tensor parallel" in text
    assert "tensor parallel (degrees dividing the 8 GPUs per node, the 64 heads, 8 KV heads" in text
    # configured fsdp: the advice names the degree
    assert plan_cmd.run(parse(*AUTO_70B, "--strategy", "fsdp")) == 0
    assert f"Cheapest change that fits: --tensor-parallel {par['tensor_parallel']} " in capsys.readouterr().out


def test_launch_applies_the_degree_auto_chose(monkeypatch):
    from shardwise import hardware
    from shardwise.launch import preflight

    monkeypatch.setattr(hardware, "detect_light", lambda: hardware.Hardware("cuda", "H100", 8, 80.0, 2048.0))
    flags = {"model": ("llama-3.1-70b", "flag"), "strategy": ("auto", "flag"), "nproc_per_node": (8, "flag"),
             "param_dtype": ("bf16", "flag"), "seq_len": (4096, "flag"), "micro_batch_size": (1, "flag"),
             "gradient_checkpointing": (True, "flag"), "mixed_precision": ("bf16", "flag")}
    res = config.load_config(None, flags)
    cfg = preflight.choose_strategy(res.cfg, res)
    assert cfg.strategy.startswith("fsdp") and cfg.tensor_parallel > 1 and cfg.sequence_parallel == 1
    # a model that fits with data parallelism keeps the configured degrees
    res = config.load_config(None, {**flags, "model": ("qwen2.5-0.5b", "flag")})
    cfg = preflight.choose_strategy(res.cfg, res)
    assert (cfg.tensor_parallel, cfg.sequence_parallel) == (1, 1)


def test_the_configured_degree_reaches_the_plan_and_only_tp_presets_are_planned():
    res = config.load_config(None, {"strategy": ("fsdp", "flag"), "tensor_parallel": (2, "flag"),
                                    "nproc_per_node": (4, "flag")})
    setup = make_setup(gpus=4, gpu_memory=141.0, gpu_type="H200", use_doctor=False)
    job = job_from_config(res.cfg, setup)
    assert job.tp == 2 and job.dp == 2
    plan = plan_model(resolve_model("llama-3.1-8b"), job, setup, configured="fsdp")
    assert {s.base for s in plan.strategies} == {"fsdp"}  # DDP and ZeRO do not take TP
    t = plan.for_strategy("fsdp").timing
    # tokens/s: the 2 ranks of a tp group train the same rows, 2 groups
    assert t.tokens_per_s == pytest.approx(2 * job.micro_batch * job.seq_len * job.grad_accum / t.step_s)
    assert dataclasses.asdict(job)["tp"] == 2


def test_simulate_refuses_to_measure_another_job():
    from shardwise.plan.simulate import simulate_plan

    setup = make_setup(gpus=2, gpu_memory=141.0, gpu_type="H200", use_doctor=False)
    plan = plan_model(resolve_model("qwen2.5-0.5b"), _job(world=2, tp=2), setup, configured="fsdp")
    out = simulate_plan(plan)
    assert out["results"] == [] and "not simulated" in out["errors"][0]
