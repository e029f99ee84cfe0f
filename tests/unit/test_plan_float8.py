"""The planner's float8 terms (config `float8`, issue 17) against what was measured on one H200.

Sources (benchmarks/results/, docs/planner.md "float8"):
- float8_probe_h200_2026-12-01.json (`benchmarks/float8_probe.py`): one compiled decoder block's saved activations, bf16
  vs float8, with fp32 weights under autocast (single, ddp) and bf16 weights (FSDP2), for four block shapes;
- one_gpu_levers_h200_2026-12-01.json (the anchor, single and fsdp) and float8_runs_h200_2026-12-01-*.json
  (`benchmarks/one_gpu_levers.py`): whole runs through the engine's path, each bf16 variant beside its float8 one
  in the same process. The planner's float8 step-time constant was fitted on the anchor's single row only; the
  others were predicted before they ran (the Qwen and 3B rows) or are checked here as found.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from shardwise.plan import calibration
from shardwise.plan.memory import Job, float8_block_bytes, float8_linears
from shardwise.plan.model_presets import find_preset
from tests.helpers import benchmark_module

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
MEM_TOL, SPEED_TOL = (calibration.measured_set("h200_float8")[k] for k in ("mem_tol", "step_tol"))
GiB = 2**30


def _pa():
    return benchmark_module("plan_accuracy")


# the probe's block shapes: (hidden, intermediate, heads, kv heads, head_dim), as benchmarks/float8_probe.py builds them
PROBE_SHAPES = {"llama-0.3B": (1024, 4096, 16, 8, 64), "llama-1.1B": (2048, 8192, 16, 8, 128),
                "llama-8B": (4096, 14336, 32, 8, 128), "qwen2.5-1.5B": (1536, 8960, 12, 2, 128)}
LLAMA_70B = (8192, 28672, 64, 8, 128)  # k and v are 8192 -> 1024: not narrow (in_features > 4096), converted


def _spec(shape):
    from shardwise.plan.model_spec import ModelSpec

    h, i, a, k, hd = shape
    return ModelSpec("probe", "probe", 1024, h, i, 4, a, k, hd, False)


@pytest.mark.parametrize("shape", [*PROBE_SHAPES.values(), LLAMA_70B], ids=[*PROBE_SHAPES, "llama-70B"])
def test_the_planners_float8_linears_are_the_ones_the_engine_converts(shape):
    """The planner restates models/float8.py's rule (it imports no torch); both pick the same linears of a block,
    built by transformers on the meta device: k and v stay bf16 where they are narrow, and at 70B they are not."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from shardwise.models.float8 import float8_targets

    h, i, a, k, hd = shape
    cfg = LlamaConfig(vocab_size=1024, hidden_size=h, intermediate_size=i, num_hidden_layers=2, num_attention_heads=a,
                      num_key_value_heads=k, head_dim=hd)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    engine = sorted({n.rsplit(".", 1)[-1] for n in float8_targets(model)})
    assert engine == sorted(float8_linears(_spec(shape)))
    assert ("k_proj" in engine) == (shape == LLAMA_70B)


def _probe_rows() -> dict:
    with open(RESULTS / "float8_probe_h200_2026-12-01.json") as fh:
        rows = json.load(fh)["rows"]
    return {(r["shape"], r["weights"], r["float8"]): r for r in rows}


@pytest.mark.parametrize("weights", ["autocast", "bf16"])
@pytest.mark.parametrize("shape", list(PROBE_SHAPES))
def test_float8_block_terms_reproduce_the_measured_compiled_blocks(shape, weights):
    """One compiled block's saved bytes with float8 minus without, per token, as measured: the recomputed float8
    inputs (float8_block_bytes) and, under autocast, the bf16 weight copies the compiled graph no longer saves
    for the converted linears (what the planner's autocast_weights term drops). Within 1% of the block."""
    rows = _probe_rows()
    bf16, f8 = rows[(shape, weights, False)], rows[(shape, weights, True)]
    spec = _spec(PROBE_SHAPES[shape])
    T = bf16["tokens"]
    job = Job(micro_batch=1, seq_len=T, compute="bf16", param_dtype="fp32" if weights == "autocast" else "bf16",
              compile=True, float8=True)
    predicted = float8_block_bytes(spec, job)
    if weights == "autocast":  # the planner's autocast_weights term, with float8 minus without, per block
        from dataclasses import replace

        from shardwise.plan.decide import opts_for
        from shardwise.plan.memory import estimate

        def copies(j):
            return estimate(spec, j, opts_for("single")).detail["buffer.autocast_weights"]

        predicted += (copies(job) - copies(replace(job, float8=False))) / spec.num_layers
        assert predicted < float8_block_bytes(spec, job)
    measured = f8["block_act_bytes"] - bf16["block_act_bytes"]
    assert measured < 0
    assert abs(predicted - measured) <= 0.01 * bf16["block_act_bytes"], (predicted / T, measured / T)
    # eager blocks save each linear's high-precision input as before: no activation change is counted
    assert float8_block_bytes(spec, Job(micro_batch=1, seq_len=T, compile=False, float8=True)) == 0


# (results file, model, micro-batch, seq, checkpointing); each holds bf16 variants and their float8 ones
RUNS = [("one_gpu_levers_h200_2026-12-01.json", "llama-1.1B", 8, 2048, False),
        ("float8_runs_h200_2026-12-01-anchor-ckpt.json", "llama-1.1B", 8, 2048, True),
        ("float8_runs_h200_2026-12-01-llama0.3b.json", "llama-0.3B", 16, 2048, False),
        ("float8_runs_h200_2026-12-01-llama3b.json", "llama-3B", 4, 2048, False),
        ("float8_runs_h200_2026-12-01-qwen.json", "qwen2.5-1.5B", 3, 3072, False)]


def _measured(name: str) -> dict:
    """{variant: (median step seconds, peak GiB)} of one results file."""
    with open(RESULTS / name) as fh:
        d = json.load(fh)
    runs = d["levers"]["runs"] if "levers" in d else d["runs"]
    out: dict = {}
    for r in runs:
        if "step_s" in r:
            out.setdefault(r["variant"], []).append((r["step_s"], r["peak_gib"]))
    return {v: (statistics.median(s for s, _ in rs), rs[0][1]) for v, rs in out.items()}


@pytest.mark.parametrize("run", RUNS, ids=["anchor", "anchor-ckpt", "llama-0.3B", "llama-3B", "qwen2.5-1.5B"])
def test_float8_runs_within_goals_and_the_change_predicted(run):
    """Every measured row, bf16 and float8, single and fsdp: peak within 10% and step time within 20% (issue 16's
    goals); and the changes float8 makes, to the peak within 0.3 GiB and to the step time within 12 ms of the
    measured ones."""
    name, model, mb, seq, ckpt = run
    pa = _pa()
    measured = _measured(name)
    for strategy in ("single", "fsdp"):
        if f"{strategy}+float8" not in measured:
            continue
        c = pa.case(model, strategy, mb, seq, ckpt, "bf16", 1, True, True)
        plain, f8 = pa.plan_case(c, 1, "cuda"), pa.plan_case(c, 1, "cuda", float8=True)
        (t0, m0), (t1, m1) = measured[strategy], measured[f"{strategy}+float8"]
        for sp, t, m in ((plain, t0, m0), (f8, t1, m1)):
            assert abs(sp.memory.peak_tensors / GiB / m - 1) <= MEM_TOL, (strategy, sp.memory.peak_tensors / GiB, m)
            assert abs(sp.timing.step_s / t - 1) <= SPEED_TOL, (strategy, sp.timing.step_s, t)
        change = (f8.memory.peak_tensors - plain.memory.peak_tensors) / GiB
        assert abs(change - (m1 - m0)) <= 0.3, (strategy, change, m1 - m0)
        # the step-time change too: within 12 ms of the measured one (-2.8 to -50.2 ms on these rows; the float8
        # time term left out misses the anchor by 31 ms)
        dt = f8.timing.step_s - plain.timing.step_s
        assert abs(dt - (t1 - t0)) <= 0.012, (strategy, dt, t1 - t0)
        # where float8 saves more than 1 GiB, the float8 plan is nearer the float8 run than the plan that ignores it
        if m0 - m1 > 1.0:
            assert abs(f8.memory.peak_tensors / GiB - m1) < abs(plain.memory.peak_tensors / GiB - m1)


def test_float8_with_selective_checkpointing_within_goals():
    """The anchor with selective checkpointing, bf16 and float8 (float8_runs_h200_2026-12-01-anchor-sac.json): peak
    within 10% and step time within 20%, and float8's step-time change within 12 ms of the measured one."""
    pa = _pa()
    measured = _measured("float8_runs_h200_2026-12-01-anchor-sac.json")
    c = pa.case("llama-1.1B", "single", 8, 2048, False, "bf16", 1, True, True)
    plain = pa.plan_case(c, 1, "cuda", selective_checkpointing=True)
    f8 = pa.plan_case(c, 1, "cuda", selective_checkpointing=True, float8=True)
    for sp, (t, m) in ((plain, measured["single+sac"]), (f8, measured["single+sac+float8"])):
        assert abs(sp.memory.peak_tensors / GiB / m - 1) <= MEM_TOL, (sp.memory.peak_tensors / GiB, m)
        assert abs(sp.timing.step_s / t - 1) <= SPEED_TOL, (sp.timing.step_s, t)
    dt = f8.timing.step_s - plain.timing.step_s
    assert abs(dt - (measured["single+sac+float8"][0] - measured["single+sac"][0])) <= 0.012, dt


def test_plan_cli_float8_drops_deepspeed_presets_and_refuses_a_gpu_without_float8(capsys, tmp_path, monkeypatch):
    """`plan --float8`: the DeepSpeed presets (refused with float8 before launch) are not offered, ddp is faster
    and leaner than without; a GPU known to lack float8 tensor cores is one line naming the flag, while one the
    table does not know is planned as the default GPU (as for its bf16 peak)."""
    from shardwise import cli
    from shardwise.errors import ShardwiseError
    from shardwise.plan import command as plan_cmd

    monkeypatch.setenv("SHARDWISE_CACHE_DIR", str(tmp_path / "cache"))

    def plan(*extra):
        args = cli.build_parser().parse_args(["plan", "--model", "qwen2.5-1.5b", "--gpus", "2", "--gpu-memory", "80",
                                              "--seq-len", "4096", *extra])
        return plan_cmd.build(args)[0]

    base, f8 = plan("--gpu-type", "H200"), plan("--gpu-type", "H200", "--float8")
    assert {s.strategy for s in base.strategies if s.base == "deepspeed"}
    assert not any(s.base == "deepspeed" for s in f8.strategies)
    b, f = (next(s for s in p.strategies if s.strategy == "ddp") for p in (base, f8))
    assert f.timing.step_s < b.timing.step_s and f.memory.peak_tensors < b.memory.peak_tensors
    with pytest.raises(ShardwiseError, match=r"^flag --float8: float8 runs on float8 tensor cores .*A100 has none"):
        plan("--gpu-type", "A100", "--float8")
    unknown = plan("--gpu-type", "B200", "--float8")
    assert unknown.setup.fp8_peak_flops == f8.setup.fp8_peak_flops > 0
    assert any("'B200' unknown: assumed H100" in n for n in unknown.setup.notes)


def test_the_float8_terms_are_zero_without_float8():
    spec = find_preset("llama-3.1-8b")
    job = Job(micro_batch=2, seq_len=4096, compile=True)
    assert float8_block_bytes(spec, job) == 0
    assert float8_linears(spec)  # the rule itself does not depend on the flag


def test_nothing_float8_refuses_is_offered_with_it(tmp_path, monkeypatch):
    """With float8 on, neither the tensor-parallel rows, nor --strategy auto's escalation, nor the fit advice offers
    what the config refuses with float8 (TP, adapters), unless the advice drops float8 and says so; the planner's
    float8 terms also stay out of any LoRA or TP job. Llama-3.1-8B, micro-batch 1, checkpointing, bf16 weights, on
    8 H100s: at 64k in 12 GiB only TP fits (auto picks TP 8 without float8), at 2k in 8 GiB only QLoRA does."""
    import dataclasses

    from shardwise import cli
    from shardwise.plan import command as plan_cmd
    from shardwise.plan.decide import fit_advice
    from shardwise.plan.memory import float8_backward_bytes

    monkeypatch.setenv("SHARDWISE_CACHE_DIR", str(tmp_path / "cache"))

    def plan(mem, seq, *extra):
        args = cli.build_parser().parse_args(["plan", "--model", "llama-3.1-8b", "--gpus", "8", "--gpu-type", "H100",
                                              "--micro-batch-size", "1", "--gradient-checkpointing", "--param-dtype",
                                              "bf16", "--gpu-memory", mem, "--seq-len", seq, *extra])
        return plan_cmd.build(args)[0]

    bf16, f8 = plan("12", "65536"), plan("12", "65536", "--float8")
    assert bf16.tp_rows and not f8.tp_rows
    assert bf16.parallel["tensor_parallel"] == 8 and f8.parallel.get("tensor_parallel", 1) == 1
    assert "Cheapest change that fits: --tensor-parallel 8 --no-float8 " in fit_advice(f8, "fsdp")
    assert "Cheapest change that fits: --tensor-parallel 8 " in fit_advice(bf16, "fsdp")
    assert "Cheapest change that fits: --tuner qlora --no-float8 " in fit_advice(plan("8", "2048", "--float8"), "fsdp")
    spec, job = f8.spec, f8.job
    assert float8_block_bytes(spec, job) < 0 and float8_backward_bytes(spec, job) > 0
    for other in (dataclasses.replace(job, tuner="lora"), dataclasses.replace(job, tp=2)):
        assert float8_block_bytes(spec, other) == 0 and float8_backward_bytes(spec, other) == 0


def test_lint_suggests_float8_where_the_gpu_has_it_and_it_pays(tmp_path, monkeypatch):
    """A configured full fine-tune on an H200 that float8 would speed up by >= 5% gets an info line with both
    predictions; not on an A100 (no float8), not when --float8 is on, not under LoRA (float8 is full fine-tuning
    only), and not where the planner predicts less (Qwen2.5-1.5B at 2k: its big vocabulary's head stays bf16)."""
    from shardwise import cli
    from shardwise.plan import command as plan_cmd

    monkeypatch.setenv("SHARDWISE_CACHE_DIR", str(tmp_path / "cache"))

    def lint(model, *extra):
        args = cli.build_parser().parse_args(["plan", "--model", model, "--gpus", "1", "--gpu-memory", "80",
                                              "--strategy", "single", *extra])
        plan = plan_cmd.build(args)[0]
        return [f for f in plan.lint if f["check"] == "float8-off"], plan

    found, plan = lint("llama-3.2-3b", "--gpu-type", "H200")
    assert len(found) == 1 and found[0]["severity"] == "info"
    single = next(s for s in plan.strategies if s.strategy == "single")
    assert f"vs {single.tokens_per_s:,.0f} tokens/s (+" in found[0]["message"]
    with_f8, _ = lint("llama-3.2-3b", "--gpu-type", "H200", "--float8")
    assert not with_f8
    assert not lint("llama-3.2-3b", "--gpu-type", "A100")[0]
    assert not lint("llama-3.2-3b", "--gpu-type", "H200", "--tuner", "lora")[0]
    assert not lint("qwen2.5-1.5b", "--gpu-type", "H200")[0]
