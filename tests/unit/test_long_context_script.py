"""benchmarks/long_context.py's parts that run without a GPU: the planner's prediction for a
row (through the real `shardwise plan --json`) and the report it writes."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import long_context as lc  # noqa: E402


def test_prediction_per_row_reads_the_plan_and_sp_lowers_memory():
    one = lc.predict("llama-3.1-8b", 131072, 1, 2, [])
    two = lc.predict("llama-3.1-8b", 131072, 2, 2, [])
    assert "plan_error" not in one and "plan_error" not in two, (one, two)
    assert two["pred_mem_gib"] < one["pred_mem_gib"]
    # the tensor peak (what max_memory_allocated measures), below the total with the CUDA allowance
    assert 0 < two["pred_mem_gib"] < two["pred_mem_total_gib"]
    assert 0 < two["pred_tokens_per_s_gpu"] < 10_000  # per GPU, not the cluster's


def test_report_has_a_row_per_run_with_prediction_and_oom_status(tmp_path):
    meta = {"date": "2026-11-30", "versions": {"gpu": "H200"},
            "config": {"shape": "llama3.1-8b", "model": {}, "gpus": 2, "steps": 4, "packing": False, "extra_flags": []}}
    results = [{"length": 65536, "sp": 2, "command": "x", "exit_code": 0, "tokens_per_s_gpu": 3900,
                "step_time_s": 8.4, "peak_mem_gib": 70.1, "pred_mem_gib": 72.0, "pred_mem_total_gib": 77.5,
                "pred_tokens_per_s_gpu": 2781.5},
               {"length": 262144, "sp": 1, "command": "y", "exit_code": 1, "oom": True, "error_tail": "OOM",
                "pred_mem_gib": 140.5, "pred_mem_total_gib": 146.0, "pred_tokens_per_s_gpu": 921.0}]
    base = str(tmp_path / "r")
    lc.write_report(base, meta, results)
    md = open(base + ".md").read()
    assert "| 65,536 | 2 | 3900 | 2782 | 8.4 | 70.1 | 72.0 (77.5) | ok |" in md
    assert "| 262,144 | 1 | — | 921 | — | — | 140.5 (146.0) | OOM |" in md
    assert json.load(open(base + ".json"))["results"][1]["oom"] is True
