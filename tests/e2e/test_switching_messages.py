"""Messages a user coming from LLaMA-Factory or ms-swift met that misled: a ZeRO stage 0 DeepSpeed file was told
about a 'ddp' it never passed, and a --resume (or export) of a path that does not exist was told it had no
meta.json."""

from __future__ import annotations

import argparse
import json

import pytest

from shardwise import config
from shardwise.errors import ShardwiseError
from tests.helpers import run_cli


def _load(*argv):
    p = argparse.ArgumentParser()
    config.add_flags(p)
    return config.load_config(None, config.flags_from_namespace(p.parse_args(list(argv))))


def test_a_stage_0_deepspeed_file_says_it_is_plain_data_parallelism(tmp_path):
    f = tmp_path / "ds_z0_config.json"
    f.write_text(json.dumps({"train_batch_size": "auto", "zero_optimization": {"stage": 0}}))
    with pytest.raises(ShardwiseError) as e:
        _load("--deepspeed", str(f))
    assert str(e.value) == (f"flag --deepspeed {f}: its zero_optimization.stage 0 is plain data parallelism (no ZeRO "
                            "sharding); use --strategy ddp without the DeepSpeed file, or a file of stage 1, 2 or 3")
    assert "'ddp'" not in str(e.value)


def test_resume_and_export_of_a_missing_path_say_it_does_not_exist(tmp_path):
    missing = tmp_path / "runs" / "old" / "checkpoints" / "step_00000100"
    p = run_cli("train", "--resume", str(missing), "--output-dir", str(tmp_path / "new"), "--max-steps", "1",
                check=False)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1] == (f"shardwise: error: flag --resume: {missing} does not exist; give a "
                                                 "checkpoints/step_N directory of a run, or use --resume auto")
    p = run_cli("export", str(missing), "--out", str(tmp_path / "exported"), check=False)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1] == (f"shardwise: error: {missing} does not exist; give a "
                                                 "checkpoints/step_N directory or a run directory")
