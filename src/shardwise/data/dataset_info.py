"""LLaMA-Factory's dataset_info.json: data sources by name (`--dataset NAME,NAME --dataset-dir DIR`).

Each entry names a local file or directory (`file_name`, relative to the directory of dataset_info.json), its
`formatting` (alpaca, the default; sharegpt; openai, which is sharegpt with OpenAI's role/content keys), `columns`
(which column holds what) and, for sharegpt, `tags` (the keys and role names of its turns). An entry becomes a Source
whose format, column renames and turn tags are its own, so its records reach the readers of data/formats.py as the
four formats they know. Entries on a hub (hf_hub_url, ms_hub_url, script_url, no file_name) are refused in one line:
nothing is downloaded at run time.
"""

from __future__ import annotations

import json
import os

from shardwise.errors import ShardwiseError

FILE = "dataset_info.json"
# LLaMA-Factory's column names -> the keys data/formats.py reads
ALPACA_COLUMNS = {"prompt": "instruction", "query": "input", "response": "output", "system": "system",
                  "history": "history"}
SHAREGPT_COLUMNS = {"messages": "conversations", "system": "system", "tools": "tools"}
# its sharegpt tags: (the tag, its default, what formats.py reads in its place)
SHAREGPT_TAGS = {"role_tag": ("from", "from"), "content_tag": ("value", "value"), "user_tag": ("human", "human"),
                 "assistant_tag": ("gpt", "gpt"), "observation_tag": ("observation", "observation"),
                 "function_tag": ("function_call", "function_call"), "system_tag": ("system", "system")}
# the openai formatting's defaults (OpenAI's messages: role/content, user/assistant/tool/system)
OPENAI_TAGS = {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant",
               "observation_tag": "tool", "function_tag": "function_call", "system_tag": "system"}
MEDIA_COLUMNS = ("images", "videos", "audios")


def read_info(dataset_dir: str, where: str) -> dict:
    """The entries of DIR/dataset_info.json, {name: entry}."""
    path = os.path.join(dataset_dir, FILE)
    try:
        with open(path, encoding="utf-8") as fh:
            info = json.load(fh)
    except FileNotFoundError:
        raise ShardwiseError(f"{where}: {path} does not exist; dataset_dir is a directory holding LLaMA-Factory's "
                             "dataset_info.json") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ShardwiseError(f"{path}: cannot read ({getattr(e, 'strerror', None) or e})") from None
    except json.JSONDecodeError as e:
        raise ShardwiseError(f"{path}:{e.lineno}: not valid JSON ({e.msg}); fix the file there") from None
    if not isinstance(info, dict) or not all(isinstance(v, dict) for v in info.values()):
        raise ShardwiseError(f"{path}: must be a JSON object of dataset names to entries ({{\"file_name\": ...}})")
    return info


def entry_source(name: str, entry: dict, dataset_dir: str, where: str) -> dict:
    """{path, fmt, columns, tags, take} of one entry: what load_records reads for it."""
    path = os.path.join(dataset_dir, FILE)
    at = f"{where}: dataset '{name}' ({path})"
    if not entry.get("file_name"):
        hub = next((f"{k} {entry[k]}" for k in ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url")
                    if entry.get(k)), None)
        how = (f"download it (`hf download --repo-type dataset {entry['hf_hub_url']} --local-dir "
               f"{os.path.join(dataset_dir, name)}`) and give the entry that file_name" if entry.get("hf_hub_url")
               else "download it and give the entry a file_name")
        raise ShardwiseError(f"{at}: it is on a hub ({hub or 'no file_name'}) and shardwise reads local files only; "
                             + how)
    if entry.get("ranking"):
        raise ShardwiseError(f"{at}: it is a preference (ranking) set, chosen and rejected answers, which supervised "
                             "fine-tuning does not take")
    formatting = entry.get("formatting", "alpaca")
    if formatting not in ("alpaca", "sharegpt", "openai"):
        raise ShardwiseError(f"{at}: formatting {formatting!r} is not alpaca, sharegpt or openai")
    cols = entry.get("columns") or {}
    tags = entry.get("tags") or {}
    if not isinstance(cols, dict) or not isinstance(tags, dict):
        raise ShardwiseError(f"{at}: 'columns' and 'tags' must be JSON objects")
    media = [c for c in MEDIA_COLUMNS if cols.get(c)]
    if media:
        raise ShardwiseError(f"{at}: it has {' and '.join(media)} columns; this is text-only fine-tuning (no image, "
                             "video or audio inputs)")
    table = ALPACA_COLUMNS if formatting == "alpaca" else SHAREGPT_COLUMNS
    unknown = [c for c in cols if c not in table]
    if unknown:
        raise ShardwiseError(f"{at}: columns {', '.join(map(repr, unknown))} are not {formatting} columns "
                             f"({', '.join(table)})")
    columns = {str(cols[c]): table[c] for c in table if cols.get(c) and cols[c] != table[c]}
    retag = {}
    if formatting != "alpaca":
        defaults = OPENAI_TAGS if formatting == "openai" else {k: d for k, (d, _) in SHAREGPT_TAGS.items()}
        retag = {SHAREGPT_TAGS[k][1]: str(tags.get(k, d)) for k, d in defaults.items()}
        if all(k == v for k, v in retag.items()):  # formats.py's own spelling already
            retag = {}
    num = entry.get("num_samples")
    if num is not None and (isinstance(num, bool) or not isinstance(num, int) or num < 1):
        raise ShardwiseError(f"{at}: num_samples must be an integer >= 1, got {num!r}")
    return {"path": os.path.join(dataset_dir, entry["file_name"]), "fmt": "alpaca" if formatting == "alpaca"
            else "sharegpt", "columns": columns, "tags": retag, "take": num}


def retag(obj, tags: dict[str, str]):
    """A sharegpt record whose turns use other keys or role names (`tags`: what formats.py reads -> the file's own)
    with formats.py's own: from/value keys, human/gpt/observation/function_call/system roles."""
    if not tags or not isinstance(obj, dict) or not isinstance(obj.get("conversations"), list):
        return obj
    role_key, content_key = tags["from"], tags["value"]
    roles = {tags[r]: r for r in ("human", "gpt", "observation", "function_call", "system")}
    turns = []
    for m in obj["conversations"]:
        if isinstance(m, dict) and role_key in m:
            m = {**{k: v for k, v in m.items() if k not in (role_key, content_key)},
                 "from": roles.get(m[role_key], m[role_key]), "value": m.get(content_key)}
        turns.append(m)
    return {**obj, "conversations": turns}
