"""The tokenized-data cache (shardwise.data.cache): a hit gives the same tensors and skips
encoding; a change of records, tokenizer or setting misses; a bad entry is rebuilt."""

import os
import shutil

import pytest
import torch

from shardwise.data import cache
from shardwise.data.encode import ChatOptions
from shardwise.data.formats import Record


@pytest.fixture()
def env(tiny_dir, tmp_path, monkeypatch):
    from shardwise.models.load import load_tokenizer

    monkeypatch.setenv("SHARDWISE_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    recs = [Record("chat", [{"role": "user", "content": f"question {i}"},
                            {"role": "assistant", "content": f"answer {i} " * (i % 4 + 1)}], f"d.jsonl:{i + 1}")
            for i in range(12)]
    return load_tokenizer(str(model)), str(model), recs


def run(env, recs=None, seq_len=64, packing=True, opts=None, note=None):
    tok, model, base = env
    return cache.encode_cached(recs if recs is not None else base, tok, model, seq_len, packing,
                               opts or ChatOptions(), True, note)


def entries():
    d = cache.cache_dir()
    return sorted(n for n in os.listdir(d) if n.endswith(".safetensors")) if os.path.isdir(d) else []


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_hit_gives_the_same_tensors_and_skips_encoding(env, monkeypatch):
    enc, t, hit = run(env)
    assert not hit and len(entries()) == 1
    import shardwise.data.cache as mod

    def boom(*a, **k):
        raise AssertionError("encode ran on a cache hit")

    monkeypatch.setattr(mod, "encode", boom)
    enc2, t2, hit2 = run(env)
    assert hit2 and same(t, t2)
    assert (enc2.input_ids, enc2.targets, enc2.position_ids, enc2.sources, enc2.stats) == \
        (enc.input_ids, enc.targets, enc.position_ids, enc.sources, enc.stats)
    # the tensors written from the hit are byte-identical to those written without the cache
    from safetensors.torch import save

    assert save(t2) == save(enc.to_tensors())


def test_a_changed_input_misses(env):
    tok, model, recs = env
    run(env)
    changed = [Record(r.kind, r.payload, r.source) for r in recs]
    changed[3] = Record("chat", [{"role": "user", "content": "question 3"},
                                 {"role": "assistant", "content": "another answer"}], "d.jsonl:4")
    for kw in (dict(recs=changed), dict(recs=recs[:-1]), dict(seq_len=32), dict(packing=False),
               dict(opts=ChatOptions(system="be brief")), dict(opts=ChatOptions(train_on_prompt=True)),
               dict(opts=ChatOptions(last_turn_only=True)),
               dict(recs=[Record(r.kind, r.payload, r.source.replace("d.", "e.")) for r in recs])):
        assert not run(env, **kw)[2], kw
        assert run(env, **kw)[2], kw  # and is kept under its own key
    # the chat template and the tokenizer's files are part of the key
    tok.chat_template = tok.chat_template + " "
    assert not run(env)[2]
    with open(os.path.join(model, "tokenizer_config.json"), "a") as fh:
        fh.write("\n")
    assert not run(env)[2]


def test_a_corrupt_or_truncated_entry_is_rebuilt(env):
    enc, t, _ = run(env)
    (name,) = entries()
    path = os.path.join(cache.cache_dir(), name)
    good = open(path, "rb").read()
    for bad in (good[: len(good) // 2], b"", b"\x00" * 64, good[:8] + b"garbage" + good[15:]):
        with open(path, "wb") as fh:
            fh.write(bad)
        notes = []
        enc2, t2, hit = run(env, note=notes.append)
        assert not hit and same(t, t2) and len(notes) == 1 and "tokenizing again" in notes[0]
        _, t3, hit3 = run(env)  # rewritten whole: the next run hits it
        assert hit3 and same(t, t3)


def test_an_entry_of_another_key_is_not_used(env):
    run(env)
    (name,) = entries()
    other = os.path.join(cache.cache_dir(), "f" * 64 + ".safetensors")
    shutil.copy(os.path.join(cache.cache_dir(), name), other)
    k = name[:64]
    assert cache._read(other, k) is not None and cache._read(other, "f" * 64) is None


def test_only_the_newest_entries_are_kept(env):
    for n in range(cache.KEEP + 2):
        run(env, seq_len=32 + n)
    assert len(entries()) == cache.KEEP
    assert len(os.listdir(cache.cache_dir())) == cache.KEEP  # no temporary file left either


def test_disabled_writes_nothing(env):
    tok, model, recs = env
    enc, t, hit = cache.encode_cached(recs, tok, model, 64, True, ChatOptions(), False)
    assert not hit and entries() == [] and t["lengths"].sum() == sum(map(len, enc.input_ids))


def test_prepare_reads_a_repeat_run_from_the_cache_byte_identical(tiny_dir, tmp_path, monkeypatch, capsys):
    """Through the launcher's prepare (no workers): the second run says the data came from the
    cache and writes the same data.safetensors; --no-data-cache tokenizes and writes no entry."""
    import json

    from shardwise import config, launch

    monkeypatch.setenv("SHARDWISE_CACHE_DIR", str(tmp_path / "cache"))
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q {i}"},
                                                     {"role": "assistant", "content": f"a {i}"}]}) + "\n"
                            for i in range(40)))

    def prepare(out, **kw):
        flags = {"model": tiny_dir, "data": str(data), "seq_len": 64, "val_split": 0.1, "output_dir": str(out),
                 "nproc_per_node": 2, "strategy": "ddp", **kw}
        p = launch.prepare(config.load_config(None, {k: (v, "flag") for k, v in flags.items()}))
        p.lock.release()
        prep = os.path.join(str(out), ".prep", "node0")
        return (capsys.readouterr().out, open(os.path.join(prep, "data.safetensors"), "rb").read(),
                open(os.path.join(prep, "val.safetensors"), "rb").read())

    first = prepare(tmp_path / "a")
    assert "from the cache" not in first[0] and len(entries()) == 2  # training and validation sets
    second = prepare(tmp_path / "b")
    assert "tokenized data from the cache" in second[0] and second[1:] == first[1:]
    shutil.rmtree(tmp_path / "cache")
    third = prepare(tmp_path / "c", data_cache=False)
    assert "from the cache" not in third[0] and third[1:] == first[1:] and entries() == []


# -- a repeat launch without the tokenizer (source keys) -------------------------------------------------------------


def _prepare(model, data, out, **kw):
    """The launcher's prepare (no workers); (printed output, data.safetensors bytes)."""
    from shardwise import config, launch

    flags = {"model": model, "data": str(data), "seq_len": 64, "val_split": 0.1, "output_dir": str(out),
             "nproc_per_node": 2, "strategy": "ddp", **kw}
    p = launch.prepare(config.load_config(None, {k: (v, "flag") for k, v in flags.items()}))
    p.lock.release()
    with open(os.path.join(str(out), ".prep", "node0", "data.safetensors"), "rb") as fh:
        return fh.read()


@pytest.fixture()
def launch_env(tiny_dir, tmp_path, monkeypatch):
    """A cache and a model directory of this test's own, chat data, and a switch that makes loading the tokenizer
    fail (to show a launch did not load it)."""
    import json

    import shardwise.models.load as load

    monkeypatch.setenv("SHARDWISE_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q {i}"},
                                                     {"role": "assistant", "content": f"a {i}"}]}) + "\n"
                            for i in range(40)))
    real, loads = load.load_tokenizer, []

    def counted(*a, **k):
        loads.append(a[0])
        return real(*a, **k)

    monkeypatch.setattr(load, "load_tokenizer", counted)
    return model, data, loads


def test_a_repeat_launch_takes_its_data_from_the_cache_without_loading_the_tokenizer(launch_env, tmp_path):
    model, data, loads = launch_env
    first = _prepare(str(model), data, tmp_path / "a")
    assert len(loads) == 1 and len(entries()) == 2  # training and validation sets
    assert len(os.listdir(os.path.join(cache.cache_dir(), "by-source"))) == 2
    second = _prepare(str(model), data, tmp_path / "b")
    assert len(loads) == 1 and second == first  # no load, the same bytes
    # anything the tokenizer depends on that changed loads it again: a setting, the template, a tokenizer file
    _prepare(str(model), data, tmp_path / "c", seq_len=48)
    assert len(loads) == 2
    _prepare(str(model), data, tmp_path / "d", chat_template="chatml")
    assert len(loads) == 3
    with open(model / "tokenizer_config.json", "a") as fh:
        fh.write("\n")
    again = _prepare(str(model), data, tmp_path / "e")
    assert len(loads) == 4 and again == first  # a blank line changes nothing encoded, but it was checked again
    _prepare(str(model), data, tmp_path / "f")
    assert len(loads) == 4


def test_a_refusal_is_never_remembered_and_a_changed_tokenizer_is_checked_again(launch_env, tmp_path):
    """Chat data needs a chat template. A model directory whose template was removed after a run that passed is
    refused again: its files are part of the source key, so the launch loads and checks the tokenizer."""
    from shardwise.errors import ShardwiseError

    model, data, loads = launch_env
    _prepare(str(model), data, tmp_path / "a")
    os.remove(model / "chat_template.jinja")
    for out in ("b", "c"):
        with pytest.raises(ShardwiseError, match="no chat template but the data is chat"):
            _prepare(str(model), data, tmp_path / out)
    assert len(loads) == 3 and len(os.listdir(os.path.join(cache.cache_dir(), "by-source"))) == 2


def test_an_index_naming_a_missing_or_foreign_entry_loads_the_tokenizer_and_is_rewritten(launch_env, tmp_path):
    model, data, loads = launch_env
    first = _prepare(str(model), data, tmp_path / "a")
    index = os.path.join(cache.cache_dir(), "by-source")
    names = sorted(os.listdir(index))
    for n in entries():
        os.remove(os.path.join(cache.cache_dir(), n))
    with open(os.path.join(index, names[0]), "w") as fh:
        fh.write('{"key": "../../etc/passwd"}')
    assert _prepare(str(model), data, tmp_path / "b") == first and len(loads) == 2
    assert sorted(os.listdir(index)) == names
    assert _prepare(str(model), data, tmp_path / "c") == first and len(loads) == 2


def test_the_source_key_changes_with_each_thing_it_covers(tmp_path, tiny_dir, monkeypatch):
    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    recs = [Record("text", "hello there", "d.jsonl:1"), Record("text", "bye", "d.jsonl:2")]
    base = dict(records=recs, model_dir=str(model), template="", seq_len=64, packing=False, opts=ChatOptions())
    variants = [{}, {"records": recs[:1]}, {"records": [Record("text", "hello there", "d.jsonl:9"), recs[1]]},
                {"template": "{{ messages }}"}, {"seq_len": 65}, {"packing": True},
                {"opts": ChatOptions(system="be brief")}, {"opts": ChatOptions(train_on_prompt=True)},
                {"opts": ChatOptions(last_turn_only=True)}]
    keys = [cache.source_key(**{**base, **v}) for v in variants]
    assert keys[0] == cache.source_key(**base)
    (model / "tokenizer.json").write_bytes((model / "tokenizer.json").read_bytes() + b" ")
    keys.append(cache.source_key(**base))
    (model / "extra_tokens.txt").write_text("x")  # any file that is not a weight, the tokenizer may read it
    keys.append(cache.source_key(**base))
    (model / "additional_chat_templates").mkdir()  # named templates; a default.jinja there is the template
    (model / "additional_chat_templates" / "default.jinja").write_text("{{ messages }}")
    keys.append(cache.source_key(**base))
    (model / "model.safetensors").write_bytes(b"")  # weights are not read by the tokenizer
    (model / "original").mkdir()  # nor other folders (a .git folder can hold gigabytes)
    (model / "original" / "notes.txt").write_text("x")
    assert cache.source_key(**base) == keys[-1]
    versions = cache._version
    for package in cache.TOKENIZER_PACKAGES:  # installing, removing or upgrading one changes it
        monkeypatch.setattr(cache, "_version", lambda p, package=package: "0.0.1" if p == package else versions(p))
        keys.append(cache.source_key(**base))
    assert len(set(keys)) == len(keys)


def _indexes():
    d = os.path.join(cache.cache_dir(), "by-source")
    return sorted(os.listdir(d)) if os.path.isdir(d) else []


def test_remote_code_and_no_data_cache_always_load_the_tokenizer_and_write_no_index(launch_env, tmp_path):
    model, data, loads = launch_env
    first = _prepare(str(model), data, tmp_path / "a", trust_remote_code=True)
    assert _prepare(str(model), data, tmp_path / "b", trust_remote_code=True) == first
    assert len(loads) == 2 and _indexes() == [] and len(entries()) == 2  # the entries by key still serve
    _prepare(str(model), data, tmp_path / "c")
    assert len(loads) == 3 and len(_indexes()) == 2
    assert _prepare(str(model), data, tmp_path / "d", data_cache=False) == first
    assert len(loads) == 4


def test_a_set_found_by_its_index_is_not_encoded_again_when_the_other_is_not(launch_env, tmp_path, monkeypatch):
    """The validation set's index gone: the tokenizer loads once for it, the training set still comes from its
    index, the validation set from its entry, and its index is written again."""
    import json

    from safetensors import safe_open

    import shardwise.data.cache as mod

    model, data, loads = launch_env
    first = _prepare(str(model), data, tmp_path / "a")
    folder = os.path.join(cache.cache_dir(), "by-source")

    def sequences(name):
        k = json.load(open(os.path.join(folder, name)))["key"]
        with safe_open(os.path.join(cache.cache_dir(), f"{k}.safetensors"), framework="pt") as f:
            return json.loads(f.metadata()["stats"])["sequences"]

    val_index = min(_indexes(), key=sequences)
    os.remove(os.path.join(folder, val_index))
    encoded = []
    real = mod.encode_cached
    monkeypatch.setattr(mod, "encode_cached", lambda recs, *a, **k: encoded.append(len(recs)) or real(recs, *a, **k))
    assert _prepare(str(model), data, tmp_path / "b") == first
    assert len(loads) == 2 and encoded == [4] and val_index in _indexes()  # 4 of 40 records held out


@pytest.mark.parametrize("bad", ["null", "[]", '{"key": 5}', "{", "[" * 100000, "UPPER", "x" * 5000])
def test_an_index_file_that_is_not_ours_is_a_miss(launch_env, tmp_path, bad):
    model, data, loads = launch_env
    first = _prepare(str(model), data, tmp_path / "a")
    folder = os.path.join(cache.cache_dir(), "by-source")
    for name in _indexes():
        path = os.path.join(folder, name)
        if bad == "UPPER":  # the right entry, not spelt as we write it
            bad_text = open(path).read().upper().replace('"KEY"', '"key"')
        else:
            bad_text = bad
        with open(path, "w") as fh:
            fh.write(bad_text)
    assert _prepare(str(model), data, tmp_path / "b") == first and len(loads) == 2
    assert _prepare(str(model), data, tmp_path / "c") == first and len(loads) == 2  # rewritten


def test_a_data_cache_folder_others_could_write_is_tightened_or_not_used(launch_env, tmp_path, capsys):
    """What is read from the cache becomes the training data. Our own folder that a umask left group-writable is
    made private; a link to a folder elsewhere (someone else's) is not used: the run tokenizes, reads and writes
    nothing there, and says why. A folder of another user's is not used either (as root only: chown)."""
    import stat

    model, data, loads = launch_env
    d = cache.cache_dir()
    os.makedirs(d)
    os.chmod(d, 0o777)
    _prepare(str(model), data, tmp_path / "a")
    assert stat.S_IMODE(os.stat(d).st_mode) & 0o022 == 0 and len(entries()) == 2  # tightened, then used

    elsewhere = tmp_path / "planted"
    shutil.copytree(d, elsewhere)  # a copy of valid entries: a link to them must still not be read
    shutil.rmtree(d)
    os.symlink(elsewhere, d)
    before = sorted(os.listdir(elsewhere))
    loaded = len(loads)
    capsys.readouterr()
    first = _prepare(str(model), data, tmp_path / "b")
    out = capsys.readouterr().out
    assert "data cache: " in out and "is a link or not a directory, so it is not used" in out, out
    assert len(loads) == loaded + 1  # tokenized: nothing taken from the link's entries
    assert sorted(os.listdir(elsewhere)) == before  # and nothing written there

    if os.getuid() == 0:
        os.unlink(d)
        shutil.copytree(elsewhere, d)
        os.chown(d, 65534, 65534)
        second = _prepare(str(model), data, tmp_path / "c")
        assert "belongs to another user (uid 65534)" in capsys.readouterr().out
        assert len(loads) == loaded + 2 and second == first
