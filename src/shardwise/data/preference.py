"""Preference records (task dpo): a prompt with a chosen and a rejected answer, in the forms the field writes them.

- LLaMA-Factory, sharegpt columns: {"conversations": [...the prompt's turns...], "chosen": {"from": "gpt", "value": str},
  "rejected": {...}, "system": str?}; its OpenAI form: {"messages": [...], "chosen": {"role": ..., "content": ...}, ...}
- LLaMA-Factory, alpaca columns: {"instruction": str, "input": str?, "chosen": str, "rejected": str, "system": str?,
  "history": [[q, a], ...]?}
- TRL: {"prompt": str | messages, "chosen": str | messages, "rejected": str | messages}; without "prompt" (TRL's
  implicit prompt) chosen and rejected are whole conversations that share every turn but the last
- ms-swift: {"messages": [...ending in the chosen answer...], "rejected_response": str}

Each becomes one Record of kind "pair": the prompt's turns (OpenAI messages, ending with a user turn) as its payload,
and the chosen and rejected assistant messages. The format is detected per file from its first record, as for SFT data
(data/formats.py); a record that does not fit the file's format is one line with its file:line.

Encoding (data/encode.py encode_pairs): the prompt is rendered once with the chat template's generation prompt and tokenized once;
each answer is the rest of its rendered conversation, tokenized on its own, so the chosen and the rejected row hold
the same prompt tokens. Row 2i is pair i's chosen answer, row 2i + 1 its rejected one; targets carry only the answer's
tokens (and the template's end-of-turn marker after it).
"""

from __future__ import annotations

from shardwise.data.formats import (
    SHAREGPT_ROLES,
    TOOL_ROLES,
    BadRecord,
    Record,
    _str,
    _tools,
    _turns,
    parse,
)
from shardwise.errors import ShardwiseError

PREFERENCE_FORMATS = ("lf-sharegpt", "lf-messages", "lf-alpaca", "trl", "trl-implicit", "swift")
MESSAGE_ROLES = {"system": "system", "user": "user", "assistant": "assistant", **TOOL_ROLES}


def detect_preference(obj: dict) -> str | None:
    """The preference format of one record, or None (then `not_preference` says what was found)."""
    if not isinstance(obj, dict):
        return None
    if "rejected_response" in obj and isinstance(obj.get("messages"), list):
        return "swift"
    if "chosen" not in obj or "rejected" not in obj:
        return None
    if isinstance(obj.get("conversations"), list):
        return "lf-sharegpt"
    if isinstance(obj.get("messages"), list):
        return "lf-messages"
    if obj.get("instruction") is not None:
        return "lf-alpaca"
    if obj.get("prompt") is not None:
        return "trl"
    return "trl-implicit"


def not_preference(where: str, obj) -> ShardwiseError:
    keys = ", ".join(map(str, list(obj)[:8])) if isinstance(obj, dict) else f"a JSON {type(obj).__name__}"
    return ShardwiseError(f"{where}: not a preference record (found {keys}): task dpo trains on pairs: "
                          "'chosen' + 'rejected' with 'conversations'/'messages' (LLaMA-Factory), 'instruction' "
                          "(LLaMA-Factory alpaca) or 'prompt' (TRL), or 'messages' + 'rejected_response' "
                          "(ms-swift); rename columns with --columns, or train it with --task sft")


def _answer(v, what: str, roles: dict, role_key: tuple[str, str], content_key: tuple[str, str]) -> dict:
    """One assistant answer: a string, one turn ({from, value} / {role, content}) or a list of exactly one turn."""
    if isinstance(v, str):
        if not v:
            raise BadRecord(f"field '{what}' is empty")
        return {"role": "assistant", "content": v}
    if isinstance(v, list) and len(v) == 1:
        v = v[0]
    if not isinstance(v, dict):
        raise BadRecord(f"field '{what}' must be a string or one assistant turn, got {type(v).__name__}")
    (msg,) = _turns([v], what, role_key, content_key, roles)
    if msg["role"] != "assistant" or not (msg["content"] or msg.get("tool_calls")):
        raise BadRecord(f"field '{what}' must be a non-empty assistant turn (role {msg['role']!r})")
    return msg


def _prompt(msgs: list[dict]) -> list[dict]:
    if not msgs or msgs[-1]["role"] not in ("user", "tool"):
        raise BadRecord("the prompt must end with a user turn (the answers follow it)")
    return msgs


def _messages(v, key: str) -> list[dict]:
    return _turns(v, key, ("role", "role"), ("content", "content"), MESSAGE_ROLES)


def parse_preference(obj, fmt: str, where: str) -> Record:
    """One preference record in format `fmt` as a Record of kind "pair"; raises BadRecord."""
    if not isinstance(obj, dict):
        raise BadRecord(f"a record must be a JSON object, got {type(obj).__name__}")
    sharegpt = (("from", "role"), ("value", "content"))
    openai = (("role", "role"), ("content", "content"))
    if fmt == "swift":
        msgs = _messages(obj.get("messages"), "messages")
        if msgs[-1]["role"] != "assistant":
            raise BadRecord("'messages' must end with the chosen assistant answer")
        prompt, chosen = msgs[:-1], msgs[-1]
        rejected = _answer(obj.get("rejected_response"), "rejected_response", MESSAGE_ROLES, *openai)
    elif fmt in ("lf-sharegpt", "lf-messages"):
        if fmt == "lf-sharegpt":
            prompt = _turns(obj.get("conversations"), "conversations", *sharegpt, SHAREGPT_ROLES)
            roles, keys = SHAREGPT_ROLES, sharegpt
        else:
            prompt, roles, keys = _messages(obj.get("messages"), "messages"), MESSAGE_ROLES, openai
        system = _str(obj, "system", False)
        if system and prompt[0]["role"] != "system":
            prompt.insert(0, {"role": "system", "content": system})
        chosen = _answer(obj.get("chosen"), "chosen", roles, *keys)
        rejected = _answer(obj.get("rejected"), "rejected", roles, *keys)
    elif fmt == "lf-alpaca":
        chosen = _answer(obj.get("chosen"), "chosen", MESSAGE_ROLES, *openai)
        rejected = _answer(obj.get("rejected"), "rejected", MESSAGE_ROLES, *openai)
        # the alpaca SFT parse with a stand-in answer gives the system, history and instruction + input turns
        _, msgs = parse({k: v for k, v in obj.items() if k not in ("chosen", "rejected")} | {"output": "x"}, "alpaca")
        prompt = msgs[:-1]
    elif fmt == "trl":
        p = obj.get("prompt")
        prompt = [{"role": "user", "content": _str(obj, "prompt", True)}] if isinstance(p, str) else \
            _messages(p, "prompt")
        chosen = _answer(obj.get("chosen"), "chosen", MESSAGE_ROLES, *openai)
        rejected = _answer(obj.get("rejected"), "rejected", MESSAGE_ROLES, *openai)
    elif fmt == "trl-implicit":
        c, r = _messages(obj.get("chosen"), "chosen"), _messages(obj.get("rejected"), "rejected")
        if c[:-1] != r[:-1] or c[-1]["role"] != "assistant" or r[-1]["role"] != "assistant":
            raise BadRecord("'chosen' and 'rejected' (no 'prompt': TRL's implicit prompt) must be conversations that "
                            "share every turn but the last, which is the assistant's answer")
        prompt, chosen, rejected = c[:-1], c[-1], r[-1]
    else:
        raise BadRecord(f"unknown preference format {fmt!r}")
    return Record("pair", _prompt(prompt), where, _tools(obj), chosen=chosen, rejected=rejected)


def demo_pairs() -> list[Record]:
    from shardwise.data.demo import demo_preference_records

    return [parse_preference(r, "trl", f"demo:{i + 1}") for i, r in enumerate(demo_preference_records())]
