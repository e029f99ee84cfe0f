"""Data files of every supported kind, column mapping, mixing, and the file-level error lines."""

import json
import os

import pytest

from shardwise.config import Config
from shardwise.data.batches import DataPosition, StepSampler
from shardwise.data.encode import encode
from shardwise.data.sources import load_records, parse_data_spec, read_records
from shardwise.errors import ShardwiseError
from tests.helpers import write_jsonl

ALPACA = [{"instruction": "add", "input": "1 2", "output": "3"},
          {"instruction": "greet", "output": "hello", "system": "be kind", "history": [["hi", "hey"], ["how?", "fine"]]}]
SHAREGPT = [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}], "system": "sys"},
            {"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "q"},
                               {"from": "gpt", "value": "a"}, {"from": "human", "value": "q2"},
                               {"from": "gpt", "value": "a2"}]}]
MSG = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def msgs(*turns):
    return [{"role": r, "content": c} for r, c in turns]


def test_alpaca_system_and_history_are_kept(tmp_path):
    recs, _ = read_records(write_jsonl(str(tmp_path / "a.jsonl"), ALPACA))
    assert recs[0].payload == msgs(("user", "add\n\n1 2"), ("assistant", "3"))
    assert recs[1].payload == msgs(("system", "be kind"), ("user", "hi"), ("assistant", "hey"), ("user", "how?"),
                                   ("assistant", "fine"), ("user", "greet"), ("assistant", "hello"))


def test_sharegpt_roles_and_system_field(tmp_path):
    recs, _ = read_records(write_jsonl(str(tmp_path / "s.jsonl"), SHAREGPT))
    assert recs[0].payload == msgs(("system", "sys"), ("user", "hi"), ("assistant", "hello"))
    assert [m["role"] for m in recs[1].payload] == ["system", "user", "assistant", "user", "assistant"]


def test_sharegpt_unknown_role_names_line(tmp_path):
    bad = {"conversations": [{"from": "robot", "value": "x"}, {"from": "gpt", "value": "y"}]}
    with pytest.raises(ShardwiseError, match=r"s\.jsonl:2: message 1 has unknown role 'robot' \(allowed: human"):
        read_records(write_jsonl(str(tmp_path / "s.jsonl"), [SHAREGPT[0], bad]))


def test_parquet_file_with_sharegpt_rows_and_row_errors(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = str(tmp_path / "chat.parquet")
    pq.write_table(pa.Table.from_pylist(SHAREGPT), path)
    recs, stats = read_records(path)
    assert [r.payload for r in recs] == [r.payload for r in read_records(write_jsonl(str(tmp_path / "s.jsonl"), SHAREGPT))[0]]
    assert recs[1].source == f"{path}:row 2" and stats.files == [path]
    bad = str(tmp_path / "bad.parquet")
    pq.write_table(pa.Table.from_pylist([{"text": "fine"}, {"text": ""}]), bad)
    with pytest.raises(ShardwiseError, match=r"bad\.parquet:row 2: field 'text' is empty"):
        read_records(bad)


def test_csv_and_tsv_with_column_mapping(tmp_path):
    csv = tmp_path / "qa.csv"
    csv.write_text('question,answer\nwhat is 2+2?,four\n"two\nlines",ok\n')
    recs, _ = read_records(str(csv), columns={"question": "instruction", "answer": "output"})
    assert recs[1].payload == msgs(("user", "two\nlines"), ("assistant", "ok"))
    tsv = tmp_path / "t.tsv"
    tsv.write_text("body\nsome text, with a comma\n")
    recs, _ = read_records(str(tsv), columns={"body": "text"})
    assert recs[0].kind == "text" and recs[0].payload == "some text, with a comma"
    with pytest.raises(ShardwiseError, match=r"qa\.csv:row 1: cannot detect the data format \(found question, "
                                             r"answer\).*--columns"):
        read_records(str(csv))


@pytest.mark.parametrize("name", ["arr.json", "arr.jsonl"])
def test_json_array_file(tmp_path, name):
    """A JSON array is recognised by its content, whatever the file is called."""
    path = tmp_path / name
    path.write_text(json.dumps(ALPACA, indent=2))
    recs, _ = read_records(str(path))
    assert len(recs) == 2 and recs[1].payload[0] == {"role": "system", "content": "be kind"}
    assert recs[1].source == f"{path}:row 2"


def test_saved_dataset_directory_and_arrow_file(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list([MSG, {"messages": msgs(("user", "x"), ("assistant", "y"))}])
    ds.save_to_disk(str(tmp_path / "saved"))
    recs, _ = read_records(str(tmp_path / "saved"))
    assert [r.payload[1]["content"] for r in recs] == ["hello", "y"]
    arrow = [f for f in os.listdir(tmp_path / "saved") if f.endswith(".arrow")][0]
    recs, _ = read_records(str(tmp_path / "saved" / arrow))
    assert len(recs) == 2
    # an Arrow IPC *file* (not the stream save_to_disk writes), inside a directory of mixed kinds
    import pyarrow as pa

    d = tmp_path / "mixed"
    (d / "sub").mkdir(parents=True)
    table = pa.Table.from_pylist([{"text": "arrow one"}, {"text": "arrow two"}])
    with pa.OSFile(str(d / "sub" / "t.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    ds.save_to_disk(str(d / "saved_inside"))
    write_jsonl(str(d / "a.jsonl"), [MSG])
    recs, stats = read_records(str(d))
    assert len(recs) == 5 and len(stats.files) == 3
    assert sorted(r.payload for r in recs if r.kind == "text") == ["arrow one", "arrow two"]


def test_datasets_cache_does_not_leak(tmp_path, monkeypatch):
    """The builders' Arrow caches go to a temporary directory that is removed, not ~/.cache."""
    import tempfile

    import pyarrow as pa
    import pyarrow.parquet as pq

    home = tmp_path / "home"
    monkeypatch.setenv("HF_HOME", str(home))
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    path = str(tmp_path / "x.parquet")
    pq.write_table(pa.Table.from_pylist([{"text": "a"}]), path)
    read_records(path)
    assert os.listdir(scratch) == [] and not home.exists()


@pytest.mark.parametrize("content, name, message", [
    ("instruction,output\nhi,there\n", "data.jsonl", (r"data\.jsonl: this is a CSV file \(first line "
                                                      r"'instruction,output'\), not JSON Lines; name it \.csv")),
    ('{\n  "data": [{"text": "a"}]\n}\n', "data.json", r"data\.json: this is one JSON object spread over several "
                                                    r"lines, not records; give a JSON array of records"),
])
def test_wrong_kind_of_file_says_what_it_is_even_when_skipping(tmp_path, content, name, message):
    path = tmp_path / name
    path.write_text(content)
    for skip in (False, True):
        with pytest.raises(ShardwiseError, match=message):
            read_records(str(path), skip_bad=skip)


def test_non_utf8_line_is_a_bad_record_and_skippable(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_bytes(json.dumps(MSG).encode() + b"\n" + b'{"text": "caf\xe9"}\n' + json.dumps(MSG).encode() + b"\n")
    with pytest.raises(ShardwiseError, match=r"x\.jsonl:2: not valid UTF-8 \(byte 0xe9 at column 14\)"):
        read_records(str(path))
    recs, stats = read_records(str(path), skip_bad=True)
    assert len(recs) == 2 and stats.skipped == 1 and "x.jsonl:2: not valid UTF-8" in stats.first_skipped


def test_non_utf8_csv_is_one_line(tmp_path):
    path = tmp_path / "x.csv"
    path.write_bytes(b"text\ncaf\xe9\n")
    with pytest.raises(ShardwiseError, match=r"x\.csv: not valid UTF-8 \(.*\); convert the file to UTF-8$"):
        read_records(str(path))


def test_corrupt_parquet_is_one_line(tmp_path):
    path = tmp_path / "x.parquet"
    path.write_bytes(b"PAR1 and then nothing useful")
    with pytest.raises(ShardwiseError, match=r"x\.parquet: cannot read this Parquet file \(ArrowInvalid"):
        read_records(str(path))


def test_not_a_regular_file():
    with pytest.raises(ShardwiseError, match=r"--data /dev/zero: not a regular file"):
        read_records("/dev/zero")


def test_symlink_loop_reads_each_file_once(tmp_path):
    d = tmp_path / "data"
    (d / "sub").mkdir(parents=True)
    write_jsonl(str(d / "a.jsonl"), [MSG])
    write_jsonl(str(d / "sub" / "b.jsonl"), [MSG, MSG])
    os.symlink(str(d), str(d / "sub" / "loop"))  # sub/loop -> data: a cycle
    os.symlink(str(d / "a.jsonl"), str(d / "sub" / "again.jsonl"))  # the same file under another name
    recs, stats = read_records(str(d))
    assert len(recs) == 3 and len(stats.files) == 2


def test_huge_line_is_refused_without_reading_it_whole(tmp_path, monkeypatch):
    from shardwise.data import sources

    monkeypatch.setattr(sources, "MAX_RECORD_BYTES", 1000)
    path = tmp_path / "x.jsonl"
    path.write_text(json.dumps(MSG) + "\n" + json.dumps({"text": "y" * 5000}) + "\n" + json.dumps(MSG) + "\n")
    with pytest.raises(ShardwiseError, match=r"x\.jsonl:2: record longer than 1000 bytes, not read"):
        read_records(str(path))
    recs, stats = read_records(str(path), skip_bad=True)
    assert len(recs) == 2 and stats.skipped == 1 and recs[1].source.endswith("x.jsonl:3")


# ----------------------------------------------------------------------------- mixing


def test_data_spec_parsing():
    s = parse_data_spec("a.jsonl:0.7,dir/b.parquet:300,c.csv,d:1.")
    assert [(x.path, x.weight, x.count) for x in s] == [("a.jsonl", 0.7, None), ("dir/b.parquet", None, 300),
                                                        ("c.csv", None, None), ("d", 1.0, None)]
    with pytest.raises(ShardwiseError, match=r"flag --data: 'a\.jsonl:0': a count must be >= 1"):
        parse_data_spec("a.jsonl:0", "flag --data")
    with pytest.raises(ShardwiseError, match="empty entry"):
        parse_data_spec("a.jsonl,,b.jsonl")


def _two_files(tmp_path):
    a = write_jsonl(str(tmp_path / "a.jsonl"), [{"text": f"a{i}"} for i in range(30)])
    b = write_jsonl(str(tmp_path / "b.jsonl"), [{"text": f"b{i}"} for i in range(10)])
    return a, b


def test_mix_weights_and_counts(tmp_path):
    a, b = _two_files(tmp_path)
    recs, stats = load_records(Config(data=f"{a}:0.5,{b}:0.5", seed=1))
    kinds = [r.payload[0] for r in recs]
    assert kinds.count("a") == 20 and kinds.count("b") == 20  # 40 rows shared half and half
    assert len({r.payload for r in recs if r.payload[0] == "b"}) == 10  # b repeated whole twice
    assert "(repeated)" in stats.mix
    recs, _ = load_records(Config(data=f"{a}:7,{b}", seed=1))
    assert sum(r.payload[0] == "a" for r in recs) == 7 and sum(r.payload[0] == "b" for r in recs) == 10


def test_mix_is_deterministic_for_a_seed_and_resumes_at_the_same_rows(tmp_path, tiny_dir):
    from shardwise.models.load import load_tokenizer

    a, b = _two_files(tmp_path)
    spec = f"{a}:0.8,{b}:0.2"
    first, _ = load_records(Config(data=spec, seed=5))
    again, _ = load_records(Config(data=spec, seed=5))
    other, _ = load_records(Config(data=spec, seed=6))
    assert [r.source for r in first] == [r.source for r in again]
    assert [r.source for r in first] != [r.source for r in other]
    tok = load_tokenizer(tiny_dir)
    # a run stopped after 3 steps and resumed from its data position (a fresh prepare reads
    # the mix again) trains on exactly the rows of an uninterrupted run
    rows = []
    for recs, steps, pos in ((first, 3, DataPosition()), (again, 3, DataPosition(0, 3 * 8))):
        s = StepSampler(encode(recs, tok, 32, packing=False), 4, 1, 2, 0, seed=5, pad_id=0)
        for _ in range(steps):
            batch, pos = s.next(pos)
            rows.append([s.data.input_ids[r] for r in batch.rows])
    s = StepSampler(encode(first, tok, 32, packing=False), 4, 1, 2, 0, seed=5, pad_id=0)
    pos, straight = DataPosition(), []
    for _ in range(6):
        batch, pos = s.next(pos)
        straight.append([s.data.input_ids[r] for r in batch.rows])
    assert rows == straight


def test_yaml_list_and_columns_map(tmp_path):
    from shardwise.config import load_config

    a, b = _two_files(tmp_path)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"data:\n  - {{path: {a}, weight: 1}}\n  - {{path: {b}, count: 4}}\n  - demo\n"
                   "columns: {prompt: instruction, answer: output}\n")
    res = load_config(str(cfg))
    assert res.cfg.data == f"{a}:1.0,{b}:4,demo" and res.cfg.columns == "prompt=instruction,answer=output"
    cfg.write_text("data:\n  - {path: x.jsonl, weight: 1, count: 2}\n")
    with pytest.raises(ShardwiseError, match=r"run\.yaml:1: data source 1 must be"):
        load_config(str(cfg))
    cfg.write_text(f"data: {a}\ncolumns: {{prompt: question}}\n")
    res = load_config(str(cfg))
    with pytest.raises(ShardwiseError, match=r"run\.yaml:2: 'prompt=question' maps to unknown name 'question'"):
        load_records(res.cfg, res.where)
