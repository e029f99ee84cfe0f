"""--keep-checkpoints 1 --keep-best keeps exactly one checkpoint when the best is the newest: the previous best,
kept while it was the best, goes once best.json names the checkpoint just saved (it stayed as a second one). One
rank in this process (trainer.py); tests/dist/test_evaluate.py keeps a best that is not the newest beside it."""

import json

from tests.helpers import chat_records, read_metrics, write_jsonl
from tests.inproc.trainer import train


def test_one_checkpoint_kept_when_the_best_is_the_newest(tmp_path):
    data = write_jsonl(str(tmp_path / "chat.jsonl"), chat_records(48))
    out = tmp_path / "run"
    # a small steady learning rate: the validation loss falls at every evaluation, so each save is the new best
    train("--strategy", "single", "--data", data, "--seq-len", "64", "--micro-batch-size", "4", "--max-steps", "6",
          "--lr", "3e-3", "--val-split", "0.25", "--eval-every", "2", "--save-every", "2", "--keep-checkpoints", "1",
          "--keep-best", "--no-save-final", "--output-dir", out)
    evals = [(r["step"], r["val_loss"]) for r in read_metrics(str(out)) if "val_loss" in r]
    assert [s for s, _ in evals] == [2, 4, 6]
    assert all(b[1] < a[1] for a, b in zip(evals, evals[1:])), f"the premise: each evaluation the best ({evals})"
    kept = sorted(d.name for d in (out / "checkpoints").iterdir() if d.is_dir())
    assert kept == ["step_00000006"]
    best = json.loads((out / "checkpoints" / "best.json").read_text())
    assert best["step"] == 6 and best["checkpoint"].endswith("step_00000006")
