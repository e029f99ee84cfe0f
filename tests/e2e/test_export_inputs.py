"""`shardwise export` through the real CLI on one small one-process LoRA run: a checkpoint whose
meta.json asks for remote code never gets it without the user's own flag, and an exported
adapter names a base model that `shardwise chat` can load."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.helpers import chat_records, run_cli, write_jsonl
from tests.inproc.trainer import train


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("export-inputs")
    data = write_jsonl(str(tmp / "chat.jsonl"), chat_records(16))
    out = tmp / "run"
    # made by the Trainer in this process (tests/inproc/trainer.py): the run is what the tests below read
    train("--model", "tiny", "--data", data, "--output-dir", out, "--strategy", "single", "--nproc-per-node", "1",
          "--seq-len", "64", "--micro-batch-size", "2", "--max-steps", "2", "--save-every", "2", "--tuner", "lora",
          "--lora-r", "4", "--no-save-final", "--mixed-precision", "no")
    return out


def one_line_error(p) -> str:
    assert p.returncode == 2, p.stdout + p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("shardwise: error")]
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    return lines[0]


def test_a_checkpoint_asking_for_remote_code_does_not_get_it(lora_run, tmp_path):
    """meta.json's config is the checkpoint's word, not the user's: with trust_remote_code true there and an
    auto_map in hf/config.json, export used to import and run the checkpoint's .py file."""
    ck = tmp_path / "ck"
    shutil.copytree(lora_run / "checkpoints" / "step_00000002", ck)
    marker = tmp_path / "CODE_RAN"
    (ck / "hf" / "evil_cfg.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n"
                                           "from transformers import LlamaConfig\n"
                                           "class EvilConfig(LlamaConfig):\n    pass\n")
    hf_config = json.loads((ck / "hf" / "config.json").read_text())
    hf_config["auto_map"] = {"AutoConfig": "evil_cfg.EvilConfig"}
    (ck / "hf" / "config.json").write_text(json.dumps(hf_config))
    meta = json.loads((ck / "meta.json").read_text())
    meta["config"]["trust_remote_code"] = True
    meta["files"]["hf/config.json"] = os.path.getsize(ck / "hf" / "config.json")  # as an attacker would
    (ck / "meta.json").write_text(json.dumps(meta))
    line = one_line_error(run_cli("export", str(ck), "--out", str(tmp_path / "exp"), check=False))
    assert "custom code" in line and "--trust-remote-code" in line, line
    assert not marker.exists() and not (tmp_path / "exp").exists()
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no temporary left beside --out


def test_an_exported_adapter_names_a_base_that_chat_loads(lora_run, tmp_path):
    exp = tmp_path / "adapter"
    run_cli("export", str(lora_run), "--out", str(exp), cwd=str(tmp_path))
    base = json.loads((exp / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert os.path.isabs(base) and os.path.isfile(os.path.join(base, "model.safetensors")), base
    p = run_cli("chat", str(exp), "--prompt", "hi", "--max-new-tokens", "2", check=False)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr


def test_export_out_with_a_tilde_is_under_home(lora_run, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    run_cli("export", str(lora_run), "--out", "~/exp", "--merge-lora", cwd=str(tmp_path), env={"HOME": str(home)})
    assert (home / "exp" / "model.safetensors").is_file() and not (tmp_path / "~").exists()
