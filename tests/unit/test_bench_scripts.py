"""Helpers of the benchmark scripts that decide what a GPU run reports (benchmarks/ is not a package)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import plan_accuracy as pa  # noqa: E402


def _ev(action, addr, size, filename="x.py", line=1, name="f"):
    frames = [{"filename": "/torch/nn/functional.py", "line": 9, "name": "linear"},
              {"filename": filename, "line": line, "name": name}]
    return {"action": action, "addr": addr, "size": size, "frames": frames}


def test_peak_breakdown_replays_the_trace_to_its_largest_total_and_groups_by_own_frame():
    ds = "/site-packages/deepspeed/runtime/zero/stage3.py"
    events = [
        _ev("alloc", 1, 100, ds, 10, "bucket"),              # kept throughout
        _ev("alloc", 2, 50, "/src/shardwise/train/loop.py", 5, "step"),
        _ev("alloc", 3, 70, ds, 20, "fetch"),                 # peak: 100 + 50 + 70 + 30 = 250
        _ev("alloc", 4, 30, ds, 20, "fetch"),
        _ev("free_requested", 3, 70),
        _ev("free_completed", 3, 70),
        _ev("free_completed", 4, 30),
        _ev("alloc", 5, 90, "/other/lib.py", 3, "g"),         # 100 + 50 + 90 = 240 < 250
    ]
    out = pa.peak_breakdown({"device_traces": [events]})
    assert out["peak_bytes_in_trace"] == 250 and out["events"] == 8
    top = {x["where"]: (x["blocks"], x["bytes"]) for x in out["top"]}
    assert top == {"zero/stage3.py:10 bucket": (1, 100), "zero/stage3.py:20 fetch": (2, 100),
                   "train/loop.py:5 step": (1, 50)}
    assert [x["bytes"] for x in out["top"]] == sorted((x["bytes"] for x in out["top"]), reverse=True)
    # each block alive at the peak, largest first, with the frames that made it (innermost first)
    assert [(x["bytes"], x["own"]) for x in out["largest"]] == [
        (100, ["zero/stage3.py:10 bucket"]), (70, ["zero/stage3.py:20 fetch"]), (50, ["train/loop.py:5 step"]),
        (30, ["zero/stage3.py:20 fetch"])]
    assert out["largest"][0]["made_in"] == ["nn/functional.py:9 linear", "zero/stage3.py:10 bucket"]


def test_peak_breakdown_takes_the_peak_inside_the_measured_window_only():
    """The model built in fp32 before wrapping can be the largest total of the whole trace; the breakdown must
    describe the second step's peak, which opens at the _window_mark allocation."""
    init = "/site-packages/transformers/models/llama/modeling_llama.py"
    mark = {"action": "alloc", "addr": 9, "size": 512,
            "frames": [{"filename": "/benchmarks/plan_accuracy.py", "line": 1, "name": pa.WINDOW_MARK}]}
    events = [
        _ev("alloc", 1, 1000, init, 169, "__init__"),          # the whole trace's largest total: 1000 + 40
        _ev("alloc", 2, 40, "/src/shardwise/strategies/fsdp.py", 7, "wrap"),
        _ev("free_completed", 1, 1000),
        mark, _ev("free_completed", 9, 512),
        _ev("alloc", 3, 300, "/src/shardwise/models/speed.py", 31, "forward"),  # window peak: 40 + 300 + 200
        _ev("alloc", 4, 200, "/src/shardwise/models/speed.py", 26, "forward"),
        _ev("free_completed", 3, 300),
    ]
    out = pa.peak_breakdown({"device_traces": [events]})
    assert out["peak_bytes_in_trace"] == 540 and out["window_from_event"] == 3
    assert {x["where"]: x["bytes"] for x in out["top"]} == {
        "models/speed.py:31 forward": 300, "models/speed.py:26 forward": 200, "strategies/fsdp.py:7 wrap": 40}
    assert out["at"] == ["models/speed.py:26 forward"]
    # without a mark the window is the whole trace
    assert pa.peak_breakdown({"device_traces": [events[:3] + events[5:]]})["peak_bytes_in_trace"] == 1040


def test_hybrid_cases_run_on_four_ranks_in_shard_groups_of_two():
    """The CPU table's hybrid rows: their own launch of 4 ranks, fsdp.shard_group_size 2 in the config the case
    runs, and the prediction made for shard groups of 2 (the same per-rank state as fsdp on 2 ranks)."""
    hyb = [c for c in pa.cpu_cases(False) if c["strategy"] == "hybrid"]
    assert hyb and all(c["nproc"] == 4 and c["shard_group_size"] == 2 for c in hyb)
    assert all(c.get("nproc") is None for c in pa.cpu_cases(False) if c["strategy"] != "hybrid")
    c = hyb[0]
    cfg = pa.config_for(c, 4)
    assert cfg.strategy == "hybrid" and cfg.fsdp.hybrid and cfg.fsdp.shard_group_size == 2
    fsdp2 = {**c, "strategy": "fsdp"}
    del fsdp2["shard_group_size"], fsdp2["nproc"]
    assert pa.predicted_bytes(c, 4, "cpu") == pa.predicted_bytes(fsdp2, 2, "cpu")
    assert pa.predicted_bytes(c, 4, "cpu") > pa.predicted_bytes({**fsdp2}, 4, "cpu")


def test_auto_sweep_measures_and_judges_autos_whole_pick_with_its_degrees():
    """When auto adds tensor/sequence parallelism, the sweep launches that (preset + degrees) and compares it,
    not the bare preset of the same name."""
    import auto_sweep as sw

    plan = {"recommended": "fsdp", "degrees": {"tensor_parallel": 1, "sequence_parallel": 2, "sp_mode": "ulysses"}}
    assert sw.pick_name(plan) == "fsdp+sp2"
    assert sw.degree_flags("fsdp+sp2", plan) == ("fsdp", ["--sequence-parallel", "2", "--sp-mode", "ulysses"])
    assert sw.degree_flags("zero2", plan) == ("zero2", [])
    assert sw.pick_name({"recommended": "ddp", "degrees": {"tensor_parallel": 1, "sequence_parallel": 1}}) == "ddp"
    entry = {"plan": plan, "measured": [{"strategy": "fsdp", "status": "ok", "tokens_per_s": 1000},
                                        {"strategy": "fsdp+sp2", "status": "ok", "tokens_per_s": 900}]}
    v = sw.verdict(entry)
    assert v["auto"] == "fsdp+sp2" and v["fastest"] == "fsdp"
    assert abs(v["auto_vs_fastest"] + 0.10) < 1e-9 and v["auto_within_5pct"] is False


def test_scaling_rows_efficiency_and_autos_verdict():
    """benchmarks/scaling.py (issue 21): which strategy runs at which GPU count, efficiency against the smallest
    count the strategy ran at, auto's pick against the fastest measured row. (The whole script ran on 1 and 2
    gloo ranks by hand: `--device cpu --gpus 1,2 --jobs tiny`.)"""
    import scaling as sc

    assert sc.preset_flags("hybrid4") == ("hybrid", ["--fsdp-shard-group-size", "4"])
    assert sc.preset_flags("zero3") == ("zero3", [])
    assert [n for n in (1, 2, 4, 8) if sc.applies("hybrid4", n)] == [8]
    assert [n for n in (1, 2, 4, 8) if sc.applies("hybrid2", n)] == [4, 8]
    assert [n for n in (1, 2, 4, 8) if sc.applies("single", n)] == [1]
    rows = [{"job": "j", "gpus": 2, "strategy": "fsdp", "tokens_per_s_gpu": 1000, "plan": {"auto": "fsdp"}},
            {"job": "j", "gpus": 8, "strategy": "fsdp", "tokens_per_s_gpu": 920, "plan": {"auto": "hybrid"}},
            {"job": "j", "gpus": 8, "strategy": "ddp", "plan": {"auto": "hybrid"}, "status": "OOM"},
            {"job": "j", "gpus": 8, "strategy": "hybrid", "tokens_per_s_gpu": 950, "plan": {"auto": "hybrid"}}]
    sc.efficiencies(rows)
    assert rows[1]["efficiency"] == 0.92 and rows[1]["baseline_gpus"] == 2  # no 1-GPU row: the smallest that ran
    assert "efficiency" not in rows[2]
    v = {(x["job"], x["gpus"]): x for x in sc.auto_verdicts(rows)}
    assert v[("j", 8)]["fastest"] == "hybrid" and v[("j", 8)]["auto_vs_fastest"] == 0.0
    assert v[("j", 2)]["auto_vs_fastest"] == 0.0


def test_issue16_cases_cover_presets_tuners_checkpointing_and_run_the_tuner_they_name():
    """The one-H200 table of issue 16: every one-GPU preset x {full, LoRA} x checkpointing on both shapes, QLoRA under
    single only (the config refuses it sharded), compiled rows last; each case's Config carries its tuner and rank,
    and the planner plans that tuner (fewer trainable parameters, adapters' bytes in the step)."""
    cases = pa.issue16_cases()
    eager = [c for c in cases if not c["compile"]]
    assert len(eager) == 2 * (4 * 2 * 2 + 2) and cases[:len(eager)] == eager
    for model in ("qwen2.5-1.5B", "llama-1.1B"):
        got = {(c["strategy"], c.get("tuner", "full"), c["ckpt"]) for c in eager if c["model"] == model}
        assert got == {(s, t, k) for s in ("single", "fsdp", "zero2", "zero3") for t in ("full", "lora")
                       for k in (False, True)} | {("single", "qlora", False), ("single", "qlora", True)}
    q = next(c for c in cases if c.get("tuner") == "qlora")
    cfg = pa.config_for(q, 1)
    assert cfg.tuner == "qlora" and cfg.lora.r == pa.LORA_R and cfg.strategy == "single"
    full, lora = (pa.plan_case({**q, "tuner": t}, 1, "cuda") for t in ("full", "lora"))
    assert lora.memory.detail["trainable_params"] < full.memory.detail["trainable_params"] / 50
    # the Qwen shape is the published preset's (tied 152k vocabulary, q/k/v biases), shrunk for the CPU smoke run
    assert q["model"] == "qwen2.5-1.5B" and pa.shrink(q)["model"] == "cpu-q"
    spec, small = pa.spec_for("qwen2.5-1.5B"), pa.spec_for("cpu-q")
    assert spec.vocab_size == 151936 and spec.tied_embeddings and spec.attention_bias
    assert small.tied_embeddings and small.attention_bias and small.vocab_size == 2048


def test_step_table_marks_rows_outside_either_goal():
    """table_steps: a row is within goal only when memory is within 10% and step time within 20% of the planner."""
    c = {**pa.case("llama-1.1B", "single", 6, 1536, False, "bf16", 1, False, True), "world": 1, "device": "cuda",
         "error": None}
    sp = pa.plan_case(c, 1, "cuda")
    exact = {**c, "measured": sp.memory.peak_tensors, "measured_step_s": sp.timing.step_s, "tokens_per_s": 1.0}
    slow = {**exact, "measured_step_s": sp.timing.step_s * 1.3}  # predicted 23% fast
    small = {**exact, "measured": sp.memory.peak_tensors * 1.2}  # predicted 17% under
    lines = pa.table(([exact, slow, small])).splitlines()
    assert lines[2].endswith("| yes |") and lines[3].endswith("| NO |") and lines[4].endswith("| NO |")
    assert "+0.0%" in lines[2] and "-23.1%" in lines[3] and "-16.7%" in lines[4]
    assert lines[-1].endswith("both: 1/3")
