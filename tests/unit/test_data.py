import json

import pytest

from shardwise.data.sources import read_records
from shardwise.errors import ShardwiseError
from tests.helpers import write_jsonl

MSG = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def test_formats_are_detected_per_file(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    write_jsonl(str(d / "a.jsonl"), [MSG, MSG])
    write_jsonl(str(d / "b.jsonl"), [{"instruction": "add", "input": "1 2", "output": "3"}])
    write_jsonl(str(d / "c.jsonl"), [{"text": "plain text"}, ""])
    recs, stats = read_records(str(d))
    assert [r.kind for r in recs] == ["chat", "chat", "chat", "text"]
    assert recs[2].payload == [{"role": "user", "content": "add\n\n1 2"}, {"role": "assistant", "content": "3"}]
    assert recs[3].source.endswith("c.jsonl:1") and len(stats.files) == 3


@pytest.mark.parametrize("line, message", [
    ('{"messages": [', r"bad\.jsonl:2: invalid JSON"),
    ('[1, 2]', r"bad\.jsonl:2: a record must be a JSON object"),
    ('{"messages": []}', r"bad\.jsonl:2: empty conversation"),
    ('{"messages": [{"role": "robot", "content": "x"}]}', r"bad\.jsonl:2: message 1 has unknown role 'robot'"),
    ('{"messages": [{"role": "user"}]}', r"bad\.jsonl:2: message 1 has no 'content' string"),
    ('{"messages": [{"role": "user", "content": "x"}]}', r"bad\.jsonl:2: conversation has no non-empty assistant message"),
    ('{"prompt": "x"}', r"bad\.jsonl:2: missing field 'messages'"),
])
def test_bad_chat_records_name_file_and_line(tmp_path, line, message):
    path = write_jsonl(str(tmp_path / "bad.jsonl"), [MSG, line])
    with pytest.raises(ShardwiseError, match=message):
        read_records(path)


@pytest.mark.parametrize("fmt, good, bad, message", [
    ("alpaca", {"instruction": "a", "output": "b"}, {"instruction": "a"}, r"missing field 'output'"),
    ("alpaca", {"instruction": "a", "output": "b"}, {"instruction": "a", "output": "b", "input": 3}, r"field 'input' must be a string"),
    ("text", {"text": "abc"}, {"text": ""}, r"field 'text' is empty"),
    ("text", {"text": "abc"}, {"body": "x"}, r"missing field 'text'"),
])
def test_bad_alpaca_and_text_records(tmp_path, fmt, good, bad, message):
    path = write_jsonl(str(tmp_path / "bad.jsonl"), [good, bad])
    with pytest.raises(ShardwiseError, match=r"bad\.jsonl:2: " + message):
        read_records(path)


def test_undetectable_first_record(tmp_path):
    path = write_jsonl(str(tmp_path / "x.jsonl"), [{"foo": 1}])
    with pytest.raises(ShardwiseError, match=r"x\.jsonl:1: cannot detect the data format"):
        read_records(path)


def test_skip_bad_records_counts_them(tmp_path):
    path = write_jsonl(str(tmp_path / "x.jsonl"), [MSG, "{oops", MSG, '{"messages": []}'])
    recs, stats = read_records(path, skip_bad=True)
    assert len(recs) == 2 and stats.skipped == 2 and stats.first_skipped.startswith(f"{path}:2: invalid JSON")


def test_empty_after_filtering_is_an_error(tmp_path):
    path = write_jsonl(str(tmp_path / "x.jsonl"), ['{"messages": []}'])
    with pytest.raises(ShardwiseError, match=r"no usable records \(1 bad records skipped\)"):
        read_records(path, fmt="messages", skip_bad=True)


def test_missing_path_and_empty_dir(tmp_path):
    with pytest.raises(ShardwiseError, match="no such file or directory"):
        read_records(str(tmp_path / "nope.jsonl"))
    with pytest.raises(ShardwiseError, match="no data files in this directory"):
        read_records(str(tmp_path))


def test_forced_format_checks_every_record(tmp_path):
    path = write_jsonl(str(tmp_path / "x.jsonl"), [{"text": "a"}])
    with pytest.raises(ShardwiseError, match="x.jsonl:1: missing field 'messages'"):
        read_records(path, fmt="messages")
    assert json.loads(open(path).readline()) == {"text": "a"}  # input untouched
