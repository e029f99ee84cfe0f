"""`shardwise bench`: the same job under several strategies, measured side by side on this
machine, with the planner's prediction beside each number."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

from shardwise import config, presets
from shardwise.errors import ShardwiseError

DEMO_STRATEGIES = ("ddp", "fsdp")
DEMO_DEEPSPEED = ("zero2", "zero3")


def add_parser(sub) -> None:
    from shardwise.bench.runner import CONTROLLED

    b = sub.add_parser(
        "bench", help="Run strategies side by side on this machine; report measured vs predicted.",
        description="Train the same job under each strategy, in fresh processes through `shardwise train`, and "
                    "write a report (Markdown, JSON, PNG) of tokens/s, step time, peak memory per rank and final "
                    "loss, with the planner's prediction and its error beside each. No arguments: the built-in "
                    "demo (the tiny model on 2 CPU ranks or the GPUs at hand).")
    b.add_argument("config", nargs="?", help="YAML config file (optional); its strategy and run-control keys are "
                                             "replaced by the bench's.")
    b.add_argument("--strategies", default=None,
                   help="Comma-separated strategies/presets to compare (default: ddp,fsdp, plus zero2,zero3 when "
                        f"DeepSpeed is installed). Known: {', '.join(presets.PRESETS)}.")
    b.add_argument("--steps", type=int, default=30, help="Counted steps per strategy (default 30).")
    b.add_argument("--warmup", type=int, default=5, help="Uncounted steps before them (default 5).")
    b.add_argument("--profile-steps", type=int, default=2,
                   help="Steps after the counted ones that run under torch.profiler to measure communication and "
                        "the part of it no compute hides (default 2; 0 = none, and that column is n/a).")
    b.add_argument("--repeat", type=int, default=1,
                   help="Run the strategy list this many times, round-robin (a, b, a, b, ...), and report each "
                        "strategy's run with the median tokens/s (default 1). On one GPU, runs made one after "
                        "another drifted by up to 3.5%% for the same strategy: repeat to compare strategies closer "
                        "than that.")
    b.add_argument("--report-dir", default="", help="Where the report goes (default runs/bench-<date>-<time>).")
    b.add_argument("--report-name", default="report",
                   help="File name stem of the report files (default 'report'); 'auto' names them "
                        "<model>_<hardware>_<date>, as for docs/benchmarks/.")
    b.add_argument("--runs-dir", default="", help="Where each strategy's run directory goes (default REPORT_DIR/runs).")
    b.add_argument("--timeout", type=float, default=1800.0, help="Stop a strategy after this many seconds (default 1800).")
    b.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    config.add_flags(b, only=[k for k in config.FIELDS if k not in CONTROLLED])
    b.set_defaults(func=run)


def spec_from_args(args):
    from shardwise.bench.runner import BenchSpec

    if args.strategies is not None:
        names = [s.strip() for s in args.strategies.split(",") if s.strip()]
        if not names:
            raise ShardwiseError(f"--strategies: '{args.strategies}' names no strategy; give a comma-separated list "
                                 f"such as ddp,fsdp (known: {', '.join(presets.PRESETS)}) or leave the flag out")
    else:
        from shardwise import strategies

        names = list(DEMO_STRATEGIES) + [n for n in DEMO_DEEPSPEED if strategies.missing_requirement(n) is None]
    unknown = [n for n in names if n not in presets.PRESETS]
    if unknown:
        raise ShardwiseError(f"--strategies: unknown strategy '{unknown[0]}'; known: {', '.join(presets.PRESETS)}")
    if len(set(names)) != len(names):
        raise ShardwiseError(f"--strategies: '{args.strategies}' names a strategy twice")
    if args.steps < 1:
        raise ShardwiseError(f"--steps must be >= 1, got {args.steps}")
    if args.warmup < 0:
        raise ShardwiseError(f"--warmup must be >= 0, got {args.warmup}")
    if args.profile_steps < 0:
        raise ShardwiseError(f"--profile-steps must be >= 0 (0 = no profiled steps), got {args.profile_steps}")
    if args.repeat < 1:
        raise ShardwiseError(f"--repeat must be >= 1, got {args.repeat}")
    if args.timeout <= 0:
        raise ShardwiseError(f"--timeout must be > 0 seconds, got {args.timeout}")
    flags = config.flags_from_namespace(args)
    if int(flags.get("nnodes", (1, ""))[0] or 1) > 1:
        raise ShardwiseError("--nnodes: bench runs on one node; multi-node bench is not supported yet")
    report_dir = args.report_dir or os.path.join("runs", f"bench-{time.strftime('%Y%m%d-%H%M%S')}")
    from shardwise.rundir import check_creatable

    # before any run, not when the report is written
    check_creatable(report_dir, "--report-dir", "--report-dir", if_file="choose another --report-dir")
    if args.runs_dir:
        check_creatable(args.runs_dir, "--runs-dir", "--runs-dir")
    spec = BenchSpec(config_path=args.config, flags=flags, strategies=names, steps=args.steps,
                     warmup=args.warmup, report_dir=report_dir,
                     runs_dir=args.runs_dir or os.path.join(report_dir, "runs"),
                     report_name=args.report_name, timeout_s=args.timeout, profile_steps=args.profile_steps,
                     repeat=args.repeat)
    check_inputs(spec)
    return spec


def check_inputs(spec) -> None:
    """The user's config and flags as each strategy runs them, checked before anything is written: an error that
    every strategy meets (an unknown key, a bad value) is one line naming the user's own file:line or flag, not a
    report of runs that could not start; one that only some strategies meet stays their row of the report."""
    from shardwise.bench.runner import CONTROLLED, applies, strategy_flags

    first = None
    for name in spec.strategies:
        base = presets.base_strategy(name)

        def skip(key: str, base=base) -> bool:  # what the runner drops from the user's file for this strategy
            return key in CONTROLLED or not applies(key, base)

        try:
            config.load_config(spec.config_path, strategy_flags(spec, name, os.path.join(spec.runs_dir, name)), skip)
            return
        except ShardwiseError as e:
            first = first or e
    if first is not None:
        raise first


def say(msg: str) -> None:
    print(f"shardwise bench: {msg}", flush=True)


def run(args) -> int:
    from shardwise.bench import report
    from shardwise.bench.runner import Outcome, pick_median, run_strategy
    from shardwise.rundir import quiet_libraries

    spec = spec_from_args(args)
    quiet_libraries()
    started = time.time()
    hw = report.hardware()
    say(f"{len(spec.strategies)} strategies ({', '.join(spec.strategies)}), {spec.warmup} warm-up + "
        f"{spec.steps} counted" + (f" + {spec.profile_steps} profiled" if spec.profile_steps else "")
        + " steps each" + (f", {spec.repeat} times round-robin" if spec.repeat > 1 else "") + f"; runs in {spec.runs_dir}")
    by_name: dict[str, list[Outcome]] = {name: [] for name in spec.strategies}
    interrupted = False
    for r in range(spec.repeat):
        for i, name in enumerate(spec.strategies, 1):
            tag = f"[{i}/{len(spec.strategies)}" + (f", run {r + 1}/{spec.repeat}]" if spec.repeat > 1 else "]")
            if interrupted:
                by_name[name].append(Outcome(name, "interrupted", "the bench was interrupted before it ran"))
                continue
            if by_name[name] and by_name[name][0].status != "ok":  # what did not run or fit once is not run again
                continue
            say(f"{tag} {name}: running")
            try:
                o = run_strategy(spec, name, sample_rss=hw["accelerator"] == "cpu",
                                 run_name=name if spec.repeat == 1 else f"{name}-r{r + 1}")
            except KeyboardInterrupt:
                interrupted = True
                by_name[name].append(Outcome(name, "interrupted", "interrupted while running"))
                continue
            by_name[name].append(o)
            say(f"{tag} {name}: " + _one_line(o, spec.warmup))
    outcomes = [pick_median(spec, by_name[n]) if spec.repeat > 1 else by_name[n][0] for n in spec.strategies]
    runs = [o for o in outcomes if o.world_size]
    world = runs[0].world_size if runs else 0
    model = (runs[0].config or {}).get("model", "tiny") if runs else str(spec.flags.get("model", ("tiny",))[0])
    stem = spec.report_name
    if stem == "auto":
        stem = report.report_stem(model, hw, world, time.strftime("%Y-%m-%d", time.localtime(started)))
    command = "shardwise " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:2] == ["bench"] \
        else "shardwise bench"
    rep = report.build(spec, outcomes, hw, report.versions(), command, started)
    paths = report.write_all(rep, spec.report_dir, stem)
    print()
    print(report.terminal_table(rep))
    print()
    for line in rep["verdict"]:
        print("- " + line.replace("**", ""))
    print()
    say(f"report: {paths['md']} (+ .json, .png)")
    if interrupted:
        return 130
    return 0 if any(o.status == "ok" for o in outcomes) else 1


def _one_line(o, warmup: int) -> str:
    if o.status == "ok":
        from shardwise.bench.measure import read_records, summarize

        m = summarize(read_records(o.output_dir), warmup, o.rank_peak_gib or None, o.world_size)
        tps, mem = (m.get("tokens_per_s") or {}).get("median"), (m.get("peak_mem_gib") or {}).get("max")
        return f"done in {o.wall_s:.0f} s" + (f": {tps:,.0f} tokens/s" if tps else "") + \
            (f", peak {mem:.2f} GiB per rank" if mem else "")
    text = {"oom": "does not fit", "failed": "failed", "unavailable": "cannot run here"}.get(o.status, o.status)
    return f"{text}: {o.reason}"
