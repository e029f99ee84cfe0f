"""Argument parsing only: each subcommand calls one function."""

from __future__ import annotations

import argparse
import os
import sys

from shardwise import __version__
from shardwise.errors import ShardwiseError


def _train(args) -> int:
    from shardwise import config, launch, rundir
    from shardwise.models.load import hub_snapshot

    res = config.load_config(args.config, config.flags_from_namespace(args))
    snapshot = hub_snapshot(res.cfg.model, res.where("model"))
    if snapshot:  # a hub id: the run reads (and records) the cached snapshot's directory
        res.notes.append(f"model {res.cfg.model}: the Hugging Face cache's snapshot {snapshot}")
        res.cfg.model = snapshot
    config.check_train_data(res)
    # the default output directory is runs/<strategy>-<time> (named at launch)
    rundir.check_creatable(res.cfg.output_dir or os.path.join("runs", "new"), res.where("output_dir"))
    if res.cfg.output_dir and os.path.isdir(res.cfg.output_dir):  # before any check reads what the run left
        rundir.check_no_links(res.cfg.output_dir, res.where("output_dir"))
    if res.cfg.output_dir and res.cfg.node_rank == 0:
        rundir.check_resume_target(res.cfg.output_dir, res.cfg.resume, res.where("output_dir"), res.cfg.overwrite,
                                   res.where("resume"))
    for note in [config.demo_note(res), *res.notes]:
        if note:
            print(f"shardwise: {note}", flush=True)
    return launch.train(res, force=args.force)


def _config_docs(args) -> int:
    from shardwise.config import config_docs

    print(config_docs(), end="")
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse's errors as the project's one line (argparse prints the whole usage above it: 50 lines for train),
    with the closest flag for an unknown one; the subcommands' parsers are of this class too."""

    def error(self, message: str):
        if message.startswith("unrecognized arguments: "):
            import difflib

            known = set(self._option_string_actions)  # this command's own flags (main() picks the parser)
            first = message.split(": ", 1)[1].split()[0].split("=", 1)[0]
            close = difflib.get_close_matches(first, sorted(known), n=1)
            if close:
                message += f" (did you mean {close[0]}?)"
        self.exit(2, f"shardwise: error: {message}; see `{self.prog} --help`\n")


def _check_cache_dir() -> None:
    """$SHARDWISE_CACHE_DIR (the tiny model, the tokenized data, doctor.json) must be a directory or makeable as one:
    one line here rather than a traceback from whichever command first writes there."""
    path = os.environ.get("SHARDWISE_CACHE_DIR")
    if not path:
        return
    from shardwise.rundir import check_creatable

    # (whether it is writable is each writer's business: a read-only one can serve reads)
    check_creatable(path, f"SHARDWISE_CACHE_DIR={path}", "SHARDWISE_CACHE_DIR", writable=False,
                    if_file="point it at a directory (created if missing) or unset it (~/.cache/shardwise)")


def build_parser() -> argparse.ArgumentParser:
    from shardwise import config

    p = _Parser(prog="shardwise", description="Plan, explain and run DDP, FSDP2 or DeepSpeed ZeRO fine-tuning.")
    p.add_argument("--version", action="version", version=f"shardwise {__version__}")
    p.add_argument("--debug", action="store_true", help="Show tracebacks for errors.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    t = sub.add_parser("train", help="Fine-tune a model (no arguments: the built-in demo).",
                       description="Fine-tune a causal LM. Every config key is a flag (its underscore spelling too: --max_steps; and the common Hugging Face names such as --learning_rate); flags override the YAML file.")
    t.add_argument("config", nargs="?", help="YAML config file (optional).")
    t.add_argument("--force", action="store_true", help="Launch even if the planner says it will not fit.")
    t.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    config.add_flags(t)
    t.set_defaults(func=_train)

    c = sub.add_parser("config-docs", help="Print every config key as a Markdown table.")
    c.set_defaults(func=_config_docs)

    for name in ("shardwise.plan.command", "shardwise.doctor", "shardwise.bench.command", "shardwise.export",
                 "shardwise.ui.command", "shardwise.chat"):
        try:
            mod = __import__(name, fromlist=["add_parser"])
        except ImportError:
            continue
        if hasattr(mod, "add_parser"):
            mod.add_parser(sub)
    return p


def _bool_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`--flag true|false` for every boolean flag: the words before the command by the main parser's flags, those
    after it by the command's (config.bool_values)."""
    from shardwise.config import bool_values

    subs = next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})
    at = next((i for i, a in enumerate(argv) if a in subs), None)
    if at is None:
        return bool_values(argv, parser)
    return bool_values(argv[:at], parser) + [argv[at]] + bool_values(argv[at + 1:], subs[argv[at]])


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        argv = _bool_values(parser, sys.argv[1:] if argv is None else list(argv))
    except ShardwiseError as e:
        print(f"shardwise: error: {e}", file=sys.stderr, flush=True)
        return 2
    args, extra = parser.parse_known_args(argv)
    if extra:  # reported by the command's own parser: its flags for "did you mean", its --help
        sub = next((a.choices.get(getattr(args, "command", None)) for a in parser._actions
                    if isinstance(a, argparse._SubParsersAction)), None)
        (sub or parser).error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    if args.command != "train":
        from shardwise.phases import release_full_gc

        release_full_gc()  # train's launcher releases it after preparing, or after the first step it trains itself
    try:
        _check_cache_dir()
        rc = int(args.func(args) or 0)
        sys.stdout.flush()  # here, where a closed pipe is caught below, not at interpreter exit
        return rc
    except ShardwiseError as e:
        if e.exit_code == 0:  # NothingToDo
            print(f"shardwise: {e}", flush=True)
            return 0
        if getattr(args, "debug", False):
            raise
        print(f"shardwise: error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    except KeyboardInterrupt:
        print("shardwise: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`shardwise plan | head`): stop quietly, as other tools do
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush does not raise again
        return 141  # 128 + SIGPIPE, what a shell reports for a tool killed by the broken pipe


if __name__ == "__main__":
    sys.exit(main())
