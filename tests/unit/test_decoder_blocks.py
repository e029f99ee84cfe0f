"""Which modules are the decoder blocks (models/speed.py decoder_blocks): the unit that every strategy compiles,
checkpoints, wraps for FSDP/tensor parallelism and fetches whole under ZeRO-3. A model naming its layer class in
`_no_split_modules` gets those layers, even when an expert list of one class is longer than the layer list (a
remote-code MoE: 64 experts, 24 layers); else the longest one-class ModuleList."""

from __future__ import annotations

import warnings

import pytest
from torch import nn

from shardwise.models.speed import compile_blocks, decoder_blocks


class Expert(nn.Linear):
    def __init__(self):
        super().__init__(4, 4)


class MoE(nn.Module):
    def __init__(self, experts: int):
        super().__init__()
        self.gate = nn.Linear(4, experts)
        self.experts = nn.ModuleList(Expert() for _ in range(experts))


class ToyBlock(nn.Module):
    def __init__(self, experts: int):
        super().__init__()
        self.attn, self.mlp = nn.Linear(4, 4), MoE(experts)


class Toy(nn.Module):
    """A remote-code-style MoE: 2 layers, each with an nn.ModuleList of 8 experts of one class."""

    def __init__(self, layers: int = 2, experts: int = 8):
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.layers = nn.ModuleList(ToyBlock(experts) for _ in range(layers))
        self.head = nn.Linear(4, 8, bias=False)

    def get_input_embeddings(self):
        return self.embed


class DeclaredToy(Toy):
    _no_split_modules = ["ToyBlock"]


def _same(got, want):
    return len(got) == len(want) and all(a is b for a, b in zip(got, want))


@pytest.mark.parametrize("names", [["ToyBlock"], {"ToyBlock", "SiglipEncoderLayer"}, ("VisionBlock", "ToyBlock"),
                                   "ToyBlock"])
def test_the_declared_layer_class_wins_over_a_longer_expert_list(names):
    """The longest one-class list is the first block's 8 experts; the declared class names the 2 layers. Names of
    classes the model does not hold (a vision tower's) are ignored; a list, a set, a tuple or one name."""
    model = Toy()
    model._no_split_modules = names
    assert _same(decoder_blocks(model), list(model.layers))
    declared = DeclaredToy()
    assert _same(decoder_blocks(declared), list(declared.layers))


@pytest.mark.parametrize("names", [None, [], ["SomethingElse"]])
def test_without_a_declared_class_it_holds_the_longest_one_class_list_is_taken(names):
    """No usable `_no_split_modules`: the old rule, unchanged. For this model that is the FIRST layer's expert
    list (8 Experts, longer than the 2 layers; the second layer's equally long list comes later and does not
    replace it) - the defect a model's declaration avoids."""
    model = Toy()
    model._no_split_modules = names
    assert _same(decoder_blocks(model), list(model.layers[0].mlp.experts))
    short = Toy(layers=3, experts=2)  # the layer list is the longest: the layers, as before
    assert _same(decoder_blocks(short), list(short.layers))


def test_a_layer_class_swapped_for_a_subclass_still_matches():
    """FSDP2's fully_shard replaces a block's class by a subclass named FSDP<name>; the declared name still finds
    it through the base class (else the blocks would fall back to the experts once the model is wrapped)."""
    model = DeclaredToy()
    fsdp_cls = type("FSDPToyBlock", (ToyBlock,), {})
    for b in model.layers:
        b.__class__ = fsdp_cls
    assert _same(decoder_blocks(model), list(model.layers))


def test_a_peft_wrapped_model_gets_its_base_models_blocks():
    """The strategies see the PeftModel (models/lora.py apply_lora runs before parallelize): the declaration is
    the base model's, and the blocks are the base model's layers (with their LoRA-wrapped linears)."""
    from peft import LoraConfig, get_peft_model

    model = DeclaredToy()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=["attn"]))
    assert _same(decoder_blocks(peft_model), list(model.layers))
    assert type(model.layers[0].attn).__module__.startswith("peft")  # the adapters are inside the blocks found


def _tiny(family: str):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardwise.models.tiny import TINY_CONFIG, TINY_MOE_CONFIGS

    torch.manual_seed(0)
    fields = TINY_CONFIG if family == "llama" else TINY_MOE_CONFIGS[family]
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **fields))


@pytest.mark.parametrize("family, layer", [("llama", "LlamaDecoderLayer"), ("mixtral", "MixtralDecoderLayer"),
                                           ("qwen2_moe", "Qwen2MoeDecoderLayer"),
                                           ("qwen3_moe", "Qwen3MoeDecoderLayer")])
@pytest.mark.parametrize("lora", [False, True])
def test_transformers_tiny_models_blocks_are_their_decoder_layers(family, layer, lora):
    """The tiny models the suite trains (models/tiny.py): the blocks are `model.model.layers`, one per hidden
    layer, plain or under peft's LoRA wrapper (transformers 5 keeps each block's experts fused in one module)."""
    model = _tiny(family)
    layers = list(model.model.layers)
    if lora:
        from peft import LoraConfig, get_peft_model

        from shardwise.models.lora import quiet_peft

        with quiet_peft():
            model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    blocks = decoder_blocks(model)
    assert _same(blocks, layers)
    assert {type(b).__name__ for b in blocks} == {layer}
    assert len(blocks) == model.config.num_hidden_layers == 4


def test_a_hybrid_models_two_declared_layer_classes_are_all_blocks():
    """Jamba's layer list mixes its attention and Mamba layer classes, both declared: all 8 layers are blocks, in
    order. The one-class rule found no block at all in it (nothing compiled, checkpointed or fetched whole)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("jamba", vocab_size=128, hidden_size=32, intermediate_size=32, num_hidden_layers=8,
                               num_attention_heads=4, num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1,
                               expert_layer_period=2, expert_layer_offset=1, num_experts=4, mamba_d_state=4,
                               mamba_expand=1, use_mamba_kernels=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(cfg)
    blocks = decoder_blocks(model)
    assert _same(blocks, list(model.model.layers))
    assert [type(b).__name__ for b in blocks[:2]] == ["JambaMambaDecoderLayer", "JambaAttentionDecoderLayer"]


# -- the callers pick the declared blocks ---------------------------------------------------------------------


def test_compile_and_selective_checkpointing_take_the_layers_not_the_experts():
    from shardwise.models.checkpointing import checkpoint_blocks

    model = DeclaredToy()
    assert compile_blocks(model) == 2
    assert all(b._compiled_call_impl is not None for b in model.layers)  # lazy: nothing is compiled until called
    assert not any(getattr(m, "_compiled_call_impl", None) for m in model.layers[0].mlp.experts)
    model = DeclaredToy()
    assert checkpoint_blocks(model, "selective").endswith("in 2 blocks")
    assert all(b.forward.__name__ == "checkpointed_forward" for b in model.layers)
    assert not any(e.forward.__name__ == "checkpointed_forward" for e in model.layers[0].mlp.experts)


def test_zero3_fetches_each_declared_layer_whole():
    """ZeRO-3's leaves (strategies/deepspeed.py apply_leaves): the declared layers, each holding its MoE block, so
    no separate MoE leaf. Without the declaration the experts (and their MoE blocks) are the leaves and each
    layer's attention is fetched module by module (tests/unit/test_strategies.py keeps that fallback's guard)."""
    from deepspeed.utils import z3_leaf_module

    from shardwise import config
    from shardwise.strategies.deepspeed import DeepSpeedStrategy

    model = DeclaredToy()
    s = object.__new__(DeepSpeedStrategy)
    s.cfg = config.load_config(None, {"strategy": ("zero3", "flag --strategy")}).cfg
    s.apply_leaves(model)
    assert {type(m).__name__ for m in model.modules() if z3_leaf_module(m)} == {"ToyBlock"}
    assert s.describe() == "deepspeed ZeRO-3, blocks fetched whole (ToyBlock)"
