"""benchmarks/run.py, the benchmarks' one entry point: it lists its suites, and every suite runs scripts and tests
that exist in the repository (a renamed script would otherwise surface only on a GPU machine)."""

from __future__ import annotations

from pathlib import Path

from tests.helpers import benchmark_module

ROOT = Path(__file__).resolve().parents[2]


def test_lists_every_suite(capsys):
    run = benchmark_module("run")
    assert run.main(["--list"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == list(run.SUITES)
    for name in ("setup", "gpu-tests", "vs-hf-trainer", "strategies", "offload", "qlora", "plan-accuracy",
                 "time-to-first-step", "float8", "long-context", "levers"):
        assert name in run.SUITES


def test_each_suite_names_existing_scripts():
    run = benchmark_module("run")
    for name, suite in run.SUITES.items():
        if name == "setup":
            assert not suite.steps
            continue
        paths = run.scripts_named(suite)
        assert paths, name
        for rel in paths:
            assert (ROOT / rel.split("::")[0]).exists(), f"suite {name}: {rel} is not in the repository"


def test_unknown_suite_is_refused(capsys):
    run = benchmark_module("run")
    assert run.main(["no-such-suite"]) == 2
    assert "no suite 'no-such-suite'" in capsys.readouterr().err


def test_no_session_diary_left():
    assert not (ROOT / "benchmarks" / "h200_session.sh").exists()
