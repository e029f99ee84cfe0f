"""Failures a user meets at the edges of a run, through real launched runs: a hung rank named with the command
that resumes, a tampered RNG file refused in shardwise's line alone, a full disk while the final model is written,
and a second Ctrl-C while the stopping checkpoint is written."""

from __future__ import annotations

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
from tests.helpers import run_cli
from tests.inproc.trainer import train as train_here

pytestmark = pytest.mark.timeout(600)

ONE = ("--strategy", "single", "--nproc-per-node", "1", "--micro-batch-size", "2")


def train(out, data, *extra, env=None, check=True):
    return run_cli("train", *COMMON, "--data", data, "--output-dir", str(out), *extra, env=env, check=check)


def shardwise_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.strip()]


def test_a_hung_rank_is_named_and_the_resume_command_given(chat_data, tmp_path):
    """Rank 0 stops before step 5's first collective (as a process stuck in native code): rank 1's collective times
    out. The line used to say only "another rank is hung or dead", with no checkpoint although one was saved at step
    4; it names rank 0 and gives the newest checkpoint and the command that resumes from it."""
    out = tmp_path / "hang"
    p = train(out, chat_data, *DDP, "--collective-timeout", "4", "--max-steps", "8", "--save-every", "4",
              "--no-save-final", env={"SHARDWISE_FAULT": "hang@5:rank0"}, check=False)
    assert p.returncode == 2, p.stdout + p.stderr
    line = p.stderr.strip().splitlines()[-1]
    assert "rank 1: a collective did not complete within --collective-timeout 4s during step 5" in line, line
    assert "rank 0 never reached it (hung, or dead" in line, line
    ck = out / "checkpoints" / "step_00000004"
    assert line.endswith(f"; newest checkpoint: {ck}; resume with: shardwise train {out}/config.yaml --output-dir "
                         f"{out} --resume auto"), line
    p = run_cli(*line.split("resume with: shardwise ", 1)[1].split(), "--no-save-final")  # the command, as given
    assert f"resumed from {ck} at step 4" in p.stdout, p.stdout


class _RunsCode:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ.get('MARKER', '/nonexistent/x')}",))


def test_a_tampered_rng_file_is_refused_in_shardwises_line_alone(chat_data, tmp_path):
    """An rng/rank0.pt replaced by a pickle made to run code (its size written into meta.json, as an attacker
    would): torch printed its two-line warning about the pickle's protocol before shardwise's line refusing it."""
    out = tmp_path / "run"
    # the checkpoint is made in this process (tests/inproc/trainer.py); the resume that must refuse it is launched
    train_here(*COMMON, "--data", chat_data, "--output-dir", out, *ONE, "--max-steps", "2", "--save-every", "2",
               "--no-save-final")
    ck = out / "checkpoints" / "step_00000002"
    marker = tmp_path / "CODE_RAN"
    os.environ["MARKER"] = str(marker)
    try:
        (ck / "rng" / "rank0.pt").write_bytes(pickle.dumps({"cpu": _RunsCode()}, protocol=4))
    finally:
        del os.environ["MARKER"]
    meta = json.loads((ck / "meta.json").read_text())
    meta["files"]["rng/rank0.pt"] = os.path.getsize(ck / "rng" / "rank0.pt")
    (ck / "meta.json").write_text(json.dumps(meta))
    p = train(out, chat_data, *ONE, "--max-steps", "4", "--resume", str(ck), check=False)
    assert p.returncode == 2, p.stdout + p.stderr
    lines = shardwise_lines(p.stderr)
    assert len(lines) == 1 and lines[0].startswith("shardwise: error: "), p.stderr
    assert f"checkpoint {ck}" in lines[0] and "rng/rank0.pt is corrupt" in lines[0], lines[0]
    assert not marker.exists()
    shutil.rmtree(out)


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of a given size (MiB), unmounted afterwards; skipped where mounting is not allowed (needs root), as
    tests/dist/test_reliability.py's checkpoint case."""
    mounted = []

    def mount(mib: int):
        mnt = tmp_path / f"disk{len(mounted)}"
        mnt.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(mnt)],
                          capture_output=True).returncode:
            pytest.skip("cannot mount a small tmpfs here (needs root); the disk-full path is not exercised")
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in mounted:
        subprocess.run(["umount", str(mnt)])


@pytest.mark.parametrize("ranks", [ONE, DDP], ids=["one-process", "ddp-2-ranks"])
def test_a_full_disk_while_writing_final_keeps_the_trained_state_in_a_checkpoint(chat_data, tmp_path, small_disk,
                                                                                  ranks):
    """The step-4 checkpoint (11 MiB) fits a 13 MiB disk, final/ (3.4 MiB more) does not. final/ used to end in a
    traceback (on two ranks, rank 1 then waited in a barrier for rank 0); now every rank learns that rank 0 could
    not write it, and one line names the checkpoint holding the trained state and the commands that get the model
    back; the resume it gives writes final/ without training again."""
    out = small_disk(13) / "run"
    p = train(out, chat_data, *ranks, "--max-steps", "4", "--save-every", "4", "--keep-checkpoints", "1", check=False)
    assert p.returncode == 2, p.stdout + p.stderr
    lines = shardwise_lines(p.stderr)
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    ck = out / "checkpoints" / "step_00000004"
    assert lines[0].startswith(f"shardwise: error: disk full while writing the final model to {out}/final ("), lines
    assert lines[0].endswith(f"; the trained state (step 4) is kept in checkpoint {ck}: free space, then `shardwise "
                             f"train {out}/config.yaml --output-dir {out} --resume auto` writes final/ without training "
                             f"again (or `shardwise export {ck} --out DIR` writes the model elsewhere)"), lines[0]
    assert not (out / "final").exists() and not [n for n in os.listdir(out) if n.startswith(".final-")]
    moved = tmp_path / "moved"  # "free space": the run moves to a disk with room, and resumes there
    shutil.copytree(out, moved, symlinks=True)
    p = train(moved, chat_data, *ranks, "--max-steps", "4", "--save-every", "4", "--resume", "auto")
    assert (moved / "final" / "model.safetensors").is_file() and "step 5" not in p.stdout


def test_a_full_disk_while_writing_final_without_checkpoints_says_what_is_lost(chat_data, small_disk):
    """No --save-every and no room for final/ nor for a checkpoint: one line saying both could not be written and
    what to do, not a traceback; nothing half-written is left."""
    out = small_disk(2) / "run"
    p = train(out, chat_data, *ONE, "--max-steps", "2", check=False)
    assert p.returncode == 2, p.stdout + p.stderr
    lines = shardwise_lines(p.stderr)
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert lines[0].startswith(f"shardwise: error: disk full while writing the final model to {out}/final ("), lines
    assert ("; no checkpoint of the trained state could be written either (disk full while saving checkpoint "
            f"{out}/checkpoints/step_00000002 (") in lines[0], lines[0]
    assert lines[0].endswith(": the steps trained since the start are lost; free space, then train again (--save-every "
                             "N keeps checkpoints along the way)"), lines[0]
    assert not (out / "final").exists() and not [n for n in os.listdir(out) if n.startswith(".final-")]
    assert not (out / "checkpoints").exists() or os.listdir(out / "checkpoints") == []


FURTHER = "saving a checkpoint before stopping; a further Ctrl-C or SIGTERM is ignored until it is written"


def _start(out, data, *extra, env=None) -> subprocess.Popen:
    """A launched run that trains for long (no steps limit worth waiting for), in a session of its own as a
    terminal's foreground job would be; returns once it has logged 3 steps."""
    p = subprocess.Popen([sys.executable, "-m", "shardwise", "train", *COMMON, "--data", data, "--output-dir",
                          str(out), "--max-steps", "100000", "--no-save-final", *extra],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                         env={**os.environ, **(env or {})})
    metrics, t0 = out / "metrics.jsonl", time.monotonic()
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
        if p.poll() is not None or time.monotonic() - t0 > 300:
            p.kill()
            raise AssertionError("the run did not get to step 3:\n" + "".join(p.communicate()))
        time.sleep(0.05)
    return p


def _stopped(p: subprocess.Popen, out) -> tuple[str, str]:
    stdout, stderr = p.communicate(timeout=180)
    ck = sorted(os.listdir(out / "checkpoints")) if (out / "checkpoints").is_dir() else []
    assert len(ck) == 1, (ck, stdout, stderr)
    assert f"newest checkpoint: {out / 'checkpoints' / ck[0]}; resume with: " in stderr, stderr
    return stdout, stderr


def test_ctrl_c_three_times_in_one_process_still_saves_and_says_further_ones_are_ignored(chat_data, tmp_path):
    """One process (the launcher trains itself): three Ctrl-C 50 ms apart. The first stops the run at the next step
    with a checkpoint; the others are ignored, said once, not silently."""
    out = tmp_path / "one"
    p = _start(out, chat_data, *ONE)
    for _ in range(3):
        os.killpg(p.pid, signal.SIGINT)
        time.sleep(0.05)
    _, stderr = _stopped(p, out)
    assert stderr.count(FURTHER) == 1, stderr
    assert p.returncode in (128 + signal.SIGINT, 128 + signal.SIGTERM), (p.returncode, stderr)


def test_further_signals_to_the_workers_while_they_save_are_ignored_and_said(chat_data, tmp_path):
    """Two ranks under the elastic agent: Ctrl-C to the launcher, then SIGTERM and SIGINT straight to each worker (as
    a scheduler's `scancel` signals every process of a job step). Every rank still agrees on a step and saves; a rank
    given a further signal says once that it is ignored."""
    from tests.helpers import worker_processes

    out = tmp_path / "two"
    p = _start(out, chat_data, *DDP)
    workers = worker_processes(p.pid)
    assert len(workers) == 2, workers
    os.killpg(p.pid, signal.SIGINT)
    time.sleep(0.05)
    for w in workers:
        for sig in (signal.SIGTERM, signal.SIGINT):
            w.send_signal(sig)
    stdout, stderr = _stopped(p, out)
    said = stdout + stderr
    assert said.count(FURTHER) <= 2 and all(said.count(f"rank {r}: {FURTHER}") <= 1 for r in (0, 1)), said
    assert FURTHER in said, said
    assert p.returncode == 128 + signal.SIGINT, (p.returncode, stderr)


def test_ctrl_c_three_times_to_the_launcher_of_two_ranks_still_saves(chat_data, tmp_path):
    """Three Ctrl-C 50 ms apart to the launcher of two ranks: the agent's shutdown (it waits for the workers'
    checkpoint) was interrupted by the third, the launcher exited, its workers died with it, and the run said
    "newest checkpoint: none" after 40+ steps."""
    out = tmp_path / "agent"
    p = _start(out, chat_data, *DDP)
    for _ in range(3):
        os.killpg(p.pid, signal.SIGINT)
        time.sleep(0.05)
    _, stderr = _stopped(p, out)
    assert stderr.count(FURTHER) == 1, stderr
    assert p.returncode == 128 + signal.SIGINT, (p.returncode, stderr)
