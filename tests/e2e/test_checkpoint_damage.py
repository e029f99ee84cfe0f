"""Damaged checkpoints of one real tiny run (steps 2 and 4), resumed and exported through the CLI: each damage is
one line naming the file or meta.json key and an older checkpoint, never torch's advice to load with
weights_only=False, and a refusal before launch writes nothing (resumes.jsonl included)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import random
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import chat_records, run_cli, write_jsonl
from tests.inproc.trainer import train


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpt-damage")
    data = write_jsonl(str(tmp / "chat.jsonl"), chat_records(16))
    run = tmp / "run"
    train(*train_args(run, data, "--max-steps", "4")[1:])  # the Trainer in this process (tests/inproc/trainer.py)
    from shardwise.train import checkpoint as ckpt

    assert [ckpt.problem(str(ck(run, s))) for s in (2, 4)] == [None, None]  # an intact meta.json passes the checks
    return run, data


def train_args(out, data, *extra):
    return ("train", "--model", "tiny", "--data", str(data), "--output-dir", str(out), "--strategy", "single",
            "--nproc-per-node", "1", "--seq-len", "64", "--micro-batch-size", "2", "--save-every", "2",
            "--no-save-final", "--mixed-precision", "no", *extra)


def ck(run, step) -> Path:
    return run / "checkpoints" / f"step_{step:08d}"


def copy_run(made, tmp_path) -> Path:
    return Path(shutil.copytree(made[0], tmp_path / "run"))


def cli_here(capsys, *args):
    """The CLI in this process, for what is refused before anything is launched."""
    from shardwise.cli import main

    capsys.readouterr()
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, rc, out, err)


def one_line_error(p) -> str:
    assert p.returncode == 2, p.stdout + p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("shardwise: error")]
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert "weights_only" not in p.stdout + p.stderr, p.stderr  # never steer the user to let a file run code
    return lines[0]


def snapshot(d: Path) -> dict:
    """Every file's hash, but the run's lock (its holder is recorded in it)."""
    return {str(f.relative_to(d)): hashlib.sha256(f.read_bytes()).hexdigest() for f in d.rglob("*")
            if f.is_file() and f.name != ".shardwise-lock"}


def test_garbage_in_a_shard_is_named_with_an_older_checkpoint(made, tmp_path, capsys):
    run = copy_run(made, tmp_path)
    shard = next(ck(run, 4).glob("*.distcp"))
    size = shard.stat().st_size
    with open(shard, "r+b") as fh:  # same size: the size check in meta.json passes
        fh.seek(1000)
        fh.write(random.Random(0).randbytes(size - 2000))
    for p in (run_cli(*train_args(run, made[1], "--max-steps", "6", "--resume", ck(run, 4)), check=False),
              cli_here(capsys, "export", ck(run, 4), "--out", tmp_path / "exp")):
        line = one_line_error(p)
        assert f"checkpoint {ck(run, 4)}: {shard.name} is corrupt (unreadable tensor data" in line, line
        assert f"use an older one: {ck(run, 2)}" in line, line
    assert not (tmp_path / "exp").exists()
    assert not (run / "resumes.jsonl").exists()  # rank 0 records a resume once its checkpoint has loaded


def corrupt_rng(run) -> Path:
    f = ck(run, 4) / "rng" / "rank0.pt"
    b = bytearray(f.read_bytes())
    b[100:400] = bytes(300)  # same size
    f.write_bytes(bytes(b))
    return f


def test_a_corrupt_rng_file_is_refused_before_the_resume_writes_anything(made, tmp_path, capsys):
    run = copy_run(made, tmp_path)
    corrupt_rng(run)
    before = snapshot(run)
    line = one_line_error(cli_here(capsys, *train_args(run, made[1], "--max-steps", "6", "--resume", ck(run, 4))))
    assert str(ck(run, 4)) in line and "rng/rank0.pt is corrupt" in line, line
    assert snapshot(run) == before  # no resumes.jsonl recording a resume that never happened
    # an export does not need the RNG state: the weights export (in this process, as the command calls it)
    from shardwise.export import export

    export(str(ck(run, 4)), str(tmp_path / "exp"))
    assert (tmp_path / "exp" / "model.safetensors").is_file()


def test_restore_rng_names_a_corrupt_file_in_one_line(made, tmp_path):
    """In a worker (a restart resumes without the launcher's check) the same damage is one line too."""
    from shardwise.train import checkpoint as ckpt

    run = copy_run(made, tmp_path)
    corrupt_rng(run)
    with pytest.raises(ckpt.CorruptCheckpoint) as e:
        ckpt.restore_rng(str(ck(run, 4)), 0)
    msg = str(e.value)
    assert "\n" not in msg and "rng/rank0.pt is corrupt" in msg and f"use an older one: {ck(run, 2)}" in msg, msg
    assert ckpt.latest(str(run)) == str(ck(run, 2))  # --resume auto passes over it


def test_a_stray_file_in_rng_is_no_damage(made, tmp_path):
    """A file a save never writes (Finder's .DS_Store, an editor's backup) is not read: --resume auto keeps the newest
    checkpoint (it passed over it, and the run retrained over it)."""
    from shardwise.train import checkpoint as ckpt

    run = copy_run(made, tmp_path)
    (ck(run, 4) / "rng" / ".DS_Store").write_bytes(b"Bud1\x00\x00\x00\x01garbage")
    (ck(run, 4) / "rng" / "rank0.pt~").write_bytes(b"not a torch file")
    assert ckpt.problem(str(ck(run, 4))) is None
    assert ckpt.latest(str(run)) == str(ck(run, 4))


@pytest.mark.parametrize("key, damage", [
    ("'files' must be an object", lambda m: m.update(files=["x"])),
    ("'step' must be an integer", lambda m: m.update(step="four")),
    ("'data_position.offset' is 1000000000000000", lambda m: m["data_position"].update(offset=10**15)),
])
def test_a_meta_json_of_the_wrong_shape_is_one_line_and_nothing_is_written(made, tmp_path, capsys, key, damage):
    run = copy_run(made, tmp_path)
    path = ck(run, 4) / "meta.json"
    meta = json.loads(path.read_text())
    damage(meta)
    path.write_text(json.dumps(meta))
    before = snapshot(run)
    for args in (train_args(run, made[1], "--max-steps", "6", "--resume", ck(run, 4)),
                 ("export", ck(run, 4), "--out", tmp_path / "exp")):
        line = one_line_error(cli_here(capsys, *args))
        assert str(ck(run, 4)) in line and f"meta.json key {key}" in line and "use an older" in line, line
    assert snapshot(run) == before and not (tmp_path / "exp").exists()


def test_export_merge_lora_of_a_full_fine_tune_is_refused(made, tmp_path, capsys):
    line = one_line_error(cli_here(capsys, "export", ck(made[0], 4), "--out", tmp_path / "exp", "--merge-lora"))
    assert "--merge-lora" in line and "full fine-tune" in line, line
    assert list(tmp_path.iterdir()) == []


class MakesMarker:
    """Unpickling this creates a directory: the proof that loading ran code."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_tensor_item_asking_for_a_global_is_refused_as_code_not_as_corrupt(tmp_path):
    """DCP's reader loads tensor items itself (weights only); its refusal of a planted global must say why, without
    torch's advice to retry with weights_only=False."""
    import dataclasses

    import torch
    import torch.distributed.checkpoint as dcp

    from shardwise.errors import ShardwiseError
    from shardwise.train import checkpoint as ckpt

    path = tmp_path / "c"
    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(path), no_dist=True)
    marker = tmp_path / "CODE_RAN"
    buf = io.BytesIO()
    torch.save(MakesMarker(marker), buf)
    md = ckpt.read_dcp_metadata(str(path))
    ((index, info),) = md.storage_data.items()
    (path / info.relative_path).write_bytes(buf.getvalue())
    md.storage_data[index] = dataclasses.replace(info, offset=0, length=len(buf.getvalue()))
    (path / ".metadata").write_bytes(pickle.dumps(md))
    (path / "meta.json").write_text(json.dumps({"step": 1}))
    with pytest.raises(ShardwiseError) as e:
        ckpt.load(str(path), {"w": torch.zeros(2)}, no_dist=True)
    msg = str(e.value)
    assert f"refused to load {info.relative_path}: it asks for 'posix.mkdir'" in msg and "could run code" in msg, msg
    assert "weights_only" not in msg and not marker.exists()


def test_a_checkpoint_records_its_data_as_an_absolute_path(tmp_path):
    """Typed relative in one directory and resumed from another with the same file named absolutely: no 'other
    data' note (meta.json recorded 'chat.jsonl', read against the resume's directory)."""
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    write_jsonl(str(first / "chat.jsonl"), chat_records(16))
    run = tmp_path / "run"
    # the launcher's prepare and the Trainer in this process (tests/inproc/trainer.py), from each directory
    train(*train_args(run, "chat.jsonl", "--max-steps", "2")[1:], cwd=first)
    meta = json.loads((ck(run, 2) / "meta.json").read_text())
    assert meta["config"]["data"] == str(first / "chat.jsonl")
    p = train(*train_args(run, first / "chat.jsonl", "--max-steps", "4", "--resume", "auto")[1:], cwd=second)
    assert "resumed from" in p.stdout and "other data" not in p.stdout, p.stdout
