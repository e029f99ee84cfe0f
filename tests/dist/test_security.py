"""Issue 14's security and integrity items, through real processes: checkpoints that would
run code or are corrupt, temporaries that must never be someone else's, what listens where,
workers that must die with their launcher, and resumes into a different model."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.dist.shared import COMMON, DDP
from tests.helpers import ConcurrentRuns, listening, read_metrics, run_cli, worker_processes
from tests.inproc.trainer import train

ONE = ("--strategy", "single", "--nproc-per-node", "1", "--micro-batch-size", "2", "--grad-accum", "2",
       "--no-save-final")


def train_args(out, data, *extra):
    return ("train", *COMMON, "--data", str(data), "--output-dir", str(out), *ONE, *extra)


@pytest.fixture(scope="module")
def base(tmp_path_factory, chat_data):
    """One-process run with complete checkpoints at steps 2 and 4; tests work on copies."""
    out = tmp_path_factory.mktemp("base") / "run"
    # the Trainer in this process (tests/inproc/trainer.py): the run is what the tests below read
    train(*train_args(out, chat_data, "--max-steps", "4", "--save-every", "2", "--keep-checkpoints", "3")[1:])
    return out


def copy_run(base, dest):
    shutil.copytree(base, dest)
    return dest


def ckpt(run, step):
    return run / "checkpoints" / f"step_{step:08d}"


def cli_here(capsys, *args):
    """The CLI in this process, for refusals that happen before anything is launched (the
    same code path as the command; it saves a Python start with torch's imports)."""
    from shardwise.cli import main

    capsys.readouterr()
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, rc, out, err)


def one_line_error(p) -> str:
    assert p.returncode != 0, p.stdout + p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("shardwise: error")]
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    return lines[0]


class MakesMarker:
    """Unpickling this creates a directory: the proof that loading ran code."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def tamper_metadata(ck, payload: bytes) -> None:
    """Replace .metadata and, as an attacker could, keep meta.json's record consistent."""
    (ck / ".metadata").write_bytes(payload)
    meta = json.loads((ck / "meta.json").read_text())
    if "files" in meta:
        meta["files"][".metadata"] = len(payload)
        meta["metadata_sha256"] = hashlib.sha256(payload).hexdigest()
    (ck / "meta.json").write_text(json.dumps(meta))


# -- 1: nothing in a checkpoint runs code when loaded --------------------------------------

def test_a_checkpoint_whose_metadata_would_run_code_is_refused(base, chat_data, tmp_path):
    run = copy_run(base, tmp_path / "run")
    marker = tmp_path / "CODE_RAN"
    tamper_metadata(ckpt(run, 4), pickle.dumps(MakesMarker(marker)))
    runs = ConcurrentRuns()
    runs.add("export", "export", str(ckpt(run, 4)), "--out", str(tmp_path / "exp"), check=False)
    runs.add("resume", *train_args(tmp_path / "resumed", chat_data, "--max-steps", "6", "--resume", str(ckpt(run, 4))),
             check=False)
    for name in ("export", "resume"):
        line = one_line_error(runs.get(name))
        assert "refused to load" in line and "posix.mkdir" in line and str(ckpt(run, 4)) in line, line
    assert not marker.exists()
    assert not (tmp_path / "exp").exists()


def test_non_tensor_items_of_a_checkpoint_cannot_run_code(tmp_path):
    """DCP reads non-tensor items with torch.load(weights_only=False); ours must not."""
    import torch
    import torch.distributed.checkpoint as dcp

    from shardwise.errors import ShardwiseError
    from shardwise.train import checkpoint as ck

    marker = tmp_path / "CODE_RAN"
    path = str(tmp_path / "c")
    dcp.save({"w": torch.ones(2), "evil": MakesMarker(marker)}, checkpoint_id=path, no_dist=True)
    (tmp_path / "c" / "meta.json").write_text(json.dumps({"step": 1}))
    state = {"w": torch.zeros(2), "evil": None}
    with pytest.raises(ShardwiseError, match="refused to load item evil"):
        ck.load(path, state, no_dist=True)
    assert not marker.exists()
    with pytest.raises(ShardwiseError, match="refused to load"):  # the reader alone refuses a bad .metadata
        (tmp_path / "c" / ".metadata").write_bytes(pickle.dumps(MakesMarker(marker)))
        ck.SafeReader(path).read_metadata()
    assert not marker.exists()


# -- 3: temporaries are fresh names; nothing else is deleted -------------------------------

def test_export_never_deletes_a_sibling_tmp_and_refuses_an_empty_out(base, tmp_path, capsys, monkeypatch):
    users = tmp_path / "release.tmp"
    users.mkdir()
    (users / "keep.txt").write_text("the user's")
    from shardwise.export import export

    export(str(base), str(tmp_path / "release"))  # in this process, as the command calls it
    assert (tmp_path / "release" / "model.safetensors").is_file()
    assert (users / "keep.txt").read_text() == "the user's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["release", "release.tmp"]  # no temporary left
    cwd = tmp_path / "project"
    (cwd / ".tmp").mkdir(parents=True)
    (cwd / ".tmp" / "keep.txt").write_text("the user's")
    monkeypatch.chdir(cwd)
    assert "--out" in one_line_error(cli_here(capsys, "export", base, "--out", ""))
    assert (cwd / ".tmp" / "keep.txt").read_text() == "the user's"


def plant_tmp_dirs(run):
    """A user's look-alike of a save's temporary (no marker), a user's file named *.tmp, and
    the debris of an interrupted save of ours (marked): only the last may be deleted."""
    root = run / "checkpoints"
    (root / "step_00000099.tmp").mkdir()
    (root / "step_00000099.tmp" / "keep.txt").write_text("the user's")
    (root / "notes.tmp").write_text("the user's")
    debris = root / "step_00000077.tmp"
    debris.mkdir()
    (debris / ".shardwise-partial").write_text("")
    return lambda: (not debris.exists() and (root / "step_00000099.tmp" / "keep.txt").is_file()
                    and (root / "notes.tmp").is_file())


# -- 8: resume refuses another architecture, notes a changed shape, keeps config.yaml ------

def two_layer_model(dest) -> str:
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    from shardwise.models.load import resolve_model_dir

    tiny = resolve_model_dir("tiny", 0)
    cfg = AutoConfig.from_pretrained(tiny)
    cfg.num_hidden_layers = 2
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(dest)
    for f in os.listdir(tiny):
        if "token" in f or f.endswith(".jinja"):
            shutil.copy2(os.path.join(tiny, f), dest)
    return str(dest)


def test_resume_refuses_another_architecture_and_notes_a_changed_shape(base, chat_data, tmp_path, capsys):
    run = copy_run(base, tmp_path / "run")
    model2 = two_layer_model(tmp_path / "two-layers")
    original = (run / "config.yaml").read_bytes()
    args = train_args(run, chat_data, "--max-steps", "6", "--resume", "auto")
    line = one_line_error(cli_here(capsys, *args, "--model", model2))
    assert "num_hidden_layers 4 -> 2" in line and str(ckpt(run, 4)) in line, line
    assert "tuner full -> lora" in one_line_error(cli_here(capsys, *args, "--tuner", "lora"))
    p = train(*args[1:], "--seq-len", "48")  # one rank in this process (tests/inproc/trainer.py)
    assert "changed run shape (seq_len 64 -> 48)" in p.stdout, p.stdout
    assert f"resumed from {ckpt(run, 4)} at step 4" in p.stdout
    assert (run / "config.yaml").read_bytes() == original
    resumes = [json.loads(x) for x in (run / "resumes.jsonl").read_text().splitlines()]
    assert len(resumes) == 1 and resumes[0]["step"] == 4 and resumes[0]["config"]["seq_len"] == 48


# -- 9: a corrupt checkpoint is found before loading; auto falls back -----------------------

def test_a_corrupt_newest_checkpoint_is_skipped_by_auto_and_refused_by_name(base, chat_data, tmp_path, capsys):
    """Also: the resumed run's saves delete only their own marked temporaries (item 3)."""
    run = copy_run(base, tmp_path / "run")
    shard = next(ckpt(run, 4).glob("*.distcp"))
    with open(shard, "r+b") as fh:
        fh.truncate(shard.stat().st_size // 2)
    nometa = copy_run(base, tmp_path / "nometa")
    (ckpt(nometa, 4) / ".metadata").unlink()
    for args, what in ((("export", ckpt(run, 4), "--out", tmp_path / "exp"), shard.name),
                       (("export", ckpt(nometa, 4), "--out", tmp_path / "exp"), ".metadata"),
                       (train_args(tmp_path / "other", chat_data, "--resume", ckpt(run, 4)), shard.name)):
        line = one_line_error(cli_here(capsys, *args))
        assert "incomplete or corrupt" in line and what in line, line
    assert not (tmp_path / "exp").exists() and not (tmp_path / "other").exists()
    only_ours_deleted = plant_tmp_dirs(run)
    p = train(*train_args(run, chat_data, "--max-steps", "6", "--save-every", "2", "--resume", "auto")[1:])
    skipped = [ln for ln in p.stdout.splitlines() if "--resume auto: skipped" in ln]
    assert len(skipped) == 1 and str(ckpt(run, 4)) in skipped[0] and str(ckpt(run, 2)) in skipped[0], p.stdout
    assert f"resumed from {ckpt(run, 2)} at step 2" in p.stdout
    assert [r["step"] for r in read_metrics(str(run))][-1] == 6
    assert only_ours_deleted()


# -- 4 and 6: a live 2-rank run listens on loopback only and dies with its launcher --------

@pytest.fixture(scope="module")
def live(tmp_path_factory, chat_data):
    """A 2-rank DDP run with a checkpoint every 2 steps, alive once its first one is written."""
    out = tmp_path_factory.mktemp("live") / "run"
    log = open(out.parent / "log.txt", "w")  # noqa: SIM115 - open while the run lives
    args = ("train", *COMMON, "--data", str(chat_data), "--output-dir", str(out), *DDP, "--max-steps", "400",
            "--save-every", "2", "--no-save-final")
    launcher = subprocess.Popen([sys.executable, "-m", "shardwise", *args], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 400
    while not list((out / "checkpoints").glob("step_*/meta.json")):
        assert launcher.poll() is None, (out.parent / "log.txt").read_text()
        assert time.monotonic() < deadline, "no checkpoint written"
        time.sleep(0.5)
    workers = [p.pid for p in worker_processes(launcher.pid)]
    yield launcher, workers, out, args
    for pid in (launcher.pid, *workers):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    launcher.wait()
    log.close()


def test_a_run_listens_on_loopback_only(live):
    launcher, workers, _, _ = live
    assert len(workers) == 2
    socks = listening([launcher.pid, *workers])
    assert socks, "the run's stores were not found listening"
    assert all(s.startswith("127.0.0.1:") for s in socks), socks


def test_workers_die_with_a_killed_launcher_and_the_run_resumes(live, chat_data):
    launcher, workers, out, _ = live
    assert len(workers) == 2 and all(os.path.exists(f"/proc/{p}") for p in workers)
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + 60
    while any(os.path.exists(f"/proc/{p}") and "zombie" not in _state(p) for p in workers):
        assert time.monotonic() < deadline, "workers outlived their launcher"
        time.sleep(0.2)
    from shardwise.train.checkpoint import latest, read_meta

    last = read_meta(latest(str(out)))["step"]
    # on one rank in this process (cheaper, tests/inproc/trainer.py; resharding 2 -> 1 is covered elsewhere)
    p = train(*COMMON, "--data", chat_data, "--output-dir", out, *ONE, "--max-steps", last + 2, "--resume", "auto")
    assert f"at step {last}" in p.stdout and read_metrics(str(out))[-1]["step"] == last + 2


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/status") as fh:
            return next(ln for ln in fh if ln.startswith("State:")).lower()
    except (OSError, StopIteration):
        return "zombie"
