"""Progress as a user sees it: on a terminal, the tokenizing count and rate while the data is prepared and a bar
with the rate and ETA on the step lines; in a pipe or a log file, plain step lines and no terminal control codes.
The terminal is a real pseudo-terminal (the `pty` module) that reports no size, as `script` and some CI consoles do
(a size of 0 made the bar draw nothing); tests/unit keeps the 10-second lines of a non-terminal."""

from __future__ import annotations

import io
import os
import subprocess
import sys

from shardwise.launch.common import Progress
from tests.helpers import run_cli

ARGS = ("train", "--strategy", "single", "--nproc-per-node", "1", "--max-steps", "6", "--log-every", "1",
        "--no-save-final", "--no-data-cache")


def run_in_pty(*args: str, timeout: float = 300) -> str:
    """`python -m shardwise ARGS` with stdin, stdout and stderr on a pseudo-terminal; what it wrote there."""
    import pty

    main, sub = pty.openpty()
    p = subprocess.Popen([sys.executable, "-m", "shardwise", *args], stdin=sub, stdout=sub, stderr=sub,
                         close_fds=True)
    os.close(sub)
    out = b""
    while True:
        try:
            chunk = os.read(main, 65536)
        except OSError:  # EIO: every holder of the terminal's other end is gone
            break
        if not chunk:
            break
        out += chunk
    os.close(main)
    assert p.wait(timeout=timeout) == 0, out.decode(errors="replace")[-4000:]
    return out.decode(errors="replace")


def test_a_terminal_gets_tokenizing_progress_and_a_step_bar_a_pipe_plain_lines(tmp_path):
    tty = run_in_pty(*ARGS, "--output-dir", str(tmp_path / "tty"))
    # the tokenizing count, redrawn in place, then erased before the data line
    assert "\rshardwise: tokenizing: 256/3,000 records (9%), " in tty, tty[-3000:]
    assert "\r\x1b[Kshardwise: data: 3000 records" in tty
    # the bar: 6 of 6 steps with the rate and its time left, the logged values beside it; no plain step line
    assert "| 6/6 [00:" in tty and "step/s, loss " in tty, tty[-3000:]
    assert "step 1/6 |" not in tty
    piped = run_cli(*ARGS, "--output-dir", str(tmp_path / "pipe"))
    lines = piped.stdout.splitlines()
    assert [ln.split(" | ")[0] for ln in lines if ln.startswith("step ")] == [f"step {i}/6" for i in range(1, 7)]
    assert "\r" not in piped.stdout + piped.stderr and "\x1b[" not in piped.stdout + piped.stderr


def test_progress_off_a_terminal_is_a_line_every_ten_seconds():
    now = [100.0]
    out = io.StringIO()
    p = Progress("tokenizing", 1000, "records", stream=out, clock=lambda: now[0])
    for done, t in ((100, 101.0), (200, 109.9), (400, 110.0), (500, 115.0), (800, 120.5)):
        now[0] = t
        p(done)
    p.close()
    assert out.getvalue().splitlines() == [
        "shardwise: tokenizing: 400/1,000 records (40%), 40 records/s, ETA 0:15",
        "shardwise: tokenizing: 800/1,000 records (80%), 39 records/s, ETA 0:05"]
