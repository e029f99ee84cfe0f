"""The Plan/Launch form as the CLI's own arguments.

A form is turned into the argv of `shardwise plan` or `shardwise train` and parsed by the
CLI's own parser, then resolved by `shardwise.config.load_config` and planned by
`shardwise.plan.command.build`: the page has no config path of its own, its values are
coerced and validated by the same code, and its errors are the CLI's one-line messages.
"""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass

from shardwise.errors import ShardwiseError


@dataclass(frozen=True)
class Field:
    name: str           # form field name
    label: str
    plan_flag: str | None   # flag of `shardwise plan` (None: not a plan input)
    train_flag: str | None  # flag of `shardwise train` (None: not a train input)
    kind: str = "text"  # text | bool | choice
    default: str = ""
    help: str = ""
    choices: tuple = ()
    launch_only: bool = False


def _help(key: str) -> str:
    from shardwise.config import FIELDS

    return FIELDS[key].help


def _choices(key: str) -> tuple:
    from shardwise.config import FIELDS

    return tuple(str(c) for c in FIELDS[key].choices or ())


def fields() -> list[Field]:
    """The form, in page order. Defaults are the demo recipe's (model tiny on 2 ranks)."""
    from shardwise import presets

    return [
        Field("model", "model directory or preset", "--model", "--model", default="tiny",
              help=_help("model") + " The planner also takes a preset (llama3-8b) or a count (7B)."),
        Field("gpus", "GPUs (processes) per node", "--gpus", "--nproc-per-node", default="2",
              help="Processes per node: one per GPU; 2 on a CPU-only machine."),
        Field("nodes", "nodes", "--nodes", "--nnodes", default="1", help=_help("nnodes")),
        Field("gpu_memory", "GPU memory (GiB)", "--gpu-memory", None,
              help="Memory per GPU in GiB; empty: detected (on a CPU-only machine host RAM per rank)."),
        Field("gpu_type", "GPU type", "--gpu-type", None, help="e.g. H100, A100; empty: detected, else H100."),
        Field("seq_len", "sequence length", "--seq-len", "--seq-len", default="128", help=_help("seq_len")),
        Field("micro_batch_size", "micro-batch", "--micro-batch-size", "--micro-batch-size", default="8",
              help=_help("micro_batch_size")),
        Field("grad_accum", "grad-accum", "--grad-accum", "--grad-accum", default="1", help=_help("grad_accum")),
        Field("tuner", "tuner", "--tuner", "--tuner", "choice", "full", _help("tuner"), _choices("tuner")),
        Field("gradient_checkpointing", "gradient checkpointing", "--gradient-checkpointing",
              "--gradient-checkpointing", "bool", "false", _help("gradient_checkpointing")),
        Field("activation_checkpointing", "activation checkpointing", "--activation-checkpointing",
              "--activation-checkpointing", "choice", "off", _help("activation_checkpointing"),
              _choices("activation_checkpointing")),
        Field("mixed_precision", "precision", "--mixed-precision", "--mixed-precision", "choice", "auto",
              _help("mixed_precision"), _choices("mixed_precision")),
        Field("param_dtype", "weights dtype", "--param-dtype", "--param-dtype", "choice", "fp32",
              _help("param_dtype"), _choices("param_dtype")),
        Field("strategy", "strategy", "--strategy", "--strategy", "choice", "auto",
              "auto runs what the planner recommends; a preset plans and runs that one.",
              ("auto",) + tuple(n for n in presets.known_names() if n != "auto")),
        Field("shard_group_size", "shard group size (hybrid)", "--fsdp-shard-group-size", "--fsdp-shard-group-size",
              help=_help("fsdp.shard_group_size") + " Empty: not set."),
        Field("sequence_parallel", "sequence parallel degree", "--sequence-parallel", "--sequence-parallel",
              default="1", help=_help("sequence_parallel")),
        Field("sp_mode", "sequence parallel mode", "--sp-mode", "--sp-mode", "choice", "auto", _help("sp_mode"),
              _choices("sp_mode")),
        Field("tensor_parallel", "tensor parallel degree", "--tensor-parallel", "--tensor-parallel", default="1",
              help=_help("tensor_parallel")),
        Field("float8", "float8 linears (Hopper/Ada GPU)", "--float8", "--float8", "bool", "false", _help("float8")),
        # what only a launch needs
        Field("data", "data", None, "--data", default="demo", help=_help("data"), launch_only=True),
        Field("max_steps", "max steps", None, "--max-steps", default="30", help=_help("max_steps"), launch_only=True),
        Field("lr", "learning rate", None, "--lr", default="0.003", help=_help("lr"), launch_only=True),
        Field("log_every", "log every", None, "--log-every", default="1", help=_help("log_every"), launch_only=True),
        Field("save_every", "save every", None, "--save-every", default="0", help=_help("save_every"),
              launch_only=True),
        Field("save_final", "save the final model", None, "--save-final", "bool", "true", _help("save_final"),
              launch_only=True),
        Field("rdzv_endpoint", "rendezvous HOST:PORT", None, "--rdzv-endpoint", help=_help("rdzv_endpoint"),
              launch_only=True),
        Field("trust_remote_code", "trust remote code", None, "--trust-remote-code", "bool", "false",
              _help("trust_remote_code"), launch_only=True),
        Field("run_name", "run name", None, None, help="Directory of the run inside the runs directory "
              "(letters, digits, '.', '-', '_'); empty: <strategy>-<date>-<time>.", launch_only=True),
    ]


FIELDS_BY_NAME = {f.name: f for f in fields()}
RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class FormError(ShardwiseError):
    """A ShardwiseError with the form field it belongs to (None: the form as a whole)."""

    def __init__(self, message: str, field: str | None):
        super().__init__(message)
        self.field = field


def field_of(message: str, which: str) -> str | None:
    """The form field whose flag the message names: the one a `flag --x:` prefix names (config's `where`), else the
    longest flag it mentions."""
    lead = re.match(r"flag (--[a-z0-9-]+)", message)
    if lead:
        for f in FIELDS_BY_NAME.values():
            if lead.group(1) in (f.plan_flag, f.train_flag):
                return f.name
    candidates = []
    for f in FIELDS_BY_NAME.values():
        flag = f.plan_flag if which == "plan" else f.train_flag
        for fl in {flag, f.train_flag, f.plan_flag} - {None}:
            if re.search(re.escape(fl) + r"(?![a-z-])", message):
                candidates.append((len(fl), f.name))
    if not candidates:
        for f in FIELDS_BY_NAME.values():  # config.yaml-style messages name the key
            if re.search(rf"'{f.name}'", message):
                return f.name
        return None
    return max(candidates)[1]


def _text(values: dict, name: str) -> str:
    v = values.get(name, FIELDS_BY_NAME[name].default)
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v if v is not None else "").strip()


def argv_for(values: dict, which: str) -> list[str]:
    """Every non-empty field as a flag of `shardwise plan` or `shardwise train`."""
    argv = []
    for f in FIELDS_BY_NAME.values():
        flag = f.plan_flag if which == "plan" else f.train_flag
        if flag is None:
            continue
        v = _text(values, f.name)
        bad = CONTROL.search(v)
        if bad:  # a NUL cannot be on a command line; a newline would forge lines of the launcher's log
            raise FormError(f"{flag} {v[:bad.start()]!r}...: contains a control character "
                            f"(U+{ord(bad.group()):04X}); type the value on one line", f.name)
        if f.name == "strategy" and v == "auto" and which == "plan":
            continue  # plan: no configured strategy, compare them all
        if f.kind == "bool":
            on = v.lower() in ("true", "on", "1", "yes")
            argv.append(flag if on else "--no-" + flag[2:])
        elif v != "":
            argv.append(f"{flag}={v}")
    return argv


def _parser(which: str):
    """The parser of `shardwise plan` or `shardwise train`, as cli.py builds it, reporting
    instead of exiting (cli.py imports this package by name, so it is not imported here)."""
    import argparse

    from shardwise import config

    root = argparse.ArgumentParser(prog="shardwise", exit_on_error=False)
    sub = root.add_subparsers(dest="command")
    if which == "plan":
        from shardwise.plan.command import add_parser

        add_parser(sub)
    else:
        t = sub.add_parser("train")
        t.add_argument("config", nargs="?")
        config.add_flags(t)
    for p in sub.choices.values():
        p.exit_on_error = False
    return root


def _parse(which: str, argv: list[str]):
    import argparse

    try:
        return _parser(which).parse_args([which, *argv])
    except argparse.ArgumentError as e:
        raise ShardwiseError(str(e)) from None


_LOCK = threading.Lock()  # one form at a time: the first import of transformers in two threads at once fails


def _with_field(fn, which: str):
    try:
        with _LOCK:
            return fn()
    except FormError:
        raise
    except ShardwiseError as e:
        raise FormError(str(e), field_of(str(e), which)) from None


def plan(values: dict) -> dict:
    """`shardwise plan ... --json` for a form: the plan's JSON."""
    from shardwise.plan.command import build

    def go():
        args = _parse("plan", argv_for(values, "plan"))
        p, _ = build(args)
        return p.to_json()

    return _with_field(go, "plan")


_REHEARSING = threading.Lock()  # one rehearsal at a time: each runs a rank of a job on this machine's device


def rehearse(values: dict) -> dict:
    """`shardwise plan ... --rehearse --json` for a form: the plan's JSON with its `rehearsed` rows. The plan is
    built under the forms' lock; the rehearsal runs outside it (minutes on a real model), one at a time."""
    from shardwise.plan.command import build
    from shardwise.plan.rehearse import rehearse_plan

    def go():
        args = _parse("plan", argv_for(values, "plan"))
        return build(args)

    if not _REHEARSING.acquire(blocking=False):
        raise FormError("a rehearsal is running already; wait for its answer", None)
    try:
        p, res = _with_field(go, "plan")
        rehearsal = _with_field(lambda: rehearse_plan(p, res.cfg, only=p.configured), "plan")
        return {**p.to_json(), "rehearsed": rehearsal}
    finally:
        _REHEARSING.release()


def minimal_train_argv(res) -> list[str]:
    """The train flags whose value differs from what the model alone resolves to."""
    from shardwise import config

    base = config.load_config(None, {"model": (res.cfg.model, "form")}).cfg
    argv = [f"--model={res.cfg.model}"] if res.cfg.model != "tiny" else []
    for f in FIELDS_BY_NAME.values():
        if f.train_flag is None or f.name == "model":
            continue
        key = next(k for k, fi in config.FIELDS.items() if fi.flag == f.train_flag)
        value, default = config.get(res.cfg, key), config.get(base, key)
        if value == default:
            continue
        if isinstance(value, bool):
            argv.append(f.train_flag if value else "--no-" + f.train_flag[2:])
        else:
            argv.append(f"{f.train_flag}={value}")
    return argv


def train(values: dict, runs_dir: str | None = None, check_model: bool = False) -> dict:
    """Resolve and validate a form as `shardwise train` would: {argv, command, yaml, output_dir}.

    check_model: also the launcher's model checks (directory, weights, seq_len vs positions),
    which may build the tiny model (imports torch) — done before a launch, not while typing."""
    from shardwise import config
    from shardwise.launch import preflight

    def go():
        args = _parse("train", argv_for(values, "train"))
        res = config.load_config(None, config.flags_from_namespace(args))
        config.check_train_data(res)  # as `shardwise train` does: a model directory needs --data
        if check_model:
            preflight.check_model(res.cfg, res)
        argv = minimal_train_argv(res)
        out = None
        if runs_dir is not None:
            name = _text(values, "run_name")
            if name and not RUN_NAME.match(name):
                raise FormError(f"run name '{name}': use letters, digits, '.', '-' and '_' (a directory inside the "
                                "runs directory)", "run_name")
            if not name:
                import time

                name = f"{res.cfg.strategy}-{time.strftime('%Y%m%d-%H%M%S')}"
            out = os.path.join(os.path.abspath(runs_dir), name)
            if os.path.exists(out):
                raise FormError(f"run name '{name}': {out} exists; choose another name (or resume that run from "
                                "the Runs page)", "run_name")
            argv = argv + [f"--output-dir={out}"]
        return {"argv": argv, "command": "shardwise train " + " ".join(_quote(a) for a in argv),
                "yaml": config.to_yaml(res.cfg), "output_dir": out, "strategy": res.cfg.strategy}

    return _with_field(go, "train")


def _quote(a: str) -> str:
    import shlex

    return shlex.quote(a)
