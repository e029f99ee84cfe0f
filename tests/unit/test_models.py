import json
import os

import pytest
import torch

from shardwise.errors import ShardwiseError
from shardwise.models.load import load_model, load_tokenizer, resolve_model_dir


def test_tiny_is_a_real_hf_directory(tiny_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, local_files_only=True)
    assert tok.chat_template and tok.pad_token_id is not None
    assert os.path.isfile(os.path.join(tiny_dir, "model.safetensors"))
    assert model.config.model_type == "llama" and model.config.vocab_size >= len(tok)
    out = model(input_ids=torch.tensor([tok("hello")["input_ids"]]))
    assert torch.isfinite(out.logits).all()


def test_tiny_is_deterministic_per_seed(tmp_path, monkeypatch):
    from shardwise.models import tiny

    monkeypatch.setenv("SHARDWISE_CACHE_DIR", str(tmp_path))
    a = load_model(tiny.tiny_dir(7), torch.float32).state_dict()
    b_dir = tmp_path / "again"
    tiny.write_tiny(str(b_dir), 7)
    b = load_model(str(b_dir), torch.float32).state_dict()
    c = load_model(tiny.tiny_dir(8), torch.float32).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_a_tiny_model_in_the_cache_that_this_user_did_not_build_is_refused(tmp_path, monkeypatch):
    """The tiny model's cache entry is used only as this user built it: a link to another directory (or one others
    can write) under its name is refused in one line, and nothing there is deleted or replaced."""
    import shutil

    from shardwise.models import tiny

    monkeypatch.setenv("SHARDWISE_CACHE_DIR", str(tmp_path / "cache"))
    built = tiny.tiny_dir(7)
    assert tiny.tiny_dir(7) == built  # our own: used again
    elsewhere = tmp_path / "planted"
    shutil.move(built, elsewhere)
    os.symlink(elsewhere, built)
    with pytest.raises(ShardwiseError, match=r"tiny-.* is a link or not a directory: it is not the tiny model this user built; move it away"):
        tiny.tiny_dir(7)
    assert os.path.islink(built) and os.path.isfile(elsewhere / "config.json")
    os.unlink(built)
    shutil.move(elsewhere, built)
    os.chmod(built, 0o777)
    with pytest.raises(ShardwiseError, match="can be written by other users: it is not the tiny model this user built"):
        tiny.tiny_dir(7)


def test_model_dir_errors(tmp_path):
    with pytest.raises(ShardwiseError, match="no such directory"):
        resolve_model_dir(str(tmp_path / "nope"), 0)
    with pytest.raises(ShardwiseError, match="no config.json"):
        resolve_model_dir(str(tmp_path), 0)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(ShardwiseError, match="no safetensors weights.*pickle weights pytorch_model.bin"):
        resolve_model_dir(str(tmp_path), 0)


def test_corrupt_weights_are_one_clear_error(tmp_path, tiny_dir):
    import shutil

    bad = tmp_path / "m"
    shutil.copytree(tiny_dir, bad)
    with open(bad / "model.safetensors", "r+b") as fh:
        fh.truncate(1000)
    with pytest.raises(ShardwiseError, match="cannot load the model"):
        load_model(str(bad), torch.float32)


def test_tokenizer_without_pad_gets_one(tmp_path, tiny_dir):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(tiny_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.pop("pad_token", None)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = load_tokenizer(str(d))
    assert tok.pad_token_id is not None


def test_truncated_or_garbled_safetensors_are_refused_before_launch(tmp_path, tiny_dir):
    import shutil

    from shardwise.models.load import check_weights

    check_weights(tiny_dir)  # a whole file passes
    bad = tmp_path / "m"
    shutil.copytree(tiny_dir, bad)
    size = (bad / "model.safetensors").stat().st_size
    with open(bad / "model.safetensors", "r+b") as fh:
        fh.truncate(size - 100)
    with pytest.raises(ShardwiseError, match=r"model.safetensors is truncated \(\d+ of \d+ bytes\); re-copy"):
        check_weights(str(bad))
    (bad / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(ShardwiseError, match="model.safetensors is missing or corrupt"):
        check_weights(str(bad))


def test_weights_that_do_not_match_config_json_are_refused_before_launch(tmp_path, tiny_dir):
    """Issue 14.12: the shapes in the safetensors headers against the model config.json
    describes (built on the meta device), before any worker starts."""
    import json
    import shutil

    from shardwise.models.load import check_shapes, check_weights

    check_shapes(tiny_dir, check_weights(tiny_dir))  # a matching pair passes
    bad = tmp_path / "m"
    shutil.copytree(tiny_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["intermediate_size"] *= 2
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ShardwiseError, match=r"weight model\.layers\.\d+\.mlp\.\w+_proj\.weight has shape \[\d+, \d+\] "
                                             r"but config\.json describes \[\d+, \d+\]; the weights and config\.json"):
        check_shapes(str(bad), check_weights(str(bad)))


def test_model_checks_are_remembered_for_what_passed_and_redone_for_anything_changed(tmp_path, tiny_dir, monkeypatch):
    """launch.preflight.check_model builds the model on the meta device (transformers' modelling stack: 1.9 s of the
    launcher's CPU on the tiny job) only for files and settings that have not passed before (issue 17.3)."""
    import shutil

    from shardwise import config
    from shardwise.launch.preflight import check_model
    from shardwise.models import load

    monkeypatch.setenv("SHARDWISE_CACHE_DIR", str(tmp_path / "cache"))
    built = []
    real = load.check_shapes
    monkeypatch.setattr(load, "check_shapes", lambda *a, **k: built.append(a[0]) or real(*a, **k))
    m = tmp_path / "m"
    shutil.copytree(tiny_dir, m)

    def check(**flags):
        res = config.load_config(None, {"model": (str(m), "--model"), **{k: (v, f"--{k}") for k, v in flags.items()}})
        return check_model(res.cfg, res)

    assert check() == str(m) and check() == str(m)
    assert built == [str(m)]  # the second run found the first one's entry
    assert len(os.listdir(tmp_path / "cache" / "checks")) == 1
    with pytest.raises(ShardwiseError, match="no linear module named nosuch"):  # other settings: checked again
        check(tuner="lora", **{"lora.targets": "q_proj,nosuch"})
    with pytest.raises(ShardwiseError, match="no linear module named nosuch"):  # and a refusal is not remembered
        check(tuner="lora", **{"lora.targets": "q_proj,nosuch"})
    assert check(tuner="lora") == str(m)
    with pytest.raises(ShardwiseError, match="lora.r 65 is larger than"):  # the rank alone is part of the key
        check(tuner="lora", **{"lora.r": "65"})
    (m / "modeling_extra.py").write_text("# a code file of the model directory\n")
    assert check() == str(m)  # checked again
    cfg = json.loads((m / "config.json").read_text())
    cfg["intermediate_size"] *= 2
    (m / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ShardwiseError, match="the weights and config.json are from different models"):
        check()
    assert len(built) == 7 and len(os.listdir(tmp_path / "cache" / "checks")) == 3


def test_a_repeat_launch_prepares_without_transformers_or_dcp(tmp_path, tiny_dir):
    """What the launcher's prepare imports once the model passed its checks and the data was tokenized before:
    not transformers at all (neither the modelling stack of the meta-device build nor the tokenizer's classes:
    data/cache.py source_key), nor torch.distributed.checkpoint (0.6 s; only a resume reads a checkpoint). In a
    fresh interpreter, with a cache of its own."""
    import subprocess
    import sys

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"line {i} " * 5}) + "\n" for i in range(24)))
    code = ("import sys; from shardwise import config, launch; "
            f"flags = {{'model': {tiny_dir!r}, 'data': {str(data)!r}, 'seq_len': 32, 'val_split': 0.1, "
            "'nproc_per_node': 2, 'strategy': 'ddp', 'output_dir': sys.argv[1]}; "
            "p = launch.prepare(config.load_config(None, {k: (v, 'flag') for k, v in flags.items()})); "
            "p.lock.release(); "
            "print(sorted(m for m in ('transformers', 'transformers.modeling_utils', 'torch.distributed.checkpoint') "
            "if m in sys.modules))")
    env = {**os.environ, "SHARDWISE_CACHE_DIR": str(tmp_path / "cache")}
    runs = [subprocess.run([sys.executable, "-c", code, str(tmp_path / f"run{i}")], env=env, capture_output=True,
                           text=True, timeout=300) for i in range(2)]
    assert [r.returncode for r in runs] == [0, 0], runs[0].stderr[-2000:] + runs[1].stderr[-2000:]
    assert "'transformers.modeling_utils'" in runs[0].stdout  # the first run builds the meta model
    assert runs[1].stdout.strip().splitlines()[-1] == "[]", runs[1].stdout


def test_saving_a_model_does_not_import_deepspeed(tmp_path, tiny_dir):
    """transformers' save_pretrained asks accelerate to unwrap the model, which imports DeepSpeed (1.3 s of CPU)
    whenever it is installed; models.load.save_pretrained writes the same files without that import. In a fresh
    interpreter: another test may have imported deepspeed in this one."""
    pytest.importorskip("deepspeed")
    import subprocess
    import sys

    script = f"""
import sys
from transformers import AutoModelForCausalLM
from shardwise.models.save import save_pretrained
m = AutoModelForCausalLM.from_pretrained({tiny_dir!r})
save_pretrained(m, {str(tmp_path / 'ours')!r})
assert "deepspeed" not in sys.modules, "our save imported deepspeed"
m.save_pretrained({str(tmp_path / 'plain')!r})
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    from safetensors.torch import load_file

    ours, plain = load_file(tmp_path / "ours" / "model.safetensors"), load_file(tmp_path / "plain" / "model.safetensors")
    assert ours.keys() == plain.keys() and all(torch.equal(ours[k], plain[k]) for k in ours)
    assert json.load(open(tmp_path / "ours" / "config.json")) == json.load(open(tmp_path / "plain" / "config.json"))


def test_a_checks_record_this_user_did_not_write_does_not_skip_the_checks(tmp_path, tiny_dir, monkeypatch):
    """A record's name is the key of files that passed: one planted by another user (or through a link) would skip
    the model checks, so only this user's own regular files in a folder nobody else writes count."""
    import shutil

    from shardwise import config
    from shardwise.launch.preflight import check_model
    from shardwise.models import load

    monkeypatch.setenv("SHARDWISE_CACHE_DIR", str(tmp_path / "cache"))
    built = []
    real = load.check_shapes
    monkeypatch.setattr(load, "check_shapes", lambda *a, **k: built.append(a[0]) or real(*a, **k))
    m = tmp_path / "m"
    shutil.copytree(tiny_dir, m)
    res = config.load_config(None, {"model": (str(m), "--model")})
    folder = tmp_path / "cache" / "checks"

    check_model(res.cfg, res)
    check_model(res.cfg, res)
    assert len(built) == 1 and (folder.stat().st_mode & 0o777) == 0o700
    (record,) = folder.iterdir()
    folder.chmod(0o777)  # our own folder left writable by others (a umask): made private, then trusted
    check_model(res.cfg, res)
    assert len(built) == 1 and (folder.stat().st_mode & 0o022) == 0
    elsewhere = tmp_path / "planted.json"
    record.rename(elsewhere)
    record.symlink_to(elsewhere)  # a link in place of the record
    check_model(res.cfg, res)
    assert len(built) == 2  # checked again
    assert record.is_file() and not record.is_symlink()  # and recorded again, as a file of ours
    if os.getuid() == 0:  # another user's record, and another user's folder (chown needs root)
        os.chown(record, 65534, 65534)
        check_model(res.cfg, res)
        assert len(built) == 3
        record.unlink()
        check_model(res.cfg, res)
        assert len(built) == 4
        os.chown(folder, 65534, 65534)
        check_model(res.cfg, res)
        assert len(built) == 5
