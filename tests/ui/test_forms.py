"""The UI's form is the CLI's arguments: no browser, one process, milliseconds."""

from __future__ import annotations

import os

import pytest

from shardwise import config
from shardwise.cli import build_parser
from shardwise.errors import ShardwiseError
from shardwise.ui import forms, runs


def _resolved(argv):
    args = build_parser().parse_args(["train", *argv])
    return config.load_config(getattr(args, "config", None), config.flags_from_namespace(args)).cfg


def test_the_command_to_copy_resolves_to_the_form_config(tmp_path):
    """The short command the page shows (only what differs from the model's defaults) is
    the same run as every field of the form spelled out."""
    values = {"model": "tiny", "gpus": "2", "seq_len": "256", "micro_batch_size": "2", "grad_accum": "3",
              "gradient_checkpointing": True, "mixed_precision": "no", "strategy": "fsdp", "max_steps": "7",
              "save_final": False}
    t = forms.train(values, str(tmp_path))
    full = _resolved(forms.argv_for(values, "train"))
    short = _resolved(t["argv"])
    full.output_dir = short.output_dir
    assert short == full
    assert short.output_dir.startswith(str(tmp_path)) and short.strategy == "fsdp" and short.grad_accum == 3
    assert "--gradient-checkpointing" in t["argv"] and "--no-save-final" in t["argv"]
    assert "--lr=0.003" not in t["argv"]  # the demo recipe's own value is not repeated
    assert t["command"].startswith("shardwise train ")


@pytest.mark.parametrize("values, field, text", [
    ({"gpu_memory": "lots"}, "gpu_memory", "--gpu-memory must be a number, got 'lots'"),
    ({"nodes": "0"}, "nodes", "--nodes must be in 1..65536"),
    ({"grad_accum": "1.5"}, "grad_accum", "flag --grad-accum: 'grad_accum' must be an int, got '1.5'"),
    ({"model": "./no/such/dir"}, "model", "--model './no/such/dir': no such directory"),
    # the message also names --gpu-memory and --gpu-type (what to do): its `flag --float8:` prefix decides
    ({"float8": True, "gpu_type": "A100", "gpus": "2", "gpu_memory": "80"}, "float8",
     "flag --float8: float8 runs on float8 tensor cores"),
])
def test_plan_errors_are_the_cli_lines_next_to_their_field(values, field, text):
    with pytest.raises(forms.FormError) as e:
        forms.plan(values)
    assert e.value.field == field and str(e.value).startswith(text)


def test_run_names_stay_inside_the_runs_dir(tmp_path):
    for bad in ("../escape", "a/b", ".hidden"):
        with pytest.raises(forms.FormError) as e:
            forms.train({"run_name": bad}, str(tmp_path))
        assert e.value.field == "run_name"
    os.makedirs(tmp_path / "taken")
    with pytest.raises(forms.FormError, match="exists"):
        forms.train({"run_name": "taken"}, str(tmp_path))
    for bad in ("..", "../..", "/etc"):
        with pytest.raises(ShardwiseError):
            runs.resolve(str(tmp_path), bad)
    with pytest.raises(ShardwiseError, match="inside the runs directory"):
        runs.launch(str(tmp_path), {"output_dir": "/tmp/elsewhere", "argv": []})


def test_tensor_and_sequence_parallel_fields_reach_the_run_and_refuse_next_to_their_field(tmp_path):
    """The page's TP degree and SP mode are the CLI's flags: they resolve into the run's config, and the CLI's
    refusal (a degree that does not divide the heads) comes back beside the TP field."""
    t = forms.train({"strategy": "fsdp", "tensor_parallel": "2", "sp_mode": "ring"}, str(tmp_path))
    cfg = _resolved(t["argv"])
    assert cfg.tensor_parallel == 2 and cfg.sp_mode == "ring"
    with pytest.raises(forms.FormError) as e:
        forms.plan({"strategy": "fsdp", "tensor_parallel": "3"})
    assert e.value.field == "tensor_parallel" and "4 attention heads" in str(e.value)


def test_activation_checkpointing_and_float8_fields_are_the_cli_keys(tmp_path):
    """Selective checkpointing and float8 from the page resolve into the run's config; the contradiction of
    selective with the full-checkpointing switch comes back beside the checkpointing field."""
    cfg = _resolved(forms.train({"activation_checkpointing": "selective"}, str(tmp_path))["argv"])
    assert cfg.activation_checkpointing == "selective" and cfg.float8 is False
    assert _resolved(forms.argv_for({"float8": True, "strategy": "fsdp"}, "train")).float8 is True
    with pytest.raises(forms.FormError) as e:
        forms.plan({"activation_checkpointing": "selective", "gradient_checkpointing": True})
    assert e.value.field == "activation_checkpointing"
