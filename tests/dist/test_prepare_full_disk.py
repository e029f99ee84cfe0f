"""A full disk while the launcher writes the prepared data into the run directory (.prep) is one line naming the
place and the free space, with nothing trained and no traceback."""

from __future__ import annotations

import subprocess

import pytest

from tests.helpers import chat_records, run_cli, write_jsonl


@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root); the full-disk path is not exercised")
    yield mnt
    subprocess.run(["umount", str(mnt)])


def test_a_full_disk_while_preparing_is_one_line(tmp_path, small_disk):
    data = write_jsonl(str(tmp_path / "chat.jsonl"), chat_records(64) * 60)  # a few MB of tokenized tensors
    out = small_disk / "run"
    p = run_cli("train", "--model", "tiny", "--data", data, "--output-dir", str(out), "--strategy", "single",
                "--nproc-per-node", "1", "--seq-len", "128", "--max-steps", "2", "--no-data-cache", check=False)
    assert p.returncode == 2, p.stdout + p.stderr
    line = p.stderr.strip().splitlines()[-1]
    assert line.startswith(f"shardwise: error: disk full while writing the prepared data in {out}/.prep/node0 ("), line
    assert "MiB free): free space there or choose another --output-dir; nothing was trained" in line, line
    assert "Traceback" not in p.stderr
    assert not (out / "metrics.jsonl").exists()
