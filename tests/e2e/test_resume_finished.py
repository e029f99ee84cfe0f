"""`--resume` of a run that has no steps left (real 2-rank gloo runs of the built-in tiny job).

A finished run started again with `--resume auto` (a requeued job, a re-run script) crashed in every worker's end
of run and rewrote its summary.json with empty figures. Now: a finished run has nothing to do (exit 0, nothing
written); a checkpoint past this run's last step is refused; a checkpoint at the last step of a run that stopped
before its final model goes on to write the final model and summary.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from tests.helpers import run_cli

JOB = ("--strategy", "ddp", "--nproc-per-node", "2", "--max-steps", "4", "--save-every", "2")


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("finished") / "run"
    run_cli("train", *JOB, "--output-dir", str(out), timeout=300)
    return out


def snapshot(d: Path) -> dict:
    """Every file under `d` with its digest (the run lock aside: it holds the PID of the last launcher)."""
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*"))
            if p.is_file() and p.name != ".shardwise-lock"}


def copy(finished: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(finished, out, symlinks=True)
    return out


def test_a_finished_run_resumed_again_has_nothing_to_do(finished, tmp_path):
    out = copy(finished, tmp_path)
    before = snapshot(out)
    p = run_cli("train", *JOB, "--output-dir", str(out), "--resume", "auto", check=False, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert (f"shardwise: {out} already finished its 4 steps (checkpoint {out}/checkpoints/step_00000004); nothing "
            "to train: raise --max-steps above 4 to train on") in p.stdout, p.stdout
    assert "error" not in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert snapshot(out) == before  # summary.json, final/, metrics untouched; no resume recorded


def test_a_checkpoint_past_the_last_step_is_refused_and_nothing_is_written(finished, tmp_path):
    out = copy(finished, tmp_path)
    before = snapshot(out)
    p = run_cli("train", *JOB[:-4], "--max-steps", "2", "--save-every", "2", "--output-dir", str(out), "--resume",
                "auto", check=False, timeout=300)
    errors = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and errors == [
        f"shardwise: error: flag --max-steps: this run has 2 steps, but the checkpoint it resumes "
        f"({out}/checkpoints/step_00000004) is at step 4; raise --max-steps above 4 to train on, or start a new run "
        "in another --output-dir"], p.stderr[-3000:]
    assert snapshot(out) == before


def test_a_run_stopped_before_its_final_model_writes_it_on_resume(finished, tmp_path):
    """The last checkpoint is at the last step, but the run stopped while saving its final model (no summary.json):
    the resume trains nothing and writes the final model and the summary, the loss taken from the run's last
    logged record."""
    out = copy(finished, tmp_path)
    summary_before = json.loads((out / "summary.json").read_text())
    shutil.rmtree(out / "final")
    (out / "summary.json").unlink()
    p = run_cli("train", *JOB, "--output-dir", str(out), "--resume", "auto", timeout=300)
    assert f"resumed from {out}/checkpoints/step_00000004 at step 4" in p.stdout, p.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["final_loss"] == summary_before["final_loss"] is not None
    assert summary["first_loss"] == summary_before["first_loss"]
    assert summary["mean_tokens_per_s"] is None  # this launch trained nothing (it said 0.0)
    assert (out / "final" / "model.safetensors").is_file() and summary["final_model"] == str(out / "final")
    assert f"done: 4 steps, loss {summary['first_loss']:.4f} (first logged) -> {summary['final_loss']:.4f}" in p.stdout


def test_overwrite_replaces_the_runs_resume_records_and_profiles_but_not_a_users_file_among_them(finished, tmp_path):
    """A replaced run's resumes.jsonl described checkpoints that were gone; of profile/ only the profiler's own
    files go (the folder stays while something of the user's is in it)."""
    from shardwise import rundir

    out = copy(finished, tmp_path)
    (out / "resumes.jsonl").write_text('{"checkpoint": "checkpoints/step_00000002", "step": 2}\n')
    (out / "profile").mkdir()
    for name in ("step-3-rank0.txt", "step-3-rank1.json.gz"):
        (out / "profile" / name).write_text("the profiler's")
    rundir.clear(str(out))
    assert not (out / "resumes.jsonl").exists() and not (out / "profile").exists()
    assert not (out / "checkpoints").exists()
    rundir.mark(str(out))  # as the launcher marks the directory again for the run replacing it
    (out / "profile").mkdir()
    (out / "profile" / "step-3-rank0.txt").write_text("the profiler's")
    (out / "profile" / "my-notes.txt").write_text("the user's")
    rundir.clear(str(out))
    assert sorted(p.name for p in (out / "profile").iterdir()) == ["my-notes.txt"]
    rundir.mark(str(out))  # --memory-snapshot's histories alike
    (out / "memory").mkdir()
    (out / "memory" / "rank0.pickle").write_bytes(b"the allocator's")
    (out / "memory" / "rank0-notes.pickle").write_bytes(b"the user's")
    rundir.clear(str(out))
    assert sorted(p.name for p in (out / "memory").iterdir()) == ["rank0-notes.pickle"]
    (out / "memory" / "rank0-notes.pickle").unlink()
    rundir.mark(str(out))
    (out / "memory" / "rank1.pickle").write_bytes(b"the allocator's")
    rundir.clear(str(out))
    assert not (out / "memory").exists()


def test_resume_auto_with_overwrite_resumes_and_says_nothing_is_replaced(finished, tmp_path):
    out = copy(finished, tmp_path)
    p = run_cli("train", *JOB[:-4], "--max-steps", "5", "--save-every", "2", "--output-dir", str(out), "--resume",
                "auto", "--overwrite", timeout=300)
    assert (f"shardwise: --resume auto --overwrite: {out} has a checkpoint to resume, so nothing is replaced "
            "(--overwrite replaces a run only where --resume auto finds no checkpoint)") in p.stdout, p.stdout
    assert f"resumed from {out}/checkpoints/step_00000004 at step 4" in p.stdout
    assert json.loads((out / "summary.json").read_text())["steps"] == 5
    q = run_cli("train", *JOB, "--output-dir", str(out), "--resume", str(out / "checkpoints" / "step_00000004"),
                "--overwrite", check=False, timeout=300)
    assert q.returncode == 2 and q.stderr.startswith("shardwise: error: flag --overwrite: --overwrite replaces the "
                                                     "run in --output-dir and --resume "), q.stderr


def test_a_resume_on_other_data_says_so(finished, tmp_path):
    """Allowed (a curriculum), but the saved data position then counts rows of the new data: a note, as for a
    changed batch shape (a resume onto another file said nothing)."""
    from tests.helpers import chat_records, write_jsonl

    out = copy(finished, tmp_path)
    data = write_jsonl(str(tmp_path / "chat.jsonl"), chat_records(64))
    p = run_cli("train", *JOB[:-4], "--max-steps", "5", "--save-every", "2", "--output-dir", str(out), "--resume",
                "auto", "--data", data, "--micro-batch-size", "8", "--seq-len", "128", timeout=300)  # the demo's batch
    assert (f"shardwise: resuming {out}/checkpoints/step_00000004 on other data (data demo -> {data}); the data "
            "position it saved (epoch and offset) is applied to the new data") in p.stdout, p.stdout
    assert json.loads((out / "summary.json").read_text())["steps"] == 5
    assert [json.loads(ln)["notes"] for ln in (out / "resumes.jsonl").read_text().splitlines()][-1][-1].startswith(
        f"resuming {out}/checkpoints/step_00000004 on other data")


def test_resume_auto_with_overwrite_and_no_checkpoint_replaces_the_run(finished, tmp_path):
    """--resume auto --overwrite promises to replace a run that has no checkpoint left; it trained from the start over
    the old run's files (its run id, resumes.jsonl and profiler files kept). The user's own file stays."""
    from shardwise import rundir

    out = copy(finished, tmp_path)
    shutil.rmtree(out / "checkpoints")
    old_id = rundir.run_id(str(out))
    (out / "resumes.jsonl").write_text('{"checkpoint": "checkpoints/step_00000002", "step": 2}\n')
    (out / "profile").mkdir()
    (out / "profile" / "step-3-rank0.txt").write_text("the profiler's")
    (out / "my-notes.txt").write_text("the user's")
    p = run_cli("train", *JOB[:-4], "--max-steps", "2", "--output-dir", str(out), "--resume", "auto", "--overwrite",
                timeout=300)
    assert "nothing is replaced" not in p.stdout and "resumed from" not in p.stdout, p.stdout
    assert rundir.run_id(str(out)) not in (None, old_id)
    assert not (out / "resumes.jsonl").exists() and not (out / "profile").exists()
    assert (out / "my-notes.txt").read_text() == "the user's"
    assert json.loads((out / "summary.json").read_text())["steps"] == 2


def test_resume_auto_with_overwrite_never_deletes_checkpoints_it_cannot_resume(finished, tmp_path):
    """Every checkpoint damaged (here their RNG files, the weights intact and exportable): --resume auto finds none,
    and --overwrite replaced the run, deleting them without a word. Refused now, naming them; nothing written."""
    out = copy(finished, tmp_path)
    ckpts = sorted((out / "checkpoints").glob("step_*"))
    assert ckpts
    for c in ckpts:
        f = c / "rng" / "rank0.pt"
        f.write_bytes(b"\0" * f.stat().st_size)  # the size meta.json records: only the read finds it
    before = snapshot(out)
    p = run_cli("train", *JOB[:-4], "--max-steps", "6", "--output-dir", str(out), "--resume", "auto", "--overwrite",
                check=False, timeout=300)
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("shardwise: error")]
    assert p.returncode == 2 and len(errors) == 1, p.stderr[-3000:]
    assert errors[0].startswith(f"shardwise: error: flag --overwrite: --resume auto finds no checkpoint it can resume "
                                f"in {out} ({ckpts[-1].name}: rng/rank0.pt is corrupt"), errors[0]
    assert "--overwrite would delete them" in errors[0]
    assert snapshot(out) == before
