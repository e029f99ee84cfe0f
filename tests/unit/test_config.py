import argparse
import re

import pytest
import yaml

from shardwise import config
from shardwise.errors import ShardwiseError

REQUIRED_FLAGS = ["--model", "--data", "--data-format", "--strategy", "--nproc-per-node", "--nnodes", "--node-rank",
                  "--rdzv-endpoint", "--max-steps", "--epochs", "--micro-batch-size", "--grad-accum", "--seq-len",
                  "--lr", "--warmup-steps", "--seed", "--output-dir", "--log-every", "--save-every", "--resume",
                  "--mixed-precision", "--gradient-checkpointing", "--packing"]


def flags(*argv):
    p = argparse.ArgumentParser()
    config.add_flags(p)
    return config.flags_from_namespace(p.parse_args(list(argv)))


def write(tmp_path, text):
    p = tmp_path / "run.yaml"
    p.write_text(text)
    return str(p)


def test_every_required_flag_exists_with_its_spelling():
    assert set(REQUIRED_FLAGS) <= {fi.flag for fi in config.FIELDS.values()}


def test_flags_win_over_yaml_and_yaml_over_defaults(tmp_path):
    path = write(tmp_path, "model: tiny\nlr: 0.5\nmicro_batch_size: 3\nfsdp:\n  prefetch: false\nstrategy: fsdp\n")
    res = config.load_config(path, flags("--lr", "0.25"))
    assert res.cfg.lr == 0.25 and res.cfg.micro_batch_size == 3 and res.cfg.fsdp.prefetch is False
    assert res.origins["lr"] == "flag --lr" and res.origins["micro_batch_size"].endswith("run.yaml:3")
    # untouched keys keep the dataclass default (a config file disables the demo recipe)
    assert res.cfg.seq_len == config.Config().seq_len


def test_demo_recipe_applies_only_without_a_config_file(tmp_path):
    assert config.load_config(None, {}).cfg.seq_len == 128  # demo.yaml
    assert config.load_config(None, flags("--seq-len", "64")).cfg.seq_len == 64
    assert config.load_config(write(tmp_path, "model: tiny\n"), {}).cfg.seq_len == config.Config().seq_len


def test_demo_recipe_is_only_for_the_demo_data_and_says_what_it_set(tmp_path):
    demo = config.load_config(None, flags("--seq-len", "64"))
    note = config.demo_note(demo)
    assert "lr 0.003" in note and "micro_batch_size 8" in note and "warmup_steps 20" in note
    assert "seq_len" not in note  # the flag won
    data = write(tmp_path, "{}")
    own = config.load_config(None, flags("--data", data))  # the tiny model on the user's data
    assert own.cfg.lr == config.Config().lr and own.cfg.seq_len == config.Config().seq_len
    assert config.demo_note(own) is None


def test_a_model_directory_without_data_is_refused(tmp_path):
    res = config.load_config(None, flags("--model", str(tmp_path)))
    with pytest.raises(ShardwiseError, match="flag --model: a model directory needs --data"):
        config.check_train_data(res)
    config.check_train_data(config.load_config(None, flags("--model", str(tmp_path), "--data", "demo")))
    config.check_train_data(config.load_config(None, {}))  # the demo


def test_help_shows_defaults_and_hf_spellings_are_aliases():
    p = argparse.ArgumentParser()
    config.add_flags(p)
    text = " ".join(p.format_help().split())
    assert "(default: 2e-05; also --learning_rate" in text and "(default: true)" in text
    assert "--max_steps" not in text  # underscore spellings work but do not double the help
    got = flags("--learning_rate", "0.5", "--max_steps", "7", "--per_device_train_batch_size", "3",
                "--num_train_epochs", "2", "--gradient_accumulation_steps", "4", "--output_dir", "o",
                "--no_save_final", "--gradient_checkpointing", "--tuner_type", "lora", "--lora_rank", "8",
                "--fsdp_cpu_offload", "--strategy", "fsdp")
    res = config.load_config(None, got)
    c = res.cfg
    assert (c.lr, c.max_steps, c.micro_batch_size, c.epochs, c.grad_accum, c.output_dir) == (0.5, 7, 3, 2, 4, "o")
    assert c.save_final is False and c.gradient_checkpointing is True and c.lora.r == 8 and c.tuner == "lora"
    with pytest.raises(ShardwiseError, match=r"flag --learning_rate \(= --lr\): lr must be > 0"):
        config.load_config(None, flags("--learning_rate", "-1"))
    assert flags("--lr", "1")["lr"][1] == "flag --lr"


def test_unknown_key_names_file_line_and_suggests(tmp_path):
    path = write(tmp_path, "model: tiny\n\nmicro_batch: 4\n")
    with pytest.raises(ShardwiseError, match=r"run\.yaml:3: unknown key 'micro_batch' \(did you mean 'micro_batch_size'\?\)"):
        config.load_config(path, {})


def test_bad_types_and_choices_name_where(tmp_path):
    with pytest.raises(ShardwiseError, match=r"run\.yaml:1: 'lr' must be a float, got 'fast'"):
        config.load_config(write(tmp_path, "lr: fast\n"), {})
    with pytest.raises(ShardwiseError, match=r"flag --mixed-precision: 'mixed_precision' must be one of auto, no, bf16, fp16"):
        config.load_config(None, flags("--mixed-precision", "fp8"))
    with pytest.raises(ShardwiseError, match=r"run\.yaml:2: invalid YAML"):
        config.load_config(write(tmp_path, "a: 1\n  b: [\n"), {})


def test_unknown_strategy_lists_the_known_ones():
    with pytest.raises(ShardwiseError, match=r"flag --strategy: unknown strategy 'fsdp3'; known: single, ddp, fsdp"):
        config.load_config(None, flags("--strategy", "fsdp3"))


def test_preset_options_yield_to_explicit_options():
    res = config.load_config(None, flags("--strategy", "fsdp-offload"))
    assert res.cfg.fsdp.cpu_offload is True and res.origins["fsdp.cpu_offload"] == "preset fsdp-offload"
    res = config.load_config(None, flags("--strategy", "fsdp-offload", "--no-fsdp-cpu-offload"))
    assert res.cfg.fsdp.cpu_offload is False
    assert config.load_config(None, flags("--strategy", "zero3-offload")).cfg.deepspeed.offload_params is True


@pytest.mark.parametrize("argv, message", [
    (("--strategy", "ddp", "--fsdp-cpu-offload"), r"'fsdp.cpu_offload' applies to FSDP but the strategy is 'ddp'"),
    (("--strategy", "ddp", "--deepspeed-offload-optimizer"), r"applies to DeepSpeed"),
    (("--strategy", "hybrid"), r"hybrid sharding needs more than one node"),
    (("--nnodes", "2"), r"needs --rdzv-endpoint"),
    (("--node-rank", "1"), r"node_rank must be in \[0, nnodes=1\)"),
    (("--strategy", "single", "--nproc-per-node", "2"), r"strategy 'single' runs one process"),
    (("--micro-batch-size", "0"), r"flag --micro-batch-size: micro_batch_size must be >= 1"),
    (("--mixed-precision", "fp16", "--param-dtype", "bf16"), r"mixes two half types"),
    (("--fsdp-wrap", "size:x", "--strategy", "fsdp"), r"fsdp.wrap must be 'block' or 'size:N'"),
    (("--rdzv-endpoint", "nohostport"), r"rdzv_endpoint must be HOST:PORT"),
    (("--report-to", "tensorboard,comet"), r"flag --report-to: report_to: unknown tracker comet"),
    (("--val-data", "v.jsonl", "--val-split", "0.1"), r"flag --val-split: give either val_data or val_split"),
    (("--val-split", "1"), r"val_split must be in \[0, 1\)"),
    (("--lora-alpha", "0"), r"flag --lora-alpha: lora.alpha must be a positive number"),
    (("--lora-alpha", "-16"), r"lora.alpha must be a positive number \(the adapters are scaled by alpha / r\)"),
    (("--eval-every", "5"), r"flag --eval-every: eval_every needs a validation set: --val-data PATH or --val-split"),
    (("--keep-best",), r"keep_best needs a validation set"),
    (("--val-split", "0.1", "--keep-best", "--eval-every", "4", "--save-every", "6"),
     r"set --save-every to a multiple of --eval-every \(now save_every 6, eval_every 4\)"),
])
def test_invalid_combinations_are_refused_with_where(argv, message):
    with pytest.raises(ShardwiseError, match=message):
        config.load_config(None, flags(*argv))


def test_resolved_yaml_round_trips_and_omits_run_control(tmp_path):
    res = config.load_config(None, flags("--strategy", "fsdp-grad-op", "--lr", "0.01", "--output-dir", "x",
                                         "--packing", "--tuner", "lora", "--lora-r", "8"))
    text = config.to_yaml(res.cfg)
    assert "output_dir" not in yaml.safe_load(text)
    again = config.load_config(write(tmp_path, text), {}).cfg
    res.cfg.output_dir = ""
    assert again == res.cfg


def test_config_docs_lists_every_key():
    doc = config.config_docs()
    for fi in config.FIELDS.values():
        assert f"`{fi.flag}`" in doc


def test_every_subcommand_help_renders(capsys):
    """argparse %-formats help strings: a bare % in a config docstring broke `train --help`."""
    from shardwise import cli

    parser = cli.build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert {"train", "plan", "bench"} <= set(subs.choices)
    for name, sub in subs.choices.items():
        text = sub.format_help()
        assert "usage:" in text, name
    assert "20-30% more compute" in subs.choices["train"].format_help()


# -- issue 14 items 10 and 12: hostile YAML and non-finite numbers are one line each --------

BOMB = "\n".join(["a: &a [" + ",".join(['"lol"'] * 9) + "]"]
                 + [f"{n}: &{n} [" + ",".join([f"*{p}"] * 9) + "]" for p, n in zip("abcde", "bcdef")]
                 + ["lr: [" + ",".join(["*f"] * 9) + "]"]) + "\n"


@pytest.mark.parametrize("raw, message", [
    (b"lr: 1e-3\nmodel: \"caf\xe9\"\n", r"run\.yaml:2: not UTF-8 text \(byte 0xe9 at offset 20\)"),
    (b"base: &b\n  lr: 0.1\n<<: *b\n", r"run\.yaml:3: YAML merge keys \(<<\) are not supported"),
    (b"lr: " + b"[" * 100_000 + b"]" * 100_000 + b"\n", r"run\.yaml: the YAML is nested too deeply to read"),
    (BOMB.encode(), r"run\.yaml: the YAML expands to more than 10,000 values"),
    (b"lr: .inf\n", r"run\.yaml:1: 'lr' must be a finite number, got inf"),
    (b"lora:\n  alpha: .nan\n", r"run\.yaml:2: 'lora.alpha' must be a finite number, got nan"),
    (b"1: 2\n", r"run\.yaml:1: a config key must be a plain name"),
])
def test_hostile_yaml_is_one_short_line(tmp_path, raw, message):
    p = tmp_path / "run.yaml"
    p.write_bytes(raw)
    with pytest.raises(ShardwiseError, match=message) as e:
        config.load_config(str(p))
    assert len(str(e.value)) < 400 and "\n" not in str(e.value)


def test_an_alias_bomb_under_the_bound_still_prints_a_short_line(tmp_path):
    """~8,300 values (under the bound) of a wrong type: the message shows 200 characters of them."""
    text = ("lr: [&a [" + ",".join(['"lol"'] * 9) + "], " + ", ".join(
        f"&{n} [" + ",".join([f"*{p}"] * 9) + "]" for p, n in zip("abc", "bcd")) + "]\n")
    with pytest.raises(ShardwiseError, match=r"'lr' must be a float, got \[\['lol'.*\.\.\. \([\d,]+ characters\)$") as e:
        config.load_config(write(tmp_path, text))
    assert len(str(e.value)) < 400


@pytest.mark.parametrize("flag, value", [("--lr", "inf"), ("--weight-decay", "nan"), ("--max-grad-norm", "+inf"),
                                         ("--collective-timeout", "1e400")])
def test_non_finite_float_flags_are_refused(flag, value):
    with pytest.raises(ShardwiseError, match=rf"flag {flag}: '\w+' must be a finite number, got '{re.escape(value)}'"):
        config.load_config(None, flags(flag, value))


@pytest.mark.parametrize("argv, strategy, offload, config_from", [
    (["--deepspeed", "zero3"], "zero3", (False, False), None),
    (["--deepspeed", "zero3_offload"], "zero3-offload", (True, True), None),
    (["--deepspeed", "default-zero2"], "zero2", (False, False), None),
    (["--deepspeed", "{z3_opt_offload}"], "zero3", (True, False), "z3_opt_offload"),
    (["--deepspeed", "{z2_offload}"], "zero2", (True, False), "z2_offload"),
    (["--deepspeed", "{z_auto}"], None, None, "z_auto"),  # stage "auto": validation asks for a ZeRO strategy
    (["--deepspeed", "{z_auto}", "--strategy", "zero2"], "zero2", (False, False), "z_auto"),
])
def test_deepspeed_as_ms_swift_and_the_hf_trainer_spell_it(tmp_path, argv, strategy, offload, config_from):
    """`--deepspeed NAME|FILE` ("ambiguous option" before): ms-swift's built-in names are the presets; a file is
    --deepspeed-config, its ZeRO stage and offload devices the strategy where no --strategy is given."""
    import json

    from shardwise import cli

    files = {"z3_opt_offload": {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}},
             "z2_offload": {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                                  "offload_param": {"device": "none"}}},
             "z_auto": {"zero_optimization": {"stage": "auto"}}}
    for name, obj in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(obj))
    argv = [a.format(**{n: str(tmp_path / f"{n}.json") for n in files}) for a in argv]
    flags = config.flags_from_namespace(cli.build_parser().parse_args(["train", "--model", "tiny", *argv]))
    if strategy is None:
        with pytest.raises(ShardwiseError, match="'deepspeed.config' applies to DeepSpeed but the strategy is 'ddp'"):
            config.load_config(None, flags)
        return
    c = config.load_config(None, flags).cfg
    assert c.strategy == strategy and (c.deepspeed.offload_optimizer, c.deepspeed.offload_params) == offload
    assert c.deepspeed.config == (str(tmp_path / f"{config_from}.json") if config_from else "")


@pytest.mark.parametrize("argv, says", [
    (["--deepspeed", "zero0"], "flag --deepspeed zero0: ms-swift's zero0 is plain data parallelism; use --strategy ddp"),
    (["--deepspeed", "zero3", "--strategy", "zero2"],
     "flag --deepspeed zero3: it means --strategy zero3, but flag --strategy gives zero2; give one of them"),
    (["--deepspeed", "a.json", "--deepspeed-config", "b.json"],
     "flag --deepspeed a.json: flag --deepspeed-config gives another DeepSpeed config; give one of them"),
])
def test_deepspeed_alias_contradictions_are_one_line(argv, says):
    from shardwise import cli

    with pytest.raises(ShardwiseError) as e:
        config.flags_from_namespace(cli.build_parser().parse_args(["train", "--model", "tiny", *argv]))
    assert str(e.value) == says


@pytest.mark.parametrize("argv, message", [
    (("--lora_rank", "8", "--lora_alpha", "32"), r"^flag --lora_alpha \(= --lora-alpha\): lora\.alpha, lora\.r are set "
                                                 r"but tuner is full, so every weight would train and the LoRA "
                                                 r"settings be dropped: pass --tuner lora"),
    (("--tuner", "full", "--lora-targets", "q_proj"), r"^flag --lora-targets: lora\.targets is set but tuner is full"),
])
def test_lora_settings_under_a_full_fine_tune_are_refused(argv, message):
    """ms-swift's default tuner is LoRA, so `--lora_rank 8` alone means LoRA there; here it would have trained every
    weight and dropped the rank without a word."""
    with pytest.raises(ShardwiseError, match=message):
        config.load_config(None, flags(*argv))


@pytest.mark.parametrize("spelling", ["--tuner_type", "--finetuning_type", "--train_type"])
def test_ms_swift_and_llama_factory_spell_the_tuner_their_way(spelling):
    assert config.load_config(None, flags(spelling, "lora", "--lora_rank", "8")).cfg.tuner == "lora"
