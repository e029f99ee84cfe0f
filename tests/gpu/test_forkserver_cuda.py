"""Launched runs on a GPU machine with torchao installed (the float8 extra): the workers' fork server must not
initialise CUDA (train/zygote.py hides torchao from its imports), and where something in its imports does, the run
still trains, its workers started as their own interpreters, with one note.

Skipped, with the reason, without a CUDA GPU or without torchao; run on the GPU machine with
`python -m pytest -n 0 -q tests/gpu/test_forkserver_cuda.py` (torchao 0.17 is the first built for torch 2.11)."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from tests.helpers import chat_records, read_metrics, run_cli, write_jsonl

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                                 reason="needs torchao (pip install 'shardwise[float8]')")]

NOTE = "the workers' fork server cannot be used"
STEPS = ("--max-steps", "4", "--log-every", "1", "--seq-len", "128", "--micro-batch-size", "4",
         "--mixed-precision", "bf16", "--no-save-final")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(str(tmp_path_factory.mktemp("data") / "chat.jsonl"), chat_records(64))


def _train(out, data, *extra, env=None):
    p = run_cli("train", "--data", str(data), "--output-dir", str(out), "--overwrite", *STEPS, *extra,
                env=env, timeout=600)
    recs = read_metrics(str(out))
    assert len(recs) == 4 and all(math.isfinite(r["loss"]) for r in recs), p.stdout
    return p


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_a_launched_run_trains_through_the_fork_server_with_torchao_installed(strategy, data, tmp_path):
    p = _train(tmp_path / strategy, data, "--strategy", strategy, "--nproc-per-node", "1")
    assert NOTE not in p.stdout + p.stderr  # forked, as without torchao


def test_float8_trains_in_a_forked_worker_that_imports_torchao_itself(data, tmp_path):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 needs compute capability 8.9 or newer")
    p = _train(tmp_path / "f8", data, "--strategy", "fsdp", "--nproc-per-node", "1", "--float8")
    assert NOTE not in p.stdout + p.stderr


def test_a_server_whose_imports_initialise_cuda_is_replaced_by_own_interpreters_with_one_note(data, tmp_path):
    """Hiding nothing from the server (SHARDWISE_FORKSERVER_HIDE empty), its imports include torchao's, which
    initialises CUDA: the probe finds it before any worker is forked, and the run trains all the same."""
    p = _train(tmp_path / "unhidden", data, "--strategy", "fsdp", "--nproc-per-node", "1",
               env={"SHARDWISE_FORKSERVER_HIDE": ""})
    assert (p.stdout + p.stderr).count(NOTE) == 1, p.stdout + p.stderr
    assert "initialised CUDA" in p.stdout
