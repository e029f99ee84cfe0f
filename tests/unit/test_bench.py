"""`shardwise bench` without launching anything: statistics, failure classification, the
per-strategy command line, and the report (JSON schema, Markdown, PNG) from synthetic runs."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import pytest

from shardwise import config
from shardwise.bench import measure, plot, report
from shardwise.bench.command import add_parser, spec_from_args
from shardwise.bench.predict import predict
from shardwise.bench.runner import (
    BenchSpec,
    Outcome,
    classify,
    fault_for,
    memory_cap_bytes,
    strategy_config_file,
    strategy_flags,
    train_argv,
)
from shardwise.errors import ShardwiseError
from tests.helpers import write_jsonl


def _records(n, warmup, tps, loss0=6.0, mem=1.0):
    """n per-step records; the warm-up steps are 10x slower so dropping them is visible."""
    return [{"step": i, "loss": loss0 - 0.1 * i, "tokens_per_s": (tps / 10 if i <= warmup else tps + i),
             "step_time_s": (1.0 if i <= warmup else 0.1 + 0.001 * i), "peak_mem_gib": mem} for i in range(1, n + 1)]


# ----------------------------------------------------------------------------- measure


def test_summarize_drops_warmup_and_takes_median_and_p90():
    s = measure.summarize(_records(12, 2, 1000), warmup=2)
    assert s["steps_counted"] == 10
    tps = [1000 + i for i in range(3, 13)]
    assert s["tokens_per_s"]["median"] == pytest.approx((1007 + 1008) / 2)
    assert s["tokens_per_s"]["min"] == min(tps) and s["tokens_per_s"]["max"] == max(tps)
    assert s["step_time_s"]["p90"] == pytest.approx(measure.percentile([0.1 + 0.001 * i for i in range(3, 13)], 90))
    assert s["final_loss"] == pytest.approx(6.0 - 1.2)
    assert s["peak_mem_gib"]["max"] == 1.0 and s["peak_mem_gib"]["min"] is None  # the loop logs no min yet
    assert s["mfu"] is None and s["comm_exposed_s"] is None


def test_summarize_prefers_sampled_per_rank_peaks_and_reads_loop_min_when_logged():
    s = measure.summarize(_records(4, 1, 10), 1, rank_peak_gib={0: 0.5, 1: 0.4}, world_size=2)
    assert (s["peak_mem_gib"]["max"], s["peak_mem_gib"]["min"]) == (0.5, 0.4)
    # a sample that missed a rank is not a min over ranks: fall back to the loop's numbers
    s = measure.summarize(_records(4, 1, 10), 1, rank_peak_gib={0: 0.5}, world_size=2)
    assert s["peak_mem_gib"]["max"] == 1.0 and s["peak_mem_gib"]["min"] is None
    recs = [dict(r, peak_mem_gib_min=0.7, comm_exposed_s=0.02) for r in _records(4, 1, 10)]
    s = measure.summarize(recs, 1)
    assert s["peak_mem_gib"]["min"] == 0.7 and s["comm_exposed_s"]["median"] == pytest.approx(0.02)


def test_error_pct_sign():
    assert measure.error_pct(120, 100) == pytest.approx(20.0)
    assert measure.error_pct(80, 100) == pytest.approx(-20.0)
    assert measure.error_pct(None, 100) is None and measure.error_pct(1, 0) is None


# ----------------------------------------------------------------------------- failures


@pytest.mark.parametrize("text", [
    "[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79 GiB total)",
    "RuntimeError: [enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
    "you tried to allocate 29360128 bytes. Error code 12 (Cannot allocate memory)",
    "terminate called after throwing an instance of 'std::bad_alloc'",
    "shardwise: error: training failed: rank 1 exited with code -9 (killed by signal 9); its output above says more",
])
def test_out_of_memory_is_does_not_fit(text):
    status, reason = classify("Traceback (most recent call last):\n  File \"x.py\", line 1\n" + text + "\n", 1)
    assert status == "oom" and reason


def test_oom_reason_is_the_exception_not_a_source_line():
    log = ("[rank0]:     raise torch.OutOfMemoryError(f'injected')\n"
           "[rank0]: torch.OutOfMemoryError: injected out-of-memory at step 2\n")
    assert classify(log, 1) == ("oom", "torch.OutOfMemoryError: injected out-of-memory at step 2")


def test_other_failures_keep_the_error_line():
    log = "step 1/5 | loss 6\nshardwise: error: --model /x: no such directory; give a local model\n"
    assert classify(log, 2) == ("failed", "--model /x: no such directory; give a local model")
    assert classify("Traceback\nValueError: bad shape\nsomething after\n", 1) == ("failed", "ValueError: bad shape")
    assert classify("", 3)[0] == "failed"


def test_test_hooks_parse_per_strategy():
    assert memory_cap_bytes("ddp", {"SHARDWISE_BENCH_MEMORY_CAP_GIB": "2"}) == 2 * 2**30
    env = {"SHARDWISE_BENCH_MEMORY_CAP_GIB": "ddp=1.5,fsdp=3"}
    assert memory_cap_bytes("fsdp", env) == 3 * 2**30 and memory_cap_bytes("zero2", env) is None
    with pytest.raises(ShardwiseError, match="SHARDWISE_BENCH_MEMORY_CAP_GIB"):
        memory_cap_bytes("ddp", {"SHARDWISE_BENCH_MEMORY_CAP_GIB": "lots"})
    env = {"SHARDWISE_BENCH_FAULT": "fsdp=oom@3;zero2=kill@2:rank1,nan@4"}
    assert fault_for("fsdp", env) == "oom@3" and fault_for("zero2", env) == "kill@2:rank1,nan@4"
    assert fault_for("ddp", env) is None


# ----------------------------------------------------------------------------- per-strategy command


def _spec(tmp_path, flags=None, path=None, strategies=("ddp", "fsdp")):
    return BenchSpec(config_path=path, flags=flags or {}, strategies=list(strategies), steps=3, warmup=2,
                     report_dir=str(tmp_path), runs_dir=str(tmp_path / "runs"))


def test_strategy_flags_set_the_run_and_keep_each_section_to_its_strategy(tmp_path):
    flags = {"micro_batch_size": ("2", "flag --micro-batch-size"), "fsdp.cpu_offload": (True, "flag"),
             "deepspeed.stage": ("3", "flag"), "max_steps": ("99", "flag")}
    spec = _spec(tmp_path, flags)
    ddp = strategy_flags(spec, "ddp", "/o/ddp")
    assert "fsdp.cpu_offload" not in ddp and "deepspeed.stage" not in ddp
    assert ddp["max_steps"][0] == 5 and ddp["log_every"][0] == 1 and ddp["save_final"][0] is False
    assert ddp["micro_batch_size"][0] == "2" and ddp["strategy"][0] == "ddp"
    assert "fsdp.cpu_offload" in strategy_flags(spec, "fsdp", "/o/fsdp")
    argv = train_argv(None, strategy_flags(spec, "fsdp", "/o/fsdp"))
    assert argv[:4] == [sys.executable, "-m", "shardwise", "train"]
    assert "--fsdp-cpu-offload" in argv and "--no-save-final" in argv and "--force" in argv
    assert argv[argv.index("--max-steps") + 1] == "5" and argv[argv.index("--output-dir") + 1] == "/o/fsdp"
    # what the bench builds must be a valid config for each strategy
    for name in ("ddp", "fsdp", "zero3"):
        res = config.load_config(None, strategy_flags(spec, name, str(tmp_path / name)))
        assert res.cfg.strategy == name and res.cfg.max_steps == 5


def test_config_file_loses_bench_keys_and_other_strategies_sections(tmp_path):
    cfg = tmp_path / "job.yaml"
    cfg.write_text("model: tiny\nseq_len: 64\nstrategy: zero3\nmax_steps: 500\noutput_dir: /elsewhere\n"
                   "fsdp:\n  cpu_offload: true\ndeepspeed:\n  stage: 3\n")
    spec = _spec(tmp_path, path=str(cfg))
    (tmp_path / "ddp").mkdir()
    derived = strategy_config_file(spec, "ddp", str(tmp_path / "ddp"))
    res = config.load_config(derived, strategy_flags(spec, "ddp", str(tmp_path / "ddp")))
    assert res.cfg.seq_len == 64 and res.cfg.strategy == "ddp" and res.cfg.max_steps == 5
    assert "fsdp" not in open(derived).read() and "/elsewhere" not in open(derived).read()


def _args(*argv):
    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers())
    return p.parse_args(["bench", *argv])


def test_command_line_checks_and_defaults(tmp_path):
    spec = spec_from_args(_args("--micro-batch-size", "2", "--report-dir", str(tmp_path)))
    assert spec.strategies[:2] == ["ddp", "fsdp"] and spec.steps == 30 and spec.warmup == 5
    assert spec.runs_dir == os.path.join(str(tmp_path), "runs")
    assert spec.flags["micro_batch_size"][0] == "2"
    with pytest.raises(ShardwiseError, match="unknown strategy 'fdsp'"):
        spec_from_args(_args("--strategies", "ddp,fdsp"))
    with pytest.raises(ShardwiseError, match="--steps"):
        spec_from_args(_args("--steps", "0"))
    assert spec.repeat == 1 and spec_from_args(_args("--repeat", "3")).repeat == 3
    with pytest.raises(ShardwiseError, match="--repeat must be >= 1"):
        spec_from_args(_args("--repeat", "0"))
    with pytest.raises(SystemExit):  # the bench owns max_steps and output_dir
        _args("--max-steps", "3")
    # a report directory that cannot be made is one line before any run (it was a traceback after all of them)
    (tmp_path / "a-file").write_text("mine\n")
    for bad in (tmp_path / "a-file", tmp_path / "a-file" / "rep"):
        with pytest.raises(ShardwiseError, match=r"^--report-dir: .*a-file is a file, not a directory"):
            spec_from_args(_args("--report-dir", str(bad)))
    assert (tmp_path / "a-file").read_text() == "mine\n"


# ----------------------------------------------------------------------------- planner


def test_planner_missing_or_failing_gives_na(monkeypatch):
    cfg = config.load_config(None, {}).cfg
    monkeypatch.setitem(sys.modules, "shardwise.plan", None)  # import fails like an absent module
    p = predict(cfg, 2)
    assert p["available"] is False and "planner" in p["note"]

    class Broken:
        @staticmethod
        def plan_run(cfg, hw=None, world_size=None):
            raise ZeroDivisionError("boom")

    monkeypatch.setitem(sys.modules, "shardwise.plan", Broken)
    p = predict(cfg, 2)
    assert p["available"] is False and "ZeroDivisionError" in p["note"]


# ----------------------------------------------------------------------------- report


def _outcome(tmp_path, name, status, recs=None, pred=None, world=2, reason="", rank_peaks=None):
    d = tmp_path / "runs" / name
    d.mkdir(parents=True)
    if recs:
        write_jsonl(str(d / "metrics.jsonl"), recs)
    return Outcome(name, status, reason=reason, output_dir=str(d), log=str(d / "bench.log"), wall_s=12.3,
                   returncode=0 if status == "ok" else (1 if status == "oom" else None), world_size=world,
                   rank_peak_gib=rank_peaks or {}, config={"model": "tiny", "strategy": name, "seq_len": 128},
                   prediction=pred or {"available": False, "note": "this build has no planner"})


def _pred(tps, mem, fits=True, step=0.1):
    return {"available": True, "fits": fits, "tokens_per_s": tps, "slot_tokens_per_s": tps, "step_time_s": step,
            "peak_mem_gib": mem,
            "exposed_comm_s": 0.01, "mem_gib": {"total": mem}}


HW = {"accelerator": "cpu", "device_name": "cpu", "device_count": 0, "device_memory_gib": 8.0,
      "host_memory_gib": 8.0, "cpu": "Test CPU", "cpu_count": 2, "platform": "Linux"}


def test_report_files_schema_table_and_verdict(tmp_path):
    spec = _spec(tmp_path, strategies=("ddp", "fsdp", "zero3", "zero2"))
    outs = [
        _outcome(tmp_path, "ddp", "ok", _records(5, 2, 2000, mem=2.0), _pred(2500, 1.5), rank_peaks={0: 2.0, 1: 1.9}),
        _outcome(tmp_path, "fsdp", "ok", _records(5, 2, 1000, mem=1.0), _pred(1000, 1.0), rank_peaks={0: 1.0, 1: 0.8}),
        _outcome(tmp_path, "zero3", "oom", _records(1, 2, 10), _pred(900, 0.9), reason="CUDA out of memory"),
        _outcome(tmp_path, "zero2", "unavailable", reason="DeepSpeed is not installed"),
    ]
    rep = report.build(spec, outs, HW, {"python": "3.11", "torch": "2.13"}, "shardwise bench", 0.0)
    paths = report.write_all(rep, str(tmp_path / "rep"), "report")
    assert sorted(os.listdir(tmp_path / "rep")) == ["report.json", "report.md", "report.png"]

    data = json.load(open(paths["json"]))
    assert data["schema"] == report.SCHEMA
    for key in ("created", "command", "settings", "hardware", "versions", "config", "planner", "results", "verdict"):
        assert key in data, key
    rows = {r["strategy"]: r for r in data["results"]}
    assert [r["strategy"] for r in data["results"]] == ["ddp", "fsdp", "zero3", "zero2"]
    assert rows["ddp"]["measured"]["steps_counted"] == 3
    assert rows["ddp"]["measured"]["peak_mem_gib"] == {**rows["ddp"]["measured"]["peak_mem_gib"], "max": 2.0, "min": 1.9}
    # throughput at the measured (real) tokens per step: median of tokens/s x step time, over the predicted step
    real = statistics.median([(2000 + i) * (0.1 + 0.001 * i) for i in (3, 4, 5)]) / 0.1
    assert rows["ddp"]["predicted"]["tokens_per_s"] == pytest.approx(real)
    assert rows["ddp"]["error_pct"]["tokens_per_s"] == pytest.approx((real - 2004) / 2004 * 100)
    assert rows["zero3"]["result"] == "does not fit" and rows["zero3"]["predicted"]["peak_mem_gib"] == 0.9
    assert rows["zero2"]["result"] == "cannot run here" and rows["zero2"]["reason"] == "DeepSpeed is not installed"
    assert rows["fsdp"]["measured"]["loss_vs_reference"]["final_rel_diff"] == 0.0
    assert data["settings"]["steps"] == 3 and data["settings"]["warmup"] == 2

    verdict = " ".join(data["verdict"])
    assert "Fastest: **ddp**" in verdict and "Least memory: **fsdp**" in verdict and "Trade-off" in verdict
    assert "Planner said zero3 fits" in verdict and "zero2: cannot run here" in verdict

    md = open(paths["md"]).read()
    assert "| strategy | result | tokens/s median" in md and "](report.png)" in md
    assert "| zero3 | does not fit |" in md and "0.90" in md  # the planner's estimate beside the OOM
    assert sum(ln.startswith("|") for ln in md.splitlines()) == 2 + 4  # header, separator, a row each
    with open(paths["png"], "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    table = report.terminal_table(data)
    assert len(table.splitlines()) == 2 + 4 and "does not fit" in table


def test_report_without_planner_or_successes(tmp_path):
    spec = _spec(tmp_path, strategies=("ddp",))
    rep = report.build(spec, [_outcome(tmp_path, "ddp", "failed", reason="boom")], HW, {}, "shardwise bench", 0.0)
    report.write_all(rep, str(tmp_path), "x")
    assert rep["planner"]["available"] is False
    assert any("No strategy completed" in v for v in rep["verdict"])
    assert any("no predictions" in v for v in rep["verdict"])
    assert os.path.isfile(tmp_path / "x.png")


def test_losses_compared_only_at_the_same_global_batch(tmp_path):
    spec = _spec(tmp_path, strategies=("ddp", "single", "fsdp"))
    outs = [_outcome(tmp_path, "ddp", "ok", _records(4, 1, 100)),
            _outcome(tmp_path, "single", "ok", _records(4, 1, 50, loss0=5.0), world=1),
            _outcome(tmp_path, "fsdp", "ok", _records(4, 1, 90, loss0=6.5))]
    rep = report.build(spec, outs, HW, {}, "shardwise bench", 0.0)
    verdict = " ".join(rep["verdict"])
    assert "DISAGREE" in verdict and "fsdp" in verdict  # 6.5 vs 6.0 at the same world size
    assert "single (1 rank(s))" in verdict
    assert "loss_vs_reference" not in rep["results"][1]["measured"]


def test_throughput_compared_in_real_tokens_not_padded_slots(tmp_path):
    """Short records padded to seq_len: the loop counts 500 real tokens/s, the planner 2,000 slot tokens/s at the
    same step time. That is a correct prediction (0%), not a +300% over-estimate; a slower predicted step reads as
    an under-estimate of throughput."""
    spec = _spec(tmp_path, strategies=("ddp", "fsdp"))
    recs = [{"step": i, "loss": 5.0, "tokens_per_s": 500.0, "step_time_s": 0.1, "peak_mem_gib": 1.0}
            for i in range(1, 6)]
    outs = [_outcome(tmp_path, "ddp", "ok", recs, _pred(2000.0, 1.0, step=0.1)),
            _outcome(tmp_path, "fsdp", "ok", recs, _pred(1000.0, 1.0, step=0.2))]
    rep = report.build(spec, outs, HW, {}, "shardwise bench", 0.0)
    ddp, fsdp = rep["results"]
    assert ddp["error_pct"]["tokens_per_s"] == pytest.approx(0.0)
    assert ddp["predicted"]["slot_tokens_per_s"] == 2000.0 and ddp["predicted"]["tokens_per_s"] == pytest.approx(500)
    assert fsdp["error_pct"]["tokens_per_s"] == pytest.approx(-50.0)  # predicted step twice as slow
    assert fsdp["error_pct"]["step_time_s"] == pytest.approx(100.0)
    assert not any("over-estimated throughput" in v for v in rep["verdict"])
    report.write_all(rep, str(tmp_path / "rep"), "r")
    assert "real (non-padding) tokens" in open(tmp_path / "rep" / "r.md").read()


def test_report_stem_names_model_hardware_date():
    gpu = dict(HW, accelerator="cuda", device_name="NVIDIA H200", device_count=8)
    assert report.report_stem("/models/Llama-3.2-1B/", gpu, 8, "2026-12-01") == "Llama-3.2-1B_8xH200_2026-12-01"
    assert report.report_stem("tiny", HW, 2, "2026-11-29") == "tiny_cpu-2ranks_2026-11-29"


def test_png_keeps_measurements_readable_when_a_prediction_is_far_off(tmp_path):
    spec = _spec(tmp_path, strategies=("ddp",))
    outs = [_outcome(tmp_path, "ddp", "ok", _records(4, 1, 1000), _pred(3.7e7, 0.8, step=2.7e-6))]
    rep = report.build(spec, outs, dict(HW, accelerator="cuda", device_name="NVIDIA H200", device_count=1),
                       {}, "shardwise bench", 0.0)
    assert rep["results"][0]["error_pct"]["tokens_per_s"] > 1000
    assert report.table_cells(rep["results"][0])["tps_err"].endswith("x")  # a ratio, not +3690000%
    plot.write_png(rep, str(tmp_path / "r.png"))
    assert os.path.getsize(tmp_path / "r.png") > 10_000


# ----------------------------------------------------------------------------- running (a stand-in for train)


def _run_with(monkeypatch, tmp_path, code, timeout_s=60.0):
    """run_strategy with the real preflight but a stand-in command for `shardwise train`."""
    from shardwise.bench import runner

    monkeypatch.setattr(runner, "train_argv", lambda path, flags: [sys.executable, "-c", code])
    spec = _spec(tmp_path, strategies=("ddp",))
    spec.timeout_s = timeout_s
    return runner.run_strategy(spec, "ddp", sample_rss=False)


def test_a_run_that_prints_an_oom_is_does_not_fit_with_its_prediction(monkeypatch, tmp_path):
    o = _run_with(monkeypatch, tmp_path, "import sys; print('[rank0]: torch.OutOfMemoryError: CUDA out of memory. "
                                         "Tried to allocate 2.00 GiB'); sys.exit(1)")
    assert o.status == "oom" and o.reason.startswith("torch.OutOfMemoryError: CUDA out of memory")
    assert o.world_size == 2 and o.config["strategy"] == "ddp" and o.config["max_steps"] == 5
    assert "available" in o.prediction and os.path.isfile(o.log)


def test_a_hung_run_is_stopped_at_the_timeout(monkeypatch, tmp_path):
    o = _run_with(monkeypatch, tmp_path, "import time; print('shardwise: waiting at step 7', flush=True); "
                  "time.sleep(120)", timeout_s=8.0)
    assert o.status == "failed" and "timed out" in o.reason
    assert o.reason.endswith("its log ended with: shardwise: waiting at step 7")  # where it stopped
    assert o.returncode is not None and o.wall_s < 30  # the process was stopped, not waited for


def test_a_run_that_exits_0_without_metrics_is_not_ok(monkeypatch, tmp_path):
    o = _run_with(monkeypatch, tmp_path, "pass")
    assert o.status == "failed" and "no metrics.jsonl" in o.reason


def test_one_rank_fsdp_memory_is_sampled_from_its_worker_not_the_launcher(tmp_path):
    """A one-rank `fsdp` run trains in an agent-started worker (only `single` trains in the
    `shardwise train` process): bench must read the worker's peak RSS, not the launcher's."""
    import subprocess
    import sys
    import time

    from shardwise import presets
    from shardwise.bench.runner import sample_worker_peaks

    assert presets.trains_in_process("single", 1) and not presets.trains_in_process("fsdp", 1)
    assert not presets.trains_in_process("zero3", 1)
    # a launcher (small) whose child, named like a training worker, holds ~300 MiB
    worker = ("import time; b = bytearray(300 * 2**20); b[::4096] = b'x' * len(b[::4096]); "
              "open('READY', 'w').close(); time.sleep(60)")
    launcher = (f"import os, subprocess, sys; subprocess.run([sys.executable, '-c', {worker!r}, "
                "'-m', 'shardwise.train.worker'], env={**os.environ, 'RANK': '0'})")
    proc = subprocess.Popen([sys.executable, "-c", launcher], start_new_session=True, cwd=str(tmp_path))
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "READY").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        peaks: dict[int, float] = {}
        sample_worker_peaks(proc.pid, peaks, root_is_rank0=presets.trains_in_process("fsdp", 1))
        assert peaks[0] > 0.28  # GiB: the worker's 300 MiB, not the launcher's few MiB
        launcher_only: dict[int, float] = {}
        sample_worker_peaks(proc.pid, launcher_only, root_is_rank0=True)  # what bench used to read
        assert launcher_only[0] < 0.1
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()
