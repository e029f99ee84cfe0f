"""A resume on another number of ranks keeps the checkpoint's global batch (and so its schedule and epoch), from
the checkpoint's own meta.json: a ddp x 2 checkpoint resumed on one process halved the batch, doubled the steps of
the epoch and jumped the learning rate while the resume message reassured."""

from __future__ import annotations

import argparse
import json

import pytest

from shardwise import config
from shardwise.errors import ShardwiseError
from shardwise.launch.preflight import keep_global_batch


def _ckpt(tmp_path, world: int, mbs: int, ga: int, tp: int = 1, sp: int = 1) -> str:
    path = tmp_path / "step_00000175"
    path.mkdir()
    (path / "meta.json").write_text(json.dumps({"step": 175, "data_position": {}, "world_size": world, "config": {
        "micro_batch_size": mbs, "grad_accum": ga, "tensor_parallel": tp, "sequence_parallel": sp}}))
    return str(path)


def _cfg(*argv):
    p = argparse.ArgumentParser()
    config.add_flags(p)
    return config.load_config(None, config.flags_from_namespace(p.parse_args(list(argv)))).cfg


def test_fewer_ranks_raise_the_accumulation_to_keep_the_global_batch(tmp_path):
    path = _ckpt(tmp_path, world=2, mbs=4, ga=2)  # 16 sequences a step
    cfg = _cfg("--micro-batch-size", "4", "--grad-accum", "2")
    notes = keep_global_batch(path, cfg, world=1)
    assert cfg.grad_accum == 4
    assert notes == ["resuming on 1 data-parallel rank(s) (the checkpoint ran 2): --grad-accum 2 -> 4 keeps its "
                     "global batch of 16 sequences, so its schedule and epoch hold"]


def test_more_ranks_lower_it_and_the_same_batch_says_nothing(tmp_path):
    path = _ckpt(tmp_path, world=1, mbs=2, ga=8)
    cfg = _cfg("--micro-batch-size", "2", "--grad-accum", "8")
    assert keep_global_batch(path, cfg, world=4) and cfg.grad_accum == 2
    same = _cfg("--micro-batch-size", "2", "--grad-accum", "8")
    assert keep_global_batch(path, same, world=1) == [] and same.grad_accum == 8


def test_sequence_and_tensor_ranks_are_not_data_parallel(tmp_path):
    path = _ckpt(tmp_path, world=4, mbs=1, ga=2, sp=2)  # dp 2: 4 sequences a step
    cfg = _cfg("--micro-batch-size", "1", "--grad-accum", "2", "--sequence-parallel", "2")
    assert keep_global_batch(path, cfg, world=2) and cfg.grad_accum == 4  # dp 1


def test_a_batch_no_accumulation_keeps_is_refused_with_flags_that_do(tmp_path):
    path = _ckpt(tmp_path, world=3, mbs=2, ga=1)  # 6 sequences a step
    cfg = _cfg("--micro-batch-size", "2", "--grad-accum", "1")
    with pytest.raises(ShardwiseError) as e:
        keep_global_batch(path, cfg, world=2)
    assert str(e.value) == (f"--resume {path}: the checkpoint's global batch is 6 sequences (micro-batch 2 x "
                            "grad-accum 1 x 3 data-parallel rank(s)), and on 2 rank(s) no --grad-accum keeps it at "
                            "micro-batch 2; --micro-batch-size 1 --grad-accum 3 keeps it (or pass other values to "
                            "change the batch on purpose)")


def test_a_batch_changed_on_purpose_is_kept_and_said(tmp_path):
    path = _ckpt(tmp_path, world=2, mbs=4, ga=2)
    cfg = _cfg("--micro-batch-size", "8", "--grad-accum", "2")
    notes = keep_global_batch(path, cfg, world=2)
    assert (cfg.micro_batch_size, cfg.grad_accum) == (8, 2)
    assert notes == ["the global batch changes from 16 to 32 sequences a step (micro-batch 4 x grad-accum 2 x 2 "
                     "data-parallel rank(s) -> 8 x 2 x 2): the run keeps its length and learning-rate schedule as "
                     "saved, counted in sequences (the workers say the steps left and the learning rate it goes on "
                     "from)"]


def test_the_flags_offered_keep_the_micro_batch_at_most_this_runs(tmp_path):
    path = _ckpt(tmp_path, world=3, mbs=4, ga=1)  # 12 sequences a step; 2 ranks take micro-batch 1, 2, 3 or 6
    with pytest.raises(ShardwiseError, match=r"--micro-batch-size 3 --grad-accum 2 keeps it"):
        keep_global_batch(path, _cfg("--micro-batch-size", "4", "--grad-accum", "1"), world=2)
