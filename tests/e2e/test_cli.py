"""The CLI as a user meets it: the demo, and one clear line for each bad input."""

import gzip
import json
import os
import shlex

import pytest

from tests.helpers import ConcurrentRuns, chat_records, read_metrics, run_cli, write_jsonl
from tests.inproc.trainer import train


def test_demo_command_trains_and_the_loss_falls(tmp_path):
    """`shardwise train` with no arguments: tiny model, demo data, 2 processes on CPU."""
    p = run_cli("train", cwd=str(tmp_path))
    runs = os.listdir(tmp_path / "runs")
    assert len(runs) == 1 and runs[0].startswith("ddp-")
    out = tmp_path / "runs" / runs[0]
    m = read_metrics(str(out))
    assert m[0]["loss"] > 2 * m[-1]["loss"]  # visibly learns
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == m[-1]["step"]
    for key in ("step", "loss", "lr", "tokens_per_s", "step_time_s", "peak_mem_gib"):
        assert key in m[-1]
    assert (out / "final" / "model.safetensors").is_file() and (out / "config.yaml").is_file()
    assert os.listdir(out / "tensorboard")
    assert "loss" in p.stdout and str(out) in p.stdout
    assert "the built-in demo (tiny model, synthetic data) with its settings from demo.yaml: " in p.stdout
    assert "lr 0.003" in p.stdout and "seq_len 128" in p.stdout
    # the written config repeats the run; a profiled step is logged on its own whatever log_every (10 here)
    again_dir = tmp_path / "again dir"  # a space: the printed command quotes it
    again = run_cli("train", str(out / "config.yaml"), "--max-steps", "3", "--output-dir", str(again_dir),
                    "--profile-steps", "1", "--profile-start", "2")
    repeat = again.stdout.split("repeat with: ", 1)[1].splitlines()[0]
    assert shlex.split(repeat) == ["shardwise", "train", str(again_dir / "config.yaml")], repeat
    recs = read_metrics(str(again_dir))
    assert [(r["step"], r.get("profiled", False)) for r in recs] == [(1, False), (2, True), (3, False)]
    assert 0 <= recs[1]["comm_exposed_s"] <= recs[1]["comm_total_s"] and recs[1]["comm_total_s"] > 0
    assert again.returncode == 0
    # the profiled step's operators and timeline, each rank its own, whole files only
    prof = again_dir / "profile"
    assert sorted(os.listdir(prof)) == ["step-2-rank0.json.gz", "step-2-rank0.txt", "step-2-rank1.json.gz",
                                        "step-2-rank1.txt"]
    table = (prof / "step-2-rank1.txt").read_text()
    assert "operators by their own time on the host" in table and "aten::mm" in table
    with gzip.open(prof / "step-2-rank0.json.gz", "rt") as fh:
        names = {e.get("name") for e in json.load(fh)["traceEvents"]}
    assert "shardwise/profiled_step" in names and any(str(n).startswith("gloo:") for n in names)
    assert f"step 2's operators and trace: {prof / 'step-2-rank0.txt'}" in again.stdout
    # padding-free micro-batches (auto: on for this CPU run) train the same rows as padded ones: one step padded from
    # the same config has the same first loss
    assert "shardwise: padding-free: a micro-batch's rows in one sequence" in p.stdout and summary["padding_free"]
    padded_dir = tmp_path / "padded"
    padded = run_cli("train", str(out / "config.yaml"), "--max-steps", "1", "--padding-free", "off", "--no-save-final",
                     "--output-dir", str(padded_dir))
    assert "padding-free" not in padded.stdout
    assert not json.loads((padded_dir / "summary.json").read_text())["padding_free"]
    assert read_metrics(str(padded_dir))[0]["loss"] == pytest.approx(recs[0]["loss"], rel=1e-5)


def one_line_error(p, pattern):
    import re

    assert p.returncode == 2, p.stdout + p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("shardwise: error: "), p.stderr
    assert re.search(pattern, lines[0]), lines[0]
    assert "Traceback" not in p.stderr + p.stdout


BAD_DATA = [
    ([{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}, "{nope"],
     r"chat\.jsonl:2: invalid JSON"),
    ([{"messages": [{"role": "wizard", "content": "a"}]}], r"chat\.jsonl:1: message 1 has unknown role 'wizard'"),
]


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    """The CLI runs below all stop before launch, each in its own process; they are
    independent, so they are started together (two at a time)."""
    d = tmp_path_factory.mktemp("refused")
    runs = ConcurrentRuns()
    for i, (records, _) in enumerate(BAD_DATA):
        (d / f"data{i}").mkdir()
        data = write_jsonl(str(d / f"data{i}" / "chat.jsonl"), records)
        (d / f"data{i}" / "tmp").mkdir()  # the launcher's own temporary files (the job pointer, the agent's)
        runs.add(f"data{i}", "train", "--data", data, "--output-dir", str(d / f"data{i}" / "out"), check=False,
                 env={"TMPDIR": str(d / f"data{i}" / "tmp")})
    (d / "empty").mkdir()
    runs.add("strategy", "train", "--strategy", "fsdp9", check=False)
    runs.add("config", "train", str(d / "none.yaml"), check=False)
    runs.add("model", "train", "--model", str(d / "empty"), "--data", "demo", check=False)
    runs.add("model_no_data", "train", "--model", str(d / "empty"), "--output-dir", str(d / "o"), check=False)
    runs.add("seq_len", "train", "--seq-len", "100000", "--output-dir", str(d / "o"), check=False)
    runs.add("float8", "train", "--float8", "--strategy", "single", "--output-dir", str(d / "o"), check=False)
    return runs, d


@pytest.mark.parametrize("records, pattern", BAD_DATA)
def test_bad_data_is_one_line_and_writes_nothing(refused, records, pattern):
    runs, d = refused
    i = BAD_DATA.index((records, pattern))
    one_line_error(runs.get(f"data{i}"), pattern)
    # found while the workers had already started (they wait for the job, then leave): nothing is written, and the
    # launcher's temporary files are gone (torch's own caches may stay)
    assert not (d / f"data{i}" / "out").exists()
    assert not [f for f in os.listdir(d / f"data{i}" / "tmp") if f.startswith("shardwise")]


def test_bad_flags_and_files(refused):
    runs, d = refused
    one_line_error(runs.get("strategy"), r"unknown strategy 'fsdp9'; known: single")
    one_line_error(runs.get("config"), r"none\.yaml: config file not found")
    one_line_error(runs.get("model"), r"no config.json in it")
    one_line_error(runs.get("model_no_data"), r"flag --model: a model directory needs --data .*pass --data demo")
    one_line_error(runs.get("seq_len"),
                   r"seq_len 100000 is larger than the model supports \(max_position_embeddings 2048\)")
    if not torch_cuda():  # this machine cannot run float8: refused before anything is written
        one_line_error(runs.get("float8"), r"flag --float8: float8 needs a CUDA GPU of compute capability 8\.9")
    assert not (d / "o").exists()


def test_output_dir_holding_another_run_is_refused(tmp_path):
    data = write_jsonl(str(tmp_path / "d.jsonl"), chat_records(16))
    out = tmp_path / "out"
    args = ("train", "--data", data, "--output-dir", str(out), "--max-steps", "2", "--strategy", "single",
            "--nproc-per-node", "1", "--micro-batch-size", "2", "--no-save-final")
    # the run that holds the directory is made by the Trainer in this process (tests/inproc/trainer.py); the refusal
    # and the --overwrite that replaces it are the command's
    train(*args[1:])
    before = (out / "metrics.jsonl").read_text()
    one_line_error(run_cli(*args, check=False), r"holds another run; pass --resume auto to continue it, --overwrite")
    assert (out / "metrics.jsonl").read_text() == before
    run_cli(*args, "--overwrite")


def torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
