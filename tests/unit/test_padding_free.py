"""Padding-free micro-batches (--padding-free): the flattened layout, that every listed model family trains on it
as on the padded rows (same summed loss, same gradients: the mask is block-diagonal), and how auto/on/off resolve."""

import argparse
import dataclasses

import pytest
import torch

from shardwise import config
from shardwise.data.batches import (
    PADDING_FREE_FAMILIES,
    DataPosition,
    StepSampler,
    flattening_pays,
    padding_free,
)
from shardwise.data.encode import IGNORE, Encoded
from shardwise.errors import ShardwiseError
from shardwise.models.speed import token_loss_sum

LENGTHS = [13, 5, 9, 1]  # one micro-batch: 28 real tokens, padded 4 x 16 = 64 slots, flattened 1 x 32


def dataset(lengths=LENGTHS, vocab=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]
    # loss on some tokens of each row (the shifted targets of data/encode.py), IGNORE on the others
    tg = [[t if i % 3 else IGNORE for i, t in enumerate(torch.randint(0, vocab, (n,), generator=g).tolist())]
          for n in lengths]
    return Encoded(ids, tg, [list(range(n)) for n in lengths], [""] * len(lengths))


def sampler(data, flat: bool, mbs=4):
    return StepSampler(data, mbs, 1, 1, 0, seed=0, pad_id=0, padding_free=flat)


# ----------------------------------------------------------------------------- the layout


def test_flat_layout_places_each_row_with_its_own_positions():
    data = dataset()
    rows = [2, 0, 3, 1]
    mb = sampler(data, True).collate(rows)
    total = sum(LENGTHS)
    assert mb.input_ids.shape == (1, 32) and mb.targets.shape == mb.position_ids.shape == (1, 32)
    at, want_pos = 0, []
    for r in rows:
        n = LENGTHS[r]
        assert mb.input_ids[0, at:at + n].tolist() == data.input_ids[r]
        assert mb.targets[0, at:at + n].tolist() == data.targets[r]
        want_pos += list(range(n))
        at += n
    # positions restart at each row; the padding continues the last row's (row 1: 5 tokens, positions 0..4)
    assert mb.position_ids[0].tolist() == want_pos + list(range(5, 5 + 32 - total))
    assert (mb.input_ids[0, total:] == 0).all() and (mb.targets[0, total:] == IGNORE).all()
    # a multiple of 8 whatever the total (28 -> 32; 8 stays 8)
    assert sampler(dataset([3, 5]), True, mbs=2).collate([0, 1]).input_ids.shape == (1, 8)


def test_step_counts_are_real_tokens_in_both_layouts():
    data = dataset([3 + i % 7 for i in range(16)])
    padded, _ = sampler(data, False).next(DataPosition())
    flat, _ = sampler(data, True).next(DataPosition())
    assert padded.rows == flat.rows and padded.tokens == flat.tokens and padded.loss_tokens == flat.loss_tokens
    assert padded.tokens == sum(3 + r % 7 for r in padded.rows)
    assert all(mb.input_ids.shape[0] == 1 for mb in flat.micro) and all(mb.input_ids.shape[0] == 4 for mb in padded.micro)


def test_padding_free_refuses_sequence_parallel_slices():
    with pytest.raises(ShardwiseError, match="sequence parallelism"):
        StepSampler(dataset(), 4, 1, 1, 0, seed=0, pad_id=0, sp_degree=2, padding_free=True)


# ----------------------------------------------------------------------------- the models

BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=256, tie_word_embeddings=False,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, use_cache=False)
EXTRA = {"mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
         "qwen2_moe": dict(moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4,
                           num_experts_per_tok=2, decoder_sparse_step=1),
         "qwen3_moe": dict(moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1)}
WINDOW = 6  # smaller than the rows: the families with sliding-window layers take the sliding mask's path too


def tiny_model(model_type: str):
    """A random-init model of the family, fp32, SDPA attention, no KV cache (as models/load.py loads one)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, **BASE, **EXTRA.get(model_type, {}))
    if getattr(cfg, "sliding_window", None) is not None:
        cfg.sliding_window = WINDOW
    if model_type in ("qwen2", "qwen3"):  # sliding layers are opt-in there: one sliding, one full
        cfg.sliding_window, cfg.layer_types = WINDOW, ["sliding_attention", "full_attention"]
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).float().train()


def loss_and_grads(model, mb):
    model.zero_grad()
    logits = model(input_ids=mb.input_ids, position_ids=mb.position_ids).logits
    loss = token_loss_sum(logits, mb.targets)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_type", PADDING_FREE_FAMILIES)
def test_each_listed_family_trains_the_flat_batch_as_the_padded_one(model_type):
    """The same rows of different lengths, padded (4 x 16) and flattened (1 x 32): the summed token loss and every
    gradient agree in fp32, so attention never crosses rows (nor reaches the padding)."""
    data, rows = dataset(), [0, 1, 2, 3]
    model = tiny_model(model_type)
    padded = sampler(data, False).collate(rows)
    flat = sampler(data, True).collate(rows)
    assert padded.input_ids.shape == (4, 16) and flat.input_ids.shape == (1, 32)
    loss_p, grads_p = loss_and_grads(model, padded)
    loss_f, grads_f = loss_and_grads(model, flat)
    torch.testing.assert_close(loss_f, loss_p, rtol=1e-5, atol=1e-5)
    assert grads_f.keys() == grads_p.keys() and grads_p
    for name, g in grads_p.items():
        torch.testing.assert_close(grads_f[name], g, rtol=1e-4, atol=1e-5, msg=f"{model_type}: {name}")


def test_without_restarting_positions_the_rows_would_see_each_other():
    """The comparison above can fail: the same flattened tokens with positions 0..S-1 (one long sequence) give
    another loss."""
    data, rows = dataset(), [0, 1, 2, 3]
    model = tiny_model("llama")
    flat = sampler(data, True).collate(rows)
    loss_p, _ = loss_and_grads(model, sampler(data, False).collate(rows))
    joined = dataclasses.replace(flat, position_ids=torch.arange(flat.input_ids.shape[1]).unsqueeze(0))
    loss_j, _ = loss_and_grads(model, joined)
    assert not torch.allclose(loss_j, loss_p, rtol=1e-3)


# ----------------------------------------------------------------------------- auto / on / off


def cfg_of(**kw) -> config.Config:
    return dataclasses.replace(config.Config(), **kw)


def test_auto_is_on_only_for_cpu_training_of_a_listed_family_without_packing_or_model_parallelism():
    auto = cfg_of(padding_free="auto", micro_batch_size=4, seq_len=1024)
    assert padding_free(auto, "llama") is True
    assert padding_free(auto, "qwen2", sp=1, tp=1, cuda=False) is True
    assert padding_free(auto, "llama", cuda=True) is False  # a GPU: not measured there
    assert padding_free(dataclasses.replace(auto, packing=True), "llama") is False
    assert padding_free(auto, "llama", sp=2) is False
    assert padding_free(auto, "llama", tp=2) is False
    assert padding_free(dataclasses.replace(auto, micro_batch_size=1), "llama") is False  # nothing to save
    for family in ("jamba", "qwen3_next", "mamba", None):
        assert padding_free(auto, family) is False
    assert padding_free(dataclasses.replace(auto, micro_batch_size=8, seq_len=8192), "llama") is True  # judged per batch


def test_auto_flattens_only_the_micro_batches_where_it_pays():
    """auto (flat_when_it_pays): at most AUTO_FLAT_MAX tokens flattened, and at least AUTO_FLAT_SAVING fewer token
    slots than the padded rows; on flattens every micro-batch."""
    assert flattening_pays([13, 5, 9, 1], 16)  # 32 slots against 64
    assert not flattening_pays([16, 16, 15, 16], 16)  # 64 against 64: nothing saved, the causal kernel lost
    assert not flattening_pays([600, 300, 200, 100], 600)  # 1,200 tokens: the dense mask costs more than it saves
    data = dataset([13, 5, 9, 1, 16, 16, 15, 16])
    auto = StepSampler(data, 4, 1, 1, 0, seed=0, pad_id=0, padding_free=True, flat_when_it_pays=True)
    assert auto.collate([0, 1, 2, 3]).input_ids.shape == (1, 32)
    assert auto.collate([4, 5, 6, 7]).input_ids.shape == (4, 16)
    assert sampler(data, True).collate([4, 5, 6, 7]).input_ids.shape == (1, 64)


def test_off_is_off_and_on_is_on_wherever_it_is_correct():
    off = cfg_of(padding_free="off", micro_batch_size=4)
    assert padding_free(off, "llama") is False
    on = cfg_of(padding_free="on", micro_batch_size=1, seq_len=100_000)
    assert padding_free(on, "llama", cuda=True) is True  # any device, any size: the user's choice
    with pytest.raises(ShardwiseError, match=r"^--padding-free on \(key padding_free\): .*sequence parallel 2"):
        padding_free(on, "llama", sp=2)  # e.g. chosen by --strategy auto


def test_on_refuses_a_family_not_listed_in_one_line():
    on = cfg_of(padding_free="on")
    with pytest.raises(ShardwiseError) as e:
        padding_free(on, "jamba")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("--padding-free on (key padding_free): ")
    assert "not the model's 'jamba' (model_type in its config.json); use --padding-free auto or off" in msg


def flags(*argv):
    p = argparse.ArgumentParser()
    config.add_flags(p)
    return config.flags_from_namespace(p.parse_args(list(argv)))


@pytest.mark.parametrize("argv, says", [
    (("--packing",), r"^flag --padding-free: padding_free on .* packing already fills each row"),
    (("--sequence-parallel", "2"), r"^flag --padding-free: padding_free on is not built with sequence_parallel 2"),
    (("--tensor-parallel", "2", "--strategy", "fsdp"), r"^flag --padding-free: .* tensor_parallel 2"),
])
def test_config_refuses_on_with_packing_or_model_parallelism(argv, says):
    with pytest.raises(ShardwiseError, match=says):
        config.load_config(None, flags("--padding-free", "on", *argv))
    assert config.load_config(None, flags("--padding-free", "auto", *argv)).cfg.padding_free == "auto"


def test_the_key_takes_auto_on_off_only(tmp_path):
    assert config.Config().padding_free == "auto"
    path = tmp_path / "run.yaml"
    path.write_text("padding_free: sometimes\n")
    with pytest.raises(ShardwiseError, match=r"run\.yaml:1: 'padding_free' must be one of auto, on, off"):
        config.load_config(str(path))
