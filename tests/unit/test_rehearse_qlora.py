"""QLoRA's rehearsal builds its 4-bit base one linear at a time: each made in the compute dtype where the rank runs
and quantised there at once, so the full-precision base (140 GB at 70B) never exists on the host.

Needs bitsandbytes (not among the test extras: it runs where `pip install 'shardwise[qlora]'` is, as on the GPU
machine); bitsandbytes quantises on the CPU too, so the function is checked here on the CPU."""

from __future__ import annotations

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")


def test_every_4bit_linear_is_quantised_and_the_rest_is_made_real():
    from transformers import AutoModelForCausalLM, LlamaConfig

    from shardwise.models.lora import quantize_4bit
    from shardwise.train.rehearse import materialize_quantised, params_on_meta

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256)
    with params_on_meta():
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        quantize_4bit(model, torch.bfloat16)
    rotary = model.model.rotary_emb.inv_freq.clone()
    made = materialize_quantised(model, "cpu")
    assert not [n for n, p in model.named_parameters() if p.is_meta]
    quantised = [m.weight for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(quantised) == 2 * 7
    assert all(isinstance(w, bnb.nn.Params4bit) and w.bnb_quantized and w.dtype == torch.uint8 for w in quantised)
    # NF4: half a byte per weight, plus the bf16 rest (embeddings, head, norms)
    block = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, bnb.nn.Linear4bit))
    rest = sum(p.numel() * 2 for n, p in model.named_parameters() if p.dtype == torch.bfloat16)
    assert made == block // 2 + rest
    assert torch.equal(model.model.rotary_emb.inv_freq, rotary)  # real buffers kept
    logits = model(torch.randint(0, 256, (1, 8))).logits
    assert torch.isfinite(logits).all() and logits.float().std() > 0
