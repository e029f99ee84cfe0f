"""--report-to: TensorBoard, MLflow (a file store in the run directory) and W&B (offline) receive the logged
metrics; a resumed run continues the same MLflow run, and summary.json keeps the whole run's first loss and wall
time across the resume. The Trainer's Reporter on one rank in this process (trainer.py); moved from
tests/e2e/test_trackers.py (which keeps the CLI's refusal of a missing tracker)."""

import glob
import json
import os

import pytest

from tests.helpers import chat_records, read_metrics, write_jsonl
from tests.inproc.trainer import train

ARGS = ("--strategy", "single", "--seq-len", "64", "--micro-batch-size", "2", "--log-every", "1", "--save-every", "2",
        "--no-save-final", "--report-to", "tensorboard,mlflow,wandb")


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    d = tmp_path_factory.mktemp("trackers")
    out, data = d / "run", write_jsonl(str(d / "chat.jsonl"), chat_records(32))
    env = {"WANDB_MODE": "offline", "MLFLOW_TRACKING_URI": "", "WANDB_API_KEY": ""}
    train(*ARGS, "--data", data, "--max-steps", "4", "--output-dir", out, env=env)
    first = json.loads((out / "summary.json").read_text())
    train(*ARGS, "--data", data, "--max-steps", "6", "--output-dir", out, "--resume", "auto", env=env)
    return out, first, json.loads((out / "summary.json").read_text())


def test_every_tracker_gets_the_logged_losses_and_mlflow_continues_after_resume(resumed):
    out, _, _ = resumed
    want = [(r["step"], r["loss"]) for r in read_metrics(str(out))]
    assert [s for s, _ in want] == [1, 2, 3, 4, 5, 6]
    # MLflow: one run (the resume continued it), its loss series as logged
    runs = glob.glob(str(out / "mlruns" / "*" / "*" / "metrics" / "train" / "loss"))
    assert len(runs) == 1, runs
    got = [(int(ln.split()[2]), float(ln.split()[1])) for ln in open(runs[0]) if ln.strip()]
    assert got == want
    # TensorBoard events, read back with tensorboard's own reader
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(out / "tensorboard"))
    tb.Reload()
    assert sorted((e.step, pytest.approx(e.value, rel=1e-6)) for e in tb.Scalars("train/loss")) == want
    # W&B offline: a run file per launch, nothing sent
    files = glob.glob(str(out / "wandb" / "offline-run-*" / "*.wandb"))
    assert len(files) == 2 and all(os.path.getsize(f) > 0 for f in files)


def test_summary_keeps_the_first_loss_and_wall_time_across_a_resume(resumed):
    out, first, final = resumed
    losses = [r["loss"] for r in read_metrics(str(out))]
    assert final["first_loss"] == first["first_loss"] == losses[0]
    assert final["final_loss"] == final["final_loss_window_mean"] == losses[-1]
    assert final["wall_time_s"] > final["wall_time_this_launch_s"]
    # the earlier part is the first launch's time up to its step-4 checkpoint: more than nothing, at most the whole
    # first launch (its final save and exit come after the checkpoint, so the total may be below the first's)
    earlier = final["wall_time_s"] - final["wall_time_this_launch_s"]
    assert 0 < earlier <= first["wall_time_s"]
