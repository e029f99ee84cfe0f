"""Configs brought from LLaMA-Factory, ms-swift and the HF Trainer, read as they are: their YAML keys as aliases, the
keys with a translated value (bf16/fp16/torch_dtype, template, stage), the keys that change nothing (one note), the
learning rate schedules they name, and `--flag true|false` for every boolean flag."""

from __future__ import annotations

import argparse
import math

import pytest

from shardwise import cli, config
from shardwise.errors import ShardwiseError
from shardwise.train.schedule import lr_at


def write(tmp_path, text):
    p = tmp_path / "run.yaml"
    p.write_text(text)
    return str(p)


def parsed(*argv):
    """argv through the real CLI parser (the boolean words rewritten as main() does), as `train` gets it."""
    p = cli.build_parser()
    return p.parse_args(cli._bool_values(p, ["train", *argv]))


LF_YAML = """\
model_name_or_path: tiny
trust_remote_code: true
stage: sft
do_train: true
finetuning_type: lora
lora_rank: 8
lora_alpha: 16
lora_target: all
dataset: demo
template: qwen
cutoff_len: 256
max_samples: 100
overwrite_cache: true
preprocessing_num_workers: 16
output_dir: saves/x
logging_steps: 5
save_steps: 50
plot_loss: true
per_device_train_batch_size: 2
gradient_accumulation_steps: 4
learning_rate: 1.0e-4
num_train_epochs: 2.0
lr_scheduler_type: linear
warmup_ratio: 0.1
bf16: true
ddp_timeout: 180000000
resume_from_checkpoint: null
val_size: 0.1
eval_steps: 5
"""


def test_a_llama_factory_yaml_reads_as_shardwise_keys(tmp_path):
    res = config.load_config(write(tmp_path, LF_YAML))
    c = res.cfg
    assert (c.model, c.trust_remote_code, c.tuner, c.lora.r, c.lora.alpha, c.lora.targets) == \
        ("tiny", True, "lora", 8, 16.0, "all-linear")
    assert (c.data, c.chat_template, c.seq_len, c.max_samples, c.output_dir, c.log_every, c.save_every) == \
        ("demo", "qwen", 256, 100, "saves/x", 5, 50)
    assert (c.micro_batch_size, c.grad_accum, c.lr, c.epochs, c.lr_schedule, c.warmup_ratio) == \
        (2, 4, 1e-4, 2, "linear", 0.1)
    assert (c.mixed_precision, c.resume, c.val_split, c.eval_every) == ("bf16", "none", 0.1, 5)
    assert res.origins["seq_len"].endswith("run.yaml:11 (cutoff_len = seq_len)")
    assert res.origins["mixed_precision"].endswith("run.yaml:25 (= mixed_precision bf16)")
    assert c.task == "sft" and res.origins["task"].endswith("(stage = task)")
    assert res.notes == ["ignored, as they change nothing here: do_train (train "
                         "trains), overwrite_cache (tokenized data is cached by its content), preprocessing_num_workers"
                         " (tokenizing runs in the launcher), plot_loss (metrics.jsonl and `shardwise ui` plot the "
                         "loss), ddp_timeout (collective_timeout is the hang timeout)"]


@pytest.mark.parametrize("text, pattern", [
    ("model: tiny\nstage: ppo\n", r"run\.yaml:2: stage 'ppo': shardwise trains LLaMA-Factory's stages sft .* and "
                                  r"dpo .*; write stage: sft or stage: dpo"),
    ("model: tiny\ntemplate: vicuna\n",
     r"run\.yaml:2: template 'vicuna' is LLaMA-Factory's name; shardwise ships the chat templates chatml, gemma, "
     r"llama3, mistral, qwen"),
    ("model: tiny\nbf16: true\nfp16: true\n", r"run\.yaml:3: bf16 and fp16 are both on \(.*run\.yaml:2\); keep one"),
    ("model: tiny\ntorch_dtype: int8\n", r"run\.yaml:2: torch_dtype 'int8' is not one of bfloat16"),
    ("model: tiny\nval_size: 200\n", r"run\.yaml:2 \(val_size = val_split\): a number of validation records \(200\)"),
    ("model: tiny\nmodel_name_or_path: tiny\n", r"run\.yaml:2 \(model_name_or_path = model\): 'model' is also "
                                                r"given by .*run\.yaml:1; keep one of them"),
    ("model: tiny\nmixed_precision: fp16\nbf16: true\n", r"run\.yaml:3 \(= mixed_precision bf16\): "
                                                         r"'mixed_precision' is also given by .*run\.yaml:2"),
    ("model: tiny\nwarmup_ratio: 0.1\nwarmup_steps: 5\n", r"give warmup_ratio or warmup_steps, not both"),
    ("model: tiny\nnot_a_key: 1\n", r"run\.yaml:2: unknown key 'not_a_key'"),
])
def test_foreign_keys_that_cannot_be_taken_are_one_line(tmp_path, pattern, text):
    with pytest.raises(ShardwiseError, match=pattern):
        config.load_config(write(tmp_path, text))


def test_precision_switches_and_torch_dtype(tmp_path):
    def mp(text):
        return config.load_config(write(tmp_path, "model: tiny\n" + text)).cfg.mixed_precision

    assert mp("fp16: true\n") == "fp16"
    assert mp("bf16: false\nfp16: false\n") == "no"  # the HF Trainer's fp32
    assert mp("torch_dtype: bfloat16\n") == "bf16"
    assert mp("torch_dtype: float32\nbf16: true\n") == "bf16"  # the weights' dtype; the switch picks the compute


def test_a_deepspeed_json_path_as_a_yaml_key(tmp_path):
    ds = tmp_path / "ds_z3_config.json"
    ds.write_text('{"train_batch_size": "auto", "zero_optimization": {"stage": 3}}')
    res = config.load_config(write(tmp_path, f"model: tiny\ndeepspeed: {ds}\n"))
    assert (res.cfg.strategy, res.cfg.deepspeed.config) == ("zero3", str(ds))
    assert res.origins["strategy"].endswith("run.yaml:2 (its zero_optimization.stage 3)")


def test_eval_steps_without_a_validation_set_evaluates_nothing_and_says_so(tmp_path):
    res = config.load_config(None, config.flags_from_namespace(parsed("--eval_steps", "50")))
    assert res.cfg.eval_every == 0
    assert res.notes == ["flag --eval_steps (= --eval-every): no validation set (val_size / --val-split), so no "
                         "evaluation, as the HF Trainer does"]
    with pytest.raises(ShardwiseError, match="eval_every needs a validation set"):  # shardwise's own key still asks
        config.load_config(None, config.flags_from_namespace(parsed("--eval-every", "50")))


def test_every_boolean_flag_takes_true_and_false():
    ns = parsed("--gradient_checkpointing", "true", "--packing=false", "--data-cache", "False", "--force", "false",
                "--fsdp-cpu-offload=yes", "--bf16", "true")
    got = config.flags_from_namespace(ns)
    assert got["gradient_checkpointing"] == (True, "flag --gradient-checkpointing")
    assert got["packing"][0] is False and got["data_cache"][0] is False and got["fsdp.cpu_offload"][0] is True
    assert got["mixed_precision"] == ("bf16", "flag --bf16 (= mixed_precision bf16)")
    assert ns.force is False and ns.config is None  # `true`/`false` are no config path
    # a word that is no boolean after a boolean flag stays an argument of its own (here: the config file)
    ns = parsed("--packing", "run.yaml")
    assert ns.config == "run.yaml" and config.flags_from_namespace(ns)["packing"][0] is True
    # every flag that takes no value, of every config key
    for fi in config.FIELDS.values():
        if fi.type is bool:
            for word, want in (("true", True), ("false", False)):
                assert config.flags_from_namespace(parsed(fi.flag, word))[fi.key][0] is want, (fi.flag, word)


def test_a_boolean_flag_with_another_word_is_one_line(capsys):
    assert cli.main(["train", "--packing=maybe"]) == 2
    assert capsys.readouterr().err == ("shardwise: error: flag --packing: 'maybe' is not true or false; write "
                                       "--packing true, --packing false or --packing alone\n")


def test_ms_swift_flags_that_change_nothing_and_dataset_lists():
    got = config.flags_from_namespace(parsed("--dataset", "a.json#5", "b.json", "--model_author", "swift",
                                             "--model_name", "robot", "Robot", "--dataloader_num_workers", "4",
                                             "--torch_dtype", "bfloat16", "--train_type", "lora"))
    assert got["data"] == ("a.json#5,b.json", "flag --dataset (= --data)")
    assert got["mixed_precision"][0] == "bf16" and got["tuner"][0] == "lora"
    assert {k for k in got if k.startswith("ignored:")} == {"ignored:model_author", "ignored:model_name",
                                                            "ignored:dataloader_num_workers"}


@pytest.mark.parametrize("schedule, want", [
    # 10 steps, warmup_ratio 0.2 (2 steps), lr 1, min_lr_ratio 0.1
    ("cosine", [0.5, 1.0] + [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * i / 8)) for i in range(8)]),
    ("linear", [0.5, 1.0] + [0.1 + 0.9 * (1 - i / 8) for i in range(8)]),
    ("constant", [0.5, 1.0] + [1.0] * 8),
])
def test_schedules_with_warmup(schedule, want):
    cfg = config.Config(lr=1.0, lr_schedule=schedule, warmup_ratio=0.2, min_lr_ratio=0.1)
    assert [lr_at(cfg, s, 10) for s in range(10)] == pytest.approx(want)
    assert lr_at(config.Config(lr=1.0, lr_schedule=schedule, warmup_ratio=0.15), 1, 10) == pytest.approx(1.0)  # ceil


def test_lr_scheduler_type_constant_with_warmup_is_constant(tmp_path):
    assert config.load_config(write(tmp_path, "model: tiny\nlr_scheduler_type: constant_with_warmup\n"
                                    )).cfg.lr_schedule == "constant"


def test_yaml_aliases_cover_the_flag_aliases():
    for key, names in config.FLAG_ALIASES.items():
        for name in names:
            if "-" not in name[2:]:
                assert config.YAML_ALIASES[name[2:]] == key
    assert config.YAML_ALIASES["lora_dropout"] == "lora.dropout"


def test_argparse_namespace_helper_is_unchanged_for_plain_flags():
    p = argparse.ArgumentParser()
    config.add_flags(p)
    assert config.flags_from_namespace(p.parse_args(["--lr", "0.1"])) == {"lr": ("0.1", "flag --lr")}


def test_llama_factory_stage_dpo_is_task_dpo_with_its_preference_keys(tmp_path):
    """LLaMA-Factory's DPO YAML (stage: dpo, pref_beta, pref_loss) reads as task dpo with beta and loss_type."""
    res = config.load_config(write(tmp_path, "model: tiny\nstage: dpo\npref_beta: 0.2\npref_loss: ipo\n"))
    assert (res.cfg.task, res.cfg.beta, res.cfg.loss_type) == ("dpo", 0.2, "ipo")
    assert res.origins["task"].endswith("run.yaml:2 (stage = task)")
