"""A resume that changes the global batch on purpose keeps the schedule as saved, counted in sequences (train/
schedule.py): the run ends where the saved run would have (the end of its epoch, not past it), the learning rate
after each step is the saved run's after as many sequences, the step count follows from the sequences left, and one
line says exactly what changed. The issue's run went on to /375 at a learning rate from another point of the
schedule. One rank in this process, resolved and prepared through the CLI's own code (trainer.py)."""

import json

import pytest

from tests.helpers import chat_records, read_metrics, write_jsonl
from tests.inproc.trainer import train

COMMON = ("--strategy", "single", "--seq-len", "64", "--grad-accum", "2", "--lr", "1e-2", "--warmup-steps", "2",
          "--log-every", "1", "--save-every", "4", "--no-save-final", "--report-to", "none")


def test_another_global_batch_keeps_the_schedule_in_sequences(tmp_path):
    data = write_jsonl(str(tmp_path / "chat.jsonl"), chat_records(64))
    first, second = tmp_path / "first", tmp_path / "second"
    # 64 sequences, 8 a step (micro-batch 4 x 2): 8 steps an epoch; checkpoints at 4 and 8
    train(*COMMON, "--data", data, "--micro-batch-size", "4", "--output-dir", first)
    # resumed at step 4 (32 sequences trained) with micro-batch 2: 4 sequences a step, so 8 steps are left in the epoch
    run = train(*COMMON, "--data", data, "--micro-batch-size", "2", "--output-dir", second,
                "--resume", first / "checkpoints" / "step_00000004")
    lr_first = {r["step"]: r["lr"] for r in read_metrics(str(first))}
    got = read_metrics(str(second))
    assert [r["step"] for r in got] == list(range(5, 13))
    assert json.loads((second / "summary.json").read_text())["steps"] == 12
    # step t of the resumed run (its update t - 1) comes after 32 + 4 (t - 5) sequences: the saved run's
    # update (32 + 4 (t - 5)) / 8; every other one is a whole update of the saved run, logged there as step + 1
    lr = {r["step"]: r["lr"] for r in got}
    for t, saved in ((5, 5), (7, 6), (9, 7), (11, 8)):
        assert lr[t] == pytest.approx(lr_first[saved], rel=1e-12), (t, saved)
    assert lr_first[5] > lr[6] > lr_first[6]  # between two of the saved run's updates
    assert ("shardwise: global batch 8 -> 4 sequences a step: the schedule is kept as saved, in sequences (32 of 64 "
            f"trained): the run ends at step 12 (not 16), 8 steps of 4 left, and the learning rate goes on from "
            f"{lr_first[5]:.3g} where the saved run would be after as many sequences") in run.stdout.splitlines()
    # the checkpoint it writes counts in the saved batch, so a later resume goes on the same way
    meta = json.loads((second / "checkpoints" / "step_00000012" / "meta.json").read_text())
    assert meta["schedule"] == {"batch": 8, "steps": 8, "sequences": 64}
    # and it stopped where the saved run stopped: the whole epoch read, nothing past it
    saved_end = json.loads((first / "checkpoints" / "step_00000008" / "meta.json").read_text())
    assert meta["data_position"] == saved_end["data_position"] == {"epoch": 0, "offset": 64}
