"""The planner counts task dpo's reference model: its weights (a whole copy per rank where the strategy replicates,
1/N of them where it gathers parameters, none for LoRA's adapters-off reference, reference-free losses or
--precompute-ref), the reference's forward FLOPs, and 2 rows per pair."""

import argparse

import pytest

from shardwise import config, hardware
from shardwise.plan import plan_run
from shardwise.plan.memory import GiB
from shardwise.plan.model_presets import resolve_model

P = resolve_model("qwen2.5-1.5b").total_params


def plan(*argv):
    p = argparse.ArgumentParser()
    config.add_flags(p)
    cfg = config.load_config(None, config.flags_from_namespace(p.parse_args(
        ["--model", "qwen2.5-1.5b", "--data", "x.jsonl", "--seq-len", "1024", "--micro-batch-size", "2",
         "--mixed-precision", "bf16", *argv]))).cfg
    return plan_run(cfg, hardware.Hardware("cuda", "H100", 8, 80.0, 0.0), world_size=8)


@pytest.fixture(scope="module")
def plans():
    return {"sft": plan(), "dpo": plan("--task", "dpo"), "lora": plan("--task", "dpo", "--tuner", "lora"),
            "simpo": plan("--task", "dpo", "--loss-type", "simpo"), "pre": plan("--task", "dpo", "--precompute-ref"),
            "sft-rows": plan("--micro-batch-size", "4")}


def ref_bytes(p, strategy):
    return p.for_strategy(strategy).memory.detail.get("buffer.reference", 0.0)


def test_the_reference_is_whole_where_the_strategy_replicates_and_sharded_where_it_gathers(plans):
    dpo = plans["dpo"]
    assert ref_bytes(dpo, "ddp") == pytest.approx(P * 4)  # autocast: the policy's fp32, so it computes as the policy
    assert ref_bytes(dpo, "zero2") == pytest.approx(P * 2)  # DeepSpeed's bf16 engine: bf16, as the policy runs
    assert ref_bytes(dpo, "fsdp") == pytest.approx(P * 2 / 8)
    assert ref_bytes(dpo, "zero3") == pytest.approx(P * 2 / 8)
    for name in ("lora", "simpo", "pre"):
        assert ref_bytes(plans[name], "ddp") == 0.0


def test_a_pair_is_two_rows_and_the_reference_forward_costs_a_third_of_a_step(plans):
    rows, dpo, pre = plans["sft-rows"], plans["dpo"], plans["pre"]
    assert dpo.job.micro_batch == rows.job.micro_batch == 4
    # without a reference (precomputed) DPO is SFT on the same rows but for the loss head (the log-probability
    # head makes no gradient in its forward, memory.preference_head_terms) and, with one, the reference's weights
    def head(p, s):
        return sum(v for k, v in p.for_strategy(s).memory.detail.items() if k.startswith("act.head.loss_"))

    for s in ("ddp", "fsdp"):
        assert head(pre, s) < head(rows, s)
        assert pre.for_strategy(s).memory.peak_tensors - head(pre, s) == pytest.approx(
            rows.for_strategy(s).memory.peak_tensors - head(rows, s))
        grown = dpo.for_strategy(s).memory.peak_tensors - pre.for_strategy(s).memory.peak_tensors
        assert grown == pytest.approx(ref_bytes(dpo, s))  # alive through the whole step
    compute = {k: plans[k].for_strategy("fsdp").timing.compute_s for k in ("dpo", "pre")}
    assert compute["dpo"] / compute["pre"] == pytest.approx(4 / 3, rel=0.02)
    assert dpo.for_strategy("ddp").memory.total / GiB > pre.for_strategy("ddp").memory.total / GiB + 5.5


def test_strategy_auto_weighs_the_reference():
    """On a card between the two sizes ddp fits with --precompute-ref and not with the reference copy beside it, and
    the recommendation (what --strategy auto runs) is one that fits."""
    def on(gib, *argv):
        p = argparse.ArgumentParser()
        config.add_flags(p)
        cfg = config.load_config(None, config.flags_from_namespace(p.parse_args(
            ["--model", "qwen2.5-1.5b", "--data", "x.jsonl", "--seq-len", "1024", "--micro-batch-size", "2",
             "--mixed-precision", "bf16", "--task", "dpo", *argv]))).cfg
        return plan_run(cfg, hardware.Hardware("cuda", "H100", 2, gib, 0.0), world_size=2)

    sizes = {k: on(80.0, *a).for_strategy("ddp").memory.total / GiB for k, a in (("ref", ()), ("pre", ("--precompute-ref",)))}
    card = (sizes["ref"] + sizes["pre"]) / 2
    with_ref, pre = on(card), on(card, "--precompute-ref")
    assert pre.for_strategy("ddp").fits and not with_ref.for_strategy("ddp").fits
    assert with_ref.recommended != "ddp" and with_ref.for_strategy(with_ref.recommended).fits


def test_a_sharded_reference_is_gathered_once_more_per_micro_batch(plans):
    """fsdp and zero3 gather the reference's weights for its forward (LoRA: the policy's, adapters off); ddp moves
    nothing more; without a reference in training nothing is added."""
    def gathers(p, s):
        return sum(c.wire() * c.per_step for c in p.for_strategy(s).timing.collectives if c.op == "all_gather")

    for s in ("fsdp", "zero3"):
        assert gathers(plans["dpo"], s) > gathers(plans["pre"], s)
        assert gathers(plans["lora"], s) > gathers(plan("--task", "dpo", "--tuner", "lora", "--precompute-ref"), s)
    assert gathers(plans["dpo"], "ddp") == gathers(plans["pre"], "ddp")


def test_auto_never_escalates_a_dpo_job_to_tensor_or_sequence_parallelism():
    """Where no data-parallel preset fits (Llama-3.1-70B on 2 nodes of 8 x 40 GiB), an SFT job escalates to tensor
    parallelism; a DPO job, which does not compose with it, is not escalated, and the reasons say what may fit."""
    def on(*argv):
        p = argparse.ArgumentParser()
        config.add_flags(p)
        cfg = config.load_config(None, config.flags_from_namespace(p.parse_args(
            ["--model", "llama-3.1-70b", "--data", "x.jsonl", "--seq-len", "1024", "--micro-batch-size", "1",
             "--mixed-precision", "bf16", "--param-dtype", "bf16", "--gradient-checkpointing", "--nnodes", "2",
             "--rdzv-endpoint", "node0:29500", *argv]))).cfg
        return plan_run(cfg, hardware.Hardware("cuda", "H100", 8, 40.0, 0.0), world_size=16)

    sft, dpo = on(), on("--task", "dpo")
    assert sft.parallel["chosen"] and sft.parallel["tensor_parallel"] > 1
    assert not dpo.parallel and dpo.job.tp == dpo.job.sp == 1
    assert dpo.for_strategy(dpo.recommended).fits or any("task dpo is not built with tensor" in r for r in dpo.reasons)


def test_the_log_probability_head_makes_its_logits_again_in_backward():
    """task dpo's fused head cannot make its gradients in the forward (they need each token's upstream value): its
    backward runs the head's matmul once more; the plain head keeps its logits and does not."""
    import dataclasses

    from shardwise.plan.comm import flops_per_microbatch
    from shardwise.plan.memory import Job

    spec = resolve_model("qwen2.5-1.5b")
    for tuner in ("full", "lora"):
        sft = Job(micro_batch=4, seq_len=1024, tuner=tuner, fused_loss=True)
        dpo = dataclasses.replace(sft, task="dpo")
        (f0, b0), (f1, b1) = flops_per_microbatch(spec, sft), flops_per_microbatch(spec, dpo)
        assert f1 == f0 and b1 - b0 == pytest.approx(2 * spec.vocab_size * spec.hidden_size * sft.tokens)
        plain = [dataclasses.replace(j, fused_loss=False) for j in (sft, dpo)]
        assert flops_per_microbatch(spec, plain[0]) == flops_per_microbatch(spec, plain[1])


def test_the_head_passes_and_the_reference_copys_weight_casts_are_memory_bound_time():
    """The log-probability head's passes over the logits (the reference's forward once more, where it runs in
    training) and, under autocast over fp32 weights, the frozen copy's casts of every linear weight in its forward
    and the fused head's second cast of the policy's weight: bytes at the HBM rate, counted per pass."""
    import dataclasses

    from shardwise.plan.comm import (
        HBM_BYTES_PER_S,
        LOSS_BYTES_PER_LOGIT,
        PREFERENCE_HEAD_BYTES_PER_LOGIT,
        Compute,
        elementwise_time,
    )
    from shardwise.plan.memory import Job

    spec = resolve_model("qwen2.5-1.5b")
    comp = Compute(989e12, 0.57)
    sft = Job(micro_batch=4, seq_len=1024, fused_loss=True)
    logits = sft.tokens * spec.vocab_size
    assert not sft.compile  # the eager head's passes; compiled ones below
    (fwd, bwd), head = PREFERENCE_HEAD_BYTES_PER_LOGIT[True, False], spec.vocab_size * spec.hidden_size

    def extra(job, autocast, than=sft):
        return (elementwise_time(spec, job, comp, autocast=autocast)
                - elementwise_time(spec, than, comp, autocast=autocast)) * HBM_BYTES_PER_S

    ref = dataclasses.replace(sft, task="dpo", reference="model")
    base = (2 * fwd + bwd - LOSS_BYTES_PER_LOGIT) * logits
    assert extra(ref, autocast=True) == pytest.approx(base + 6 * (spec.linear_params + head))  # fp32 -> bf16 reads 4, writes 2
    assert extra(ref, autocast=False) == pytest.approx(base)  # FSDP / DeepSpeed hold the weights in bf16
    assert extra(dataclasses.replace(ref, param_dtype="bf16"), autocast=True) == pytest.approx(base)
    simpo = dataclasses.replace(ref, reference="none")  # no reference: the policy's passes only
    assert extra(simpo, autocast=False) == pytest.approx((fwd + bwd - LOSS_BYTES_PER_LOGIT) * logits)
    lora = dataclasses.replace(ref, tuner="lora", reference="adapters")  # the base is stored in bf16: no casts
    assert extra(lora, autocast=True, than=dataclasses.replace(sft, tuner="lora")) == pytest.approx(base)
    # compiled, each chunk's passes over its logits are one fused kernel each way: 4 and 6 bytes a logit
    compiled = dataclasses.replace(ref, compile=True)
    assert extra(compiled, autocast=False, than=dataclasses.replace(sft, compile=True)) == pytest.approx(
        (2 * 4 + 6 - LOSS_BYTES_PER_LOGIT) * logits)
