"""The note a resume on other data gives (launch.prep._data_change_notes), from a checkpoint's real meta.json: the same
file named another way is the same data, a validation set added changes no training row, a changed val_split does."""

from __future__ import annotations

import json
import os

import pytest

from shardwise.config import Config
from shardwise.launch.prep import _data_change_notes


@pytest.fixture
def ckpt(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.jsonl").write_text("{}\n")
    (tmp_path / "b.jsonl").write_text("{}\n")
    (tmp_path / "v1.jsonl").write_text("{}\n")
    (tmp_path / "v2.jsonl").write_text("{}\n")
    os.symlink(tmp_path / "a.jsonl", tmp_path / "link.jsonl")
    path = tmp_path / "checkpoints" / "step_00000004"
    path.mkdir(parents=True)

    def make(**saved):
        config = {"data": "a.jsonl", "val_data": "", "val_split": 0.0} | saved
        meta = {"step": 4, "data_position": {"epoch": 0, "offset": 8}, "config": config}
        (path / "meta.json").write_text(json.dumps(meta))
        return str(path)
    return make


def notes(path, **now):
    return _data_change_notes(path, Config(**({"data": "a.jsonl"} | now)))


def test_the_same_file_named_otherwise_is_the_same_data(ckpt, tmp_path):
    path = ckpt()
    assert notes(path, data=str(tmp_path / "a.jsonl")) == []  # config.yaml's absolute path, meta's as typed
    assert notes(path, data="./link.jsonl") == []
    assert notes(ckpt(data="a.jsonl:0.5,demo:0.5"), data=f"{tmp_path}/a.jsonl:0.5,demo:0.5") == []


def test_other_training_rows_are_noted(ckpt):
    (line,) = notes(ckpt(), data="b.jsonl")
    assert "on other data (data a.jsonl -> b.jsonl)" in line and "data position" in line
    (line,) = notes(ckpt(data="a.jsonl:0.5,demo:0.5"), data="a.jsonl:0.7,demo:0.3")
    assert "on other data" in line
    (line,) = notes(ckpt(), val_split=0.1)  # other rows held out: the training rows differ
    assert "val_split 0.0 -> 0.1" in line


def test_a_validation_set_changes_no_training_row(ckpt):
    assert notes(ckpt(), val_data="v1.jsonl") == []  # added: nothing to say
    assert notes(ckpt(val_data="v1.jsonl")) == []  # dropped
    (line,) = notes(ckpt(val_data="v1.jsonl"), val_data="v2.jsonl")
    assert "another validation set (v1.jsonl -> v2.jsonl)" in line and "data position" not in line


def test_a_checkpoint_past_an_epochs_run_says_to_raise_the_epochs(ckpt):
    """An epochs-counted run was told to raise --max-steps, a flag it does not use."""
    from shardwise.config import load_config
    from shardwise.launch.preflight import check_steps_left

    path = ckpt()  # at step 4
    res = load_config(None, {"epochs": (2, "flag --epochs"), "data": ("a.jsonl", "flag --data")})
    with pytest.raises(Exception) as e:
        check_steps_left(res.cfg, res, path, 3)
    assert str(e.value).startswith("flag --epochs: this run has 3 steps") and \
        "raise --epochs above 2 (or give --max-steps above 4) to train on" in str(e.value), str(e.value)
    res = load_config(None, {"max_steps": (3, "flag --max-steps"), "data": ("a.jsonl", "flag --data")})
    with pytest.raises(Exception, match=r"^flag --max-steps: .* raise --max-steps above 4 to train on"):
        check_steps_left(res.cfg, res, path, 3)


def test_a_resume_from_another_directory_compares_the_files(ckpt, tmp_path, monkeypatch):
    """meta.json records the data as absolute paths (it recorded them as typed, which meant another file once the
    resume ran elsewhere); a weight written .5 is 0.5."""
    path = ckpt(data=f"{tmp_path}/a.jsonl:0.5,demo:.5")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "a.jsonl").write_text("{}\n")
    monkeypatch.chdir(elsewhere)
    assert notes(path, data=f"{tmp_path}/a.jsonl:.5,demo:0.50") == []
    (line,) = notes(path, data="a.jsonl:0.5,demo:0.5")  # another a.jsonl, in this directory
    assert "on other data" in line


def test_the_workers_config_records_absolute_paths(tmp_path, monkeypatch):
    """What the launcher hands the workers (and so every checkpoint's meta.json): paths made absolute."""
    from shardwise.config import absolute_paths

    monkeypatch.chdir(tmp_path)
    import dataclasses

    d = absolute_paths(dataclasses.asdict(Config(data="a.jsonl:0.7,demo:0.3", val_data="v.jsonl")))
    assert d["data"] == f"{tmp_path}/a.jsonl:0.7,demo:0.3" and d["val_data"] == f"{tmp_path}/v.jsonl"
    assert d["model"] == "tiny"
    (tmp_path / "chatml").write_text("{{ messages }}")  # a file named as a shipped template: the name is read first
    (tmp_path / "mine.jinja").write_text("{{ messages }}")
    assert absolute_paths(dataclasses.asdict(Config(chat_template="chatml")))["chat_template"] == "chatml"
    assert absolute_paths(dataclasses.asdict(Config(chat_template="mine.jinja")))["chat_template"] == \
        f"{tmp_path}/mine.jinja"
