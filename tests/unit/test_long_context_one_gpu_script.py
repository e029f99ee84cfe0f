"""benchmarks/long_context_one_gpu.py's parts that run without a GPU: the plan beside a row (the real
`shardwise plan --json`), the ladder's choice, and the report (the run itself: `--smoke` on the CPU)."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import long_context_one_gpu as lc  # noqa: E402


def test_plan_beside_a_row_sees_the_levers():
    h100 = ("--gpus", "1", "--gpu-memory", "80", "--gpu-type", "H100")
    plain = lc.plan("llama-3.1-8b", 262144, lc.ROWS["lora-64k-plain"].flags, smoke=False, hardware=h100)
    levers = lc.plan("llama-3.1-8b", 262144, lc.ROWS["lora-256k-nodrop"].flags, smoke=False, hardware=h100)
    assert not plain["plan_fits"] and levers["plan_fits"], (plain, levers)
    assert plain["plan_host_kept_gib"] == 0 and levers["plan_host_kept_gib"] == 64.0  # 32 block inputs of 2 GiB
    # the process's peak: the fp32 load (29.9 GiB) without offload; with it, the checkpoints, compiler and process
    assert 29.9 < plain["plan_host_gib"] < 32 and 64.0 + 7 < levers["plan_host_gib"] < 64.0 + 9
    assert levers["plan_gib"] < 80 < plain["plan_gib"]


def test_report_rows_status_and_the_64k_ratio(tmp_path):
    meta = {"date": "2026-12-07", "versions": {"gpu": "H100"}, "host_gib": 128.0}
    results = [{"row": "lora-64k-plain", "shape": "llama3.1-8b", "what": "x", "levers": "plain", "length": 65536,
                "exit_code": 0, "tokens_per_s": 4300, "steps_logged": 3, "step_s": 15.2, "peak_gib": 51.0,
                "plan_gib": 50.8, "host_peak_gib": 20.1, "plan_host_gib": 0.0, "plan_tokens_per_s": 4304.0},
               {"row": "lora-64k-levers", "shape": "llama3.1-8b", "levers": "both", "length": 65536, "exit_code": 0,
                "tokens_per_s": 3870, "steps_logged": 3, "step_s": 16.9, "peak_gib": 30.0, "plan_gib": 31.0,
                "host_used_gib": 17.5, "host_peak_gib": 40.0, "plan_host_gib": 16.0, "plan_tokens_per_s": 4100.0},
               {"row": "lora-256k", "shape": "llama3.1-8b", "levers": "both", "length": 262144,
                "exit_code": "timeout", "tokens_per_s": 1500, "steps_logged": 1, "peak_gib": 70.0},
               {"row": "qlora-256k", "shape": "llama3.1-8b", "levers": "both", "length": 262144,
                "skipped": "220 s for one step, 40 s left"}]
    base = str(tmp_path / "r")
    lc.write_report(base, meta, results)
    md = open(base + ".md").read()
    row = "| lora-64k-levers | llama3.1-8b | both | 65,536 | ok | 3870 | 0.90 | 16.9 | 30.0 | 31.0 | 17.5 (40.0) | 16.0 | 4100 |"
    assert row in md
    assert "| lora-256k | llama3.1-8b | both | 262,144 | stopped at the budget after 1 step(s) | 1500 (1st) |" in md
    assert "| skipped: 220 s for one step, 40 s left |" in md
    assert json.load(open(base + ".json"))["results"][3]["skipped"]


def test_snapshot_breakdown_names_what_was_alive_at_the_peak_and_the_report_lists_it(tmp_path):
    """--snapshot: a run's allocator history (torch's snapshot format: device_traces of alloc / free_completed
    events with their Python frames) is replayed to its largest total; what was alive there, by the line that
    made it, goes into the row and the report. A block freed before the peak is not in it."""
    import pickle

    def frame(path, line, name):
        return [{"filename": f"/site-packages/{path}", "line": line, "name": name}]

    events = [{"action": "alloc", "addr": 1, "size": 3 << 30, "frames": frame("shardwise/models/tiles.py", 30, "t")},
              {"action": "alloc", "addr": 2, "size": 1 << 30, "frames": frame("transformers/x.py", 5, "a")},
              {"action": "free_completed", "addr": 2, "size": 1 << 30, "frames": []},
              {"action": "alloc", "addr": 3, "size": 2 << 30, "frames": frame("shardwise/models/speed.py", 9, "h")},
              {"action": "free_completed", "addr": 1, "size": 3 << 30, "frames": []}]
    path = tmp_path / "rank0.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [events]}))
    b = lc.breakdown(str(path))
    assert b["peak_bytes_in_trace"] == 5 << 30
    assert [(x["where"], x["bytes"]) for x in b["top"]] == [("models/tiles.py:30 t", 3 << 30),
                                                            ("models/speed.py:9 h", 2 << 30)]
    meta = {"date": "2026-12-07", "versions": {"gpu": "H100"}, "host_gib": 128.0}
    rec = {"row": "lora-256k", "shape": "llama3.1-8b", "levers": "both", "length": 262144, "exit_code": 0,
           "peak_breakdown": b}
    lc.write_report(str(tmp_path / "r"), meta, [rec])
    text = (tmp_path / "r.md").read_text()
    assert "alive at the first step's peak (5.00 GiB" in text and "- 3.00 GiB in 1 block(s): models/tiles.py:30 t" in text
