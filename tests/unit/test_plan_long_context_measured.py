"""The planner against the long-context rows measured on one H100 (LoRA and QLoRA on the Llama-3.1-8B shape,
strategy single, bf16, `--activation-checkpointing offload`, `--mlp-tiles N`; compiled blocks unless a row says eager).

Source: benchmarks/results/long_context_1gpu_h100_2026-12-07.md (the 32-layer rows at 64K and the 256K OOM),
long_context_1gpu_h100_2026-12-07b.md (the 2-layer probes and the 32-layer 256K row), long_context_probe_h100_2026-12-07b.md
(the eager 2-layer probes at 128K and 256K), long_context_1gpu_h100_2026-12-07c.md (128K, 64K without adapter
dropout, the full fine-tune at 256K) and long_context_1gpu_h100_2026-12-08.md (QLoRA's 32 layers at 256K; the
compiled 2-layer 256K probe again, 46.33 GiB as before), torch 2.11, transformers 5.17, peak `max_memory_allocated`,
plan `peak_tensors` for the same flags. Bound: the plan within 10% of the measured peak (docs/planner.md "Long context
on one H100: the 256K gap"); a row that ran out of memory must not plan as fitting.
Every row holds but two: the 2-layer compiled 64K row, where the norm's backward moment (`memory.norm_backward`,
which every compiled row at 256K reaches) is 14% above what the compiled blocks measured, and the full fine-tune at
256K, where the plan is 18% high. They are strict xfails, pinned so that a change that closes either shows.
"""

from __future__ import annotations

import json

import pytest

from shardwise import cli
from shardwise.plan import command as plan_cmd

GiB = 2**30
TOL = 0.10
LLAMA_8B = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
            "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "max_position_embeddings": 524288, "rope_theta": 500000.0,
            "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
HIGH_64K = pytest.mark.xfail(strict=True, reason="the compiled 2-layer 64K row peaks 14% below the norm backward's "
                             "moment that the compiled 256K rows reach (memory.norm_backward)")

# (layers, tokens, tuner, lora dropout, tiles, measured GiB, how): how "=" a peak, ">=" a lower bound (out of memory)
ROWS = [
    pytest.param(2, 65536, "lora", 0.05, 8, 16.02, "=", id="2l-64k-drop-8tiles", marks=HIGH_64K),
    pytest.param(32, 65536, "lora", 0.05, 8, 28.79, "=", id="32l-64k-drop-8tiles"),
    pytest.param(32, 262144, "lora", 0.0, 16, 59.11, "=", id="32l-256k-nodrop-16tiles"),
    pytest.param(2, 262144, "lora", 0.0, 16, 46.33, "=", id="2l-256k-nodrop-16tiles"),
    pytest.param(2, 262144, "qlora", 0.0, 16, 45.95, "=", id="2l-256k-qlora-16tiles"),
    pytest.param(2, 262144, "lora", 0.05, 16, 71.13, "=", id="2l-256k-drop-16tiles"),
    # out of memory with at least 71.42 GiB allocated and a 2 GiB buffer asked for
    pytest.param(32, 262144, "lora", 0.05, 16, 73.4, ">=", id="32l-256k-drop-16tiles-oom"),
    pytest.param(32, 65536, "lora", 0.0, 8, 24.67, "=", id="32l-64k-nodrop-8tiles"),
    pytest.param(32, 131072, "lora", 0.05, 1, 57.49, "=", id="32l-128k-drop-auto-1tile"),  # auto chose no tiles
    pytest.param(2, 131072, "lora", 0.0, 16, 25.46, "=eager", id="2l-128k-nodrop-16tiles-eager"),
    pytest.param(2, 262144, "lora", 0.0, 16, 48.06, "=eager", id="2l-256k-nodrop-16tiles-eager"),
    pytest.param(32, 262144, "qlora", 0.0, 16, 49.68, "=", id="32l-256k-qlora-nodrop-16tiles"),
]


@pytest.fixture(autouse=True)
def _no_doctor_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDWISE_CACHE_DIR", str(tmp_path / "cache"))


def planned_row(tmp_path, layers, tokens, tuner, dropout, tiles, compiled=True, model=None):
    if model is None:
        model = tmp_path / f"llama-8b-{layers}l"
        model.mkdir()
        (model / "config.json").write_text(json.dumps({**LLAMA_8B, "num_hidden_layers": layers}))
    lora = ["--lora-r", "16", "--lora-dropout", str(dropout)] if tuner != "full" else []
    args = cli.build_parser().parse_args([
        "plan", "--model", str(model), "--gpus", "1", "--gpu-memory", "80", "--gpu-type", "H100",
        "--seq-len", str(tokens), "--micro-batch-size", "1", "--strategy", "single", "--mixed-precision", "bf16",
        "--tuner", tuner, *lora, "--compile", "on" if compiled else "off",
        "--activation-checkpointing", "offload", "--mlp-tiles", str(tiles)])
    p = plan_cmd.build(args)[0]
    assert p.job.compile == compiled and p.job.offload_checkpoints and p.job.mlp_tiles == tiles
    return p.for_strategy("single")


def planned_gib(tmp_path, *job, **kw) -> tuple[float, bool]:
    row = planned_row(tmp_path, *job, **kw)
    return row.memory.peak_tensors / GiB, row.fits


@pytest.mark.parametrize(("layers", "tokens", "tuner", "dropout", "tiles", "measured", "how"), ROWS)
def test_long_context_plan_within_bounds_of_the_measured_peak(tmp_path, layers, tokens, tuner, dropout, tiles,
                                                              measured, how):
    plan, fits = planned_gib(tmp_path, layers, tokens, tuner, dropout, tiles, compiled=how != "=eager")
    if how == ">=":  # it ran out of memory on the 80 GiB card: the plan must not say it fits
        assert plan >= measured * (1 - TOL) and not fits, f"plan {plan:.2f} GiB (fits: {fits}), measured at least {measured} GiB"
    else:
        assert abs(plan / measured - 1) <= TOL, f"plan {plan:.2f} GiB, measured {measured} GiB"


@pytest.mark.xfail(strict=True, reason="the full fine-tune at 256K: plan 18% high at the end of backward, not explained")
def test_the_full_fine_tune_at_256k_plans_within_bounds_of_its_measured_peak(tmp_path):
    """The Qwen2.5-1.5B shape, full fine-tune, offloaded checkpoints, no tiles (what the plan chose as the longest
    length that fits one 80 GiB card), at 262,144 tokens (4,610 tokens/s)."""
    measured = 49.13
    plan, fits = planned_gib(tmp_path, 0, 262144, "full", 0.0, 1, model="qwen2.5-1.5b")
    assert fits and abs(plan / measured - 1) <= TOL, f"plan {plan:.2f} GiB, measured {measured} GiB"


# host memory: (layers or a preset, tokens, tuner, lora dropout, tiles, compiled, measured GiB): the machine's used
# memory at its peak over its level before the run, the same rows' `host GiB` (one process on the one GPU: its
# pinned checkpoints, its own memory, its compiler's workers, or at the start the model's load in fp32)
HOST_ROWS = [
    pytest.param(2, 131072, "lora", 0.0, 16, False, 6.48, id="2l-128k-eager"),  # the load: 5.54 GiB of fp32 weights
    pytest.param(2, 262144, "lora", 0.0, 16, False, 6.42, id="2l-256k-eager"),
    pytest.param(32, 65536, "lora", 0.0, 8, True, 30.77, id="32l-64k-nodrop-8tiles"),  # the load: 29.9 GiB
    pytest.param(32, 131072, "lora", 0.05, 1, True, 39.8, id="32l-128k-drop-auto-1tile"),  # 32 GiB of checkpoints
    pytest.param(32, 262144, "lora", 0.0, 16, True, 69.3, id="32l-256k-nodrop-16tiles"),  # 64 GiB of checkpoints
    pytest.param("qwen2.5-1.5b", 262144, "full", 0.0, 1, True, 67.64, id="1.5b-full-256k"),  # 56 GiB of checkpoints
    pytest.param(32, 262144, "qlora", 0.0, 16, True, 69.3, id="32l-256k-qlora-nodrop-16tiles"),  # 64 GiB of them
    # the compiled 2-block probe: 4 GiB of checkpoints and ~3 GiB else, where the compiler's allowance is 7
    pytest.param(2, 262144, "lora", 0.0, 16, True, 7.07, id="2l-256k-compiled-probe", marks=pytest.mark.xfail(
        strict=True, reason="the compiler-worker allowance (host_compile_workers_gib, fitted on 32-block rows) is "
                            "larger than a two-block model's steady host memory beside its checkpoints")),
]


@pytest.mark.parametrize(("layers", "tokens", "tuner", "dropout", "tiles", "compiled", "measured"), HOST_ROWS)
def test_host_memory_plans_within_bounds_of_the_measured_peak(tmp_path, layers, tokens, tuner, dropout, tiles,
                                                              compiled, measured):
    model = layers if isinstance(layers, str) else None
    row = planned_row(tmp_path, 0 if model else layers, tokens, tuner, dropout, tiles, compiled=compiled,
                      model=model)
    plan = row.memory.host_peak / GiB
    assert row.memory.host_peak >= row.memory.host  # never below what the rank keeps there
    assert abs(plan / measured - 1) <= TOL, f"plan {plan:.2f} GiB of host memory, measured {measured} GiB"
