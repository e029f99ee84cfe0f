"""doctor's pure parts: the bus-bandwidth factors and its one-line errors."""

from __future__ import annotations

import argparse

import pytest

from shardwise import doctor
from shardwise.errors import ShardwiseError


def test_bus_factors_follow_nccl_tests():
    assert doctor.bus_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    assert doctor.bus_factor("all_gather", 8) == pytest.approx(7 / 8)
    assert doctor.bus_factor("reduce_scatter", 2) == pytest.approx(0.5)
    assert doctor.bus_factor("all_reduce", 1) == 0


@pytest.mark.parametrize("argv,needle", [
    (["--nproc", "0"], "--nproc must be >= 1"),
    (["--nproc", "two"], "--nproc must be an integer"),
    (["--sizes", "1k,2k"], "--sizes must be comma-separated byte counts"),
    (["--sizes", "2"], "at least 4 bytes"),
    (["--iters", "0"], "--iters must be >= 1"),
])
def test_bad_arguments_are_one_line_errors(argv, needle):
    p = argparse.ArgumentParser()
    doctor.add_parser(p.add_subparsers())
    with pytest.raises(ShardwiseError, match=needle.replace("(", r"\(")):
        doctor.run(p.parse_args(["doctor", *argv]))


def test_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    from shardwise import hardware

    monkeypatch.setenv("SHARDWISE_CACHE_DIR", str(tmp_path))
    assert hardware.doctor_path() == str(tmp_path / "doctor.json") and hardware.load_doctor() is None
    (tmp_path / "doctor.json").write_text("not json")
    assert hardware.load_doctor() is None
