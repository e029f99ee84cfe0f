"""JSONL records in three formats, detected per file, validated with file:line errors.

- messages: {"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}
- alpaca:   {"instruction": str, "input": str (optional), "output": str}
- text:     {"text": str}
Every record becomes {"messages": [...]} (alpaca is turned into a user/assistant pair) or
{"text": ...}, with its source "file:line".
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field

from shardwise.errors import ShardwiseError

ROLES = ("system", "user", "assistant")
FORMATS = ("messages", "alpaca", "text")


@dataclass
class Record:
    kind: str  # "chat" or "text"
    payload: list | str  # messages or text
    source: str  # "file:line"


@dataclass
class ReadStats:
    files: list[str] = field(default_factory=list)
    records: int = 0
    skipped: int = 0
    first_skipped: str = ""


class BadRecord(Exception):
    pass


def detect_format(obj: dict) -> str | None:
    if "messages" in obj:
        return "messages"
    if "instruction" in obj and "output" in obj:
        return "alpaca"
    if "text" in obj:
        return "text"
    return None


def _parse(obj, fmt: str) -> tuple[str, list | str]:
    if not isinstance(obj, dict):
        raise BadRecord(f"a record must be a JSON object, got {type(obj).__name__}")
    if fmt == "messages":
        msgs = obj.get("messages")
        if not isinstance(msgs, list):
            raise BadRecord("missing field 'messages' (a list of {role, content})")
        if not msgs:
            raise BadRecord("empty conversation ('messages' is [])")
        out = []
        for i, m in enumerate(msgs, 1):
            if not isinstance(m, dict):
                raise BadRecord(f"message {i} is not an object")
            role = m.get("role")
            if role not in ROLES:
                raise BadRecord(f"message {i} has unknown role {role!r} (allowed: {', '.join(ROLES)})")
            if not isinstance(m.get("content"), str):
                raise BadRecord(f"message {i} has no 'content' string")
            out.append({"role": role, "content": m["content"]})
        if not any(m["role"] == "assistant" and m["content"] for m in out):
            raise BadRecord("conversation has no non-empty assistant message, so nothing to learn")
        return "chat", out
    if fmt == "alpaca":
        for key in ("instruction", "output"):
            if not isinstance(obj.get(key), str):
                raise BadRecord(f"missing field '{key}' (a string)")
        if "input" in obj and not isinstance(obj["input"], str):
            raise BadRecord("field 'input' must be a string")
        if not obj["output"]:
            raise BadRecord("field 'output' is empty, so nothing to learn")
        prompt = obj["instruction"] + (("\n\n" + obj["input"]) if obj.get("input") else "")
        return "chat", [{"role": "user", "content": prompt}, {"role": "assistant", "content": obj["output"]}]
    text = obj.get("text")
    if not isinstance(text, str):
        raise BadRecord("missing field 'text' (a string)")
    if not text.strip():
        raise BadRecord("field 'text' is empty")
    return "text", text


def data_files(path: str) -> list[str]:
    if os.path.isdir(path):
        files = sorted(glob.glob(os.path.join(path, "**", "*.jsonl"), recursive=True))
        if not files:
            raise ShardwiseError(f"--data {path}: no .jsonl files in this directory")
        return files
    if not os.path.isfile(path):
        raise ShardwiseError(f"--data {path}: no such file or directory; give a JSONL file, a directory of them, or 'demo'")
    return [path]


def read_records(path: str, fmt: str = "auto", skip_bad: bool = False) -> tuple[list[Record], ReadStats]:
    """All records of a JSONL file or directory; the first bad one stops, unless skip_bad."""
    stats = ReadStats()
    out: list[Record] = []
    for fname in data_files(path):
        stats.files.append(fname)
        file_fmt = None if fmt == "auto" else fmt
        try:
            fh = open(fname, encoding="utf-8")
        except OSError as e:
            raise ShardwiseError(f"{fname}: cannot read ({e.strerror})")
        with fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                where = f"{fname}:{lineno}"
                try:
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise BadRecord(f"invalid JSON ({e.msg} at column {e.colno})")
                    except UnicodeDecodeError:
                        raise BadRecord("not valid UTF-8")
                    if file_fmt is None:
                        if not isinstance(obj, dict) or detect_format(obj) is None:
                            raise ShardwiseError(
                                f"{where}: cannot detect the data format: expected a 'messages' list, "
                                "'instruction' + 'output', or 'text'; or set --data-format")
                        file_fmt = detect_format(obj)
                    kind, payload = _parse(obj, file_fmt)
                except BadRecord as e:
                    if not skip_bad:
                        raise ShardwiseError(f"{where}: {e} (format {file_fmt or 'unknown'}); fix the record or pass --skip-bad-records")
                    stats.skipped += 1
                    stats.first_skipped = stats.first_skipped or f"{where}: {e}"
                    continue
                except UnicodeDecodeError:
                    raise ShardwiseError(f"{where}: not valid UTF-8")
                out.append(Record(kind, payload, where))
                stats.records += 1
    if not out:
        extra = f" ({stats.skipped} bad records skipped)" if stats.skipped else ""
        raise ShardwiseError(f"--data {path}: no usable records{extra}; check the file and --data-format")
    return out, stats


def demo_dataset() -> list[Record]:
    from shardwise.data.demo import demo_records

    return [Record("chat", r["messages"], f"demo:{i + 1}") for i, r in enumerate(demo_records())]
