"""Non-finite steps on one rank (SHARDWISE_FAULT=nan@3 poisons step 3's loss): --on-nan skip counts the skipped
update and keeps the weights finite, --on-nan stop stops before the next update with the batch's records and the
last good checkpoint named. The loop reads each step's non-finite flag one step late (after the next step's
forward/backward), so the window runs log every 4 steps to exercise that path (log_every 1 reads the flag first).
The real Trainer in this process (trainer.py); moved from tests/dist/test_nonfinite_window.py and
test_reliability.py, which ran them through `shardwise train` subprocesses."""

import math
import os

import torch

from shardwise.errors import ShardwiseError
from tests.dist.shared import COMMON
from tests.inproc.trainer import train

NAN3 = {"SHARDWISE_FAULT": "nan@3"}


def _train(out, data, *extra, log_every="4", check=True):
    return train(*COMMON, "--log-every", log_every, "--data", data, "--output-dir", out, "--strategy", "single",
                 "--nproc-per-node", "1", "--micro-batch-size", "2", "--max-steps", "6", "--no-save-final", *extra,
                 env=NAN3, check=check)


def assert_stopped(run) -> str:
    """The run stopped with a ShardwiseError (exit code 2, the one line the CLI prints); its message."""
    assert isinstance(run.error, ShardwiseError) and run.error.exit_code == 2, (run.error, run.stdout)
    line = str(run.error)
    assert "\n" not in line
    return line


def test_a_skipped_step_inside_a_window_stays_out_of_its_mean_and_stop_acts_before_the_next_update(chat_data,
                                                                                                   tmp_path):
    every = _train(tmp_path / "every", chat_data, "--on-nan", "skip", log_every="1").metrics
    p = _train(tmp_path / "window", chat_data, "--on-nan", "skip")
    window = p.metrics
    assert "step 3: non-finite" in p.stdout
    assert [r["step"] for r in window] == [4, 6] and window[0]["skipped_nonfinite_steps"] == 1
    # the step-4 record is the mean of steps 1, 2 and 4 as logged one by one (3's update was skipped in both)
    per_step = {r["step"]: r["loss"] for r in every}
    assert math.isnan(per_step[3])
    expect = (per_step[1] + per_step[2] + per_step[4]) / 3
    assert abs(window[0]["loss"] - expect) <= 1e-6 * abs(expect)
    assert abs(window[1]["loss"] - (per_step[5] + per_step[6]) / 2) <= 1e-6 * abs(per_step[6])

    stop = _train(tmp_path / "stop", chat_data, "--save-every", "2", check=False)
    line = assert_stopped(stop)
    assert "non-finite loss or gradients at step 3" in line and "step_00000002" in line
    ckpts = sorted(os.listdir(tmp_path / "stop" / "checkpoints"))
    assert ckpts and ckpts[-1] == "step_00000002"  # read during step 4, before its update and its checkpoint


def test_non_finite_loss_skip_or_stop(chat_data, tmp_path):
    """Every step logged, 2 micro-batches a step (test_reliability.py's flags)."""
    one = ("--micro-batch-size", "2", "--strategy", "single", "--nproc-per-node", "1", "--grad-accum", "2",
           "--max-steps", "5", "--no-save-final")
    skip = train(*COMMON, "--data", chat_data, "--output-dir", tmp_path / "skip", *one, "--on-nan", "skip", env=NAN3)
    assert skip.summary_file()["skipped_nonfinite_steps"] == 1 and "step 3: non-finite" in skip.stdout
    m = skip.metrics
    assert m[2]["skipped_nonfinite_steps"] == 1  # step 3's loss is logged as it was (NaN) ...
    assert all(torch.isfinite(torch.tensor([r["loss"] for r in m[3:]])))  # ... and the weights stayed finite
    stop = train(*COMMON, "--data", chat_data, "--output-dir", tmp_path / "stop", *one, "--save-every", "2", env=NAN3,
                 check=False)
    line = assert_stopped(stop)
    assert "non-finite loss or gradients at step 3" in line and "chat.jsonl:" in line
    assert "last good checkpoint: " in line and "step_00000002" in line
