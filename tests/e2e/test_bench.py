"""`shardwise bench` end to end: real 2-rank launches through `shardwise train`, kept short
(a few steps, three launches in all)."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import time

import pytest

from tests.helpers import ConcurrentRuns, read_metrics


@contextlib.contextmanager
def logs_on_failure(rep_dir):
    """A failed assertion also shows the end of each strategy's bench.log."""
    try:
        yield
    except AssertionError as e:
        tails = []
        for log in sorted(glob.glob(os.path.join(str(rep_dir), "runs", "*", "bench.log"))):
            with open(log, errors="replace") as fh:
                tails.append(f"--- {log}\n" + "".join(fh.readlines()[-25:]))
        raise AssertionError(f"{e}\n" + "\n".join(tails)) from None


@pytest.fixture(scope="module")
def benches(tmp_path_factory):
    """The two bench commands below, started together: each is mostly process start-up and
    nothing here asserts a speed, so two at a time use both cores."""
    runs, dirs = ConcurrentRuns(), {}
    dirs["every"] = tmp_path_factory.mktemp("bench-every")
    runs.add("every", "bench", "--strategies", "fsdp,single,ddp", "--nproc-per-node", "2", "--steps", "2",
             "--warmup", "1", "--repeat", "2", "--report-dir", str(dirs["every"] / "rep"), "--report-name", "auto", "--timeout", "180",
             env={"SHARDWISE_BENCH_FAULT": "fsdp=oom@2"}, cwd=str(dirs["every"]))
    dirs["alloc"] = tmp_path_factory.mktemp("bench-alloc")
    runs.add("alloc", "bench", "--strategies", "ddp", "--micro-batch-size", "512", "--steps", "1", "--warmup", "0",
             "--report-dir", str(dirs["alloc"] / "rep"), "--timeout", "180",
             env={"SHARDWISE_BENCH_MEMORY_CAP_GIB": "2.0"}, cwd=str(dirs["alloc"]), check=False)
    return runs, dirs


def test_bench_reports_every_strategy_even_when_some_fail(benches):
    """fsdp runs out of memory at step 2 (the loop's fault injection raises
    torch.OutOfMemoryError through the real worker path), `single` cannot run on 2 ranks, and
    ddp still runs; the report names its files model_hardware_date and has a row for each. The
    bench's default 2 profiled steps (after the counted ones) measure ddp's communication.
    --repeat 2: ddp runs twice (round-robin) and its row is the run with the median tokens/s;
    what did not fit or could not run is not run again."""
    runs, dirs = benches
    rep_dir = dirs["every"] / "rep"
    p = runs.get("every")
    with logs_on_failure(rep_dir):
        _check_report(rep_dir, p.stdout)


def _check_report(rep_dir, stdout):
    stem = f"tiny_cpu-2ranks_{time.strftime('%Y-%m-%d')}"
    assert sorted(f for f in os.listdir(rep_dir) if f != "runs") == [f"{stem}.{e}" for e in ("json", "md", "png")]
    rep = json.load(open(rep_dir / f"{stem}.json"))
    rows = {r["strategy"]: r for r in rep["results"]}

    assert rows["fsdp"]["status"] == "oom" and rows["fsdp"]["result"] == "does not fit"
    assert "OutOfMemoryError" in rows["fsdp"]["reason"] or "out of memory" in rows["fsdp"]["reason"]
    assert rows["single"]["status"] == "unavailable" and "one process" in rows["single"]["reason"]
    ddp = rows["ddp"]
    assert ddp["status"] == "ok" and ddp["measured"]["steps_counted"] == 2 and ddp["measured"]["last_step"] == 5
    # steps 4-5 ran under torch.profiler: gloo's all-reduces were seen, and never more exposed than in all
    recs = read_metrics(ddp["run_dir"])
    assert [r["step"] for r in recs if r.get("profiled")] == [4, 5]
    for r in recs:
        if r["step"] <= 3:
            assert not {"profiled", "comm_total_s", "comm_exposed_s"} & set(r), r
        else:
            assert r["comm_total_s"] > 0 and 0 <= r["comm_exposed_s"] <= r["comm_total_s"], r
            assert r["comm_method"].startswith("cpu: gloo collectives")
    comm = ddp["measured"]["comm_exposed_s"]
    assert comm["n"] == 2 and comm["median"] <= ddp["measured"]["comm_total_s"]["median"]
    assert ddp["measured"]["tokens_per_s"]["median"] > 0 and ddp["measured"]["final_loss"] > 0
    mem = ddp["measured"]["peak_mem_gib"]
    assert 0 < mem["min"] <= mem["max"] and set(mem["per_rank"]) == {"0", "1"}
    assert ddp["config"]["strategy"] == "ddp" and ddp["config"]["save_final"] is False
    assert not os.path.exists(os.path.join(ddp["run_dir"], "final"))  # no final save in a bench
    # the planner's estimate stands beside the row that did not fit (when this build has a planner)
    if rep["planner"]["available"]:
        assert rows["fsdp"]["predicted"]["peak_mem_gib"] > 0 and ddp["error_pct"]["tokens_per_s"] is not None
    for key in ("python", "torch", "transformers"):
        assert rep["versions"][key]
    assert rep["hardware"]["accelerator"] == "cpu" and rep["config"]["model"] == "tiny"

    md = open(rep_dir / f"{stem}.md").read()
    assert "| fsdp | does not fit |" in md and "| ddp | ok |" in md and f"]({stem}.png)" in md
    assert "then 2 profiled steps" in md and "Method: cpu: gloo collectives" in md
    assert "ddp" in stdout and "does not fit" in stdout and "cannot run here" in stdout  # terminal table

    # --repeat 2
    assert rep["settings"]["repeat"] == 2 and "run 2/2] ddp" in stdout
    reps = ddp["repeats"]
    assert [os.path.basename(r["run_dir"]) for r in reps] == ["ddp-r1", "ddp-r2"]
    assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 for r in reps)
    slower = min(reps, key=lambda r: r["tokens_per_s"])  # the median of two: the lower middle one
    assert ddp["run_dir"] == slower["run_dir"] and ddp["measured"]["tokens_per_s"]["median"] == slower["tokens_per_s"]
    assert [r["status"] for r in rows["fsdp"]["repeats"]] == ["oom"] and len(rows["single"]["repeats"]) == 1
    assert "ran 2 times round-robin" in md and "ddp " + " / ".join(f"{r['tokens_per_s']:,.0f}" for r in reps) in md


def test_a_real_failed_allocation_becomes_does_not_fit(benches):
    """An address-space cap on the strategy's processes makes a large micro-batch's activations
    really fail to allocate on the CPU; the bench reports it as "does not fit" and exits 1
    because nothing could be measured."""
    runs, dirs = benches
    tmp_path = dirs["alloc"]
    p = runs.get("alloc")
    with logs_on_failure(tmp_path / "rep"):
        assert p.returncode == 1, p.stdout + p.stderr
        rep = json.load(open(tmp_path / "rep" / "report.json"))
        (row,) = rep["results"]
        assert row["status"] == "oom", row
        assert "allocate" in row["reason"].lower()
        assert os.path.isfile(tmp_path / "rep" / "report.png") and os.path.isfile(tmp_path / "rep" / "report.md")
