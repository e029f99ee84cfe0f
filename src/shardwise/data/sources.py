"""Data files -> records: find the files, tell what each one is, read it, mix several sources.

What a file is, is decided per file from its content where that is unambiguous (Parquet
and Arrow magic bytes, a JSON array), else from its name (.csv/.tsv), else it is read as
JSON Lines, as before. A directory is searched recursively (hidden entries skipped; each
real path read once, so a symlink loop reads nothing twice); a directory written by
`datasets.Dataset.save_to_disk` is one source.

Readers: Parquet, CSV/TSV, JSON arrays, Arrow files and saved datasets go through the
Hugging Face `datasets` library, local files only (HF_DATASETS_OFFLINE=1, nothing resolved
on the hub). Its builders write Arrow caches; they go to a temporary directory that is
deleted once the records are read (the tokenized result is what the run keeps), never to
~/.cache/huggingface. Errors name the file and the row ("file:row N", rows counted from 1,
a CSV's header excluded). JSON Lines stay on a line reader of our own: `datasets` parses
a JSONL file as a whole, so one bad line would fail the file without its line number and
--skip-bad-records could not skip it; the line reader gives "file:line" for each record,
decodes each line on its own (a non-UTF-8 line is one bad record) and never holds more
than MAX_RECORD_BYTES of one line.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

from shardwise.config import split_source
from shardwise.data.dataset_info import entry_source, read_info, retag
from shardwise.data.formats import (
    BadRecord,
    ReadStats,
    Record,
    demo_dataset,
    detect_format,
    parse_columns,
    parse_record,
    preference_pair,
    rename,
    undetectable,
)
from shardwise.data.preference import demo_pairs, detect_preference, not_preference, parse_preference
from shardwise.errors import ShardwiseError

SUFFIXES = (".jsonl", ".json", ".csv", ".tsv", ".parquet", ".arrow")
# A JSON line longer than this is refused as a bad record without being read whole: no
# training example is 64 MiB, and parsing one costs several times its size in memory.
MAX_RECORD_BYTES = 64 << 20


# ----------------------------------------------------------------------------- finding files


def is_saved_dataset(path: str) -> bool:
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, f))
                                       for f in ("state.json", "dataset_dict.json"))


def data_files(path: str, flag: str = "--data") -> list[str]:
    """The sources under `path`: data files and saved-dataset directories, each real path once."""
    if os.path.isdir(path):
        if is_saved_dataset(path):
            return [path]
        out, seen_dirs, seen = [], set(), set()
        for base, dirs, files in os.walk(path, followlinks=True):
            real = os.path.realpath(base)
            if real in seen_dirs:  # a symlink back to a directory already walked
                dirs[:] = []
                continue
            seen_dirs.add(real)
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for d in list(dirs):
                p = os.path.join(base, d)
                if is_saved_dataset(p):
                    dirs.remove(d)
                    if os.path.realpath(p) not in seen:
                        seen.add(os.path.realpath(p))
                        out.append(p)
            for f in files:
                p = os.path.join(base, f)
                if f.startswith(".") or not f.endswith(SUFFIXES) or not os.path.isfile(p):
                    continue
                if os.path.realpath(p) in seen:
                    continue
                seen.add(os.path.realpath(p))
                out.append(p)
        if not out:
            raise ShardwiseError(f"{flag} {path}: no data files in this directory (.jsonl, .json, .csv, .tsv, "
                                 ".parquet, .arrow, or a saved `datasets` directory)")
        return sorted(out)
    if not os.path.exists(path):
        import re

        from shardwise.models.load import HUB_ID

        if re.fullmatch(HUB_ID, path):  # ms-swift's and LLaMA-Factory's hub dataset ids
            raise ShardwiseError(f"{flag} {path}: no such file or directory; if it is a hub dataset, shardwise reads "
                                 f"local files only: download it (`hf download --repo-type dataset {path} --local-dir "
                                 f"DIR`) and give DIR")
        raise ShardwiseError(f"{flag} {path}: no such file or directory; give a data file, a directory of them"
                             + (", or 'demo'" if flag == "--data" else ""))
    if not os.path.isfile(path):
        raise ShardwiseError(f"{flag} {path}: not a regular file (a device, pipe or socket); give a data file "
                             "or a directory of them")
    return [path]


def file_kind(path: str) -> str:
    """'saved', 'parquet', 'arrow' (IPC file), 'arrow-stream', 'json-array', 'csv' or 'jsonl'."""
    if os.path.isdir(path):
        return "saved"
    try:
        with open(path, "rb") as fh:
            head = fh.read(4096)
    except OSError as e:
        raise ShardwiseError(f"{path}: cannot read ({e.strerror})")
    if head.startswith(b"PAR1"):
        return "parquet"
    if head.startswith(b"ARROW1"):
        return "arrow"
    if head.startswith(b"\xff\xff\xff\xff"):
        return "arrow-stream"
    first = head.lstrip(b"\xef\xbb\xbf \t\r\n")[:1]
    ext = os.path.splitext(path)[1].lower()
    if ext in (".parquet", ".arrow") and head:  # named as one, but without the format's magic bytes
        want = "PAR1" if ext == ".parquet" else "ARROW1 (or an Arrow stream's 0xFFFFFFFF)"
        raise ShardwiseError(f"{path}: not a{' Parquet' if ext == '.parquet' else 'n Arrow'} file (it does not "
                             f"start with {want}); re-export it, or rename it if it holds JSON lines")
    if first == b"[":
        return "json-array"
    if ext in (".csv", ".tsv"):
        return "csv"
    return "jsonl"


# ----------------------------------------------------------------------------- reading


def _lines(fh, limit: int) -> Iterator[tuple[int, bytes | None]]:
    """(line number, bytes) per line; None for a line longer than `limit` (not kept)."""
    lineno = 0
    while True:
        line = fh.readline(limit + 1)
        if not line:
            return
        lineno += 1
        if len(line) > limit and not line.endswith(b"\n"):
            while True:  # drop the rest of the line without holding it
                chunk = fh.readline(1 << 20)
                if not chunk or chunk.endswith(b"\n"):
                    break
            yield lineno, None
            continue
        yield lineno, line


def _not_jsonl(path: str, line: bytes) -> str | None:
    """What a file whose first line is not JSON looks like, if it is clearly something else."""
    s = line.lstrip(b"\xef\xbb\xbf \t")
    if s.strip() == b"{":
        return ("one JSON object spread over several lines, not records; give a JSON array of records (.json) "
                "or JSON Lines (one record per line)")
    if not s.startswith(b"{") and (b"," in s or b"\t" in s):
        header = s.decode("utf-8", "replace").strip()[:60]
        return f"a CSV file (first line '{header}'), not JSON Lines; name it .csv (or .tsv)"
    return None


def _jsonl_rows(path: str) -> Iterator[tuple[str, object]]:
    """(where, record or BadRecord) per non-empty line."""
    try:
        fh = open(path, "rb")
    except OSError as e:
        raise ShardwiseError(f"{path}: cannot read ({e.strerror})")
    first = True
    with fh:
        for lineno, raw in _lines(fh, MAX_RECORD_BYTES):
            where = f"{path}:{lineno}"
            if raw is None:
                size = f"{MAX_RECORD_BYTES >> 20} MiB" if MAX_RECORD_BYTES >= 1 << 20 else f"{MAX_RECORD_BYTES} bytes"
                yield where, BadRecord(f"record longer than {size}, not read (no training example is this long)")
                first = False
                continue
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                first = False
                yield where, BadRecord(f"not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})")
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                if first and (what := _not_jsonl(path, raw)):
                    raise ShardwiseError(f"{path}: this is {what}")
                obj = BadRecord(f"invalid JSON ({e.msg} at column {e.colno})")
            except RecursionError:
                obj = BadRecord("invalid JSON (nested too deeply)")
            first = False
            yield where, obj


def _root_cause(e: BaseException) -> BaseException:
    seen = set()
    while (e.__cause__ or e.__context__) is not None and id(e) not in seen:
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return e


def _hf_rows(path: str, kind: str, cache: str) -> Iterator[tuple[str, object]]:
    """Rows of a file read by `datasets`, as (where, dict)."""
    ds = _hf_dataset(path, kind, cache)
    for i, row in enumerate(ds, 1):
        yield f"{path}:row {i}", row


def _json_array_first(path: str) -> str:
    """The first character after a JSON array file's `[` ('{' for records, ']' for an empty array), read without
    loading a large array ('' when the first 64 KiB hold none)."""
    with open(path, "rb") as fh:
        head = fh.read(1 << 16).lstrip(b"\xef\xbb\xbf").lstrip()
    rest = head[1:].lstrip() if head.startswith(b"[") else b""
    return chr(rest[0]) if rest else ""


def _hf_dataset(path: str, kind: str, cache: str):
    os.environ["HF_DATASETS_OFFLINE"] = "1"  # local files only, whatever the environment says
    import datasets

    datasets.config.HF_DATASETS_OFFLINE = True
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    kw = {"cache_dir": cache, "keep_in_memory": True}
    try:
        if kind == "saved":
            ds = datasets.load_from_disk(path)
            if isinstance(ds, datasets.DatasetDict):
                if "train" not in ds:
                    raise ShardwiseError(f"{path}: a saved DatasetDict without a 'train' split (splits: "
                                         f"{', '.join(ds)}); save the split to train on, or name its directory")
                ds = ds["train"]
            return ds
        if kind == "parquet":
            return datasets.Dataset.from_parquet(path, **kw)
        if kind == "csv":
            sep = "\t" if path.lower().endswith(".tsv") else ","
            return datasets.Dataset.from_csv(path, sep=sep, **kw)
        if kind == "json-array":
            first = _json_array_first(path)
            if first == "]":  # datasets says 'Instruction "train" corresponds to no data!'
                raise ShardwiseError(f"{path}: an empty JSON array ([]): no records; give records in it, or "
                                     "leave the file out")
            if first and first != "{":  # datasets reads [1, 2] as a column 'text' of numbers
                raise ShardwiseError(f"{path}: a JSON array whose first item is not an object ({{...}}): each item "
                                     "must be one record, e.g. {\"messages\": [...]} or {\"text\": \"...\"}")
            return datasets.Dataset.from_json(path, **kw)
        if kind == "arrow-stream":  # what save_to_disk writes
            return datasets.Dataset.from_file(path, in_memory=True)
        return datasets.load_dataset("arrow", data_files=path, split="train", **kw)  # an Arrow IPC file
    except ShardwiseError:
        raise
    except Exception as e:  # pyarrow, pandas and datasets raise many types here
        cause = _root_cause(e)
        detail = str(cause).strip().splitlines()[0][:200] if str(cause).strip() else type(cause).__name__
        if isinstance(cause, UnicodeDecodeError):
            detail = f"byte 0x{cause.object[cause.start]:02x} at offset {cause.start}"
        if isinstance(cause, UnicodeDecodeError) or "utf8" in detail.lower().replace("-", ""):
            raise ShardwiseError(f"{path}: not valid UTF-8 ({detail}); convert the file to UTF-8") from None
        if kind == "json-array":  # pyarrow's parser names a byte position; Python's names the line
            _json_array_syntax(path)
        name = {"saved": "saved dataset", "json-array": "JSON array", "csv": "CSV", "parquet": "Parquet"}.get(kind, "Arrow")
        raise ShardwiseError(f"{path}: cannot read this {name} file ({type(cause).__name__}: {detail}); "
                             "check that it is complete and in that format") from None


def _json_array_syntax(path: str) -> None:
    """Raise a ShardwiseError at the line and column of a JSON syntax error in `path` (a file datasets could not
    read), if Python's parser finds one."""
    import json

    try:
        with open(path, encoding="utf-8-sig") as fh:
            json.load(fh)
    except json.JSONDecodeError as e:
        raise ShardwiseError(f"{path}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno}); fix the file "
                             "there") from None
    except (OSError, ValueError, RecursionError):
        return


def read_records(path: str, fmt: str = "auto", skip_bad: bool = False, columns: dict | None = None,
                 stats: ReadStats | None = None, flag: str = "--data", tags: dict | None = None,
                 preference: bool = False) -> tuple[list[Record], ReadStats]:
    """All records of one --data path (or of the option `flag` names: --val-data); the first bad one stops, unless
    skip_bad. `tags`: a dataset_info entry's sharegpt turn keys and roles (dataset_info.retag). `preference` (task
    dpo): the records are preference pairs (data/preference.py)."""
    stats = stats or ReadStats()
    out: list[Record] = []
    with tempfile.TemporaryDirectory(prefix="shardwise-datasets-") as cache:
        for fname in data_files(path, flag):
            stats.files.append(fname)
            kind = file_kind(fname)
            rows = _jsonl_rows(fname) if kind == "jsonl" else _hf_rows(fname, kind, cache)
            out += _records(rows, None if fmt == "auto" else fmt, skip_bad, columns or {}, stats, tags or {},
                            preference)
    if not out:
        extra = f" ({stats.skipped} bad records skipped)" if stats.skipped else ""
        raise ShardwiseError(f"{flag} {path}: no usable records{extra}; check the file and --data-format")
    return out, stats


def _records(rows, file_fmt: str | None, skip_bad: bool, columns: dict, stats: ReadStats,
             tags: dict, preference: bool = False) -> list[Record]:
    out = []
    for where, obj in rows:
        try:
            if isinstance(obj, BadRecord):
                raise obj
            obj = retag(rename(obj, columns), tags)
            if preference:
                if file_fmt is None:
                    file_fmt = detect_preference(obj)
                    if file_fmt is None:
                        raise not_preference(where, obj)
                out.append(parse_preference(obj, file_fmt, where))
                stats.records += 1
                continue
            if file_fmt is None:
                file_fmt = detect_format(obj) if isinstance(obj, dict) else None
                if file_fmt is None:
                    raise preference_pair(where, obj) or undetectable(where, obj)
            rec = parse_record(obj, file_fmt, where)
        except BadRecord as e:
            if not skip_bad:
                fmt_note = f" (format {file_fmt})" if file_fmt else ""
                raise ShardwiseError(f"{where}: {e}{fmt_note}; fix the record or pass --skip-bad-records")
            stats.skipped += 1
            stats.first_skipped = stats.first_skipped or f"{where}: {e}"
            continue
        out.append(rec)
        stats.records += 1
    return out


# ----------------------------------------------------------------------------- several sources


@dataclass
class Source:
    path: str
    weight: float | None = None  # share of the mix (weights are relative to each other)
    count: int | None = None  # exactly this many examples (sampled, or repeated when larger)
    take: int | None = None  # PATH#N (ms-swift's spelling): N records sampled from the source before any mixing
    name: str = ""  # a dataset_info.json name (its entry gives path, fmt, columns, tags)
    fmt: str | None = None
    columns: dict | None = None
    tags: dict | None = None

    def __str__(self) -> str:
        spec = f":{self.weight!r}" if self.weight is not None else (f":{self.count}" if self.count is not None else "")
        return (self.name or self.path) + (f"#{self.take}" if self.take else "") + spec


def parse_data_spec(spec: str, where: str = "--data", info: dict | None = None, dataset_dir: str = "",
                    ) -> list[Source]:
    """'a.jsonl:0.7,b.parquet:0.3' / 'a.jsonl:1000,b' / 'a.jsonl#500' -> Sources. PATH:N with a decimal point is
    a weight, an integer N is a count of examples; PATH#N samples N records of the source first (ms-swift's
    spelling; repeated when it has fewer), and composes with either; a bare PATH is taken whole. A name that
    `info` (dataset_dir's dataset_info.json) defines is read as its entry says."""
    out = []
    items = [s.strip() for s in (spec or "").split(",")]
    if not any(items):
        raise ShardwiseError(f"{where}: no data given; give a data file, a directory, 'demo', or PATH:WEIGHT,...")
    for item in items:
        if not item:
            raise ShardwiseError(f"{where}: empty entry in '{spec}'; separate sources with single commas")
        path, num = split_source(item)
        path, take = split_take(path)
        src = Source(path, count=int(num)) if num.isdigit() else Source(path, weight=float(num)) if num else Source(path)
        if (src.count is not None and src.count < 1) or (src.weight is not None and not src.weight > 0):
            raise ShardwiseError(f"{where}: '{item}': a count must be >= 1 and a weight > 0")
        if take == 0:
            raise ShardwiseError(f"{where}: '{item}': #N takes N records, N >= 1")
        src.take = take
        if info and path in info:
            entry = entry_source(path, info[path], dataset_dir, where)
            src.name, src.path, src.fmt, src.columns, src.tags = path, entry["path"], entry["fmt"], \
                entry["columns"], entry["tags"]
            src.take = take or entry["take"]
        out.append(src)
    return out


def split_take(path: str) -> tuple[str, int | None]:
    """'a.jsonl#500' -> ('a.jsonl', 500); a path without '#N' -> (path, None)."""
    head, hash_, num = path.rpartition("#")
    if hash_ and head and num.isdigit():
        return head, int(num)
    return path, None


def mix(groups: list[tuple[Source, list[Record]]], seed: int) -> tuple[list[Record], str]:
    """The mixed record list, deterministic for `seed`, and a line saying what was taken.

    A source with a count gives exactly that many examples; weighted sources share the sum of
    their sizes in proportion to their weights; a bare source is taken whole. A source asked
    for more examples than it has is repeated whole, then sampled for the rest. The order
    inside the list does not matter (the sampler shuffles each epoch)."""
    weighted = [(s, r) for s, r in groups if s.weight is not None]
    total = sum(len(r) for _, r in weighted)
    wsum = sum(s.weight for s, _ in weighted)
    out, parts = [], []
    for i, (src, recs) in enumerate(groups):
        n = src.count if src.count is not None else (
            max(1, round(total * src.weight / wsum)) if src.weight is not None else len(recs))
        rng = random.Random(seed * 1_000_003 + i)
        whole, rest = divmod(n, len(recs))
        picked = list(range(len(recs))) * whole + sorted(rng.sample(range(len(recs)), rest))
        out += [recs[j] for j in picked]
        parts.append(f"{src.name or src.path}{f'#{src.take}' if src.take else ''} {n} of {len(recs)}" + (" (repeated)" if n > len(recs) else ""))
    return out, "mix: " + ", ".join(parts) + " examples"


def load_records(cfg, where=lambda key: f"--{key.replace('_', '-')}") -> tuple[list[Record], ReadStats | None]:
    """Every record cfg.data names ('demo', a path, a dataset_info name, or several with weights/counts); `where(key)`
    says where a config key was set, for the error lines."""
    info = read_info(cfg.dataset_dir, where("dataset_dir")) if cfg.dataset_dir else None
    sources = parse_data_spec(cfg.data, where("data"), info, cfg.dataset_dir)
    cols = parse_columns(cfg.columns, where("columns"))
    demo = demo_pairs if cfg.task == "dpo" else demo_dataset
    plain = [s for s in sources if s.weight is None and s.count is None and s.take is None]
    if len(plain) == len(sources) == 1 and sources[0].path == "demo" and not cfg.max_samples:
        return demo(), None
    stats, groups = ReadStats(), []
    for i, src in enumerate(sources):
        if src.path == "demo" and not src.name:
            recs = demo()
        else:
            fmt = src.fmt or cfg.data_format
            recs, _ = read_records(src.path, fmt, cfg.skip_bad_records, src.columns or cols, stats, tags=src.tags,
                                   preference=cfg.task == "dpo")
        if cfg.max_samples:  # LLaMA-Factory's: the first N of each source
            recs = recs[:cfg.max_samples]
        if src.take is not None and (src.weight is not None or src.count is not None):
            recs = mix([(Source(str(src), count=src.take), recs)], cfg.seed + i)[0]
        elif src.take is not None:
            src.count = src.take
        groups.append((src, recs))
    if len(plain) == len(groups) == 1:
        return groups[0][1], stats
    records, stats.mix = mix(groups, cfg.seed)
    return records, stats
