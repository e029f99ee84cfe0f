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


def _saved_activation_bytes(model, tokens: int) -> int:
    """Bytes of the tensors the first decoder block saves for backward (distinct storages, parameters excluded),
    fp32 on the CPU, measured through autograd's saved-tensor hooks."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            storages[s.data_ptr()] = s.nbytes()
        return t

    ids = torch.randint(0, model.config.vocab_size, (1, tokens))
    pos = torch.arange(tokens)[None]
    x = model.model.embed_tokens(ids).detach().requires_grad_()
    rope = model.model.rotary_emb(x, pos)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model.layers[0](x, position_embeddings=rope, attention_mask=None, position_ids=pos)
    return sum(storages.values())


@pytest.mark.parametrize("family,extra", [
    ("mixtral", {"num_local_experts": 8, "num_experts_per_tok": 2}),
    ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 1}),
    ("qwen2_moe", {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 256,
                   "shared_expert_intermediate_size": 384, "decoder_sparse_step": 1, "mlp_only_layers": []}),
])
def test_an_moe_blocks_saved_activations_are_what_the_planner_counts(family, extra):
    """The planner's per-block activations of an MoE block (the top-k experts' width, each routed token's copy
    and weighted output, the router) against what transformers' block saves for backward: within 10%. Counting
    all experts' width, or the dense intermediate size, is 40-60% off here."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardwise.plan.memory import Opts, layer_activations

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(family, vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa", **extra)
    model = AutoModelForCausalLM.from_config(cfg).train()
    spec = from_hf_config(cfg.to_dict(), family, "test")
    assert spec.num_experts == (extra.get("num_local_experts") or extra["num_experts"])
    job = Job(seq_len=512, micro_batch=1, compute="fp32", param_dtype="fp32", accelerator="cpu")
    predicted = sum(layer_activations(spec, job, Opts(base="single")).values())
    assert predicted == pytest.approx(_saved_activation_bytes(model, 512), rel=0.10)
