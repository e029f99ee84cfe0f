"""Data sources named the way LLaMA-Factory and ms-swift name them: a dataset_info.json's entries (formatting, columns,
tags, num_samples, hub entries refused), ms-swift's PATH#N with and without the PATH:WEIGHT mixing, and
LLaMA-Factory's max_samples. The dataset_info.json here is written in LLaMA-Factory's shape (its data/README)."""

from __future__ import annotations

import json

import pytest

from shardwise.config import Config, absolute_paths
from shardwise.data.sources import load_records, parse_data_spec
from shardwise.errors import ShardwiseError

ALPACA = [{"instruction": f"q{i}", "input": "", "output": f"a{i}"} for i in range(10)]
# LLaMA-Factory's alpaca columns under other names
RENAMED = [{"question": f"r{i}", "answer": f"b{i}", "sys": "be brief"} for i in range(4)]
GLAIVE = [{"conversations": [{"from": "human", "value": "1+2?"},
                             {"from": "function_call", "value": '{"name": "add", "arguments": {"a": 1, "b": 2}}'},
                             {"from": "observation", "value": "3"}, {"from": "gpt", "value": "3."}],
           "tools": '[{"name": "add", "description": "add", "parameters": {"type": "object"}}]'}]
# sharegpt with OpenAI's keys, as LLaMA-Factory's mllm_demo and its `tags` describe them
TAGGED = [{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"},
                        {"role": "assistant", "content": "hello"}]}]
OPENAI = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}]
INFO = {
    "alpaca_demo": {"file_name": "alpaca.json"},
    "renamed": {"file_name": "renamed.json", "columns": {"prompt": "question", "response": "answer",
                                                          "system": "sys"}},
    "glaive": {"file_name": "glaive.json", "formatting": "sharegpt",
               "columns": {"messages": "conversations", "tools": "tools"}},
    "tagged": {"file_name": "tagged.json", "formatting": "sharegpt", "columns": {"messages": "messages"},
               "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                        "assistant_tag": "assistant", "system_tag": "system"}},
    "openai": {"file_name": "openai.json", "formatting": "openai", "columns": {"messages": "messages"}},
    "sampled": {"file_name": "alpaca.json", "num_samples": 3},
    "on_hub": {"hf_hub_url": "llamafactory/alpaca_en", "ms_hub_url": "llamafactory/alpaca_en"},
    "images": {"file_name": "tagged.json", "formatting": "sharegpt", "columns": {"messages": "messages",
                                                                                 "images": "images"}},
    "dpo": {"file_name": "alpaca.json", "ranking": True},
}


@pytest.fixture
def ddir(tmp_path):
    for name, recs in (("alpaca", ALPACA), ("renamed", RENAMED), ("glaive", GLAIVE), ("tagged", TAGGED),
                       ("openai", OPENAI)):
        (tmp_path / f"{name}.json").write_text(json.dumps(recs, indent=1))
    (tmp_path / "dataset_info.json").write_text(json.dumps(INFO, indent=2))
    return tmp_path


def read(data, ddir="", **kw):
    return load_records(Config(data=data, dataset_dir=str(ddir), **kw))[0]


def test_entries_are_read_as_dataset_info_describes_them(ddir):
    recs = read("renamed", ddir)
    assert recs[0].payload == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "r0"},
                               {"role": "assistant", "content": "b0"}]
    (g,) = read("glaive", ddir)
    assert g.tools[0]["function"]["name"] == "add"
    assert g.payload[1]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 1, "b": 2}}
    want = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}]
    assert read("tagged", ddir)[0].payload == want
    assert read("openai", ddir)[0].payload == want[1:2] + [{"role": "assistant", "content": "yo"}]
    # several names mixed with a path of their own; the mix line names the entries
    recs, stats = load_records(Config(data=f"alpaca_demo:2,renamed:0.5,{ddir / 'openai.json'}",
                                      dataset_dir=str(ddir)))
    assert len(recs) == 2 + 4 + 1  # the one weighted source is all of the weighted share
    assert stats.mix.startswith("mix: alpaca_demo 2 of 10, renamed 4 of 4, ")


def test_num_samples_and_path_hash_n(ddir):
    assert len(read("sampled", ddir)) == 3
    path = str(ddir / "alpaca.json")
    four = read(f"{path}#4")
    assert len(four) == 4 and len({r.payload[0]["content"] for r in four}) == 4  # sampled, not repeated
    assert len(read(f"{path}#25")) == 25  # more than it holds: repeated whole, then sampled (ms-swift's)
    # #N first, then the mix: 4 of the file, weighted 1:1 against the other file's 4 records
    recs, stats = load_records(Config(data=f"{path}#4:1.0,{ddir / 'renamed.json'}:1.0",
                                      columns="question=instruction,answer=output"))
    assert len(recs) == 8 and stats.mix == f"mix: {path}#4 4 of 4, {ddir / 'renamed.json'} 4 of 4 examples"


def test_max_samples_takes_the_first_records_of_each_source(ddir):
    recs = read(f"alpaca_demo,{ddir / 'openai.json'}", ddir, max_samples=3)
    assert [r.payload[0]["content"] for r in recs] == ["q0", "q1", "q2", "hi"]


@pytest.mark.parametrize("name, pattern", [
    ("on_hub", r"dataset 'on_hub' \(.*dataset_info\.json\): it is on a hub \(hf_hub_url llamafactory/alpaca_en\) "
               r"and shardwise reads local files only; download it \(`hf download --repo-type dataset "
               r"llamafactory/alpaca_en --local-dir .*on_hub`\)"),
    ("images", r"it has images columns; this is text-only fine-tuning"),
    ("dpo", r"it is a preference \(ranking\) set"),
])
def test_entries_that_cannot_be_read_are_one_line(ddir, name, pattern):
    with pytest.raises(ShardwiseError, match=pattern):
        read(name, ddir)


def test_a_missing_dataset_info_is_named(tmp_path):
    with pytest.raises(ShardwiseError, match=r"dataset_info\.json does not exist; dataset_dir is a directory"):
        read("x", tmp_path)


def test_names_stay_names_in_the_recorded_config(ddir, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    d = absolute_paths({"model": "tiny", "data": "alpaca_demo#3,renamed:0.5,local.json#2", "val_data": "",
                        "chat_template": "", "dataset_dir": "."})
    assert d["data"] == f"alpaca_demo#3,renamed:0.5,{tmp_path / 'local.json'}#2"
    assert d["dataset_dir"] == str(tmp_path)


def test_a_hash_count_must_be_at_least_one():
    with pytest.raises(ShardwiseError, match=r"'a\.json#0': #N takes N records, N >= 1"):
        parse_data_spec("a.json#0")


def test_a_hub_dataset_id_names_the_download_command(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ShardwiseError, match=r"^--data AI-ModelScope/alpaca-gpt4-data-en: no such file or directory; "
                                             r"if it is a hub dataset, shardwise reads local files only: download it "
                                             r"\(`hf download --repo-type dataset AI-ModelScope/alpaca-gpt4-data-en "
                                             r"--local-dir DIR`\) and give DIR$"):
        read("AI-ModelScope/alpaca-gpt4-data-en#500")
