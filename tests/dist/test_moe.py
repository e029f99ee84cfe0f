"""Mixture-of-experts models (models/moe.py, docs/moe.md) through the real CLI on 2 gloo ranks.

A tiny random-init Mixtral (4 experts, top-2; transformers' own modelling code) with the router's
load-balancing loss switched on in its config trains under fsdp (experts sharded with their
decoder block) and zero3 (each decoder block a DeepSpeed leaf, fetched whole, its sparse MoE block with it) exactly
like one process on the same global batch: loss and pre-clip gradient norm step for step, in fp32. A
router aux loss added on one side only, scaled per rank instead of per global batch, or an
expert's gradient lost on a rank would move the norms.
"""

from __future__ import annotations

import pytest

from shardwise.models.tiny import write_tiny_moe
from tests.dist.shared import SINGLE, TWO, Run, train_args
from tests.dist.test_parity import assert_same_run
from tests.helpers import ConcurrentRuns
from tests.inproc.trainer import train

# (DeepSpeed's per-submodule fetch, `--deepspeed-fetch module`, keeps each sparse MoE block a leaf of its own: not
# run here, a 2-rank launch of suite time for a path that was the default until 2026-12-01)
CASES = {"single": SINGLE, "fsdp": ("--strategy", "fsdp", *TWO), "zero3": ("--strategy", "zero3", *TWO)}


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory, chat_data) -> dict[str, Run]:
    model = tmp_path_factory.mktemp("mixtral")
    write_tiny_moe(str(model), 0, "mixtral", output_router_logits=True, router_aux_loss_coef=0.02)
    batch, outs, args = ConcurrentRuns(), {}, {}
    for name, flags in CASES.items():
        outs[name] = tmp_path_factory.mktemp(f"moe-{name}")
        args[name] = train_args(outs[name], chat_data, "--model", str(model), *flags, "--no-save-final")
    for name in ("fsdp", "zero3"):
        batch.add(name, *args[name])
    # the one-process reference trains in this process (tests/inproc/trainer.py); its 2-rank partners stay real
    runs = {"single": train(*args["single"][1:])}
    for name in ("fsdp", "zero3"):
        runs[name] = Run(outs[name], batch.get(name).stdout, batch.get(name).stderr)
    return runs


@pytest.mark.parametrize("name", ["fsdp", "zero3"])
def test_tiny_mixtral_with_router_loss_trains_like_one_process(moe_runs, name):
    assert_same_run(moe_runs[name].metrics, moe_runs["single"].metrics)


def test_zero3_fetches_each_sparse_moe_block_whole(moe_runs):
    """Whole decoder blocks by default, each sparse MoE block inside its decoder block."""
    assert "blocks fetched whole (MixtralDecoderLayer)" in moe_runs["zero3"].stdout + moe_runs["zero3"].stderr
