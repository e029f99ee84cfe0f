"""Run one strategy of a bench: check it can run here, then `python -m shardwise train ...`
in a fresh subprocess, and say how it ended.

Why a subprocess per strategy, rather than `launch.prepare` + `launch.launch` in this
process: a strategy that crashes, hangs, is killed by the kernel's OOM killer, or leaves
a process group / CUDA context / DeepSpeed state behind cannot take the bench or the next
strategy with it; every strategy starts from the same clean state (peak-memory counters
included); a hung run can be stopped (timeout) without stopping the bench; and the
memory cap used to test the out-of-memory path (below) can be applied to one strategy's
process tree only. The cost is one interpreter start per strategy (a few seconds), small
next to the elastic agent's own start. The subprocess is the very `train` command, so
there is no separate benchmark code path.

Test hooks (environment variables of the bench process):
  SHARDWISE_BENCH_MEMORY_CAP_GIB="2.5" (every strategy) or "ddp=2.5,fsdp=3" caps the address
    space (RLIMIT_AS) of a strategy's process tree, so that a large enough allocation really
    fails on the CPU and the run ends the way an out-of-memory run does. CPU runs only: CUDA
    reserves far more address space than it uses.
  SHARDWISE_BENCH_FAULT="fsdp=oom@3;zero2=kill@2:rank1" hands one strategy's run the loop's
    fault injection (SHARDWISE_FAULT, see train/faults.py), e.g. torch.OutOfMemoryError at a step.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import resource
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import yaml

from shardwise import config, presets
from shardwise.errors import ShardwiseError
from shardwise.rundir import atomic_write

# Config keys the bench sets itself for every strategy.
CONTROLLED = ("strategy", "max_steps", "epochs", "log_every", "output_dir", "resume", "overwrite",
              "save_final", "save_every", "keep_checkpoints", "max_restarts", "profile_steps", "profile_start")
CAP_ENV = "SHARDWISE_BENCH_MEMORY_CAP_GIB"
FAULT_ENV = "SHARDWISE_BENCH_FAULT"
POLL_S = 0.5


@dataclass
class BenchSpec:
    """What one `shardwise bench` invocation runs."""

    config_path: str | None
    flags: dict[str, tuple[Any, str]]  # the user's config flags: dotted key -> (raw value, where)
    strategies: list[str]
    steps: int
    warmup: int
    report_dir: str
    runs_dir: str
    report_name: str = "report"
    timeout_s: float = 1800.0
    profile_steps: int = 0  # profiled steps after the counted ones (`shardwise bench --profile-steps`, default 2)
    repeat: int = 1  # runs of each strategy, round-robin (`shardwise bench --repeat`)


@dataclass
class Outcome:
    """How one strategy's run ended."""

    strategy: str
    status: str  # ok | oom | failed | unavailable | interrupted
    reason: str = ""
    output_dir: str = ""
    log: str = ""
    wall_s: float = 0.0
    returncode: int | None = None
    world_size: int = 0
    rank_peak_gib: dict = field(default_factory=dict)  # CPU: rank -> peak RSS (GiB)
    config: dict | None = None  # the runtime-resolved config
    prediction: dict = field(default_factory=lambda: {"available": False, "note": "not planned"})
    repeats: list = field(default_factory=list)  # with --repeat: every run of this strategy (see pick_median)


# ----------------------------------------------------------------------------- preflight


def unavailable_reason(name: str) -> str | None:
    """Why a strategy cannot run in this installation, without importing its backend."""
    from shardwise import strategies

    module = presets.spec_of(name).cls.split(":")[0]
    if importlib.util.find_spec(module) is None:
        return f"strategy '{name}' is not implemented in this version of shardwise"
    return strategies.missing_requirement(name)


def applies(key: str, base: str) -> bool:
    """Whether a (dotted) config key applies to the strategy family `base` (another family's section does not)."""
    return presets.section_applies(key.split(".", 1)[0] if "." in key else None, base)


def strategy_flags(spec: BenchSpec, name: str, output_dir: str) -> dict[str, tuple[Any, str]]:
    """The user's flags (less another strategy's section options) plus what the bench sets."""
    base = presets.base_strategy(name)
    flags = {k: v for k, v in spec.flags.items() if applies(k, base) and k not in CONTROLLED}
    control = {"strategy": name, "max_steps": spec.warmup + spec.steps + spec.profile_steps, "log_every": 1,
               "output_dir": output_dir, "resume": "none", "overwrite": True, "save_final": False,
               "save_every": 0, "max_restarts": 0,
               # the last profile_steps steps are profiled (train/profile.py): `profiled: true` in their records
               "profile_steps": spec.profile_steps, "profile_start": 0}
    flags.update({k: (v, "set by shardwise bench") for k, v in control.items()})
    if "data" not in flags and not _yaml_sets(spec.config_path, "data"):
        # a bench of a model directory measures on the synthetic set unless told otherwise (train refuses
        # a model directory without --data)
        flags["data"] = ("demo", "set by shardwise bench (no --data given)")
    return flags


def _yaml_sets(path: str | None, key: str) -> bool:
    if not path:
        return False
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(data, dict) and key in data


def strategy_config_file(spec: BenchSpec, name: str, output_dir: str) -> str | None:
    """The user's YAML without the keys the bench sets and without another strategy's section,
    written next to the run (the original is returned unchanged when it cannot be parsed, so
    that `load_config` reports the problem with file and line)."""
    if not spec.config_path:
        return None
    try:
        with open(spec.config_path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except (OSError, yaml.YAMLError):
        return spec.config_path
    if not isinstance(data, dict):
        return spec.config_path
    base = presets.base_strategy(name)
    kept = {k: v for k, v in data.items()
            if k not in CONTROLLED and presets.section_applies(k, base)}
    path = os.path.join(output_dir, "bench-input.yaml")
    atomic_write(path, f"# {spec.config_path}, as `shardwise bench` runs it for strategy {name}\n"
                 + yaml.safe_dump(kept, sort_keys=False))
    return path


def train_argv(config_file: str | None, flags: dict[str, tuple[Any, str]]) -> list[str]:
    """`python -m shardwise train [FILE] --flag value ...` for these flags."""
    argv = [sys.executable, "-m", "shardwise", "train"] + ([config_file] if config_file else [])
    for key, (raw, _) in flags.items():
        fi = config.FIELDS[key]
        if fi.type is bool:
            on = raw if isinstance(raw, bool) else str(raw).lower() in ("true", "yes", "1", "on")
            argv.append(fi.flag if on else "--no-" + fi.flag[2:])
        else:
            argv += [fi.flag, str(raw)]
    return argv + ["--force"]  # measure even what the planner says will not fit: that is a finding too


# ----------------------------------------------------------------------------- failures

_OOM = re.compile(r"OutOfMemoryError|out of memory|can't allocate memory|cannot allocate memory|"
                  r"\bMemoryError\b|std::bad_alloc", re.IGNORECASE)
_KILLED = re.compile(r"killed by signal 9|Signals\.SIGKILL|exitcode\s*:\s*-9\b")
_RANK_PREFIX = re.compile(r"^\[(?:rank|default)\d+\]:")  # torchrun's per-rank line prefix
_ERROR_LINE = re.compile(r"^\s*(shardwise: error: .*|[\w.]*(Error|Exception)\b.*)$")


def classify(log_text: str, returncode: int | None) -> tuple[str, str]:
    """("oom", why) when a failed run's output shows an allocation failure or a SIGKILL
    (the kernel OOM killer's signal), else ("failed", the most telling error line)."""
    lines = [_RANK_PREFIX.sub("", ln).strip() for ln in log_text.splitlines()]
    lines = [ln for ln in lines if ln]
    oom = [ln for ln in lines if _OOM.search(ln) and "warning" not in ln.lower()]  # not a library's caution
    if oom:  # prefer the launcher's one-line error, then the exception line, over source lines
        best = ([ln for ln in oom if ln.startswith("shardwise: error: ") and "training failed: " not in ln]
                or [ln for ln in oom if _ERROR_LINE.match(ln) and not ln.startswith("shardwise: error: ")]
                or oom)
        return "oom", _short(best[0].removeprefix("shardwise: error: "))
    if _KILLED.search(log_text) or returncode in (-9, 137):
        return "oom", "a rank was killed by SIGKILL, most likely by the kernel's out-of-memory killer"
    errors = [ln for ln in lines if _ERROR_LINE.match(ln)]
    shardwise_errors = [ln for ln in errors if ln.startswith("shardwise: error: ")]
    if shardwise_errors:
        return "failed", _short(shardwise_errors[-1][len("shardwise: error: "):])
    if errors:
        return "failed", _short(errors[-1])
    return "failed", _short(lines[-1]) if lines else f"exited with code {returncode} and no output"


def _short(s: str, n: int = 240) -> str:
    return s if len(s) <= n else s[: n - 3] + "..."


def memory_cap_bytes(name: str, env: dict | None = None) -> int | None:
    """The RLIMIT_AS for a strategy from SHARDWISE_BENCH_MEMORY_CAP_GIB, or None."""
    raw = (env if env is not None else os.environ).get(CAP_ENV, "").strip()
    if not raw:
        return None
    try:
        if "=" not in raw:
            return int(float(raw) * 2**30)
        for part in raw.split(","):
            k, _, v = part.partition("=")
            if k.strip() == name:
                return int(float(v) * 2**30)
    except ValueError:
        raise ShardwiseError(f"{CAP_ENV}={raw!r}: give GiB ('2.5') or per strategy ('ddp=2.5,fsdp=3')")
    return None


def fault_for(name: str, env: dict | None = None) -> str | None:
    """The SHARDWISE_FAULT value SHARDWISE_BENCH_FAULT gives this strategy, or None."""
    raw = (env if env is not None else os.environ).get(FAULT_ENV, "")
    for part in raw.split(";"):
        k, sep, v = part.partition("=")
        if sep and k.strip() == name:
            return v.strip()
    return None


# ----------------------------------------------------------------------------- running


def preflight(spec: BenchSpec, name: str, output_dir: str):
    """(Resolved, the launcher's RunPlan, argv, why it cannot run here or None); ShardwiseError when the
    config is invalid for this strategy or this machine."""
    from shardwise.launch.preflight import plan_of

    path = strategy_config_file(spec, name, output_dir)
    flags = strategy_flags(spec, name, output_dir)
    res = config.load_config(path, flags)
    return res, plan_of(res), train_argv(path, flags), unavailable_reason(name)


def run_strategy(spec: BenchSpec, name: str, sample_rss: bool, say=print, run_name: str = "") -> Outcome:
    """Preflight, run and classify one strategy (its run directory: runs_dir/run_name, default the name).
    Never raises for a strategy's own failure."""
    from shardwise.bench.predict import predict

    out_dir = os.path.abspath(os.path.join(spec.runs_dir, run_name or name))
    os.makedirs(out_dir, exist_ok=True)
    log_path = os.path.join(out_dir, "bench.log")
    oc = Outcome(name, "unavailable", output_dir=out_dir, log=log_path)
    try:
        _, plan, argv, why = preflight(spec, name, out_dir)
    except ShardwiseError as e:
        oc.reason = str(e)
        return oc
    oc.world_size = plan.world
    oc.config = dataclasses.asdict(plan.cfg)
    oc.prediction = predict(plan.cfg, plan.world)
    if why:
        oc.reason = why
        return oc
    cap = memory_cap_bytes(name)
    env = dict(os.environ)
    fault = fault_for(name)
    if fault:
        env["SHARDWISE_FAULT"] = fault
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(argv) + "\n")
        log.flush()
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=_cap_fn(cap) if cap else None, env=env)
        timed_out = False
        try:
            while True:
                try:
                    proc.wait(timeout=POLL_S)
                    break
                except subprocess.TimeoutExpired:
                    pass
                if sample_rss:
                    # a one-rank `single` trains in the `shardwise train` process itself; any other
                    # strategy in agent-started workers, even on one rank
                    sample_worker_peaks(proc.pid, oc.rank_peak_gib,
                                        root_is_rank0=plan.in_process)
                if time.monotonic() - t0 > spec.timeout_s:
                    timed_out = True
                    stop(proc)
                    break
        except KeyboardInterrupt:
            stop(proc)
            raise
    oc.wall_s = time.monotonic() - t0
    oc.returncode = proc.returncode
    if timed_out:
        oc.status, oc.reason = "failed", f"timed out after {spec.timeout_s:.0f} s (raise --timeout)" + _last_line(log_path)
    elif proc.returncode == 0:
        if os.path.isfile(os.path.join(out_dir, "metrics.jsonl")):
            oc.status = "ok"
        else:
            oc.status, oc.reason = "failed", f"the run exited 0 but wrote no metrics.jsonl (see {log_path})"
    else:
        with open(log_path, errors="replace") as fh:
            oc.status, oc.reason = classify(fh.read(), proc.returncode)
    return oc


def _last_line(log_path: str) -> str:
    """'; its log ended with: LINE' (where a timed-out run was), or nothing."""
    try:
        with open(log_path, errors="replace") as fh:
            lines = [ln.strip() for ln in fh.readlines()[-50:] if ln.strip()]
    except OSError:
        return ""
    return f"; its log ended with: {lines[-1][:200]}" if lines else ""


def pick_median(spec: BenchSpec, runs: list[Outcome]) -> Outcome:
    """The run of one strategy that the report shows when it ran several times: among the completed runs, the one
    with the median tokens/s (the lower middle one for an even count), else the first run. Every run's status,
    tokens/s and directory go into its `repeats`."""
    from shardwise.bench.measure import read_records, summarize

    def tps(o: Outcome):
        if o.status != "ok":
            return None
        m = summarize(read_records(o.output_dir), spec.warmup, o.rank_peak_gib or None, o.world_size)
        return (m.get("tokens_per_s") or {}).get("median")

    speeds = [tps(o) for o in runs]
    done = sorted((s, i) for i, s in enumerate(speeds) if s is not None)
    chosen = runs[done[(len(done) - 1) // 2][1]] if done else runs[0]
    chosen.repeats = [{"run_dir": o.output_dir, "status": o.status, "tokens_per_s": s, "wall_s": round(o.wall_s, 1)}
                      for o, s in zip(runs, speeds)]
    return chosen


def _cap_fn(cap: int):
    def apply():
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    return apply


def sample_worker_peaks(root_pid: int, peaks: dict[int, float], root_is_rank0: bool = False) -> None:
    """Each training worker's own peak RSS (VmHWM, Linux), by its RANK. A one-process run
    trains in the `shardwise train` process itself (root_is_rank0)."""
    if root_is_rank0:
        hwm = _vmhwm_gib(root_pid)
        if hwm is not None:
            peaks[0] = max(peaks.get(0, 0.0), hwm)
        return
    try:
        import psutil

        kids = psutil.Process(root_pid).children(recursive=True)
    except Exception:  # psutil missing, or the tree is gone: nothing to sample
        return
    from shardwise.train.zygote import worker_rank

    for p in kids:
        rank = worker_rank(p.pid)
        if rank is None:
            continue
        hwm = _vmhwm_gib(p.pid)
        if hwm is not None:
            peaks[rank] = max(peaks.get(rank, 0.0), hwm)


def _vmhwm_gib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as fh:
            return next(int(ln.split()[1]) for ln in fh if ln.startswith("VmHWM:")) / 2**20  # kB -> GiB
    except (OSError, ValueError, StopIteration):
        return None


def stop(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """Stop a run: SIGTERM to `shardwise train` (its agent stops the workers), then SIGKILL
    to whatever of its process tree is left."""
    try:
        import psutil

        tree = psutil.Process(proc.pid).children(recursive=True)
    except Exception:
        tree = []
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    except ProcessLookupError:
        pass
    if proc.poll() is None:
        proc.kill()
    for p in tree:  # psutil checks the process is still the one it listed (no PID reuse)
        try:
            p.kill()
        except Exception:
            pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
