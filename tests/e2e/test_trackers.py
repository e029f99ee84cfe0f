"""--report-to through the CLI: an unknown or missing tracker is one line before launch. (What the trackers
receive, and summary.json across a resume, is the Trainer's: tests/inproc/test_trackers.py.)"""

import sys


def test_an_unknown_or_missing_tracker_is_one_line_before_launch(tmp_path, monkeypatch, capsys):
    from shardwise.cli import main

    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if not installed: find_spec gives None, import fails
    assert main(["train", "--report-to", "tensorboard,mlflow", "--output-dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "report_to mlflow needs the 'mlflow' package" in err[0]
    assert "pip install 'shardwise[mlflow]'" in err[0] and "flag --report-to" in err[0]
    assert not (tmp_path / "o").exists()
    assert main(["train", "--report-to", "tensorboard,comet", "--output-dir", str(tmp_path / "o")]) == 2
    assert "unknown tracker comet" in capsys.readouterr().err
