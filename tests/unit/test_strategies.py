"""Strategy pieces that need no process group: registry, DeepSpeed config generation, FSDP
unit selection, LoRA merge math, and the refusals made before any process starts."""

import json
import re
import sys
import warnings
from pathlib import Path

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


def test_a_user_deepspeed_json_overrides_the_keys_no_flag_decides(tmp_path):
    from shardwise.strategies.deepspeed import ds_config

    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"zero_optimization": {"reduce_bucket_size": 1000, "stage": 2},
                                "gradient_clipping": 1, "communication_data_type": "fp16", "comment": "mine"}))
    ds = ds_config(cfg_of(strategy="zero2", max_grad_norm=1.0, **{"deepspeed.config": str(user)}), 2, False)
    assert ds["gradient_clipping"] == 1.0 and ds["communication_data_type"] == "fp16"
    assert ds["comment"] == "mine"  # a key close to no DeepSpeed key is left to DeepSpeed (newer keys)
    assert ds["zero_optimization"] == {"stage": 2, "reduce_bucket_size": 1000}  # merged, not replaced
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ShardwiseError, match="deepspeed.config"):
        ds_config(cfg_of(strategy="zero2", **{"deepspeed.config": str(bad)}), 2, False)


# An ms-swift / HF-examples style file (the keys of ms-swift 4.6's swift/config/zero3.json): "auto" for what the
# trainer decides, DeepSpeed settings for the rest.
HF_STYLE = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "none", "pin_memory": True},
        "offload_param": {"device": "none", "pin_memory": True}, "overlap_comm": False, "contiguous_gradients": True,
        "sub_group_size": 1e9, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}


def _hf_style(tmp_path, **changes) -> str:
    obj = json.loads(json.dumps(HF_STYLE))
    for dotted, value in changes.items():
        *parents, last = dotted.split("__")
        d = obj
        for part in parents:
            d = d.setdefault(part, {})
        d[last] = value
    path = tmp_path / "zero3.json"
    path.write_text(json.dumps(obj, indent=4))
    return str(path)


def test_an_hf_style_deepspeed_json_gets_its_autos_filled_as_the_hf_trainer_fills_them(tmp_path):
    """"auto" = the flag's value; the three bucket sizes from the model's hidden size (hidden^2, 0.9 hidden^2,
    10 hidden); offload devices "none" agree with a preset without offload; the rest of the file is kept."""
    from shardwise.strategies import ds_json
    from shardwise.strategies.deepspeed import ds_config

    c = cfg_of(strategy="zero3", micro_batch_size=3, grad_accum=5, max_grad_norm=0.7, mixed_precision="bf16",
               **{"deepspeed.config": _hf_style(tmp_path)})
    ds = ds_config(c, world=4, cuda=True)
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["train_batch_size"]) == \
        (3, 5, 60)
    assert ds["gradient_clipping"] == 0.7 and ds["bf16"] == {"enabled": True}
    assert "enabled" not in ds["fp16"] and ds["fp16"]["loss_scale_window"] == 1000  # DeepSpeed's default: off
    z = ds["zero_optimization"]
    assert z["stage"] == 3 and "offload_optimizer" not in z and "offload_param" not in z
    assert z["overlap_comm"] is False and z["stage3_max_live_parameters"] == 1e9 and ds["steps_per_print"] == 2000
    assert z["reduce_bucket_size"] == "auto"  # until the model is known
    filled = ds_json.fill_hidden(ds, 4096, "zero3.json")
    assert (z["reduce_bucket_size"], z["stage3_prefetch_bucket_size"], z["stage3_param_persistence_threshold"]) == \
        (4096 * 4096, int(0.9 * 4096 * 4096), 40960)
    assert filled == "reduce_bucket_size 16777216, stage3_prefetch_bucket_size 15099494, " \
                     "stage3_param_persistence_threshold 40960"
    assert not any(v == "auto" for _, v in ds_json._walk(ds))
    with pytest.raises(ShardwiseError, match=r"zero_optimization.reduce_bucket_size is \"auto\", .* has none"):
        ds_json.fill_hidden(ds_config(c, world=4, cuda=True), None, "zero3.json")

    fp16 = ds_config(cfg_of(strategy="zero3", mixed_precision="fp16", **{"deepspeed.config": _hf_style(tmp_path)}),
                     world=2, cuda=True)
    assert fp16["fp16"]["enabled"] is True and fp16["fp16"]["hysteresis"] == 2
    assert fp16["bf16"] == {}  # "auto" taken out: DeepSpeed's default, off
    below3 = ds_config(cfg_of(strategy="zero2", mixed_precision="no",
                              **{"deepspeed.config": _hf_style(tmp_path, zero_optimization__stage="auto")}),
                       world=2, cuda=False)["zero_optimization"]
    assert below3["stage"] == 2 and below3["reduce_bucket_size"] == "auto"
    assert not [k for k in below3 if k.startswith("stage3_") and below3[k] == "auto"]  # read only at stage 3
    offload = ds_config(cfg_of(strategy="zero3-offload", **{"deepspeed.config": _hf_style(
        tmp_path, zero_optimization__offload_optimizer={"device": "cpu", "pin_memory": False},
        zero_optimization__offload_param={"device": "auto"})}), world=2, cuda=True)["zero_optimization"]
    assert offload["offload_optimizer"] == {"device": "cpu", "pin_memory": False}
    assert offload["offload_param"] == {"device": "cpu", "pin_memory": True}  # the generated one


# the HF examples' sections (transformers' docs, deepspeed.md: ds_config_zero3.json): a type, every parameter "auto"
HF_OPTIMIZER = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}}
HF_SCHEDULER = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                    "warmup_num_steps": "auto", "total_num_steps": "auto"}}


def test_an_optimizer_and_scheduler_asking_for_nothing_of_their_own_give_way_to_ours(tmp_path):
    """The HF examples' all-"auto" sections were refused; they are dropped (ours run with the flags' values, as the
    Trainer fills those "auto"s), and any value or another type is still refused (see the table below)."""
    from shardwise.strategies import ds_json
    from shardwise.strategies.deepspeed import ds_config

    path = _hf_style(tmp_path, optimizer=HF_OPTIMIZER, scheduler=HF_SCHEDULER)
    ds = ds_config(cfg_of(strategy="zero3", **{"deepspeed.config": path}), world=2, cuda=False)
    assert "optimizer" not in ds and "scheduler" not in ds
    assert ds_json.auto_sections(json.loads(Path(path).read_text())) == ["optimizer", "scheduler"]
    assert ds_json.auto_sections({"optimizer": {"type": "adam"}, "scheduler": {"type": "WarmupLR", "params": {}}}) \
        == ["optimizer", "scheduler"]
    assert ds_json.auto_sections({"optimizer": dict(HF_OPTIMIZER, torch_adam=True)}) == []  # a key beside params
    off = ds_config(cfg_of(strategy="zero3", **{"deepspeed.config": _hf_style(tmp_path, fp8={"enabled": False})}),
                    world=2, cuda=False)
    assert off["fp8"] == {"enabled": False}  # switched off: nothing asked for, passed on (DeepSpeed ignores it)
    for value in (None, "False", 0):
        path = _hf_style(tmp_path, sequence_parallel={"enabled": value, "size": 4})
        assert ds_config(cfg_of(strategy="zero3", **{"deepspeed.config": path}), world=2, cuda=False)[
            "sequence_parallel"]["size"] == 4
    forced = _hf_style(tmp_path, zero_force_ds_cpu_optimizer="false")  # a string: truthy to DeepSpeed
    assert ds_config(cfg_of(strategy="zero3", **{"deepspeed.config": forced}), world=2,
                     cuda=False)["zero_force_ds_cpu_optimizer"] is False  # dropped: the generated config's false
    assert ds_config(cfg_of(strategy="zero3", **{"deepspeed.config": _hf_style(
        tmp_path, zero_force_ds_cpu_optimizer=False)}), world=2, cuda=False)["zero_force_ds_cpu_optimizer"] is False


@pytest.mark.parametrize("change, says", [
    ({"gradient_clipping": 0.5}, r":\d+: gradient_clipping: 0.5 here, but this run's --max-grad-norm 1.0 sets it to 1.0; "
                                 r"write \"auto\""),
    ({"train_micro_batch_size_per_gpu": 8}, r": train_micro_batch_size_per_gpu: 8 here, but this run's "
                                            r"--micro-batch-size 4 sets it to 4"),
    ({"train_batch_size": 64}, r": train_batch_size: 64 here, but this run's --micro-batch-size 4 x --grad-accum 1 x "
                               r"2 data-parallel ranks sets it to 8"),
    ({"zero_optimization__stage": 2}, r": zero_optimization.stage: 2 here, but this run's --strategy zero3 \(ZeRO "
                                      r"stage 3\) sets it to 3; write \"auto\" .* or run --strategy zero2$"),
    ({"bf16__enabled": True}, r": bf16.enabled: true here, but this run's --mixed-precision no sets it to false"),
    ({"zero_optimization__offload_optimizer": {"device": "cpu"}},
     r": zero_optimization.offload_optimizer.device: \"cpu\" here, but this run's --strategy zero3 .* does not "
     r"offload; write \"auto\", or pass --deepspeed-offload-optimizer"),
    ({"zero_optimization__stage": True}, r": zero_optimization.stage: true here, .* or remove the key \(shardwise"),
    ({"zero_optimization__stage": 0}, r": zero_optimization.stage: 0 here, .* or remove the key \(shardwise runs ZeRO "
                                      r"stages 1, 2 and 3"),
    ({"zero_optimization__sub_group_size": "auto"}, r": zero_optimization.sub_group_size: \"auto\" is filled in only "
                                                    r"for the batch sizes, .*; give a value"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": "auto"}}},
     r": optimizer: shardwise trains every strategy with its own AdamW; remove the section and set --lr"),
    ({"optimizer": {"type": "Lamb", "params": {"lr": "auto"}}}, r": optimizer: shardwise trains every strategy with "
                                                                r"its own AdamW"),
    ({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": "auto"}}},
     r": scheduler: .* remove the section and set --warmup-steps, --min-lr-ratio, or leave its every parameter "
     r"\"auto\""),
    ({"zero_optimization": "yes"}, r": zero_optimization: DeepSpeed reads this as a JSON object \(\{\"key\": value, "
                                   r"\.\.\.\}\), got \"yes\"; fix that key"),
    ({"zero_optimization__offload_param": "cpu"}, r": zero_optimization.offload_param: DeepSpeed reads this as a JSON "
                                                  r"object"),
    ({"sequence_parallel": {"enabled": True, "size": 4, "mode": "ulysses"}},
     r": sequence_parallel: LLaMA-Factory's own sequence-parallel settings .* pass --sequence-parallel N"),
    ({"fp8": {"enabled": True}}, r": fp8: LLaMA-Factory's own FP8 switch, which DeepSpeed does not read; .* --float8"),
    ({"fp8": True}, r": fp8: LLaMA-Factory's own FP8 switch"),
    ({"fp8": {"enabled": "auto"}}, r": fp8: LLaMA-Factory's own FP8 switch"),
    ({"sequence_parallel": 4}, r": sequence_parallel: not a DeepSpeed key .*did you mean 'sequence_parallel_size'\?"),
    ({"zero_optimisation": {"stage": 3}}, r": zero_optimisation: not a DeepSpeed key \(DeepSpeed would ignore it\); "
                                          r"did you mean 'zero_optimization'\?"),
])
def test_a_deepspeed_json_that_disagrees_with_the_run_is_refused_at_its_line(tmp_path, change, says):
    """A key a flag decides must say "auto" or agree (the data loader and the loop follow the flag); the message
    names the file and the line of the key (the innermost key, searched after its section)."""
    from shardwise.strategies.deepspeed import ds_config

    path = _hf_style(tmp_path, **change)
    with pytest.raises(ShardwiseError) as e:
        ds_config(cfg_of(strategy="zero3", micro_batch_size=4, mixed_precision="no", **{"deepspeed.config": path}),
                  world=2, cuda=False)
    msg = str(e.value)
    assert "\n" not in msg and re.match(re.escape(path) + r":\d+: " + says.removeprefix(r":\d+: ").removeprefix(": "),
                                        msg), msg
    line = int(msg.split(":")[1])
    key = re.match(re.escape(path) + r":\d+: ([\w.]+):", msg).group(1).split(".")[-1]
    assert f'"{key}"' in Path(path).read_text().splitlines()[line - 1]  # the line of that key


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


@pytest.mark.parametrize("strategy, offload, says", [
    ("zero2", {"offload_optimizer": {"device": "cpu"}}, "pass --deepspeed-offload-optimizer"),
    ("zero2", {"offload_param": {"device": "cpu"}}, r"remove the key \(ZeRO-2 does not offload parameters"),
    ("zero2-offload", {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "auto"}},
     r"remove the key \(ZeRO-2 does not offload parameters"),
    ("zero2-offload", {}, "pass --no-deepspeed-offload-optimizer"),  # the file's "none"
    ("zero3", {"offload_param": {"device": "cpu"}}, "pass --deepspeed-offload-params"),
    ("zero3-offload", {"offload_optimizer": {"device": "cpu"}}, "pass --no-deepspeed-offload-params"),
])
def test_an_offload_disagreement_names_a_flag_that_ends_it(tmp_path, strategy, offload, says):
    """A ZeRO-2 run was told to choose zero3-offload; a zero2 run asked for parameter offload was sent to
    zero2-offload, which gave the same advice again. The advice, taken, gives a run the file agrees with."""
    from shardwise.config import load_config
    from shardwise.strategies.deepspeed import ds_config

    changes = {"zero_optimization__stage": "auto"}
    changes.update({f"zero_optimization__{k}": v for k, v in offload.items()})
    path = _hf_style(tmp_path, **changes)
    with pytest.raises(ShardwiseError, match=says) as e:
        ds_config(cfg_of(strategy=strategy, **{"deepspeed.config": path}), world=2, cuda=False)
    fix = re.search(r"pass (--[\w-]+)", str(e.value))
    if fix:  # the flag, given: the file agrees (its other key "none" or "auto" included)
        name = fix.group(1).removeprefix("--").removeprefix("no-").removeprefix("deepspeed-").replace("-", "_")
        flags = {"strategy": (strategy, "flag"), "deepspeed.config": (path, "flag"),
                 f"deepspeed.{name}": (not fix.group(1).startswith("--no-"), "flag")}
        ds_config(load_config(None, flags).cfg, world=2, cuda=False)
