"""Runs in a runs directory: find them, tell their state, start, stop and resume them.

A run started from the page is `python -m shardwise train ...` in a session of its own
(no shell), its output in `ui-launch.log` and its process id in `ui-launch.json` inside the
run directory: it outlives the page and the server, and a restarted server finds it again by
scanning the runs directory. Runs started from a terminal are found the same way (by their
config.yaml / metrics.jsonl / summary.json) and read the same way, from what the CLI writes.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time

import yaml

from shardwise.errors import ShardwiseError

RECORD = "ui-launch.json"
LOG = "ui-launch.log"
MARKERS = ("config.yaml", "metrics.jsonl", "summary.json", RECORD)
INTERRUPTED_LINE = "shardwise: interrupted by signal"
ERROR_LINE = "shardwise: error: "
ATTEMPT = "=== shardwise ui started: "

_children: dict[int, subprocess.Popen] = {}  # launched by this server: reaped here


def _open(path: str, mode: str = "r"):
    """A file a run wrote, for reading: a regular file, not a symlink (a run directory may be
    copied or shared: a planted link must not show a file from outside it, and a FIFO or a
    device must not hang or flood the server)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path}: not a regular file")
        return open(fd, mode, errors=None if "b" in mode else "replace")
    except BaseException:
        os.close(fd)
        raise


MAX_JSON_BYTES = 1 << 20  # summary.json and the small records a run writes are a few KiB; a larger one is not read


def _read_json(path: str, cap: int = MAX_JSON_BYTES) -> dict | None:
    """A JSON object the run wrote; None for anything else (missing, unreadable, not an object, over `cap` bytes)."""
    return _read_json_why(path, cap)[0]


def _read_json_why(path: str, cap: int = MAX_JSON_BYTES) -> tuple[dict | None, str | None]:
    """(the JSON object, None), or (None, why not) for a file that is there but not shown: one over `cap` bytes
    is not read whole (the server reads it at every listing), nor parsed."""
    try:
        with _open(path, "rb") as fh:
            data = fh.read(cap + 1)
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return None, f"{os.path.basename(path)}: cannot read it ({e.strerror or e})"
    if len(data) > cap:
        return None, f"{os.path.basename(path)}: larger than {cap:,} bytes; not read"
    try:
        d = json.loads(data)
    except (ValueError, RecursionError):
        return None, f"{os.path.basename(path)}: not valid JSON"
    return (d, None) if isinstance(d, dict) else (None, f"{os.path.basename(path)}: not a JSON object")


def _mtime(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except OSError:  # removed while the list was made
        return 0.0


def find(runs_dir: str, max_depth: int = 3) -> list[str]:
    """Every run directory under runs_dir (bench runs sit two levels down), newest first."""
    found = []
    root = os.path.abspath(runs_dir)
    for dirpath, dirnames, filenames in os.walk(root):
        depth = dirpath[len(root):].count(os.sep)
        names = set(filenames) | set(dirnames)
        if dirpath != root and any(m in names for m in MARKERS):
            found.append(dirpath)
            dirnames[:] = []
            continue
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in ("tensorboard", "checkpoints", "final")]
        if depth >= max_depth:
            dirnames[:] = []
    return sorted(found, key=_mtime, reverse=True)


def resolve(runs_dir: str, name: str) -> str:
    """A run's directory from its name relative to runs_dir; nothing outside runs_dir."""
    root = os.path.realpath(runs_dir)
    try:
        path = os.path.realpath(os.path.join(root, name))
    except ValueError:  # a NUL
        path = root
    if os.path.commonpath([root, path]) != root or path == root or not os.path.isdir(path):
        raise ShardwiseError(f"run {name!r}: no such run in {root}")
    return path


def _runs_into(cmdline: list[str], path: str) -> bool:
    """Whether a command line is `... shardwise train ... --output-dir=PATH`."""
    if "shardwise" not in cmdline or "train" not in cmdline:
        return False
    outs = [a[len("--output-dir="):] for a in cmdline if a.startswith("--output-dir=")]
    return any(os.path.realpath(o) == os.path.realpath(path) for o in outs)


def _alive(rec: dict | None, path: str) -> bool:
    """Whether the launcher a record names is alive and is the one started into this run
    directory (not another process: a record copied with the directory, planted, or of a
    process id since reused)."""
    if not rec:
        return False
    pid = rec.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    child = _children.get(pid)
    if child is not None:
        if child.poll() is None:
            return _runs_into(list(child.args), path)
        _children.pop(pid, None)
        return False
    import psutil

    try:
        p = psutil.Process(pid)
        created = rec.get("create_time", 0)
        if not isinstance(created, (int, float)) or abs(p.create_time() - created) > 1.0:
            return False  # the id was reused by another process
        return p.status() != psutil.STATUS_ZOMBIE and _runs_into(p.cmdline(), path)
    except psutil.Error:
        return False


def _attempt_lines(path: str, tail: int = 1 << 20) -> list[str]:
    """The launcher output of the newest attempt (each attempt starts with an ATTEMPT line),
    from the log's last `tail` bytes (read every second: a long run's log is not read whole)."""
    try:
        with _open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            fh.seek(max(0, size - tail))
            data = fh.read(tail)
    except OSError:
        return []
    lines = data.decode(errors="replace").splitlines()
    if size > tail:
        lines = lines[1:]  # the first line is cut
    starts = [i for i, line in enumerate(lines) if line.startswith(ATTEMPT)]
    return lines[starts[-1]:] if starts else lines


def _last_line(path: str, prefix: str) -> str | None:
    for line in reversed(_attempt_lines(path)[-200:]):
        if line.startswith(prefix):
            return line
    return None


def state(path: str) -> tuple[str, str]:
    """(running | finished | failed | interrupted | unknown, why)."""
    rec = _read_json(os.path.join(path, RECORD))
    if _alive(rec, path):
        started = rec.get("started")
        since = time.strftime(" started %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else ""
        return "running", f"process {rec['pid']}{since}"
    log = os.path.join(path, LOG)
    summary = os.path.join(path, "summary.json")
    if rec:  # started by the page: its launcher's last words say how it ended
        line = _last_line(log, INTERRUPTED_LINE)
        if line:
            return "interrupted", line[len("shardwise: "):]
        line = _last_line(log, ERROR_LINE)
        if line:
            return "failed", line[len(ERROR_LINE):]
        started = rec.get("started")
        if os.path.isfile(summary) and _mtime(summary) >= (started if isinstance(started, (int, float)) else 0) - 1:
            return "finished", "summary.json written"
        return "failed", "the launcher exited without a message (killed?); see " + LOG
    # started from a terminal: what the run directory holds
    prep = os.path.join(path, ".prep")
    errors = os.path.join(prep, "errors")
    linked = os.path.islink(prep) or os.path.islink(errors)  # a directory elsewhere: not this run's to show
    marker = None if linked else _read_json(os.path.join(prep, "interrupted.json"))
    if marker:
        return "interrupted", f"stopped by a signal after step {marker.get('step')}; checkpoint {marker.get('checkpoint')}"
    if not linked and os.path.isdir(errors):
        # a rank's one-line error (rankN.txt), else its exception's first line (rankN.exc); not its life mark
        # (.alive: a PID) nor its report of a collective it waited in (.waiting: a phase)
        names = os.listdir(errors)
        for f in sorted(n for n in names if n.endswith(".txt")) + sorted(n for n in names if n.endswith(".exc")):
            try:
                with _open(os.path.join(errors, f)) as fh:
                    text = fh.read(4096).strip()
            except OSError:
                continue
            if text:
                return "failed", text.splitlines()[0]
    if os.path.isfile(summary):
        return "finished", "summary.json written"
    metrics = os.path.join(path, "metrics.jsonl")
    if os.path.isfile(metrics) and time.time() - _mtime(metrics) < 120:
        return "running", "metrics.jsonl written in the last 2 minutes (started outside the page)"
    return "unknown", "no summary.json and no record of how it ended (started outside the page)"


METRICS_POINTS = 2000  # records one answer holds at most: a chart is a few hundred pixels wide
METRICS_WHOLE = 8 << 20  # bytes read whole; past this, records are read at evenly spaced places
METRICS_LINE = 64 << 10  # a record is a few hundred bytes; a longer line is skipped


def _even(n: int, points: int) -> list[int]:
    """Indices of `points` items spread evenly over n, the first and the last included."""
    if n <= points:
        return list(range(n))
    return sorted({round(i * (n - 1) / (points - 1)) for i in range(points)})


def _records(lines: list[bytes]) -> list[dict]:
    out = []
    for line in lines:
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def _sampled_lines(fh, offset: int, end: int, points: int) -> list[bytes]:
    """Up to `points` whole lines of fh between byte offset (a line's start) and end (just past a newline):
    the first, the last, and lines at evenly spaced byte positions between, each read on its own."""
    starts, seen = [], set()
    for i in range(points - 1):
        pos = offset + (end - offset) * i // (points - 1)
        if pos > offset:  # inside a line: the next one starts after its newline
            fh.seek(pos - 1)
            while True:  # to the next newline, a bounded read at a time (a long line is skipped)
                chunk = fh.readline(METRICS_LINE)
                if not chunk or chunk.endswith(b"\n"):
                    break
            pos = fh.tell()
        if pos < end and pos not in seen:
            seen.add(pos)
            starts.append(pos)
    fh.seek(max(offset, end - METRICS_LINE))
    tail = fh.read(end - fh.tell())
    last = tail.rfind(b"\n", 0, len(tail) - 1) + 1  # the last whole line's start in the tail
    if last or end - offset <= METRICS_LINE:
        starts.append(end - len(tail) + last)
    lines = []
    for pos in sorted(set(starts)):
        fh.seek(pos)
        line = fh.readline(METRICS_LINE)
        if line.endswith(b"\n"):
            lines.append(line)
    return lines


def metrics(path: str, offset: int = 0, points: int = METRICS_POINTS) -> tuple[list[dict], int]:
    """metrics.jsonl records from byte offset on (whole lines only) and the next offset. At most `points` records:
    where there are more, the first, the last and an even sample between (a long run's file is hundreds of MB:
    past METRICS_WHOLE bytes it is not read whole, only a line at each sampled place)."""
    p = os.path.join(path, "metrics.jsonl")
    try:
        with _open(p, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size <= offset:
                return [], offset
            fh.seek(max(offset, size - METRICS_LINE))
            tail = fh.read(size - fh.tell())
            if b"\n" not in tail:  # no whole line yet (or one longer than METRICS_LINE being written)
                return [], offset
            end = size - len(tail) + tail.rfind(b"\n") + 1  # past the last whole line
            if end <= offset:
                return [], offset
            if end - offset > METRICS_WHOLE:
                return _records(_sampled_lines(fh, offset, end, points)), end
            fh.seek(offset)
            data = fh.read(end - offset)
    except OSError:
        return [], offset
    lines = [line for line in data.splitlines() if line.strip()]
    return _records([lines[i] for i in _even(len(lines), points)]), end


MAX_CONFIG_BYTES = 1 << 20  # a run's config.yaml is a few hundred bytes; a larger one is not read


def read_config(path: str) -> tuple[dict, str | None]:
    """config.yaml of a run, flattened to dotted keys, and why it could not be read (None when it was, or when
    there is none). Read as `shardwise train` reads a config: the safe loader, merge keys refused, and no more than
    config.MAX_YAML_VALUES values however its aliases expand (a few hundred bytes of aliases would otherwise expand
    to millions of values in every listing)."""
    from shardwise import config

    name = os.path.join(path, "config.yaml")
    try:
        with _open(name, "rb") as fh:
            raw = fh.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        return {}, None
    except OSError as e:
        return {}, f"config.yaml: cannot read it ({e.strerror or e})"
    if len(raw) > MAX_CONFIG_BYTES:
        return {}, f"config.yaml: larger than {MAX_CONFIG_BYTES:,} bytes; not read"
    try:
        text = raw.decode("utf-8")
        d = config.bounded_yaml(text, "config.yaml")[0] or {}  # the CLI's bound, before anything is built from it
    except ShardwiseError as e:
        return {}, str(e)
    except UnicodeDecodeError:
        return {}, "config.yaml: not UTF-8 text"
    except (yaml.YAMLError, RecursionError) as e:
        return {}, f"config.yaml: invalid YAML ({type(e).__name__})"
    if not isinstance(d, dict):
        return {}, "config.yaml: not a mapping of keys to values"
    flat = {}
    for k, v in d.items():
        if isinstance(v, dict):
            flat.update({f"{k}.{sk}": sv for sk, sv in v.items()})
        else:
            flat[k] = v
    return flat, None


def config_of(path: str) -> dict:
    """config.yaml of a run, flattened to dotted keys ({} when it cannot be read: read_config says why)."""
    return read_config(path)[0]


def diff(a: str, b: str) -> list[dict]:
    ca, cb = config_of(a), config_of(b)
    return [{"key": k, "a": ca.get(k), "b": cb.get(k)} for k in sorted(set(ca) | set(cb)) if ca.get(k) != cb.get(k)]


def predicted(path: str) -> dict | None:
    """The planner's peak memory per rank and step time for the run's config.yaml, read and
    validated as `shardwise train` reads it (a hand-edited file: the CLI's line for it)."""
    from shardwise import config

    if not config_of(path):
        return None
    try:
        from shardwise.plan import plan_run

        cfg = config.load_config(os.path.join(path, "config.yaml")).cfg
        sp = plan_run(cfg, None, (cfg.nproc_per_node or 1) * cfg.nnodes).for_strategy(cfg.strategy)
    except ShardwiseError as e:
        return {"error": str(e)}
    except (TypeError, ValueError, KeyError) as e:  # an old config the planner cannot take: say so
        return {"error": f"{type(e).__name__}: {e}"}
    return {"peak_mem_gib": sp.mem_gib["total"], "step_time_s": sp.step_time_s, "tokens_per_s": sp.tokens_per_s}


def commands(path: str) -> dict:
    """The commands to copy for a run, quoted for a shell."""
    from shlex import quote

    final = os.path.join(path, "final")
    return {"resume": f"shardwise train {quote(path + '/config.yaml')} --output-dir {quote(path)} --resume auto",
            "export": f"shardwise export {quote(path)} --out {quote(path + '-export')}"
            if os.path.isdir(os.path.join(path, "checkpoints")) else None,
            "final": final if os.path.isdir(final) else None}


def info(runs_dir: str, path: str, detail: bool = False) -> dict:
    st, why = state(path)
    summary, summary_error = _read_json_why(os.path.join(path, "summary.json"))
    d = {"name": os.path.relpath(os.path.realpath(path), os.path.realpath(runs_dir)), "path": path, "state": st, "why": why,
         "summary": summary, "summary_error": summary_error, "mtime": _mtime(path)}
    cfg, d["config_error"] = read_config(path)  # an unreadable config is listed as one, without its values
    d["strategy"] = cfg.get("strategy")
    nproc, nnodes = cfg.get("nproc_per_node"), cfg.get("nnodes", 1)
    d["world"] = (nproc * (nnodes or 1) or None) if all(type(x) is int for x in (nproc, nnodes or 1)) else None
    if detail:
        d["commands"] = commands(path)
        d["predicted"] = predicted(path)
        d["config"] = cfg
        d["log_tail"] = "\n".join(_attempt_lines(os.path.join(path, LOG))[-15:])
    return d


def _start(out: str, argv: list[str]) -> int:
    os.makedirs(out, exist_ok=True)
    import psutil

    try:  # not through a link: a copied or planted run directory must not make the server write elsewhere
        fd = os.open(os.path.join(out, LOG), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        raise ShardwiseError(f"{os.path.join(out, LOG)}: cannot write the launcher's log there ({e.strerror}; "
                             "a link is refused); move it away and try again")
    with open(fd, "a") as log:  # every attempt's output, the newest last
        log.write(f"{ATTEMPT}shardwise train {' '.join(argv)} at {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        log.flush()
        proc = subprocess.Popen([sys.executable, "-m", "shardwise", "train", *argv], stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    _children[proc.pid] = proc
    rec = {"pid": proc.pid, "create_time": psutil.Process(proc.pid).create_time(), "started": time.time(),
           "argv": ["shardwise", "train", *argv]}
    import tempfile

    fd, tmp = tempfile.mkstemp(prefix=RECORD + ".", dir=out)  # a new file: never through a link planted there
    with open(fd, "w") as fh:
        json.dump(rec, fh)
    os.replace(tmp, os.path.join(out, RECORD))
    return proc.pid


def launch(runs_dir: str, train: dict) -> dict:
    """Start a validated `shardwise train` (forms.train's result) into its run directory."""
    out = train["output_dir"]
    root = os.path.realpath(runs_dir)
    if os.path.commonpath([root, os.path.realpath(out)]) != root:
        raise ShardwiseError(f"{out}: a run directory must be inside the runs directory {root}")
    try:
        os.makedirs(os.path.dirname(out), exist_ok=True)  # the runs directory, if it was removed while the page ran
        try:
            os.mkdir(out)  # one launch per directory: a second launch of the name at the same moment is told so
        except FileExistsError:
            from shardwise.ui.forms import FormError

            raise FormError(f"run name '{os.path.basename(out)}': {out} exists; choose another name",
                            "run_name") from None
    except OSError as e:
        raise ShardwiseError(f"{out}: cannot create the run directory ({e.strerror or e}); check the runs directory "
                             f"{root}") from None
    pid = _start(out, train["argv"])
    return {"pid": pid, "name": os.path.relpath(out, os.path.abspath(runs_dir))}


def stop(path: str) -> dict:
    """SIGTERM to the launcher: its workers checkpoint and it exits saying how to resume."""
    rec = _read_json(os.path.join(path, RECORD))
    if not _alive(rec, path):
        raise ShardwiseError(f"{path}: not running (only runs started from this page can be stopped here)")
    os.kill(rec["pid"], signal.SIGTERM)
    return {"pid": rec["pid"], "signal": "SIGTERM"}


def _check_unlocked(path: str) -> None:
    """A launcher started elsewhere (a terminal) holds the run directory's lock while it lives:
    a second one into the directory would fail on it and leave the page calling the live run failed."""
    import fcntl

    from shardwise import rundir

    lock = os.path.join(path, rundir.LOCK)
    if os.path.islink(lock):  # the launcher would truncate the link's target to write its PID
        raise ShardwiseError(f"{lock} is a symlink (to {os.readlink(lock)}); a run's lock file is its own: "
                             "remove the link, then resume")
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return  # no lock file: no launcher has run here
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ShardwiseError(f"{path} is in use by another shardwise run (PID {rundir.holder(path) or 'unknown'}); "
                             "wait for it to finish, or stop it where it was started") from None
    finally:
        os.close(fd)


def resume(path: str, trust_remote_code: bool = False, listen_beyond_loopback: bool = False) -> dict:
    """`shardwise train RUN/config.yaml --output-dir RUN --resume auto`, as the CLI prints it. A run directory may
    be copied or planted, and its file is not the user's word, so two things it can turn on need the page's user
    to say so for this resume: trust_remote_code (`trust_remote_code`), and a rendezvous over several nodes,
    which listens on its endpoint's address beyond loopback (`listen_beyond_loopback`)."""
    if _alive(_read_json(os.path.join(path, RECORD)), path):
        raise ShardwiseError(f"{path}: still running; stop it first")
    cfg = os.path.join(path, "config.yaml")
    if os.path.islink(cfg):  # as every file a run wrote: a planted link must not make the page read (or run) another
        raise ShardwiseError(f"{cfg} is a symbolic link, not the config this run wrote; resume it from a terminal "
                             f"(`shardwise train CONFIG --output-dir {path} --resume auto`)")
    if not os.path.isfile(cfg):
        raise ShardwiseError(f"{path}: no config.yaml; this run never started, launch it again from the Plan page")
    from shardwise import config
    from shardwise.ui.forms import FormError

    res = config.load_config(cfg, {"resume": ("auto", "ui"), "output_dir": (path, "ui")})  # validated as the CLI will
    if res.cfg.trust_remote_code and not trust_remote_code:
        raise FormError(f"{cfg} turns on trust_remote_code: resuming runs the code in its model directory "
                        f"{res.cfg.model}; resume only a run you trust, and confirm to run its code (the API: "
                        "resend with \"trust_remote_code\": true)", "trust_remote_code")
    if res.cfg.nnodes > 1 and not listen_beyond_loopback:
        raise FormError(f"{cfg} spans {res.cfg.nnodes} nodes: resuming listens for them on {res.cfg.rdzv_endpoint}, "
                        "beyond this machine's loopback; resume only a run you trust, and confirm to listen there "
                        "(the API: resend with \"listen_beyond_loopback\": true)", "listen_beyond_loopback")
    _check_unlocked(path)
    # the child reads config.yaml again: without the user's word, flags hold remote code off and the run on this
    # machine whatever the file says by then (a planted run's owner could change it between this check and that read)
    pins = ([] if trust_remote_code else ["--no-trust-remote-code"]) + ([] if listen_beyond_loopback else ["--nnodes=1"])
    pid = _start(path, [cfg, f"--output-dir={path}", "--resume=auto", *pins])
    return {"pid": pid}


BENCH_SCHEMA_MARK = b'"shardwise-bench/'  # bench/report.py writes {"schema": "shardwise-bench/N", ...}
MAX_BENCH_BYTES = 20_000_000  # a report holds every strategy's per-step records: larger than a run's summary


def bench_reports(runs_dir: str) -> list[dict]:
    """Every shardwise bench report (JSON, schema shardwise-bench/*) under runs_dir."""
    out = []
    root = os.path.abspath(runs_dir)
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in ("tensorboard", "checkpoints", "final")]
        for f in filenames:
            if f.endswith(".json") and f not in ("summary.json", RECORD, "config.json"):
                p = os.path.join(dirpath, f)
                try:
                    if os.path.islink(p) or os.path.getsize(p) > MAX_BENCH_BYTES:
                        continue  # a link (perhaps dangling, perhaps out of the runs directory) is not listed
                    with _open(p, "rb") as fh:  # a report names its schema first: other JSON is not parsed
                        if BENCH_SCHEMA_MARK not in fh.read(4096):
                            continue
                except OSError:
                    continue
                d = _read_json(p, MAX_BENCH_BYTES)
                if isinstance(d, dict) and str(d.get("schema", "")).startswith("shardwise-bench/"):
                    out.append({"name": os.path.relpath(p, root), "created": d.get("created"),
                                "command": d.get("command")})
    return sorted(out, key=lambda r: r["created"] or "", reverse=True)


def bench_report(runs_dir: str, name: str) -> dict:
    root = os.path.realpath(runs_dir)
    try:
        p = os.path.realpath(os.path.join(root, name))
    except ValueError:  # a NUL
        p = root
    if os.path.commonpath([root, p]) != root or not p.endswith(".json"):
        raise ShardwiseError(f"bench report {name!r}: not a report in {root}")
    d = _read_json(p, MAX_BENCH_BYTES)
    if d is None or not str(d.get("schema", "")).startswith("shardwise-bench/"):
        raise ShardwiseError(f"bench report '{name}': not a shardwise bench report")
    return d
