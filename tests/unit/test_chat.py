"""`shardwise chat`'s refusals: one line naming what is missing and the flag that fixes it."""

import json
import shutil

import pytest

from shardwise.chat import resolve_dirs, set_template
from shardwise.errors import ShardwiseError


def test_an_adapter_dir_is_detected_and_its_recorded_base_checked(tmp_path, tiny_dir):
    ad = tmp_path / "final"
    ad.mkdir()
    (ad / "adapter_model.safetensors").write_bytes(b"")
    (ad / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tmp_path / "gone")}))
    with pytest.raises(ShardwiseError, match=r"base model recorded in adapter_config.json .*gone.* pass --base DIR"):
        resolve_dirs(str(ad))
    assert resolve_dirs(str(ad), base=tiny_dir) == (tiny_dir, str(ad))
    (ad / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": tiny_dir}))
    assert resolve_dirs(str(ad)) == (tiny_dir, str(ad))
    assert resolve_dirs(tiny_dir, adapter=str(ad)) == (tiny_dir, str(ad))
    with pytest.raises(ShardwiseError, match="DIR is an adapter directory already"):
        resolve_dirs(str(ad), adapter=str(ad))
    (ad / "adapter_model.safetensors").unlink()
    with pytest.raises(ShardwiseError, match="no adapter_model.safetensors"):
        resolve_dirs(str(ad))


def test_a_dir_without_weights_or_config_is_refused(tmp_path, tiny_dir):
    with pytest.raises(ShardwiseError, match="neither a model directory"):
        resolve_dirs(str(tmp_path))
    d = tmp_path / "m"
    shutil.copytree(tiny_dir, d)
    (d / "model.safetensors").unlink()
    with pytest.raises(ShardwiseError, match="no safetensors weights"):
        resolve_dirs(str(d))


def test_no_chat_template_is_one_line_naming_the_flag(tmp_path, tiny_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)
    tok.chat_template = None
    with pytest.raises(ShardwiseError, match="has no chat template; pass --chat-template"):
        set_template(tok, "", "here")
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    set_template(tok, str(f), "here")
    assert tok.apply_chat_template([{"role": "user", "content": "abc"}], tokenize=False) == "abc"


def test_a_shipped_template_name_is_accepted(tiny_dir):
    from shardwise.models.load import load_tokenizer

    tok = load_tokenizer(tiny_dir, False)
    tok.chat_template = None
    set_template(tok, "chatml", "here")
    text = tok.apply_chat_template([{"role": "user", "content": "abc"}], tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nabc<|im_end|>" in text and text.rstrip().endswith("<|im_start|>assistant")
    with pytest.raises(ShardwiseError, match="neither a shipped chat template"):
        set_template(tok, "no-such-template", "here")
