"""Issue 16 item 1: the planner's LoRA memory follows what models/lora.py and the fused head do."""

from __future__ import annotations

import argparse

import pytest
import torch

from shardwise import config
from shardwise.plan import command as plan_cmd
from shardwise.plan.costs.replica import replica_states
from shardwise.plan.decide import fit_advice
from shardwise.plan.memory import GiB, Job, Opts, States, head_activations, trainable
from shardwise.plan.model_spec import from_hf_config


@pytest.fixture(autouse=True)
def _no_doctor_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDWISE_CACHE_DIR", str(tmp_path / "cache"))


def _plan(*argv: str):
    p = argparse.ArgumentParser()
    plan_cmd.add_parser(p.add_subparsers())
    return plan_cmd.build(p.parse_args(["plan", *argv]))[0]


def test_planned_lora_weights_are_the_bytes_apply_lora_leaves(tiny_dir):
    """The frozen base in the compute dtype (bf16), the adapters in param_dtype (fp32): the planner's weight bytes
    for single are the bytes of the model apply_lora returns."""
    import json
    import os

    from transformers import AutoModelForCausalLM

    from shardwise.models.lora import apply_lora

    cfg = config.load_config(None, {"tuner": ("lora", "t"), "mixed_precision": ("bf16", "t"),
                                     "lora.r": (4, "t")}).cfg
    model = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_dir, local_files_only=True), cfg)
    real = sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights counted once
    with open(os.path.join(tiny_dir, "config.json")) as fh:
        spec = from_hf_config(json.load(fh), "tiny", "test")
    job = Job(tuner="lora", lora_r=4, compute="bf16", param_dtype="fp32")
    st = States(*trainable(spec, job))
    replica_states(spec, job, Opts("single"), 1, st)
    assert st.params == pytest.approx(real, rel=0.01)
    # autocast casts only the fp32 adapters, not a bf16 base: its copies are the adapters' size in bf16
    assert st.extraA["autocast_weights"] == 2 * st.P_t


def test_fused_head_skips_a_frozen_heads_gradient():
    """The fused loss head computes no weight gradient when the head is frozen (LoRA): same loss and hidden-state
    gradient as with a trained head, no weight .grad."""
    from shardwise.models.speed import linear_cross_entropy

    torch.manual_seed(0)
    h = torch.randn(12, 8, requires_grad=True)
    w = torch.randn(40, 8)
    t = torch.randint(0, 40, (12,))
    loss = linear_cross_entropy(h, w, t, chunk=5)
    loss.backward()
    h2 = h.detach().clone().requires_grad_(True)
    w2 = w.clone().requires_grad_(True)
    ref = torch.nn.functional.cross_entropy(h2 @ w2.t(), t, reduction="sum")
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(h.grad, h2.grad)
    assert w.grad is None and w2.grad is not None


def test_lora_head_at_the_peak_is_one_chunk_of_logits():
    """A 7.6B model with a 152k vocab at 1 x 512 tokens: the fused head under LoRA holds one chunk of fp32 logits
    and its bf16 copy (512 x 152064 x 6 B = 0.44 GiB), not a head-weight gradient (it was 8.56 GiB)."""
    plan = _plan("--model", "qwen2.5-7b", "--gpus", "1", "--gpu-memory", "24", "--tuner", "lora",
                 "--micro-batch-size", "1", "--seq-len", "512")
    head = head_activations(plan.spec, plan.job, Opts("single"))
    loss = sum(v for k, v in head.items() if k.startswith(("logits", "loss_")))
    assert loss < 0.5 * GiB
    assert head["loss_grad_head"] == 0
    full = head_activations(plan.spec, Job(**{**plan.job.__dict__, "tuner": "full"}), Opts("single"))
    assert full["loss_grad_head"] >= 4 * 152064 * 3584  # a trained head keeps its fp32 gradient


def test_suggester_combines_cheap_levers_when_no_single_change_fits():
    """Qwen2.5-7B LoRA, 4 x 2048 on a 20 GiB card: no one change fits, param dtype bf16 + checkpointing +
    micro-batch 1 does; the advice names the combination instead of 'use a smaller model'."""
    plan = _plan("--model", "qwen2.5-7b", "--gpus", "1", "--gpu-memory", "20", "--tuner", "lora",
                 "--micro-batch-size", "4", "--seq-len", "2048", "--strategy", "single")
    advice = fit_advice(plan, "single")
    assert "does not fit" in advice and "smaller model" not in advice
    assert "--gradient-checkpointing" in advice and "--micro-batch-size 1" in advice
    # each lever alone leaves it over 20 GiB
    for flags in (["--gradient-checkpointing"], ["--param-dtype", "bf16"], ["--micro-batch-size", "1"]):
        alone = _plan("--model", "qwen2.5-7b", "--gpus", "1", "--gpu-memory", "20", "--tuner", "lora",
                      "--micro-batch-size", "4", "--seq-len", "2048", "--strategy", "single", *flags)
        assert not alone.for_strategy("single").fits, flags
