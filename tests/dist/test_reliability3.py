"""Failures a user meets at the edges of a run, through real launched runs: a hung rank named with the command
that resumes, a tampered RNG file refused in shardwise's line alone, a full disk while the final model is written,
and a second Ctrl-C while the stopping checkpoint is written."""

from __future__ import annotations

import json
import os
import pickle
import shutil

import pytest

from tests.dist.shared import COMMON, DDP
from tests.helpers import run_cli

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
    train(out, chat_data, *ONE, "--max-steps", "2", "--save-every", "2", "--no-save-final")
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
