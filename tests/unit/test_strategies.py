"""Strategy pieces that need no process group: registry, DeepSpeed config generation, FSDP
unit selection, LoRA merge math, and the refusals made before any process starts."""

import json
import sys
import warnings

import pytest
import torch
from torch import nn

from shardwise import config, strategies
from shardwise.errors import ShardwiseError
from tests.helpers import run_cli


def cfg_of(**flags):
    return config.load_config(None, {k: (v, f"flag --{k}") for k, v in flags.items()}).cfg


# -- registry ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["single", "ddp", "fsdp", "fsdp-grad-op", "fsdp-offload", "hybrid",
                                  "zero1", "zero2", "zero3", "zero2-offload", "zero3-offload"])
def test_every_preset_resolves_to_a_strategy_class(name):
    cls = strategies.get(name)
    assert hasattr(cls, "setup") and hasattr(cls, "step")


def test_zero_without_deepspeed_is_one_line_with_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # find_spec -> None, as when not installed
    with pytest.raises(ShardwiseError, match=r"needs deepspeed.*pip install 'shardwise\[deepspeed\]'"):
        strategies.get("zero3-offload")
    strategies.get("fsdp")  # others are unaffected


def test_cli_refuses_zero_without_deepspeed_before_launch(tmp_path):
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['deepspeed'] = None\n")
    out = tmp_path / "run"
    p = run_cli("train", "--strategy", "zero2", "--max-steps", "1", "--output-dir", str(out), check=False,
                env={"PYTHONPATH": str(hide)})
    assert p.returncode != 0
    err = [line for line in p.stderr.splitlines() if line.strip()]
    assert err == ["shardwise: error: strategy 'zero2' needs deepspeed, which is not installed; "
                   "install it with: pip install 'shardwise[deepspeed]'"]
    assert not out.exists()


# -- DeepSpeed config: one source of truth ----------------------------------------------------


def test_deepspeed_is_imported_without_mlflow_which_stays_importable():
    """DeepSpeed's autotuner imports mlflow when the package is imported (2.6 CPU-s of 4.7 here); ZeRO runs import
    deepspeed without it (strategies/deepspeed.import_deepspeed), and a run reporting to mlflow can still import it
    afterwards (a plain `import deepspeed` imports it: has_mlflow would be True). In a fresh interpreter: another
    test may have imported either in this one."""
    pytest.importorskip("deepspeed")
    pytest.importorskip("mlflow")
    import subprocess

    script = """
import sys
from shardwise.strategies.deepspeed import import_deepspeed
ds = import_deepspeed()
assert ds is sys.modules["deepspeed"] and ds.initialize
assert "mlflow" not in sys.modules, "mlflow imported with deepspeed"
from deepspeed.autotuning import autotuner
assert autotuner.has_mlflow is False
import mlflow
assert mlflow.log_metric
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]


def test_zero3_keeps_deepspeeds_linear_except_for_compiled_whole_blocks(tmp_path):
    """DeepSpeed's F.linear saves the weight parameter, so a released weight's gathered buffer is freed; torch's eager
    linear keeps a view of it to backward (every released weight alive: ZeRO-3's sharding undone on several ranks).
    Compiled blocks save the parameter too, and DeepSpeed's linear traced into them recompiled every block: off there
    only. A user's deepspeed.config still wins."""
    from shardwise.strategies.deepspeed import ds_config

    def zero(**flags):
        return ds_config(cfg_of(strategy="zero3", **flags), world=2, cuda=False)["zero_optimization"]

    assert "memory_efficient_linear" not in zero(compile="off")  # DeepSpeed's default: on
    assert zero(compile="on")["memory_efficient_linear"] is False
    assert "memory_efficient_linear" not in zero(compile="on", **{"deepspeed.fetch": "module"})
    user = tmp_path / "ds.json"
    user.write_text('{"zero_optimization": {"memory_efficient_linear": true}}')
    assert zero(compile="on", **{"deepspeed.config": str(user)})["memory_efficient_linear"] is True


def test_deepspeed_config_is_generated_from_ours(tmp_path):
    from shardwise.strategies.deepspeed import ds_config

    c = cfg_of(strategy="zero3-offload", micro_batch_size=3, grad_accum=5, max_grad_norm=0.7,
               mixed_precision="bf16")
    ds = ds_config(c, world=4, cuda=True)
    assert ds["train_micro_batch_size_per_gpu"] == 3 and ds["gradient_accumulation_steps"] == 5
    assert ds["train_batch_size"] == 3 * 5 * 4
    assert ds["gradient_clipping"] == 0.7
    assert ds["bf16"] == {"enabled": True} and "fp16" not in ds
    assert ds["communication_data_type"] == "fp32"
    z = ds["zero_optimization"]
    assert z["stage"] == 3 and z["offload_optimizer"]["device"] == "cpu" and z["offload_param"]["device"] == "cpu"

    pure = ds_config(cfg_of(strategy="zero1", mixed_precision="bf16", param_dtype="bf16"), world=2, cuda=True)
    assert pure["bf16"]["bf16_master_weights_and_grads"] and pure["bf16"]["bf16_optimizer_states"]
    fp32 = ds_config(cfg_of(strategy="zero2", mixed_precision="no"), world=2, cuda=False)
    assert "bf16" not in fp32 and "fp16" not in fp32 and "offload_optimizer" not in fp32["zero_optimization"]
    fp16 = ds_config(cfg_of(strategy="zero2", mixed_precision="fp16"), world=2, cuda=True)
    assert fp16["fp16"]["enabled"] and fp16["fp16"]["loss_scale"] == 0


def test_a_user_deepspeed_json_overrides_generated_keys(tmp_path):
    from shardwise.strategies.deepspeed import ds_config

    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"zero_optimization": {"reduce_bucket_size": 1000}, "gradient_clipping": 0.0}))
    ds = ds_config(cfg_of(strategy="zero2", max_grad_norm=1.0, **{"deepspeed.config": str(user)}), 2, False)
    assert ds["gradient_clipping"] == 0.0
    assert ds["zero_optimization"] == {"stage": 2, "reduce_bucket_size": 1000}  # merged, not replaced
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ShardwiseError, match="deepspeed.config"):
        ds_config(cfg_of(strategy="zero2", **{"deepspeed.config": str(bad)}), 2, False)


# -- FSDP units -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tiny_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir, local_files_only=True)


def test_block_wrap_makes_each_decoder_layer_one_unit(tiny_model):
    from shardwise.strategies.fsdp import block_units

    units = block_units(tiny_model)
    assert units == list(tiny_model.model.layers)
    in_units = {id(p) for u in units for p in u.parameters()}
    # embeddings, final norm and head stay with the root: not separate tiny units
    for m in (tiny_model.model.embed_tokens, tiny_model.model.norm, tiny_model.lm_head):
        assert all(id(p) not in in_units for p in m.parameters())


def test_size_wrap_units_hold_at_least_n_params_and_never_split_a_tie():
    from shardwise.strategies.fsdp import size_units

    class Toy(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(100, 8)  # 800, tied with head
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)) for _ in range(3))
            self.head = nn.Linear(8, 100, bias=False)
            self.head.weight = self.emb.weight

    toy = Toy()
    units = size_units(toy, 100)  # each Linear(8, 8) has 72 params; a block 144
    assert units == list(toy.blocks)
    assert all(sum(p.numel() for p in u.parameters()) >= 100 for u in units)
    assert toy.emb not in units and toy.head not in units  # tied: the root keeps them
    assert size_units(toy, 10**6) == []


# -- LoRA -------------------------------------------------------------------------------------


def test_lora_freezes_the_base_in_the_compute_dtype_and_trains_fp32_adapters(tiny_dir):
    from transformers import AutoModelForCausalLM

    from shardwise.models.lora import apply_lora

    c = cfg_of(tuner="lora", mixed_precision="bf16", **{"lora.r": 4})
    base = AutoModelForCausalLM.from_pretrained(tiny_dir, local_files_only=True)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model = apply_lora(base, c)
    # peft's read of transformers' deprecated `is_gradient_checkpointing` stays out of the run's log
    assert not [w for w in seen if "is_gradient_checkpointing" in str(w.message)], [str(w.message) for w in seen]
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n and p.dtype == torch.float32 for n, p in trainable.items())
    frozen = [p for p in model.named_parameters() if not p[1].requires_grad]
    assert all(p.dtype == torch.bfloat16 for _, p in frozen)
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    with pytest.raises(ShardwiseError, match="no linear module named nope"):
        apply_lora(AutoModelForCausalLM.from_pretrained(tiny_dir, local_files_only=True),
                   cfg_of(tuner="lora", mixed_precision="no", **{"lora.targets": "q_proj,nope"}))


def test_merged_state_dict_is_w_plus_scaled_ba():
    from shardwise.models.lora import merged_state_dict

    c = cfg_of(tuner="lora", **{"lora.r": 2, "lora.alpha": 8.0})
    w, a, b = torch.randn(3, 5), torch.randn(2, 5), torch.randn(3, 2)
    full = {"base_model.model.layer.q.base_layer.weight": w, "base_model.model.layer.q.lora_A.default.weight": a,
            "base_model.model.layer.q.lora_B.default.weight": b, "base_model.model.norm.weight": torch.ones(5)}
    out = merged_state_dict(full, c)
    assert set(out) == {"layer.q.weight", "norm.weight"}
    torch.testing.assert_close(out["layer.q.weight"], w + 4.0 * b @ a)


# -- refused before launch --------------------------------------------------------------------


@pytest.mark.parametrize("flags,match", [
    ({"strategy": "fsdp", "tuner": "qlora"}, "QLoRA's 4-bit base is not sharded by 'fsdp'"),
    ({"strategy": "zero3", "tuner": "qlora"}, "QLoRA's 4-bit base is not sharded by 'zero3'"),
    ({"strategy": "zero2", "deepspeed.fetch": "module"}, "deepspeed.fetch chooses ZeRO-3's fetch unit"),
    ({"strategy": "ddp", "merge_lora": True}, "merge_lora needs --tuner lora"),
    ({"strategy": "hybrid", "nproc_per_node": 3, "fsdp.shard_group_size": 2}, "must divide the 3 ranks"),
    ({"strategy": "zero2", "deepspeed.offload_params": True}, "needs ZeRO stage 3"),
    ({"strategy": "ddp", "fsdp.cpu_offload": True}, "applies to FSDP"),
])
def test_invalid_combinations_are_refused_with_the_reason(flags, match):
    with pytest.raises(ShardwiseError, match=match):
        cfg_of(**flags)


def test_zero3_leaves_are_the_decoder_blocks_and_any_moe_block_outside_them():
    """ZeRO-3's fetch units (DeepSpeedStrategy.apply_leaves): each decoder block; a sparse MoE block that no found
    block holds (a model whose expert list is longer than its layer list, so the block rule finds the experts)
    stays a leaf of its own, fetched whole whichever experts a rank's tokens chose; module fetch: the MoE blocks."""
    from deepspeed.utils import z3_leaf_module
    from torch import nn

    from shardwise.strategies.deepspeed import DeepSpeedStrategy

    class Expert(nn.Linear):
        pass

    class MoE(nn.Module):
        def __init__(self, n):
            super().__init__()
            self.gate, self.experts = nn.Linear(4, n), nn.ModuleList(Expert(4, 4) for _ in range(n))

    class Layer(nn.Module):
        def __init__(self, n):
            super().__init__()
            self.attn, self.mlp = nn.Linear(4, 4), MoE(n)

    class Model(nn.Module):
        def __init__(self, layers, experts):
            super().__init__()
            self.embed = nn.Embedding(8, 4)
            self.layers = nn.ModuleList(Layer(experts) for _ in range(layers))

        def get_input_embeddings(self):
            return self.embed

    def leaves(model, fetch="block"):
        s = object.__new__(DeepSpeedStrategy)
        s.cfg = cfg_of(strategy="zero3", **{"deepspeed.fetch": fetch})
        s.apply_leaves(model)
        return {type(m).__name__ for m in model.modules() if z3_leaf_module(m)}, s.describe()

    assert leaves(Model(layers=3, experts=2)) == ({"Layer"}, "deepspeed ZeRO-3, blocks fetched whole (Layer)")
    assert leaves(Model(layers=3, experts=8))[0] == {"Expert", "MoE"}  # the experts list is the longest
    assert leaves(Model(layers=3, experts=2), fetch="module")[0] == {"MoE"}
