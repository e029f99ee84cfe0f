"""Preference training (task dpo) trains identically under every strategy: on 2 gloo ranks, ddp, fsdp and zero3 give
the same per-step loss, pre-clip gradient norm, rewards and reward margin as one process on the same global batch of
pairs (fp32, tests/dist/shared.py's RTOL), the reference model being one copy (ddp), FSDP-sharded (fsdp) or ZeRO-3
partitioned (zero3). --precompute-ref gives the same run from a table computed before training, and LoRA's reference
(the policy with its adapters off) the same run on one process and on 2 zero3 or ddp ranks. The one-process references
train in this process (tests/inproc/trainer.py); their 2-rank partners launch through the real CLI."""

import json

import pytest
import torch

from shardwise.data.demo import demo_preference_records
from tests.dist.shared import LORA, RTOL, SINGLE, TWO, train_args
from tests.helpers import ConcurrentRuns
from tests.inproc.trainer import train

STEPS = 6
DPO = ("--task", "dpo", "--max-steps", str(STEPS), "--no-save-final", "--report-to", "none")
KEYS = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")
CASES = {
    "single": SINGLE,
    "ddp": ("--strategy", "ddp", *TWO),
    "fsdp": ("--strategy", "fsdp", *TWO),
    "zero3": ("--strategy", "zero3", *TWO),
    "fsdp-precompute": ("--strategy", "fsdp", *TWO, "--precompute-ref"),
    "lora-single": (*SINGLE, *LORA),
    "lora-zero3": ("--strategy", "zero3", *TWO, *LORA),
    "lora-ddp": ("--strategy", "ddp", *TWO, *LORA),
    # one micro-batch a step: the unit's first backward reduces at once (accumulating, it did not fail)
    "lora-fsdp-bf16": ("--strategy", "fsdp", "--nproc-per-node", "2", "--micro-batch-size", "2", "--grad-accum", "1",
                       *LORA, "--mixed-precision", "bf16"),
}
IN_PROCESS = ("single", "lora-single")  # one rank: the launcher's start-up would buy nothing


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("dpo-data")
    data = d / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in demo_preference_records(64)))
    batch, outs, done = ConcurrentRuns(), {}, {}
    for name, extra in CASES.items():
        outs[name] = tmp_path_factory.mktemp(name)
        if name not in IN_PROCESS:
            batch.add(name, *train_args(outs[name], data, *extra, *DPO))
    for name in IN_PROCESS:
        done[name] = train(*train_args(outs[name], data, *CASES[name], *DPO)[1:])

    def get(name):
        if name in done:  # a failed in-process run raised in train() above, with its output
            return done[name].metrics, done[name].stdout
        r = batch.get(name)
        assert r.returncode == 0, r.stderr[-3000:]
        return [json.loads(line) for line in (outs[name] / "metrics.jsonl").read_text().splitlines()], r.stdout

    return get


def assert_same(got: list[dict], ref: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in ref] == list(range(1, STEPS + 1))
    for key in KEYS:
        torch.testing.assert_close(torch.tensor([r[key] for r in got]), torch.tensor([r[key] for r in ref]),
                                   rtol=RTOL, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")


def test_the_reference_is_sharp(runs):
    """The runs move: the margin leaves 0 (the policy starts as the reference) and the losses change."""
    ref, _ = runs("single")
    assert ref[0]["rewards/margins"] == pytest.approx(0, abs=1e-6)
    assert max(abs(r["rewards/margins"]) for r in ref) > 1e3 * RTOL
    assert abs(ref[0]["loss"] - ref[-1]["loss"]) > 1e2 * RTOL


@pytest.mark.parametrize("name", ["ddp", "fsdp", "zero3", "fsdp-precompute"])
def test_two_ranks_train_as_one_process(runs, name):
    got, out = runs(name)
    assert_same(got, runs("single")[0])
    layout = {"ddp": "one copy per rank", "fsdp": "sharded like the policy", "zero3": "partitioned like the policy",
              "fsdp-precompute": "sharded like the policy"}[name]
    assert f"reference: the starting model, {layout}" in out
    if name == "fsdp-precompute":
        assert "reference log-probabilities of 128 rows precomputed" in out


@pytest.mark.parametrize("name", ["lora-zero3", "lora-ddp"])
def test_lora_reference_is_the_base_with_adapters_off(runs, name):
    got, out = runs(name)
    assert "reference: the base model with the adapters off" in out
    assert_same(got, runs("lora-single")[0])
    assert max(abs(r["rewards/margins"]) for r in got) > 1e3 * RTOL


def test_lora_under_fsdp_in_bf16_trains_from_its_reference(runs):
    """FSDP2 fixes a unit's gradient dtype at its first forward, which under LoRA is the reference's (the adapters
    off): with peft's disable_adapter() the adapters required no gradient there, and the step failed on the
    adapters' bf16 gradients meeting their fp32 parameters. bf16 rounds differently on one and two ranks, so this
    run is checked on its own: it trains, from a first margin of exactly 0 (zero-initialised adapters)."""
    got, out = runs("lora-fsdp-bf16")
    assert "reference: the base model with the adapters off" in out
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert got[0]["rewards/margins"] == 0.0 and got[0]["loss"] == pytest.approx(0.6931472, abs=1e-6)
    assert max(abs(r["rewards/margins"]) for r in got) > 1e3 * RTOL
