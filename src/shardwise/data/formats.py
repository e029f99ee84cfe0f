"""Record formats: detect, validate and normalise one record (a dict) with a 'where' for errors.

- messages: {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": str}, ...],
             "tools": [...]?}  (OpenAI's tool calling: an assistant message's `tool_calls`,
            `tool` messages with the results)
- sharegpt: {"conversations": [{"from": "system"|"human"|"gpt", "value": str}, ...], "system": str?,
             "tools": str?}  (roles human/user, gpt/assistant/chatgpt/model/bard/bing, system, and
            function_call/observation, the glaive-style tool turns; `role`/`content` keys are
            accepted too)
- alpaca:   {"instruction": str, "input": str?, "output": str, "system": str?,
             "history": [[instruction, output], ...]?}  (history = earlier turns, in order)
- text:     {"text": str}
Every record becomes a chat Record (a list of {role, content}, in the OpenAI messages form that
Hugging Face chat templates take: tool calls as an assistant message's `tool_calls`, their results
as `tool` messages, the function schemas in Record.tools) or a text Record, with its
source ("file:line" or "file:row N"). Column mapping (`--columns prompt=instruction,...`)
renames a record's keys before detection, so other names reach these four formats.
Reading files is sources.py's job (read_records, load_records); this module never opens one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from shardwise.errors import ShardwiseError

ROLES = ("system", "user", "assistant")
# tool turns: OpenAI's `tool` (and its older `function`), LLaMA-Factory's glaive-style `function_call` (an assistant
# turn whose text is the JSON call) and `observation` (the call's result)
TOOL_ROLES = {"tool": "tool", "function": "tool", "observation": "tool", "function_call": "function_call"}
FORMATS = ("messages", "sharegpt", "alpaca", "text")
# the names --columns may map a column to
TARGET_COLUMNS = ("messages", "conversations", "instruction", "input", "output", "system", "history", "text",
                  "tools", "prompt", "chosen", "rejected", "rejected_response")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "model": "assistant", "bard": "assistant", "bing": "assistant",
                  "system": "system", **TOOL_ROLES}
# content parts that are not text: this is text-only fine-tuning
MEDIA_PARTS = ("image", "image_url", "input_image", "audio", "audio_url", "input_audio", "video", "video_url",
               "file", "input_file")


@dataclass
class Record:
    kind: str  # "chat", "text", or "pair" (a preference record: data/preference.py)
    payload: list | str  # messages (a pair's: the prompt's turns) or text
    source: str  # "file:line" / "file:row N"
    tools: list | None = None  # the function schemas a chat record's template renders ({"type": "function", ...})
    chosen: dict | None = None  # a pair's chosen and rejected assistant messages
    rejected: dict | None = None

    @property
    def has_tools(self) -> bool:
        """Whether rendering this record needs a template that renders tools, tool calls or their results."""
        return bool(self.tools) or (self.kind == "chat" and any(
            m["role"] == "tool" or m.get("tool_calls") for m in self.payload))


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


def _content(m: dict, ck: str, i: int) -> str:
    """A message's text: a string, or a list of parts (OpenAI's {"type": "text", "text": ...}, LLaMA-Factory's
    {"type": "text", "value": ...}) whose text parts are joined as they stand, the way chat templates that take
    parts render them one after another."""
    v = m.get(ck)
    if isinstance(v, str):
        return _text(v, f"message {i}")
    if not isinstance(v, list):
        raise BadRecord(f"message {i} has no '{ck}' string")
    out = []
    for part in v:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in MEDIA_PARTS or (isinstance(part, dict) and kind is None and set(part) & set(MEDIA_PARTS)):
            raise BadRecord(f"message {i} has a{'n' if str(kind or '')[:1] in 'aeiou' else ''} "
                            f"'{kind or next(iter(set(part) & set(MEDIA_PARTS)))}' part: this is text-only "
                            "fine-tuning (no image, audio or video inputs); drop the record or keep only its "
                            "text parts")
        # a Parquet or JSON-array file read by `datasets` gives every part every key, the absent ones None
        text = (part.get("text") if part.get("text") is not None else part.get("value")) if kind == "text" else None
        if not isinstance(text, str):
            raise BadRecord(f"message {i}: a part of '{ck}' is not {{\"type\": \"text\", \"text\": \"...\"}}")
        out.append(_text(text, f"message {i}"))
    return "".join(out)


def _call(f, i: int, what: str) -> dict:
    """One tool call in the form Hugging Face chat templates take: {"type": "function", "function": {"name": str,
    "arguments": dict}}; OpenAI's arguments are a JSON string, which the templates would print quoted."""
    if isinstance(f, dict) and isinstance(f.get("function"), dict):
        call_id, f = f.get("id"), f["function"]
    else:
        call_id = None
    if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
        raise BadRecord(f"message {i}: {what} is not a function call {{\"name\": ..., \"arguments\": {{...}}}}")
    args = f.get("arguments") if f.get("arguments") is not None else f.get("parameters")
    if args is None:
        args = {}
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise BadRecord(f"message {i}: the arguments of call '{f['name']}' are not JSON") from None
    if not isinstance(args, dict):
        raise BadRecord(f"message {i}: the arguments of call '{f['name']}' are not a JSON object")
    out = {"type": "function", "function": {"name": f["name"], "arguments": args}}
    if isinstance(call_id, str) and call_id:
        out["id"] = call_id
    return out


def _calls(v, i: int, what: str) -> list[dict]:
    if isinstance(v, str):  # glaive-style: the turn's text is the call, as JSON
        try:
            v = json.loads(v)
        except ValueError:
            raise BadRecord(f"message {i}: {what} is not JSON; a function call is "
                            "{\"name\": ..., \"arguments\": {...}}") from None
    calls = [_call(f, i, what) for f in (v if isinstance(v, list) else [v])]
    if not calls:
        raise BadRecord(f"message {i}: {what} is empty")
    return calls


def _message(m: dict, i: int, role: str, ck: str) -> dict:
    """One turn in the OpenAI messages form, tool calls and results included."""
    if role == "function_call":
        return {"role": "assistant", "content": "", "tool_calls": _calls(m.get(ck), i, "the 'function_call' turn")}
    if role == "assistant" and (m.get("tool_calls") or m.get("function_call")):
        v = m.get("tool_calls") or m.get("function_call")
        content = _content(m, ck, i) if m.get(ck) is not None else ""
        return {"role": "assistant", "content": content, "tool_calls": _calls(v, i, "its 'tool_calls'")}
    out = {"role": role, "content": _content(m, ck, i)}
    if role == "tool":
        for k in ("tool_call_id", "name"):
            if isinstance(m.get(k), str):
                out[k] = m[k]
    return out


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
        out.append(_message(m, i, roles[role], ck))
    return out


def _tools(obj: dict) -> list[dict] | None:
    """The record's function schemas ('tools': a list, or the JSON string of one as LLaMA-Factory's glaive data
    holds it), each as {"type": "function", "function": {...}}; None for none."""
    v = obj.get("tools")
    if isinstance(v, str):
        if not v.strip():
            return None
        try:
            v = json.loads(v)
        except ValueError:
            raise BadRecord("field 'tools' is not JSON; it holds a list of function schemas "
                            "[{\"name\": ..., \"description\": ..., \"parameters\": {...}}]") from None
    if v is None or v == []:
        return None
    if isinstance(v, dict):
        v = [v]
    out = []
    for t in v if isinstance(v, list) else [None]:
        f = t.get("function") if isinstance(t, dict) and isinstance(t.get("function"), dict) else t
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise BadRecord("field 'tools' must be a list of function schemas, each with a 'name' "
                            "({\"name\": ..., \"description\": ..., \"parameters\": {...}})")
        out.append({"type": "function", "function": f})
    return out


def _need_answer(msgs: list[dict]) -> list[dict]:
    if not any(m["role"] == "assistant" and (m["content"] or m.get("tool_calls")) for m in msgs):
        raise BadRecord("conversation has no non-empty assistant message, so nothing to learn")
    return msgs


def preference_pair(where: str, obj) -> ShardwiseError | None:
    """The line for a preference record ('chosen' and 'rejected' answers, e.g. LLaMA-Factory's dpo_en_demo or
    {prompt, chosen, rejected}), which supervised fine-tuning does not take; None for any other record."""
    if not (isinstance(obj, dict) and "chosen" in obj and "rejected" in obj):
        return None
    prompt = next((k for k in ("prompt", "question", "instruction") if isinstance(obj.get(k), str)), None)
    if prompt and isinstance(obj["chosen"], str):
        how = (f"to fine-tune on the chosen answers, pass --columns {prompt}=instruction,chosen=output"
               if prompt != "instruction" else "to fine-tune on the chosen answers, pass --columns chosen=output")
    else:
        how = "to fine-tune on the chosen answers, write them as conversations ending in that answer"
    return ShardwiseError(f"{where}: this is a preference pair ('chosen' and 'rejected' answers), data for "
                          f"DPO-style training, which supervised fine-tuning (--task sft) does not take; pass --task "
                          f"dpo to train on the pairs (docs/dpo.md), or, {how}")


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
                                           {**{r: r for r in ROLES}, **TOOL_ROLES}))
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
    if _tools(obj):
        raise BadRecord("field 'tools' is set, but a text record has no turns to call them from; give the calls "
                        "as messages or conversations")
    text = _str(obj, "text", True)
    if not text.strip():
        raise BadRecord("field 'text' is empty")
    return "text", text


def parse_record(obj, fmt: str, where: str) -> Record:
    """One record in format `fmt` as a Record, its function schemas ('tools') kept; raises BadRecord, and a
    ShardwiseError for a preference pair (the whole file is one, not a bad record)."""
    pair = preference_pair(where, obj)
    if pair:
        raise pair
    kind, payload = parse(obj, fmt)
    return Record(kind, payload, where, _tools(obj) if kind == "chat" else None)


def demo_dataset() -> list[Record]:
    from shardwise.data.demo import demo_records

    return [Record("chat", r["messages"], f"demo:{i + 1}") for i, r in enumerate(demo_records())]
