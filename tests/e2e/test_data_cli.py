"""Data through the real CLI: a base model without a chat template, a mix of a Parquet ShareGPT
file and an alpaca JSONL file, a shipped template (trained on one rank in this process); and the
one-line refusals."""

import json
import os
import shutil

import pytest

from tests.e2e.test_cli import one_line_error
from tests.helpers import ConcurrentRuns, write_jsonl
from tests.inproc.trainer import train


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = tmp_path_factory.mktemp("datacli")
    base = d / "base"  # the tiny model as a base model: no chat template
    shutil.copytree(tiny_dir, base)
    os.remove(base / "chat_template.jinja")
    share = [{"conversations": [{"from": "human", "value": f"say {w}"}, {"from": "gpt", "value": w}]}
             for w in "apple river stone cloud lamp tiger paper green".split()]
    pq.write_table(pa.Table.from_pylist(share), str(d / "chat.parquet"))
    alpaca = [{"instruction": "upper", "input": w, "output": w.upper(), "history": [["hi", "hello"]]}
              for w in "quiet music honey window orange silver".split()]
    write_jsonl(str(d / "alpaca.jsonl"), alpaca)
    common = ("train", "--model", str(base), "--strategy", "single", "--nproc-per-node", "1",
              "--micro-batch-size", "2", "--seq-len", "64")
    mix = f"{d / 'chat.parquet'}:0.5,{d / 'alpaca.jsonl'}:0.5"
    runs = ConcurrentRuns()
    runs.add("no_template", *common, "--data", mix, "--output-dir", str(d / "nt"), check=False)
    runs.add("dev_zero", *common, "--data", "/dev/zero", "--output-dir", str(d / "dz"), check=False)
    return runs, d, (*common[1:], "--data", mix)


def test_mixed_parquet_sharegpt_and_alpaca_with_a_shipped_template(setup):
    """Trained by the Trainer in this process after the launcher's prepare (tests/inproc/trainer.py)."""
    _, d, args = setup
    p = train(*args, "--chat-template", "chatml", "--last-turn-only", "--system", "Be brief.", "--max-steps", "2",
              "--save-every", "2", "--output-dir", d / "ok")
    assert "mix: " in p.stdout and "chat.parquet 7 of 8" in p.stdout and "alpaca.jsonl 7 of 6 (repeated)" in p.stdout
    final = d / "ok" / "final"
    from shardwise.data.templates import template_text

    saved = (final / "chat_template.jinja").read_text() if (final / "chat_template.jinja").exists() else \
        json.loads((final / "tokenizer_config.json").read_text())["chat_template"]
    assert saved == template_text("chatml")  # the trained model carries the template it was trained with
    ckpts = sorted((d / "ok" / "checkpoints").glob("step_*"))
    assert ckpts, "--save-every 2 saves the last step"
    assert (ckpts[-1] / "hf" / "chat_template.jinja").read_text() == template_text("chatml")  # so does its export


def test_refusals_are_one_line(setup):
    runs, d, _ = setup
    one_line_error(runs.get("no_template"), r"tokenizer has no chat template .* pass --chat-template NAME")
    one_line_error(runs.get("dev_zero"), r"--data /dev/zero: not a regular file")
    for out in ("nt", "dz"):
        assert not (d / out).exists()
