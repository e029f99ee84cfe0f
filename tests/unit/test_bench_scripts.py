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
