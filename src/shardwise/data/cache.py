"""Tokenized-data cache: a repeat run with the same records, tokenizer and encoding settings
reads the tokenized data back instead of rendering and tokenizing every record again.

An entry is one safetensors file, $SHARDWISE_CACHE_DIR/data/<key>.safetensors (default
~/.cache/shardwise/data), holding the tensors the run directory's data.safetensors holds plus
the rows' sources (UTF-8 JSON bytes as a uint8 tensor) and, in its metadata, the key and
the statistics. Nothing read from it can run code (safetensors and JSON only).

The key is a SHA-256 over everything `encode` reads, so no setting can be left out of it:
- the records themselves (kind, content, "file:line"), i.e. after the files were read,
  columns renamed, formats detected, sources mixed and the validation split held out: a
  changed file, --data spec, --columns, --data-format, --skip-bad-records, --seed or
  --val-split changes them;
- the tokenizer: the bytes of every file in the model directory that is not a weight file
  (tokenizer.json, tokenizer_config.json, vocab, merges, chat_template.jinja, ...), its
  class, the transformers and tokenizers versions, and the chat template in effect
  (--chat-template included);
- seq_len, packing, system, train_on_prompt, last_turn_only, and FORMAT (raised whenever
  encode.py changes what it produces).

Entries are written atomically (a reader sees a whole entry or none); an entry that cannot
be read or does not match its key is ignored and rewritten. The newest KEEP entries are
kept, older ones removed (a hit refreshes an entry's time).

A repeat launch finds its entry without loading the tokenizer (time to first step): AutoTokenizer
imports transformers and the model's configuration module, about 2 s of the launcher's
CPU on the tiny job, for files the launcher read the same way in an earlier run. Beside
each entry an index file, $SHARDWISE_CACHE_DIR/data/by-source/<source key>.json, names the
entry's key; the source key (source_key) covers, read from files and package metadata
only, everything the tokenizer and the launcher's tokenizer checks depend on. The index is
written only after those checks passed and the entry was read or written, so a refusal is
never remembered, and a miss of the index is the ordinary path (load, check, encode).
Remote code never uses the index: such a tokenizer may read code from outside the directory.
"""

from __future__ import annotations

import hashlib
import json
import os

import torch

from shardwise.data.encode import ChatOptions, Encoded, encode
from shardwise.data.formats import Record
from shardwise.errors import ShardwiseError
from shardwise.rundir import prune_keyed

FORMAT = 2  # 2: encode checks token ids against the model's vocab_size; format-1 entries were never checked
KEEP = 8
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".index.json")
TENSORS = ("input_ids", "targets", "position_ids", "lengths")
STATS = ("records", "truncated", "dropped_no_loss_tokens", "loss_tokens", "tokens", "sequences")


def cache_dir() -> str:
    from shardwise.hardware import cache_dir as root

    return os.path.join(root(), "data")


def not_private() -> str | None:
    """Why the data cache folder cannot be trusted, or None (made here, mode 0700, where it is missing).

    What is read from it becomes the training data, so it is used only when this user owns it and nobody else can
    write it (hardware.folder_problem, the compile cache's rule); a folder of ours that a umask made group- or
    other-writable is tightened."""
    from shardwise.hardware import folder_problem

    d = cache_dir()
    try:
        os.makedirs(os.path.dirname(d), exist_ok=True)
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:  # made before (or by a concurrent launcher): judged below like any other
            pass
        return folder_problem(d, tighten=True)
    except OSError as e:
        return f"cannot make or use {d} ({e.strerror or e})"


def tokenizer_digest(tokenizer, model_dir: str) -> str:
    h = hashlib.sha256()
    import tokenizers
    import transformers

    h.update(json.dumps([type(tokenizer).__name__, transformers.__version__, tokenizers.__version__,
                         getattr(tokenizer, "chat_template", None), tokenizer.eos_token_id]).encode())
    _hash_model_files(h, model_dir)
    return h.hexdigest()


def _hash_model_files(h, model_dir: str) -> None:
    """Every file of `model_dir` that is not a weight file: name, size and bytes."""
    for name in sorted(os.listdir(model_dir)):
        path = os.path.join(model_dir, name)
        if name.endswith(WEIGHT_SUFFIXES) or not os.path.isfile(path):
            continue
        try:
            h.update(f"\0{name}\0{os.path.getsize(path)}\0".encode())
            with open(path, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
        except OSError as e:
            raise ShardwiseError(f"--model {model_dir}: cannot read {name} ({e.strerror or e}); "
                                 "check the file's permissions") from None


def records_digest(records: list[Record]) -> str:
    h = hashlib.sha256(str(len(records)).encode())
    for r in records:
        # a record's tools only where it has some, so the keys of records without them stay as they were
        rec = [r.kind, r.payload, r.source] + ([r.tools] if r.tools else []) + (
            [r.chosen, r.rejected] if r.kind == "pair" else [])
        h.update(json.dumps(rec, ensure_ascii=False, default=repr).encode("utf-8", "surrogatepass"))
        h.update(b"\n")
    return h.hexdigest()


def key(records: list[Record], tok_digest: str, seq_len: int, packing: bool, opts: ChatOptions,
        rec_digest: str | None = None) -> str:
    return hashlib.sha256(json.dumps([FORMAT, tok_digest, seq_len, packing, opts.system, opts.train_on_prompt,
                                      opts.last_turn_only, rec_digest or records_digest(records)]).encode()).hexdigest()


# -- finding an entry without the tokenizer -------------------------------------------------------------------------

SOURCES_KEEP = 64
# Packages whose presence or version can change which tokenizer class loads or what it and the chat template give:
# those transformers' tokenizer loading asks about (is_*_available in tokenization_auto.py and the tokenizer
# classes), and jinja2, which renders the template. Keep it in step with transformers.
TOKENIZER_PACKAGES = ("transformers", "tokenizers", "jinja2", "sentencepiece", "protobuf", "tiktoken",
                      "mistral_common")
# The only subfolder of a model directory the tokenizer reads (transformers' CHAT_TEMPLATE_DIR: named templates,
# a default.jinja there replaces chat_template.jinja). Other subfolders are not read: a .git folder can hold gigabytes.
TEMPLATE_SUBDIR = "additional_chat_templates"
# The modules whose code the remembered verdicts come from: a changed check is checked again.
CHECKING_MODULES = (("models", "load.py"), ("data", "templates.py"), ("data", "encode.py"), ("data", "cache.py"),
                    ("launch", "prep.py"))


def _version(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        if package == "transformers":  # a source tree on PYTHONPATH has no installed metadata
            import transformers

            return transformers.__version__
        return None


def model_files_digest(model_dir: str) -> str:
    """What of the model directory the tokenizer can read, without loading it: every top-level file that is not a
    weight file (code files included) and the files of TEMPLATE_SUBDIR, by name, size and bytes."""
    h = hashlib.sha256()
    _hash_model_files(h, model_dir)
    sub = os.path.join(model_dir, TEMPLATE_SUBDIR)
    if os.path.isdir(sub):
        h.update(f"\0{TEMPLATE_SUBDIR}/\0".encode())
        _hash_model_files(h, sub)
    return h.hexdigest()


def source_key(records: list[Record], model_dir: str, template: str, seq_len: int, packing: bool, opts: ChatOptions,
               rec_digest: str | None = None, files_digest: str | None = None) -> str:
    """SHA-256 over everything the launcher's tokenizer, its checks (models/load.load_tokenizer,
    data/templates.use_chat_template, data/encode.check_options, as launch.prep._tokenized calls them) and `key` depend on,
    read without loading the tokenizer: model_files_digest, the versions of TOKENIZER_PACKAGES (None where absent),
    the --chat-template text in effect ('' keeps the tokenizer's own, which those files hold), seq_len, packing,
    the chat options, the records, and the source of CHECKING_MODULES. Not for remote code: its tokenizer may read
    code from outside the directory (the launcher does not use the index then)."""
    h = hashlib.sha256(json.dumps([FORMAT, [_version(p) for p in TOKENIZER_PACKAGES], template, seq_len, packing,
                                   opts.system, opts.train_on_prompt, opts.last_turn_only,
                                   rec_digest or records_digest(records),
                                   files_digest or model_files_digest(model_dir)]).encode())
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for rel in CHECKING_MODULES:
        with open(os.path.join(pkg, *rel), "rb") as fh:
            h.update(fh.read())
    return h.hexdigest()


def _index_path(skey: str) -> str:
    return os.path.join(cache_dir(), "by-source", f"{skey}.json")


def cached_by_source(skey: str) -> tuple[Encoded, dict] | None:
    """The entry a run with source key `skey` read or wrote before, whole and matching its key; None otherwise
    (an index file that is missing, too long, not JSON or not ours is a miss)."""
    try:
        with open(_index_path(skey), "rb") as fh:
            raw = fh.read(1024)
        k = json.loads(raw)["key"]
    except Exception:  # noqa: BLE001 - anything there that is not our small JSON object is a miss
        return None
    if not (isinstance(k, str) and len(k) == 64 and all(c in "0123456789abcdef" for c in k)):
        return None
    got = _entry(k)
    if got is not None:
        _touch(_index_path(skey))
    return got


def _remember_source(skey: str, k: str) -> None:
    """Best effort: an index that cannot be written costs the next launch the tokenizer, nothing else."""
    from shardwise.rundir import atomic_write

    path = _index_path(skey)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        atomic_write(path, json.dumps({"key": k}))
    except OSError:
        return
    prune_keyed(os.path.dirname(path), ".json", SOURCES_KEEP)


def _touch(path: str) -> None:
    """Most recently used: kept by the pruning (prune_keyed goes by modification time)."""
    try:
        os.utime(path)
    except OSError:
        pass


def _entry(k: str) -> tuple[Encoded, dict] | None:
    """The entry of key `k` if it is there, whole and `k`'s (its time refreshed); None otherwise."""
    path = os.path.join(cache_dir(), f"{k}.safetensors")
    got = _read(path, k) if os.path.exists(path) else None
    if got is not None:
        _touch(path)
    return got


def _read(path: str, k: str) -> tuple[Encoded, dict] | None:
    """The entry at `path` if it is whole and is the entry for key `k`; None otherwise."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("key") != k:
                return None
            t = {name: f.get_tensor(name) for name in (*TENSORS, "sources")}
        stats = json.loads(meta["stats"])
        sources = json.loads(bytes(t.pop("sources").tolist()).decode("utf-8"))
        lens = t["lengths"]
        n = int(lens.sum()) if len(lens) else 0
        if (lens.dtype != torch.int64 or len(sources) != len(lens) or stats.get("sequences") != len(lens)
                or any(t[x].dtype != torch.int32 or t[x].dim() != 1 or len(t[x]) != n for x in TENSORS[:3])
                or any(not isinstance(stats.get(s), int) for s in STATS) or (len(lens) and int(lens.min()) < 1)):
            return None
    except Exception:  # truncated, corrupt, or written by something else: rebuilt by the caller
        return None
    enc = Encoded.from_tensors(t)
    enc.sources, enc.stats = sources, stats
    return enc, t


def _write(path: str, k: str, enc: Encoded, tensors: dict) -> None:
    from safetensors.torch import save_file

    from shardwise.rundir import atomic_path

    os.makedirs(os.path.dirname(path), exist_ok=True)
    src = torch.frombuffer(bytearray(json.dumps(enc.sources).encode("utf-8")) or bytearray(b"[]"), dtype=torch.uint8)
    with atomic_path(path) as tmp:
        save_file({**tensors, "sources": src}, tmp, metadata={"key": k, "stats": json.dumps(enc.stats)})


def encode_cached(records: list[Record], tokenizer, model_dir: str, seq_len: int, packing: bool,
                  opts: ChatOptions, enabled: bool = True, note=None, source: str | None = None,
                  rec_digest: str | None = None, progress=None) -> tuple[Encoded, dict, bool]:
    """(encoded, its tensors as data.safetensors holds them, whether it came from the cache).
    `note(msg)` is told about an entry that was ignored or could not be written. `source`: the records' source
    key (source_key), indexed to the entry once it was read or written: give it only after the tokenizer's checks
    passed. `progress(records done)` is called as it tokenizes."""
    if not enabled:
        enc = encode(records, tokenizer, seq_len, packing, opts, progress)
        return enc, enc.to_tensors(), False
    k = key(records, tokenizer_digest(tokenizer, model_dir), seq_len, packing, opts, rec_digest)
    path = os.path.join(cache_dir(), f"{k}.safetensors")
    got = _entry(k)
    if got is not None:
        if source:
            _remember_source(source, k)
        return got[0], got[1], True
    if note and os.path.exists(path):
        note(f"data cache: {path} is unreadable or not this data's; tokenizing again and replacing it")
    enc = encode(records, tokenizer, seq_len, packing, opts, progress)
    tensors = enc.to_tensors()
    try:
        _write(path, k, enc, tensors)
        prune_keyed(os.path.dirname(path), ".safetensors", KEEP)
    except OSError as e:
        if note:
            note(f"data cache: cannot write {path} ({e.strerror or e}); the run goes on without it "
                 "(--no-data-cache skips the cache)")
        return enc, tensors, False
    if source:
        _remember_source(source, k)
    return enc, tensors, False
