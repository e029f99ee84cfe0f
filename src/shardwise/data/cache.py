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
"""

from __future__ import annotations

import hashlib
import json
import os

import torch

from shardwise.data.encode import ChatOptions, Encoded, encode
from shardwise.data.formats import Record
from shardwise.rundir import prune_keyed

FORMAT = 1
KEEP = 8
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".index.json")
TENSORS = ("input_ids", "targets", "position_ids", "lengths")
STATS = ("records", "truncated", "dropped_no_loss_tokens", "loss_tokens", "tokens", "sequences")


def cache_dir() -> str:
    from shardwise.hardware import cache_dir as root

    return os.path.join(root(), "data")


def tokenizer_digest(tokenizer, model_dir: str) -> str:
    h = hashlib.sha256()
    import tokenizers
    import transformers

    h.update(json.dumps([type(tokenizer).__name__, transformers.__version__, tokenizers.__version__,
                         getattr(tokenizer, "chat_template", None), tokenizer.eos_token_id]).encode())
    for name in sorted(os.listdir(model_dir)):
        path = os.path.join(model_dir, name)
        if name.endswith(WEIGHT_SUFFIXES) or not os.path.isfile(path):
            continue
        h.update(f"\0{name}\0{os.path.getsize(path)}\0".encode())
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def key(records: list[Record], tok_digest: str, seq_len: int, packing: bool, opts: ChatOptions) -> str:
    h = hashlib.sha256(json.dumps([FORMAT, tok_digest, seq_len, packing, opts.system, opts.train_on_prompt,
                                   opts.last_turn_only, len(records)]).encode())
    for r in records:
        h.update(json.dumps([r.kind, r.payload, r.source], ensure_ascii=False, default=repr).encode("utf-8", "surrogatepass"))
        h.update(b"\n")
    return h.hexdigest()


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
                  opts: ChatOptions, enabled: bool = True, note=None) -> tuple[Encoded, dict, bool]:
    """(encoded, its tensors as data.safetensors holds them, whether it came from the cache).
    `note(msg)` is told about an entry that was ignored or could not be written."""
    if not enabled:
        enc = encode(records, tokenizer, seq_len, packing, opts)
        return enc, enc.to_tensors(), False
    k = key(records, tokenizer_digest(tokenizer, model_dir), seq_len, packing, opts)
    path = os.path.join(cache_dir(), f"{k}.safetensors")
    if os.path.exists(path):
        got = _read(path, k)
        if got is not None:
            try:
                os.utime(path)
            except OSError:
                pass
            return got[0], got[1], True
        if note:
            note(f"data cache: {path} is unreadable or not this data's; tokenizing again and replacing it")
    enc = encode(records, tokenizer, seq_len, packing, opts)
    tensors = enc.to_tensors()
    try:
        _write(path, k, enc, tensors)
        prune_keyed(os.path.dirname(path), ".safetensors", KEEP)
    except OSError as e:
        if note:
            note(f"data cache: cannot write {path} ({e.strerror or e}); the run goes on without it "
                 "(--no-data-cache skips the cache)")
    return enc, tensors, False
