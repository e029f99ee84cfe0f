"""A non-finite step inside a log window: the loop reads each step's non-finite flag one step late (after the
next step's forward/backward), so these runs log every 4 steps to exercise that path (the session's other runs
log every step, where the log step reads the flag first). One process, the CLI."""

import math
import os

from tests.dist.shared import COMMON
from tests.helpers import read_metrics, run_cli

NAN3 = {"SHARDWISE_FAULT": "nan@3"}


def _train(out, data, *extra, log_every="4", check=True):
    return run_cli("train", *COMMON, "--log-every", log_every, "--data", data, "--output-dir", str(out), "--strategy",
                   "single", "--nproc-per-node", "1", "--micro-batch-size", "2", "--max-steps", "6",
                   "--no-save-final", *extra, env=NAN3, check=check)


def test_a_skipped_step_inside_a_window_stays_out_of_its_mean_and_stop_acts_before_the_next_update(chat_data,
                                                                                                   tmp_path):
    _train(tmp_path / "every", chat_data, "--on-nan", "skip", log_every="1")
    p = _train(tmp_path / "window", chat_data, "--on-nan", "skip")
    every, window = read_metrics(str(tmp_path / "every")), read_metrics(str(tmp_path / "window"))
    assert "step 3: non-finite" in p.stdout
    assert [r["step"] for r in window] == [4, 6] and window[0]["skipped_nonfinite_steps"] == 1
    # the step-4 record is the mean of steps 1, 2 and 4 as logged one by one (3's update was skipped in both)
    per_step = {r["step"]: r["loss"] for r in every}
    assert math.isnan(per_step[3])
    expect = (per_step[1] + per_step[2] + per_step[4]) / 3
    assert abs(window[0]["loss"] - expect) <= 1e-6 * abs(expect)
    assert abs(window[1]["loss"] - (per_step[5] + per_step[6]) / 2) <= 1e-6 * abs(per_step[6])

    p = _train(tmp_path / "stop", chat_data, "--save-every", "2", check=False)
    assert p.returncode == 2
    line = p.stderr.strip().splitlines()[-1]
    assert "non-finite loss or gradients at step 3" in line and "step_00000002" in line
    ckpts = sorted(os.listdir(tmp_path / "stop" / "checkpoints"))
    assert ckpts and ckpts[-1] == "step_00000002"  # read during step 4, before its update and its checkpoint
