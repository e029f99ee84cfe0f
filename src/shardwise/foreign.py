"""Other tools' spellings of a run: LLaMA-Factory, ms-swift and Hugging Face Trainer configs as they are.

Their YAML keys and flags that are aliases of shardwise's keys (config.FLAG_ALIASES; as YAML keys too), the keys
whose value is translated (bf16 / fp16 / torch_dtype -> mixed_precision, template -> a shipped chat_template, stage
sft), the keys that change nothing in a shardwise run (taken and named in one note), and `--flag true|false` for
every boolean flag (HF scripts' spelling). config.py reads a YAML layer and the flags through foreign_keys and
registers the hidden flags with add_flags; cli.py rewrites argv with bool_values before argparse reads it.
"""

from __future__ import annotations

import argparse
import json
import os
from importlib import resources
from typing import Any

from shardwise.errors import ShardwiseError
from shardwise.preflight.flags import show

# the words a boolean takes, in a YAML value or after a flag (`--gradient_checkpointing true`, HF scripts' spelling)
BOOL_WORDS = {"true": True, "yes": True, "1": True, "on": True, "false": False, "no": False, "0": False, "off": False}


def yaml_aliases(keys, flag_aliases: dict[str, tuple[str, ...]]) -> dict[str, str]:
    """YAML keys the same projects write, {name: dotted key}: every underscore alias of the flag aliases
    (model_name_or_path, learning_rate, ...) and a section key's flat flag spelling (lora_alpha, fsdp_cpu_offload)."""
    out = {a[2:]: key for key, names in flag_aliases.items() for a in names if "-" not in a[2:]}
    out.update({key.replace(".", "_"): key for key in keys if "." in key})
    return out


# Keys of LLaMA-Factory, ms-swift and HF Trainer configs that change nothing in a shardwise run, with why: taken and
# named in one note line rather than refused (a config brought over runs as it is)
IGNORED_KEYS = {
    "do_train": "train trains", "do_eval": "eval_every/val_split evaluate",
    "plot_loss": "metrics.jsonl and `shardwise ui` plot the loss",
    "overwrite_cache": "tokenized data is cached by its content",
    "preprocessing_num_workers": "tokenizing runs in the launcher", "dataloader_num_workers": "batches are in memory",
    "dataloader_pin_memory": "batches are in memory", "ddp_timeout": "collective_timeout is the hang timeout",
    "overwrite_output_dir": "a run over a run needs --overwrite or --resume",
    "save_only_model": "checkpoints keep the optimizer state for --resume",
    "per_device_eval_batch_size": "evaluation uses micro_batch_size", "eval_strategy": "eval_every decides",
    "evaluation_strategy": "eval_every decides", "save_strategy": "save_every decides",
    "logging_strategy": "log_every decides", "logging_dir": "logs go to output_dir",
    "flash_attn": "the attention is chosen per model", "model_author": "no self-cognition data is built",
    "model_name": "no self-cognition data is built",
}
# the value keys of those, as flags: `--dataloader_num_workers 4`, `--model_name 'A' 'B'` (ms-swift's two names)
IGNORED_NARGS = {"model_author": "+", "model_name": "+"}
# keys whose value is translated: HF precision switches, LLaMA-Factory's template and stage
TRANSLATED_KEYS = ("bf16", "fp16", "torch_dtype", "template", "stage")
TORCH_DTYPES = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "half": "fp16",
                "float32": "no", "fp32": "no", "float": "no", "auto": "auto"}


def _shipped_templates() -> list[str]:
    folder = resources.files("shardwise").joinpath("data", "templates")
    return sorted(p.name[:-6] for p in folder.iterdir() if p.name.endswith(".jinja"))


def _as_bool(value: Any, where: str, name: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in BOOL_WORDS:
        return BOOL_WORDS[value.strip().lower()]
    raise ShardwiseError(f"{where}: '{name}' must be true or false, got {show(value)}")


def _translated(name: str, value: Any, where: str, out: dict[str, tuple[Any, str]]) -> None:
    """LLaMA-Factory's stage or template into the key it means, in `out`."""
    if name == "stage":  # LLaMA-Factory's training stage: the two shardwise trains are its tasks
        task = str(value).strip().lower()
        if task not in ("sft", "dpo"):
            raise ShardwiseError(f"{where}: stage {show(value)}: shardwise trains LLaMA-Factory's stages sft "
                                 "(supervised fine-tuning) and dpo (preference pairs) only; write stage: sft or "
                                 "stage: dpo (task)")
        _put(out, "task", task, f"{where} (stage = task)")
        return
    shipped = _shipped_templates()
    if str(value) not in shipped:
        raise ShardwiseError(f"{where}: template {show(value)} is LLaMA-Factory's name; shardwise ships the chat "
                             f"templates {', '.join(shipped)} (chat_template), or takes a Jinja file: give one, "
                             "or remove the key to keep the tokenizer's own template")
    _put(out, "chat_template", str(value), f"{where} (= chat_template)")


def _precision(items: list[tuple[str, Any, str]], out: dict[str, tuple[Any, str]]) -> None:
    """HF's bf16 / fp16 switches and torch_dtype into mixed_precision: a switch that is on picks the compute dtype;
    else torch_dtype's (ms-swift's --torch_dtype bfloat16); else both switches off (HF's default) is fp32."""
    on = [(n, w) for n, v, w in items if n in ("bf16", "fp16") and _as_bool(v, w, n)]
    if len(on) > 1:
        raise ShardwiseError(f"{on[1][1]}: bf16 and fp16 are both on ({on[0][1]}); keep one")
    dtype = [(v, w) for n, v, w in items if n == "torch_dtype"]
    if on:
        mp, where = on[0][0], on[0][1]
    elif dtype:
        mp, where = TORCH_DTYPES.get(str(dtype[0][0]).strip().lower()), dtype[0][1]
        if mp is None:
            raise ShardwiseError(f"{where}: torch_dtype {show(dtype[0][0])} is not one of {', '.join(TORCH_DTYPES)}")
    else:
        mp, where = "no", items[0][2]
    _put(out, "mixed_precision", mp, f"{where} (= mixed_precision {mp})")


def _put(out: dict[str, tuple[Any, str]], key: str, value: Any, where: str) -> None:
    """`out[key]`, refusing a second spelling of a key already set in the same layer (model and
    model_name_or_path), which one of the two would override silently."""
    if key in out:
        raise ShardwiseError(f"{where}: '{key}' is also given by {out[key][1]}; keep one of them")
    out[key] = (value, where)


def foreign_keys(layer: dict[str, tuple[Any, str]], keys, aliases: dict[str, str]) -> dict[str, tuple[Any, str]]:
    """A layer ({key: (value, where)}, a YAML file's or the flags') with the other projects' keys in shardwise's
    terms (`keys`: shardwise's own, `aliases`: yaml_aliases); a key of IGNORED_KEYS becomes 'ignored:NAME'
    (config.load_config names them in a note), and 'alias:deepspeed' stays for config to read. Other unknown keys
    pass through (they are refused as unknown)."""
    out: dict[str, tuple[Any, str]] = {}
    later = []
    for name, (value, where) in layer.items():
        if name in keys or name.startswith("alias:"):
            _put(out, name, value, where)
        elif name in aliases:
            key = aliases[name]
            if key == "resume" and value is None:  # resume_from_checkpoint: null
                value = "none"
            _put(out, key, value, f"{where} ({name} = {key})")
        elif name in IGNORED_KEYS:
            out["ignored:" + name] = (IGNORED_KEYS[name], where)
        elif name in TRANSLATED_KEYS:
            later.append((name, value, where))
        else:
            out[name] = (value, where)
    for name, value, where in later:
        if name in ("stage", "template"):
            _translated(name, value, where, out)
    precision = [t for t in later if t[0] in ("bf16", "fp16", "torch_dtype")]
    if precision:
        _precision(precision, out)
    if "val_split" in out and not isinstance(out["val_split"][0], bool) and isinstance(out["val_split"][0], int) \
            and out["val_split"][0] >= 1:
        raise ShardwiseError(f"{out['val_split'][1]}: a number of validation records ({out['val_split'][0]}) is not "
                             "taken; give the fraction to hold out, e.g. 0.1")
    if out.get("lr_schedule", (None,))[0] == "constant_with_warmup":  # the HF name of constant (warm-up applies)
        out["lr_schedule"] = ("constant", out["lr_schedule"][1])
    if out.get("lora.targets", (None,))[0] == "all":  # LLaMA-Factory's lora_target: all
        out["lora.targets"] = ("all-linear", out["lora.targets"][1])
    return out



def add_flags(parser: argparse.ArgumentParser, keys) -> None:
    """The other projects' flags that are no config key (`keys`), hidden, each stored under 'foreign:NAME' (foreign_keys
    reads them as it reads the YAML keys): --bf16/--fp16 (booleans), --torch_dtype, --template, --stage, and
    IGNORED_KEYS (each takes its value, if any)."""
    taken = set(parser._option_string_actions)
    for name in dict.fromkeys([*TRANSLATED_KEYS, *IGNORED_KEYS]):
        flag = "--" + name
        if flag in taken or name in keys:
            continue
        dest = "foreign:" + name
        if name in ("bf16", "fp16"):
            parser.add_argument(flag, dest=dest, action="store_const", const=True, default=argparse.SUPPRESS,
                                help=argparse.SUPPRESS)
            parser.add_argument("--no_" + name, dest=dest, action="store_const", const=False,
                                default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        else:
            parser.add_argument(flag, dest=dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS,
                                nargs=IGNORED_NARGS.get(name, "?" if name in IGNORED_KEYS else None))



def _sets(action: argparse.Action, option: str) -> Any:
    """The value a flag that takes no value stores (None: not such a flag)."""
    if isinstance(action, argparse.BooleanOptionalAction):
        return not option.startswith("--no-")
    if action.nargs != 0:
        return None
    # config's own store-a-value action keeps its value in const_value; argparse's store_true/false/const in const
    value = getattr(action, "const_value", action.const)
    return value if isinstance(value, bool) else None


def bool_values(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """argv with `--flag true|false` and `--flag=true|false` (how HF scripts write booleans) as the spelling argparse
    takes (`--flag`, `--no-flag`, or nothing for a false store_true flag), for every flag of `parser` that takes no
    value; a word after such a flag that is no boolean stays an argument of its own."""
    options = parser._option_string_actions
    out, i = [], 0
    while i < len(argv):
        tok = argv[i]
        i += 1
        if tok == "--":
            return out + [tok] + argv[i:]
        name, eq, word = tok.partition("=")
        act = options.get(name) if tok.startswith("--") else None
        said = _sets(act, name) if act is not None else None
        if not isinstance(said, bool):
            out.append(tok)
            continue
        if not eq:
            if i >= len(argv) or argv[i].lower() not in BOOL_WORDS:
                out.append(tok)
                continue
            word, i = argv[i], i + 1
        if word.lower() not in BOOL_WORDS:
            raise ShardwiseError(f"flag {name}: {show(word)} is not true or false; write {name} true, {name} false "
                                 f"or {name} alone")
        want = said if BOOL_WORDS[word.lower()] else not said
        spelled = [o for a in parser._actions if a.dest == act.dest for o in a.option_strings if _sets(a, o) is want]
        out += sorted(spelled, key=lambda o: (o.replace("_", "-") != name.replace("_", "-"), len(o)))[:1]
    return out


def eval_steps_alone(res) -> None:
    """The HF Trainer's eval_steps evaluates nothing without a validation set (its eval_strategy is 'no'): a config
    brought over with eval_steps and no val_size runs without evaluation, said in a note (in the config.Resolved
    `res`), where shardwise's own eval_every would be refused without a validation set."""
    c, where = res.cfg, res.origins.get("eval_every", "")
    if "eval_steps" in where and not c.val_data and not c.val_split and not c.keep_best:
        res.notes.append(f"{where}: no validation set (val_size / --val-split), so no evaluation, as the HF "
                         "Trainer does")
        c.eval_every = 0
        del res.origins["eval_every"]


def dataset_names(dataset_dir: str) -> set[str]:
    """The names DIR/dataset_info.json (LLaMA-Factory's) defines; none where it cannot be read (reading the data
    names the problem: data/dataset_info.py)."""
    try:
        with open(os.path.join(dataset_dir, "dataset_info.json"), encoding="utf-8") as fh:
            info = json.load(fh)
    except (OSError, ValueError):
        return set()
    return set(info) if isinstance(info, dict) else set()
