"""The planner against the rows measured on H200s with the landed `shardwise train` CLI.

Source: docs/measurements.md, section "`shardwise train` measured from the outside, H200 (2026-11-30)" (the
`shardwise train` CLI, torch 2.11, DeepSpeed 0.19.8): models built from published configs with random
weights, tokens/s the median after step 10, peak memory `max_memory_allocated` (metrics.jsonl), the plan
`shardwise plan --json`'s `peak_tensors` for the same flags. Each row below copies one line of that table
(its tokens/s, peak GiB and the flags of the job); the planner must predict the step time within 20% and
the tensor peak within 10% (the bounds: plan/calibration.json's measured_sets). The row measured on "another
machine" (25% slower for the same job, per the same page) is left out: the page says to compare only within one
call. docs/planner.md's tables of these rows are generated (python -m shardwise.plan.calibration docs/planner.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from shardwise.plan import calibration
from shardwise.plan import command as plan_cmd
from tests.helpers import benchmark_module

# the 1.14B Llama shape of docs/measurements.md: vocab 32000, hidden 2048, intermediate 8192, 16 layers,
# 16 heads, 8 KV heads, untied
LLAMA_1B = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 2048,
            "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 16,
            "num_key_value_heads": 8, "max_position_embeddings": 4096, "tie_word_embeddings": False}
H200 = ["--gpu-type", "H200", "--gpu-memory", "141"]
Q15 = "qwen2.5-1.5b"

# (label, argv, strategy, measured tokens/s (all ranks), measured peak GiB). The planner models today's engine; rows
# measured under an engine that has since changed what it keeps, and that today's model no longer predicts within
# the bounds, are archived in ARCHIVE (their data kept, not tested): the two LoRA rows of this table (the fused head
# then computed a frozen head's weight gradient too).
ARCHIVE = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "plan_measured_archived.json"
# ZeRO-3 ran with DeepSpeed's per-submodule fetch until whole-block fetch became the default (2026-12-01)
Z3_THEN = ("--strategy", "zero3", "--deepspeed-fetch", "module")
ROWS = [
    ("1 H200, 1.14B Llama, 8 x 2048", ["--model", "{llama}", "--gpus", "1", "--micro-batch-size", "8",
                                       "--seq-len", "2048"], "single", 71.1e3, 37.1),
    ("same", ["--model", "{llama}", "--gpus", "1", "--micro-batch-size", "8", "--seq-len", "2048"],
     "fsdp", 69.7e3, 35.9),
    ("2 H200, same job per GPU", ["--model", "{llama}", "--gpus", "2", "--micro-batch-size", "8",
                                  "--seq-len", "2048"], "ddp", 131.5e3, 41.3),
    ("same", ["--model", "{llama}", "--gpus", "2", "--micro-batch-size", "8", "--seq-len", "2048"],
     "fsdp", 134.9e3, 27.9),
    ("same", ["--model", "{llama}", "--gpus", "2", "--micro-batch-size", "8", "--seq-len", "2048"],
     "zero2", 125.9e3, 29.6),
    ("same", ["--model", "{llama}", "--gpus", "2", "--micro-batch-size", "8", "--seq-len", "2048",
              *Z3_THEN], "zero3", 78.9e3, 37.3),
    ("1 H200, Qwen2.5-1.5B shape, 2 x 4096, checkpointing", ["--model", Q15, "--gpus", "1", "--micro-batch-size",
                                                             "2", "--seq-len", "4096", "--gradient-checkpointing"],
     "single", 30.9e3, 27.1),
    ("same, no checkpointing", ["--model", Q15, "--gpus", "1", "--micro-batch-size", "2", "--seq-len", "4096",
                                *Z3_THEN], "zero3", 12.6e3, 51.9),
    ("Qwen2.5-1.5B shape, 4 x 4096, --param-dtype bf16", ["--model", Q15, "--gpus", "1", "--micro-batch-size", "4",
                                                          "--seq-len", "4096", "--param-dtype", "bf16"],
     "fsdp", 42.3e3, 48.6),
    ("Qwen2.5-1.5B shape, 4 x 2048", ["--model", Q15, "--gpus", "1", "--micro-batch-size", "4", "--seq-len", "2048"],
     "zero2", 31.1e3, 43.8),
    ("2 H200, Llama-3.1-8B shape, 1 x 32768 per GPU, checkpointing",
     ["--model", "llama-3.1-8b", "--gpus", "2", "--micro-batch-size", "1", "--seq-len", "32768",
      "--gradient-checkpointing"], "fsdp", 11.3e3, 67.4),
    ("same, 1 x 65536 per GPU", ["--model", "llama-3.1-8b", "--gpus", "2", "--micro-batch-size", "1",
                                 "--seq-len", "65536", "--gradient-checkpointing"], "fsdp", 8.2e3, 75.8),
    # 2026-12-01, `shardwise train --float8` (benchmarks/results/strategies-gpu-2026-12-01-f8cli.md, torchao 0.17.0)
    ("1 H200, 1.14B Llama, 8 x 2048, --float8", ["--model", "{llama}", "--gpus", "1", "--micro-batch-size", "8",
                                                 "--seq-len", "2048", "--float8"], "single", 84.7e3, 30.47),
    ("same", ["--model", "{llama}", "--gpus", "1", "--micro-batch-size", "8", "--seq-len", "2048", "--float8"],
     "fsdp", 83.3e3, 31.08),
]
SPEED_TOL, MEM_TOL = (calibration.measured_set("shardwise_train_h200")[k] for k in ("step_tol", "mem_tol"))

# ----------------------------------------------------------------------------- one H100: the anchor and task dpo
# Sources: the anchor's `single` and `fsdp` rows against the HF Trainer (benchmarks/results/vs_hf_trainer_h100_2026-12-06
# .json: the 1.14B Llama shape, 8 x 2048, compiled blocks) and `shardwise train --task dpo` against TRL
# (benchmarks/results/dpo_vs_trl_h100_2026-12-07.md, raw records full.json and lora.json beside it, written by
# benchmarks/dpo_vs_trl.py: the Qwen2.5-1.5B shape, 2 pairs a step, rows padded to seq_len 1032, no checkpointing),
# each a median of its counted steps, peak max_memory_allocated. The plan is the scripts' own (`shardwise plan` of
# the job, the GPU given as --gpus 1 --gpu-memory 80: an H100). The DPO record's tokens/s counts a pair's real tokens;
# the plan counts its padded rows, so the measured step time is turned into tokens/s as the plan counts them.
H100 = ["--gpu-type", "H100", "--gpu-memory", "80"]
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
QWEN_DPO = {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
            **benchmark_module("dpo_vs_trl").QWEN15}  # benchmarks/common.py build_model_dir's LlamaForCausalLM


def _record(path: Path, name: str) -> dict:
    with open(path) as fh:
        return next(r for r in json.load(fh)["results"] if r["name"] == name)


def h100_rows() -> list[tuple]:
    """(label, argv, strategy, measured tokens/s, measured peak GiB) of the H100 rows, read from their records."""
    import re

    rows = []
    anchor = ["--model", "{llama}", "--gpus", "1", "--micro-batch-size", "8", "--seq-len", "2048"]
    for strategy in ("single", "fsdp"):
        r = _record(RESULTS / "vs_hf_trainer_h100_2026-12-06.json", f"sw-{strategy}")
        rows.append(("1 H100, 1.14B Llama, 8 x 2048", anchor, strategy, r["tokens_per_s"], r["peak_mem_gib"]))
    bench = benchmark_module("dpo_vs_trl")
    for tuner in ("full", "lora"):
        path = RESULTS / "dpo_vs_trl_h100_2026-12-07b" / f"{tuner}.json"
        with open(path) as fh:
            job = json.load(fh)["info"]["job"]
        seq, pairs = int(re.search(r"seq_len (\d+)", job)[1]), int(re.search(r"(\d+) pairs a step", job)[1])
        r = _record(path, f"sw-{tuner}")
        argv = ["--model", "{qwen_dpo}", "--gpus", "1", "--task", "dpo", "--seq-len", str(seq), "--micro-batch-size",
                str(pairs), "--strategy", "single", "--mixed-precision", "bf16", *bench.sw_flags(r["name"])[:4]]
        rows.append((f"1 H100, Qwen2.5-1.5B shape, task dpo {tuner}, {pairs} pairs x 2 rows x {seq}", argv, "single",
                     2 * pairs * seq / r["step_time_s"], r["peak_mem_gib"]))
    return rows


H100_ROWS = h100_rows()


def predict(argv: list[str], strategy: str, tmp: Path, gpu: list[str] = H200) -> tuple[float, float]:
    """(tokens/s, tensor peak GiB) that `shardwise plan --json` gives for the row's flags on `gpu`."""
    for name, config in (("llama", LLAMA_1B), ("qwen_dpo", QWEN_DPO)):
        d = tmp / name
        d.mkdir(exist_ok=True)
        (d / "config.json").write_text(json.dumps(config))
        argv = [a.replace("{" + name + "}", str(d)) for a in argv]
    argv = argv + gpu
    p = argparse.ArgumentParser()
    plan_cmd.add_parser(p.add_subparsers())
    plan, _ = plan_cmd.build(p.parse_args(["plan", *argv]))
    s = next(s for s in plan.to_json()["strategies"] if s["strategy"] == strategy)
    return s["tokens_per_s"], s["mem_gib"]["peak_tensors"]


@pytest.fixture(autouse=True)
def _no_doctor_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDWISE_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("row", ROWS, ids=[f"{i}-{r[2]}" for i, r in enumerate(ROWS)])
def test_measured_row_within_bounds(row, tmp_path):
    label, argv, strategy, tps, peak = row
    p_tps, p_peak = predict(argv, strategy, tmp_path)
    # step time: the same tokens per step on both sides, so the step-time error is tps / p_tps - 1
    assert abs(tps / p_tps - 1) <= SPEED_TOL, f"{label} {strategy}: step time {tps / p_tps - 1:+.1%} " \
                                               f"(planned {p_tps:,.0f} tokens/s, measured {tps:,.0f})"
    assert abs(p_peak / peak - 1) <= MEM_TOL, f"{label} {strategy}: peak {p_peak:.2f} GiB vs measured {peak:.2f}"


@pytest.mark.parametrize("row", H100_ROWS, ids=[f"{i}-{r[2]}" for i, r in enumerate(H100_ROWS)])
def test_h100_row_within_bounds(row, tmp_path):
    """The H100 rows (task dpo's step: the log-probability head's passes, the reference's forward and weight casts;
    memory-bound passes at the H100's bandwidth) within calibration.json's bounds for the set."""
    mem_tol, step_tol = (calibration.measured_set("h100_one_gpu")[k] for k in ("mem_tol", "step_tol"))
    label, argv, strategy, tps, peak = row
    p_tps, p_peak = predict(argv, strategy, tmp_path, H100)
    assert abs(tps / p_tps - 1) <= step_tol, f"{label} {strategy}: step time {tps / p_tps - 1:+.1%} " \
                                             f"(planned {p_tps:,.0f} tokens/s, measured {tps:,.0f})"
    assert abs(p_peak / peak - 1) <= mem_tol, f"{label} {strategy}: peak {p_peak:.2f} GiB vs measured {peak:.2f}"


# ----------------------------------------------------------------------------- one H200, 2026-12-01 (issue 16)
# Source: benchmarks/results/plan_accuracy_h200_2026-12-01.json (`plan_accuracy.py --gpu --cases issue16`, two calls:
# docs/planner.md, "H200: presets x full/LoRA/QLoRA x checkpointing"): every one-GPU preset x tuner x checkpointing on
# the Qwen2.5-1.5B shape (3 x 3072) and the 1.14B Llama shape (6 x 1536), measured through the engine's own code
# (peak max_memory_allocated, step time by CUDA events, median after 2 warm-up steps). Each row is predicted through
# the harness's own case -> Config -> Job mapping (plan_accuracy.plan_case), as the table was.
H200_RUN = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "plan_accuracy_h200_2026-12-01.json"
# these rows ran before the fused head dropped each chunk's logits before the next (models/speed.py): the Qwen rows
# whose peak was the head's two chunks are archived (ARCHIVE, "h200_head_two_chunks"); the others hold for today's
# engine
# step time outside 20% where two runs of the same row disagree by up to 30% (eager ZeRO-3's host-bound hooks):
# (model, strategy, tuner, ckpt, compile) -> the bound these rows are held to (calibration.json's measured_sets)
ZERO3_NOISY = calibration.wide_bounds("h200_presets_tuners_checkpointing")


def _h200_rows() -> list[dict]:
    """The rows, each with the ZeRO-3 fetch it ran with (DeepSpeed's per-submodule fetch: they predate 'block'),
    less the archived ones."""
    archived = {tuple(k) for k in _archive()["h200_head_two_chunks"]["keys"]}
    with open(H200_RUN) as fh:
        return [{**r, "ds_fetch": "module"} if r["strategy"].startswith("zero3") else r
                for r in json.load(fh) if not r.get("error") and _key(r) not in archived]


def _key(r: dict) -> tuple:
    return (r["model"], r["strategy"], r.get("tuner", "full"), r["ckpt"], r["compile"])


def _archive() -> dict:
    with open(ARCHIVE) as fh:
        return json.load(fh)


def _plan_case():
    return benchmark_module("plan_accuracy").plan_case


def test_h200_preset_tuner_checkpointing_table_within_goals():
    """Issue 16 item 1 on one H200: peak memory within 10% on all 48 rows; step time within 20% except the two eager
    ZeRO-3 rows whose repeat runs disagree (ZERO3_NOISY, held to their own bound). The planner terms these rows fixed:
    the fused head's two chunks (every Qwen row was 1.8-3.5 GiB under), ZeRO-3's linear saving the frozen base inputs
    under LoRA (-19% / -14%), the checkpointed LoRA/QLoRA peak at the start of backward (-11% / -13%), LoRA's eager
    adapter bytes (-19..-30% step time), ZeRO-3's host-bound hooks (+63% / -70% step time)."""
    mem_tol, step_tol = (calibration.measured_set("h200_presets_tuners_checkpointing")[k] for k in ("mem_tol", "step_tol"))
    plan_case = _plan_case()
    rows = _h200_rows()
    assert len(rows) == 48 - len(_archive()["h200_head_two_chunks"]["keys"])
    worst_mem, misses = 0.0, []
    for r in rows:
        sp = plan_case(r, 1, "cuda")
        mem = sp.memory.peak_tensors / r["measured"] - 1
        step = sp.timing.step_s / r["measured_step_s"] - 1
        worst_mem = max(worst_mem, abs(mem))
        key = (r["model"], r["strategy"], r.get("tuner", "full"), r["ckpt"], r["compile"])
        assert abs(mem) <= mem_tol, f"{key}: peak {mem:+.1%}"
        assert abs(step) <= ZERO3_NOISY.get(key, step_tol), f"{key}: step time {step:+.1%}"
        if abs(step) > step_tol:
            misses.append(key)
    assert sorted(misses) == sorted(ZERO3_NOISY)  # a bound that no longer binds is removed from ZERO3_NOISY


def test_h200_fixes_one_row_each():
    """One measured row per planner fix (same source), with the number that was wrong before it."""
    plan_case = _plan_case()
    rows = {(r["model"], r["strategy"], r.get("tuner", "full"), r["ckpt"], r["compile"]): r for r in _h200_rows()}

    def pred(key):
        return plan_case(rows[key], 1, "cuda")

    # (the fused head's two chunks, the fix these rows first showed, was the engine's: the head now holds one chunk,
    # test_h200_head_bound_rows_after_the_head_holds_one_chunk)
    # ZeRO-3's linear saves the frozen base projections' inputs under LoRA (48.77 GiB measured, 39.34 before; within
    # the table's bound now that the head, which held two chunks when this row ran, is modelled as it runs today)
    key = ("qwen2.5-1.5B", "zero3", "lora", False, False)
    GiB = 2 ** 30
    assert pred(key).memory.peak_tensors / GiB > 1.1 * 39.34
    assert pred(key).memory.peak_tensors / rows[key]["measured"] == pytest.approx(1.0, abs=MEM_TOL)
    # checkpointed QLoRA peaks in the last block's recompute beside 15 boundaries (3.50 GiB, 2.69 before)
    key = ("llama-1.1B", "single", "qlora", True, False)
    m = pred(key).memory
    assert m.phase.startswith("start of backward") and m.peak_tensors / rows[key]["measured"] > 0.90
    # LoRA's eager adapters under autocast: 0.316 s measured, 0.256 s before
    key = ("qwen2.5-1.5B", "single", "lora", False, False)
    assert pred(key).timing.step_s / rows[key]["measured_step_s"] == pytest.approx(1.0, abs=0.05)
    # compiled ZeRO-3 LoRA is host-bound: 0.948 s measured (0.513 s before)
    key = ("llama-1.1B", "zero3", "lora", False, True)
    assert pred(key).timing.step_s / rows[key]["measured_step_s"] == pytest.approx(1.0, abs=0.10)


# ----------------------------------------------------------------------------- ZeRO-3 fetching whole blocks
# Source: benchmarks/results/plan_accuracy_h200_2026-12-01-zero3block.json (one H200, four calls after whole-block
# fetch became zero3's default: `plan_accuracy.py --gpu --cases issue16` rows and the 8 x 2048 anchor's two zero3
# rows of the default list; docs/planner.md). The same measurement and mapping as the table above. The last two rows
# are eager with DeepSpeed's linear (as eager blocks run now); the earlier eager rows ran torch's (`torch_linear`):
# where that changes the prediction beyond the bounds the row is archived (ARCHIVE, "h200_zero3_torch_linear").
ZERO3_BLOCK_RUN = H200_RUN.with_name("plan_accuracy_h200_2026-12-01-zero3block.json")
# the two rows the per-tensor host term misses by more than 20%: (model, tuner, ckpt, compile) -> their bound
ZERO3_BLOCK_WIDE = calibration.wide_bounds("h200_zero3_whole_blocks")


def test_h200_zero3_whole_block_rows_within_goals():
    """ZeRO-3 with whole-block fetch: every row's peak within 10%, step time within 20% except ZERO3_BLOCK_WIDE."""
    mem_tol, step_tol = (calibration.measured_set("h200_zero3_whole_blocks")[k] for k in ("mem_tol", "step_tol"))
    plan_case = _plan_case()
    with open(ZERO3_BLOCK_RUN) as fh:
        rows = [r for r in json.load(fh) if not r.get("error")]
    archived = {tuple(k) for k in _archive()["h200_zero3_torch_linear"]["keys"]}
    rows = [r for r in rows if (r["model"], r.get("tuner", "full"), r["ckpt"], r["compile"], r["torch_linear"])
            not in archived]
    assert len(rows) == 15 - len(archived)
    assert all(r["ds_fetch"] == "block" and r["strategy"] == "zero3" for r in rows)
    misses = []
    for r in rows:
        sp = plan_case(r, 1, "cuda")
        key = (r["model"], r.get("tuner", "full"), r["ckpt"], r["compile"])
        mem = sp.memory.peak_tensors / r["measured"] - 1
        step = sp.timing.step_s / r["measured_step_s"] - 1
        assert abs(mem) <= mem_tol, f"{key}: peak {mem:+.1%}"
        assert abs(step) <= ZERO3_BLOCK_WIDE.get(key, step_tol), f"{key}: step time {step:+.1%}"
        if abs(step) > step_tol:
            misses.append(key)
    assert sorted(misses) == sorted(ZERO3_BLOCK_WIDE)


if __name__ == "__main__":
    import os
    import tempfile

    os.environ.setdefault("SHARDWISE_CACHE_DIR", tempfile.mkdtemp())
    with tempfile.TemporaryDirectory() as d:
        print("| job | strategy | measured tokens/s | planned tokens/s | step-time error | measured GiB | "
              "planned GiB | error |\n|---|---|---|---|---|---|---|---|")
        for label, argv, strategy, tps, peak in ROWS:
            p_tps, p_peak = predict(argv, strategy, Path(d))
            print(f"| {label} | {strategy} | {tps / 1e3:.1f}k | {p_tps / 1e3:.1f}k | {p_tps / tps - 1:+.1%} | "
                  f"{peak:.1f} | {p_peak:.1f} | {p_peak / peak - 1:+.1%} |")
    sys.exit(0)


def test_h200_head_bound_rows_after_the_head_holds_one_chunk():
    """The Qwen2.5-1.5B rows whose peak is the fused head's, measured again after the head drops each chunk's logits
    before the next and computes its log-sum-exp in place (benchmarks/results/fused_head_memory_h200_2026-12-01.md:
    LoRA 10.92 -> 7.46 GiB), predicted for today's engine (one chunk)."""
    mem_tol, step_tol = (calibration.measured_set("h200_fused_head_one_chunk")[k] for k in ("mem_tol", "step_tol"))
    plan_case = _plan_case()
    with open(H200_RUN.with_name("plan_accuracy_h200_2026-12-01-headlse.json")) as fh:
        rows = [r for r in json.load(fh) if not r.get("error")]
    assert len(rows) == 2
    for r in rows:
        sp = plan_case(r, 1, "cuda")
        assert abs(sp.memory.peak_tensors / r["measured"] - 1) <= mem_tol
        assert abs(sp.timing.step_s / r["measured_step_s"] - 1) <= step_tol
