"""`shardwise doctor` on 2 real gloo ranks, launched through the elastic agent."""

from __future__ import annotations

import argparse
import json

import pytest

from shardwise import doctor, hardware


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDWISE_CACHE_DIR", str(tmp_path))
    return tmp_path


def parse(*argv):
    p = argparse.ArgumentParser()
    doctor.add_parser(p.add_subparsers())
    return p.parse_args(["doctor", *argv])


def test_doctor_measures_two_gloo_ranks_and_plan_reads_it(cache, capsys):
    assert doctor.run(parse("--nproc", "2", "--sizes", "4096,262144", "--iters", "2", "--json")) == 0
    out = json.loads(capsys.readouterr().out)
    saved = json.loads((cache / "doctor.json").read_text())
    assert saved["collectives"] == out["collectives"] and saved["world_size"] == 2 and saved["backend"] == "gloo"
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        rows = out["collectives"][op]
        assert [r["bytes"] for r in rows] == [4096, 262144]
        for r in rows:
            assert r["time_us"] > 0
            # nccl-tests: all-reduce busbw = algbw * 2(n-1)/n = algbw at n=2; gather/scatter: algbw * (n-1)/n
            factor = 1.0 if op == "all_reduce" else 0.5
            assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * factor, rel=0.01, abs=0.002)
    assert out["matmul_gflops"] > 0 and out["versions"]["torch"]
    assert hardware.load_doctor()["matmul_gflops"] == out["matmul_gflops"]


def test_a_signal_while_the_ranks_measure_is_one_line_and_saves_nothing(tmp_path):
    """SIGTERM to `shardwise doctor` while its 2 ranks run: the agent stops them and the command says so in one line
    (it was torch's SignalException traceback), exits 128 + 15 and writes no doctor.json."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    env = {**os.environ, "SHARDWISE_CACHE_DIR": str(tmp_path)}
    p = subprocess.Popen([sys.executable, "-m", "shardwise", "doctor", "--nproc", "2", "--sizes", "4194304",
                          "--iters", "100000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    launcher, deadline = psutil.Process(p.pid), time.monotonic() + 120
    while len([c for c in launcher.children(recursive=True) if "shardwise.doctor" in " ".join(c.cmdline())]) < 2:
        if p.poll() is not None or time.monotonic() > deadline:
            p.kill()
            raise AssertionError(f"doctor's ranks never both started: {p.communicate()}")
        time.sleep(0.1)
    time.sleep(1.0)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert p.returncode == 128 + signal.SIGTERM, (p.returncode, err[-3000:])
    assert lines == ["shardwise: error: doctor: interrupted by signal 15; nothing was saved"], err[-3000:]
    assert not [f for _, _, files in os.walk(tmp_path) for f in files if f == "doctor.json"]
