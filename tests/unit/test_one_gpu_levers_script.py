"""benchmarks/one_gpu_levers.py's parts that need no GPU: the lever names, the config each variant runs, the
loss-curve data and the summary table (the whole script runs on the CPU with --device cpu; see its docstring)."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import one_gpu_levers as lev  # noqa: E402


class _Args:
    model, seq_len, ckpt, device, eager = "cpu-b", 64, False, "cpu", True


def test_levers_map_to_the_config_keys_the_engine_reads():
    _, cfg, levers = lev.variant_config("fsdp+sac+float8", _Args(), 2)
    assert cfg.strategy == "fsdp" and cfg.activation_checkpointing == "selective" and cfg.float8
    assert levers == {"sac", "float8"}
    _, cfg, _ = lev.variant_config("single+fullac", _Args(), 2)
    assert cfg.activation_checkpointing == "full" and not cfg.float8 and cfg.micro_batch_size == 2
    with pytest.raises(SystemExit, match="unknown lever"):
        lev.parse("single+fp4")


def test_planned_peak_follows_the_checkpointing_lever():
    a = _Args()
    a.model, a.seq_len, a.eager = "llama-1.1B", 2048, False  # the anchor job: compiled, 8 x 2048
    peaks = {v: lev.planned_peak_gib(*lev.variant_config(v, a, 8)[:2], "cuda")
             for v in ("single", "single+sac", "single+fullac")}
    assert peaks["single+fullac"] < peaks["single+sac"] < peaks["single"], peaks


def test_curve_batches_are_the_same_every_time_and_learnable():
    a = lev.curve_batches(2, 3, 200, 1024)
    b = lev.curve_batches(2, 3, 200, 1024)
    for x, y in zip(a, b):
        assert torch.equal(x.micro[0].input_ids, y.micro[0].input_ids)
    mb = a[0].micro[0]
    assert mb.input_ids.shape == mb.targets.shape == (3, 200)
    assert torch.equal(mb.input_ids[:, 1:], mb.targets[:, :-1])  # targets are the next tokens
    succ = torch.randperm(1024, generator=torch.Generator().manual_seed(0))
    followed = (succ[mb.input_ids] == mb.targets).float().mean().item()
    assert 0.65 < followed < 0.85  # the successor table, p = 0.75 (+ 1/1024 by chance)
    assert not torch.equal(a[0].micro[0].input_ids, a[1].micro[0].input_ids)


def test_table_gives_medians_against_the_first_and_the_reason_of_a_refusal():
    runs = [{"variant": "single", "tokens_per_s": 100, "mfu": 0.5, "peak_gib": 30, "pred_peak_gib": 31.5},
            {"variant": "single", "tokens_per_s": 104, "mfu": 0.52, "peak_gib": 30},
            {"variant": "single+sac", "tokens_per_s": 90, "mfu": 0.45, "peak_gib": 20},
            {"variant": "single+float8", "refused": "--float8: float8 needs a CUDA GPU"}]
    text = lev.table(runs, ["single", "single+sac", "single+float8"], 2)
    assert "| single | 102 | +0.0% | 51.0% | 30 | 31.5 |" in text
    assert "| single+sac | 90 | -11.8% |" in text
    assert "| single+float8 | — | — | — | — | --float8: float8 needs a CUDA GPU |" in text
