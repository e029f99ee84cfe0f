"""Record formats: detect, validate and normalise one record (a dict) with a 'where' for errors.

- messages: {"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}
- sharegpt: {"conversations": [{"from": "system"|"human"|"gpt", "value": str}, ...], "system": str?}
            (roles human/user, gpt/assistant/chatgpt/model/bard/bing, system; `role`/`content`
            keys are accepted too)
- alpaca:   {"instruction": str, "input": str?, "output": str, "system": str?,
             "history": [[instruction, output], ...]?}  (history = earlier turns, in order)
- text:     {"text": str}
Every record becomes a chat Record (a list of {role, content}) or a text Record, with its
source ("file:line" or "file:row N"). Column mapping (`--columns prompt=instruction,...`)
renames a record's keys before detection, so other names reach these four formats.
Reading files is sources.py's job (read_records, load_records); this module never opens one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardwise.errors import ShardwiseError

ROLES = ("system", "user", "assistant")
FORMATS = ("messages", "sharegpt", "alpaca", "text")
# the names --columns may map a column to
TARGET_COLUMNS = ("messages", "conversations", "instruction", "input", "output", "system", "history", "text")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "model": "assistant", "bard": "assistant", "bing": "assistant",
                  "system": "system"}


@dataclass
class Record:
    kind: str  # "chat" or "text"
    payload: list | str  # messages or text
    source: str  # "file:line" / "file:row N"


@dataclass
class ReadStats:
    files: list[str] = field(default_factory=list)
    records: int = 0
    skipped: int = 0
    first_skipped: str = ""
    mix: str = ""  # how several sources were mixed, for the launch line ("" for one source)


class BadRecord(Exception):
    """One record is malformed: skippable with --skip-bad-records."""


def detect_format(obj: dict) -> str | None:
    if "messages" in obj and obj["messages"] is not None:
        return "messages"
    if "conversations" in obj and obj["conversations"] is not None:
        return "sharegpt"
    if obj.get("instruction") is not None and "output" in obj:
        return "alpaca"
    if "text" in obj and obj["text"] is not None:
        return "text"
    return None


def parse_columns(spec: str, where: str = "--columns") -> dict[str, str]:
    """'prompt=instruction,answer=output' -> {"prompt": "instruction", "answer": "output"}."""
    out: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in (spec or "").split(","))):
        src, eq, dst = item.partition("=")
        src, dst = src.strip(), dst.strip()
        if not eq or not src or not dst:
            raise ShardwiseError(f"{where}: '{item}' is not COLUMN=NAME; e.g. --columns prompt=instruction,answer=output")
        if dst not in TARGET_COLUMNS:
            raise ShardwiseError(f"{where}: '{item}' maps to unknown name '{dst}'; map columns to one of "
                                 f"{', '.join(TARGET_COLUMNS)}")
        out[src] = dst
    return out


def rename(obj, columns: dict[str, str]):
    if not columns or not isinstance(obj, dict):
        return obj
    out = {k: v for k, v in obj.items() if k not in columns}
    out.update({dst: obj[src] for src, dst in columns.items() if src in obj})
    return out


def undetectable(where: str, obj) -> ShardwiseError:
    keys = ", ".join(map(str, list(obj)[:8])) if isinstance(obj, dict) else f"a JSON {type(obj).__name__}"
    return ShardwiseError(f"{where}: cannot detect the data format (found {keys}): expected 'messages', "
                          "'conversations' (ShareGPT), 'instruction' + 'output' (alpaca) or 'text'; rename "
                          "columns with --columns COLUMN=NAME (e.g. prompt=instruction,answer=output) "
                          "or set --data-format")


def _text(v: str, what: str) -> str:
    """`v` if it is text: JSON's "\\udcff" escapes parse into lone surrogates, which no tokenizer encodes."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRecord(f"{what} holds an unpaired surrogate (\\u{ord(v[e.start]):04x} at character {e.start + 1}), "
                        "not text") from None
    return v


def _str(obj: dict, key: str, required: bool) -> str | None:
    v = obj.get(key)
    if v is None:
        if required:
            raise BadRecord(f"missing field '{key}' (a string)")
        return None
    if not isinstance(v, str):
        raise BadRecord(f"field '{key}' must be a string")
    return _text(v, f"field '{key}'")


def _turns(items, key: str, role_key: tuple[str, str], content_key: tuple[str, str], roles: dict) -> list[dict]:
    if not isinstance(items, list):
        raise BadRecord(f"missing field '{key}' (a list of turns)" if items is None else
                        f"field '{key}' must be a list of turns, got {type(items).__name__}")
    if not items:
        raise BadRecord(f"empty conversation ('{key}' is [])")
    out = []
    for i, m in enumerate(items, 1):
        if not isinstance(m, dict):
            raise BadRecord(f"message {i} is not an object")
        rk = role_key[0] if m.get(role_key[0]) is not None else role_key[1]
        ck = content_key[0] if m.get(content_key[0]) is not None else content_key[1]
        role = m.get(rk)
        if role not in roles:
            raise BadRecord(f"message {i} has unknown role {role!r} (allowed: {', '.join(roles)})")
        if not isinstance(m.get(ck), str):
            raise BadRecord(f"message {i} has no '{ck}' string")
        out.append({"role": roles[role], "content": _text(m[ck], f"message {i}")})
    return out


def _need_answer(msgs: list[dict]) -> list[dict]:
    if not any(m["role"] == "assistant" and m["content"] for m in msgs):
        raise BadRecord("conversation has no non-empty assistant message, so nothing to learn")
    return msgs


def parse(obj, fmt: str) -> tuple[str, list | str]:
    """(kind, payload) of one record in format `fmt`; raises BadRecord."""
    if not isinstance(obj, dict):
        raise BadRecord(f"a record must be a JSON object, got {type(obj).__name__}")
    if fmt == "messages":
        msgs = obj.get("messages")
        if not isinstance(msgs, list):
            raise BadRecord("missing field 'messages' (a list of {role, content})" if msgs is None else
                            f"field 'messages' must be a list of {{role, content}}, got {type(msgs).__name__}")
        return "chat", _need_answer(_turns(msgs, "messages", ("role", "role"), ("content", "content"),
                                           {r: r for r in ROLES}))
    if fmt == "sharegpt":
        msgs = _turns(obj.get("conversations"), "conversations", ("from", "role"), ("value", "content"),
                      SHAREGPT_ROLES)
        system = _str(obj, "system", False)
        if system and msgs[0]["role"] != "system":
            msgs.insert(0, {"role": "system", "content": system})
        return "chat", _need_answer(msgs)
    if fmt == "alpaca":
        instruction, output = _str(obj, "instruction", True), _str(obj, "output", True)
        inp, system = _str(obj, "input", False), _str(obj, "system", False)
        if not output:
            raise BadRecord("field 'output' is empty, so nothing to learn")
        msgs = [{"role": "system", "content": system}] if system else []
        history = obj.get("history")
        if history is not None:
            if not isinstance(history, list) or not all(
                    isinstance(t, (list, tuple)) and len(t) == 2 and all(isinstance(x, str) for x in t) for t in history):
                raise BadRecord("field 'history' must be a list of [instruction, output] string pairs")
            for q, a in history:
                msgs += [{"role": "user", "content": _text(q, "field 'history'")},
                         {"role": "assistant", "content": _text(a, "field 'history'")}]
        prompt = instruction + (("\n\n" + inp) if inp else "")
        return "chat", msgs + [{"role": "user", "content": prompt}, {"role": "assistant", "content": output}]
    text = _str(obj, "text", True)
    if not text.strip():
        raise BadRecord("field 'text' is empty")
    return "text", text


def demo_dataset() -> list[Record]:
    from shardwise.data.demo import demo_records

    return [Record("chat", r["messages"], f"demo:{i + 1}") for i, r in enumerate(demo_records())]
