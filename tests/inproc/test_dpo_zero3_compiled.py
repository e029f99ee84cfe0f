"""task dpo under ZeRO-3 with compiled blocks in bf16 (the CUDA defaults, here on one CPU rank in this process:
tests/inproc/trainer.py): the frozen reference, a second DeepSpeed engine, starts equal to the policy, so the first
step's reward margin is exactly 0 and the loss ln 2. The reference fetches the policy's units (each decoder block
a DeepSpeed leaf, strategies/deepspeed.py wrap_frozen): with DeepSpeed's per-submodule hooks instead, its compiled
blocks break into several graphs whose bf16 roundings differ from the policy's one graph (a first margin of
-5.9e-6 on this run, 1.04e-4 in tests/gpu/test_dpo_cuda.py on an H100)."""

import importlib.util
import json
import math

import pytest

from shardwise.data.demo import demo_preference_records
from tests.inproc.trainer import train

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")


def test_a_compiled_zero3_reference_starts_equal_to_the_policy(tiny_dir, tmp_path):
    from torch._dynamo.utils import counters

    breaks = sum(counters["graph_break"].values())
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in demo_preference_records(64)))
    run = train("--model", tiny_dir, "--data", data, "--strategy", "zero3", "--nproc-per-node", "1", "--task", "dpo",
                "--compile", "on", "--mixed-precision", "bf16", "--seq-len", "64", "--micro-batch-size", "8",
                "--max-steps", "1", "--log-every", "1", "--no-save-final", "--report-to", "none",
                "--output-dir", tmp_path / "run")
    # every compiled block, the policy's and the reference's, is one graph (with per-submodule hooks the reference's break 28 times)
    assert sum(counters["graph_break"].values()) == breaks
    assert "compile: 4 blocks (forward only; ZeRO-3 hooks eager)" in run.stdout
    assert "reference: the starting model, partitioned like the policy (ZeRO-3)" in run.stdout
    first = run.metrics[0]
    assert first["rewards/margins"] == 0 and first["rewards/chosen"] == first["rewards/rejected"] == 0
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-7)
