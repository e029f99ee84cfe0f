"""task dpo on one rank in this process (tests/inproc/trainer.py): the reward margin grows on the built-in synthetic
preference set with the tiny model, and a DPO run resumes, exports and chats as an SFT run does."""

import json

import pytest
import torch

from tests.helpers import read_metrics
from tests.inproc.trainer import train

ARGS = ("--strategy", "single", "--task", "dpo", "--data", "demo", "--seq-len", "48", "--micro-batch-size", "8",
        "--lr", "2e-3", "--warmup-steps", "2", "--log-every", "1", "--report-to", "tensorboard", "--mixed-precision", "no")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("dpo") / "run"
    first = train(*ARGS, "--max-steps", "24", "--save-every", "12", "--output-dir", out)
    resumed = train(*ARGS, "--max-steps", "30", "--output-dir", out, "--resume", "auto")
    return out, first, resumed


def test_the_reward_margin_grows(run):
    out, _, _ = run
    recs = read_metrics(str(out))
    assert recs[0]["rewards/margins"] == pytest.approx(0, abs=1e-6)  # the policy starts as its reference
    assert recs[0]["loss"] == pytest.approx(0.6931, abs=1e-3)  # -log sigmoid(0)
    late = recs[-8:]
    assert sum(r["rewards/margins"] for r in late) / len(late) > 0.1
    assert sum(r["rewards/accuracies"] for r in late) / len(late) > 0.6
    assert sum(r["loss"] for r in late) / len(late) < 0.68
    # the trackers get the rewards as logged (TensorBoard, read back with its own reader)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(out / "tensorboard"))
    tb.Reload()
    for key in ("rewards/margins", "rewards/accuracies", "rewards/chosen", "rewards/rejected"):
        got = sorted((e.step, e.value) for e in tb.Scalars(f"train/{key}"))
        assert got == [(r["step"], pytest.approx(r[key], rel=1e-6, abs=1e-7)) for r in recs]


def test_a_dpo_run_resumes_where_it_stopped(run):
    out, first, resumed = run
    assert "resumed from" in resumed.stdout and "at step 24" in resumed.stdout
    assert "| margin " in first.stdout and "| acc " in first.stdout
    steps = [r["step"] for r in read_metrics(str(out))]
    assert steps == list(range(1, 31))
    assert resumed.summary["steps"] == 30 and resumed.summary["first_loss"] == first.summary["first_loss"]


def test_a_dpo_run_exports_and_chats(run, tmp_path):
    from shardwise import chat
    from shardwise.export import export

    out, _, _ = run
    exported = export(str(out / "checkpoints" / "step_00000012"), str(tmp_path / "hf"))
    final = out / "final"
    for d in (exported, str(final)):
        model, tok = chat.load(d, None, torch.device("cpu"))
        text = chat.answer(model, tok, [{"role": "user", "content": "Uppercase: apple"}], 8)
        assert isinstance(text, str)
    assert json.loads((out / "summary.json").read_text())["final_model"] == str(final)


def test_a_reference_that_is_not_a_model_or_scores_other_tokens_is_one_line(tmp_path):
    import shutil

    from shardwise.models.tiny import tiny_dir

    args = (*ARGS, "--max-steps", "1", "--output-dir", tmp_path / "run")
    missing = train(*args, "--ref-model", tmp_path / "nowhere", check=False)
    assert f"flag --ref-model {tmp_path / 'nowhere'}: no such directory" in str(missing.error)
    other = shutil.copytree(tiny_dir(0), tmp_path / "other")
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "vocab_size": cfg["vocab_size"] * 2}))
    run = train(*args, "--ref-model", other, check=False)
    assert "the reference model's vocab_size" in str(run.error) and "is not the policy's" in str(run.error)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("loss", ["ipo", "simpo", "orpo"])
def test_every_loss_type_trains_and_logs_its_rewards(tmp_path, loss):
    """IPO starts at (0 - 1/(2 beta))^2 (the policy is its reference); SimPO and ORPO need no reference and report
    beta x the mean token log-probability as the rewards (negative); every loss moves."""
    run = train(*ARGS, "--loss-type", loss, "--max-steps", "4", "--no-save-final", "--output-dir", tmp_path / loss)
    recs = read_metrics(str(tmp_path / loss))
    assert len(recs) == 4 and all(r["loss"] == r["loss"] for r in recs)
    if loss == "ipo":
        assert recs[0]["loss"] == pytest.approx((1 / (2 * 0.1)) ** 2, rel=1e-6)
        assert "reference: the starting model" in run.stdout
    else:
        assert "reference: none (reference-free)" in run.stdout
        assert all(r["rewards/chosen"] < 0 and r["rewards/rejected"] < 0 for r in recs)
    assert recs[0]["loss"] != recs[-1]["loss"]


def test_under_bf16_autocast_the_reference_starts_equal_to_the_policy(tmp_path):
    """The reference copy computes what the policy computes (its storage dtype under autocast): the first step's
    log-ratios are 0, so the margin is 0 and the loss ln 2 (a bf16 copy beside fp32 weights would not be)."""
    args = [a for a in ARGS if a not in ("--mixed-precision", "no")]
    train(*args, "--mixed-precision", "bf16", "--max-steps", "1", "--no-save-final", "--output-dir", tmp_path / "r")
    (rec,) = read_metrics(str(tmp_path / "r"))
    assert rec["rewards/margins"] == 0.0 and rec["rewards/chosen"] == 0.0
    assert rec["loss"] == pytest.approx(0.693147, abs=1e-6)
