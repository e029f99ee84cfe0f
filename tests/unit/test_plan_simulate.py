"""--simulate (fake tensors + fake process group) against the analytic model."""

from __future__ import annotations

import argparse
import json

import pytest

pytest.importorskip("torch")

from shardwise.plan import command as plan_cmd  # noqa: E402
from shardwise.plan.memory import Job, Opts, estimate  # noqa: E402
from shardwise.plan.model_spec import ModelSpec  # noqa: E402
from shardwise.plan.simulate import simulate  # noqa: E402

TOLERANCE = 0.10  # analytic tensor peak within 10% of the simulated one
SPEC = ModelSpec("sim", "test", vocab_size=4096, hidden_size=256, intermediate_size=704, num_layers=4,
                 num_heads=4, num_kv_heads=2, head_dim=64, tied_embeddings=False)


@pytest.mark.parametrize("base,world,compute,param,ckpt,accum,reshard,fused", [
    ("fsdp", 2, "fp32", "fp32", False, 1, True, False),
    ("ddp", 4, "bf16", "fp32", False, 1, True, False),  # autocast: fp32 residual stream, bf16 weight copies
    ("fsdp", 4, "bf16", "fp32", True, 2, True, False),  # MixedPrecisionPolicy, checkpointing, no-sync accumulation
    ("fsdp", 4, "bf16", "bf16", False, 1, False, False),  # pure bf16, fsdp-grad-op
    ("ddp", 4, "bf16", "fp32", False, 1, True, True),  # the engine's fused loss head under autocast
    ("fsdp", 4, "bf16", "fp32", False, 1, True, True),  # ... and under MixedPrecisionPolicy
])
def test_analytic_peak_matches_simulation(base, world, compute, param, ckpt, accum, reshard, fused):
    job = Job(world=world, micro_batch=2, seq_len=128, compute=compute, param_dtype=param, checkpointing=ckpt,
              grad_accum=accum, accelerator="cpu", fused_loss=fused)
    opts = Opts(base, reshard_after_forward=reshard)
    sim = simulate(SPEC, job, opts, steps=2)["peak_bytes"]
    ana = estimate(SPEC, job, opts).peak_tensors
    assert abs(ana / sim - 1) < TOLERANCE, (ana, sim)


def test_plan_simulate_flag_reports_each_simulated_strategy(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDWISE_CACHE_DIR", str(tmp_path))
    p = argparse.ArgumentParser()
    plan_cmd.add_parser(p.add_subparsers())
    args = p.parse_args(["plan", "--model", "tiny", "--gpus", "2", "--gpu-memory", "8", "--simulate", "--json",
                         "--seq-len", "64", "--micro-batch-size", "2"])
    assert plan_cmd.run(args) == 0
    d = json.loads(capsys.readouterr().out)
    got = {r["strategy"]: r for r in d["simulated"]["results"]}
    assert set(got) == {"ddp", "fsdp", "fsdp-grad-op"} and not d["simulated"]["errors"]
    for r in got.values():
        assert abs(r["diff_pct"]) < 100 * TOLERANCE
