"""MoE in the planner and the engine's router-loss switch (models/moe.py, plan/model_spec.py)."""

from __future__ import annotations

import pytest

from shardwise.plan.comm import flops_per_microbatch
from shardwise.plan.memory import Job
from shardwise.plan.model_spec import from_hf_config

# Mixtral-8x7B's published config.json (mistralai/Mixtral-8x7B-v0.1); Mistral AI publishes 46.7B parameters in
# all and 12.9B used per token
MIXTRAL_8X7B = {"model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                "num_local_experts": 8, "num_experts_per_tok": 2, "tie_word_embeddings": False,
                "max_position_embeddings": 32768}


def test_mixtral_total_and_active_parameters_match_the_published_counts():
    spec = from_hf_config(MIXTRAL_8X7B, "mixtral", "test")
    assert spec.total_params == pytest.approx(46.7e9, rel=0.005)
    assert spec.active_params == pytest.approx(12.9e9, rel=0.005)


def test_flops_count_the_active_experts_only():
    """Top-2 of 8 experts of width F compute what one dense MLP of width 2F computes (plus the router)."""
    moe = from_hf_config(MIXTRAL_8X7B, "mixtral", "test")
    dense = from_hf_config({**{k: v for k, v in MIXTRAL_8X7B.items() if "expert" not in k},
                            "model_type": "mistral", "intermediate_size": 2 * 14336}, "dense", "test")
    assert moe.active_params == dense.total_params + 32 * 4096 * 8  # + each layer's router (hidden x experts)
    job = Job(seq_len=2048)
    assert flops_per_microbatch(moe, job) == pytest.approx(flops_per_microbatch(dense, job), rel=1e-4)  # the router
    assert flops_per_microbatch(moe, job)[0] < 0.3 * 2 * moe.total_params * job.tokens  # not all 8 experts


def test_router_loss_weight_follows_the_model_config(tmp_path):
    from transformers import AutoModelForCausalLM

    from shardwise.models.moe import aux_loss_weight, moe_leaf_classes
    from shardwise.models.tiny import write_tiny_moe

    write_tiny_moe(str(tmp_path / "off"), 0, "mixtral")
    write_tiny_moe(str(tmp_path / "on"), 0, "mixtral", output_router_logits=True, router_aux_loss_coef=0.02)
    off = AutoModelForCausalLM.from_pretrained(str(tmp_path / "off"))
    on = AutoModelForCausalLM.from_pretrained(str(tmp_path / "on"))
    assert aux_loss_weight(off) == 0.0 and aux_loss_weight(on) == pytest.approx(0.02)
    assert [c.__name__ for c in moe_leaf_classes(on)] == ["MixtralSparseMoeBlock"]
