"""A run directory whose own entries are symbolic links is refused before anything is written through them: a
copied run whose .prep links elsewhere had that directory's errors/ removed and the preparation written into it
when it was resumed (the UI's Resume takes the same path)."""

from __future__ import annotations

import os
import shutil

import pytest

from tests.helpers import chat_records, run_cli, write_jsonl
from tests.inproc.trainer import train

COMMON = ("--model", "tiny", "--strategy", "single", "--nproc-per-node", "1", "--seq-len", "64",
          "--micro-batch-size", "2", "--log-every", "1", "--mixed-precision", "no", "--no-save-final")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("links")
    data = write_jsonl(str(root / "chat.jsonl"), chat_records(32))
    out = root / "run"
    # the run being resumed is made in this process (tests/inproc/trainer.py); the resumes below are launched
    train(*COMMON, "--data", data, "--output-dir", str(out), "--max-steps", "4", "--save-every", "2")
    return out


def _copy_with_link(trained, tmp_path, entry: str):
    copy = tmp_path / "copy"
    shutil.copytree(trained, copy, symlinks=True)
    target = tmp_path / "elsewhere"
    (target / "errors").mkdir(parents=True)
    (target / "errors" / "keep.txt").write_text("the user's")
    shutil.rmtree(copy / entry) if (copy / entry).is_dir() else None
    os.symlink(target, copy / entry)
    return copy, target


@pytest.mark.parametrize("entry", [".prep", "checkpoints", "tensorboard"])
def test_a_linked_entry_is_refused_and_its_target_untouched(trained, tmp_path, entry):
    copy, target = _copy_with_link(trained, tmp_path, entry)
    before = sorted(str(p.relative_to(target)) for p in target.rglob("*"))
    p = run_cli("train", str(copy / "config.yaml"), "--output-dir", str(copy), "--resume", "auto",
                "--max-steps", "8", check=False)
    assert p.returncode == 2, p.stdout + p.stderr
    line = p.stderr.strip().splitlines()[-1]
    assert line == (f"shardwise: error: flag --output-dir: {copy / entry} is a symbolic link (to {target}); "
                    "shardwise writes there itself and never through a link: remove the link, or choose another "
                    "--output-dir"), p.stderr
    assert "Traceback" not in p.stderr
    assert sorted(str(p.relative_to(target)) for p in target.rglob("*")) == before
    assert (target / "errors" / "keep.txt").read_text() == "the user's"


def test_a_link_inside_prep_is_refused(trained, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(trained, copy, symlinks=True)
    target = tmp_path / "elsewhere"
    target.mkdir()
    shutil.rmtree(copy / ".prep" / "node0", ignore_errors=True)
    os.symlink(target, copy / ".prep" / "node0")
    p = run_cli("train", str(copy / "config.yaml"), "--output-dir", str(copy), "--resume", "auto",
                "--max-steps", "8", check=False)
    assert p.returncode == 2 and "node0 is a symbolic link" in p.stderr.strip().splitlines()[-1], p.stderr
    assert os.listdir(target) == []
