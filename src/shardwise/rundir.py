"""The run directory: what shardwise writes there, how it marks and locks it, and how it
writes files atomically. A ground-floor module: it imports nothing of shardwise but errors,
so the launcher, the workers, export, doctor and bench all import it and nothing imports
back up.

A run directory is shardwise's when it holds the marker file `.shardwise-run` (JSON with a
run id), written when the run directory is created. Only a marked directory is ever
cleared by `--overwrite`, and only of the entries in `OWN_ENTRIES`; the user's other files
stay. While a run lives, its launcher holds an exclusive `flock` on `.shardwise-lock`
(holding the launcher's PID), so a second run into the same directory is refused; the
kernel releases the lock when the launcher exits, however it exits.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import time
import uuid

from shardwise.errors import ShardwiseError

MARKER = ".shardwise-run"
LOCK = ".shardwise-lock"
PREP = ".prep"
# Everything a run writes at the top of its directory (the lock file is not cleared: it is held).
OWN_ENTRIES = ("config.yaml", "metrics.jsonl", "summary.json", "checkpoints", "final", "tensorboard", "mlruns", "wandb", PREP,
               MARKER)
# Entries whose presence means a run trained there (a run that failed before its first step leaves none).
TRAINED_ENTRIES = ("metrics.jsonl", "summary.json", "checkpoints", "final")


# ----------------------------------------------------------------------------- paths


def prep_dir(output_dir: str) -> str:
    return os.path.join(output_dir, PREP)


def error_dir(output_dir: str) -> str:
    """Where a worker leaves its one-line ShardwiseError for the launcher to print."""
    return os.path.join(output_dir, PREP, "errors")


def interrupted_path(output_dir: str) -> str:
    return os.path.join(output_dir, PREP, "interrupted.json")


# ----------------------------------------------------------------------------- full disks


def is_disk_full(e: BaseException | None) -> bool:
    """Whether an error (or one it was raised from) is a full disk or an exceeded quota; libraries that wrap the
    OSError (safetensors, DCP) keep only its text."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(e) or "Disk quota exceeded" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


@contextlib.contextmanager
def full_disk_is_one_line(what: str, folder: str, then: str):
    """A full disk while writing `what` into `folder` becomes one line: what, where, how much is free, and
    `then` (what the user does next); other errors pass through."""
    try:
        yield
    except Exception as e:
        if not is_disk_full(e):
            raise
        there = os.path.abspath(folder)
        while not os.path.isdir(there) and os.path.dirname(there) != there:  # the folder itself may not be made yet
            there = os.path.dirname(there)
        try:
            free = f"{shutil.disk_usage(there).free / 2**20:.0f} MiB free"
        except OSError:
            free = "free space unknown"
        raise ShardwiseError(f"disk full while writing {what} in {folder} ({free}): {then}") from None


# ----------------------------------------------------------------------------- atomic writes


@contextlib.contextmanager
def atomic_path(path: str, suffix: str = ""):
    """Yield a fresh temporary path beside `path` for a writer that takes a path (safetensors,
    matplotlib); once the block ends the file is flushed to disk and renamed onto `path`. On an
    error the temporary file is removed and `path` is untouched. `suffix` keeps an extension
    for writers that choose the format from it."""
    parent, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(parent, f".{name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp{suffix}")
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    _fsync_dir(parent)


def prune_keyed(folder: str, suffix: str, keep: int) -> None:
    """Remove all but the `keep` most recently used entries of a cache folder keyed by SHA-256: only files named
    <64 hex digits><suffix>, never anything else there. Best effort (a concurrent pruner may remove one first)."""
    try:
        entries = [os.path.join(folder, n) for n in os.listdir(folder)
                   if n.endswith(suffix) and len(n) == 64 + len(suffix) and all(c in "0123456789abcdef" for c in n[:64])]
        entries.sort(key=os.path.getmtime, reverse=True)
        for p in entries[keep:]:
            os.remove(p)
    except OSError:
        pass


def atomic_write(path: str, data: str | bytes) -> None:
    """Write `data` to `path` so that a reader sees the old file or the whole new one, never
    part of it: a fresh temporary file in the same directory, fsync, os.replace."""
    with atomic_path(path) as tmp:
        with open(tmp, "xb" if isinstance(data, bytes) else "x", encoding=None if isinstance(data, bytes) else "utf-8") as fh:
            fh.write(data)


def atomic_write_json(path: str, obj, indent: int | None = 1) -> None:
    atomic_write(path, json.dumps(obj, indent=indent, default=str))


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- the interrupted-run record


def record_interrupted(output_dir: str, step: int, checkpoint: str) -> None:
    """Rank 0 notes that a signal stopped the run after `step` (checkpoint written)."""
    atomic_write_json(interrupted_path(output_dir), {"step": step, "checkpoint": checkpoint})


def read_interrupted(output_dir: str) -> dict | None:
    """The record of a signal-stopped run ({} if unreadable), None if there is none. It stays
    after the run (`shardwise ui` shows such a run as interrupted) until the next run into
    the directory starts: see clear_interrupted."""
    try:
        with open(interrupted_path(output_dir)) as fh:
            text = fh.read()
    except FileNotFoundError:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return {}


def clear_interrupted(output_dir: str) -> None:
    """A new run (a resume included) starts: the previous run's record is not this one's."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(interrupted_path(output_dir))


# ----------------------------------------------------------------------------- marker


def run_id(output_dir: str) -> str | None:
    """The run id of a directory shardwise created and marked, else None."""
    try:
        with open(os.path.join(output_dir, MARKER)) as fh:
            rid = json.load(fh).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None
    return rid if isinstance(rid, str) and rid else None


def mark(output_dir: str) -> str:
    """Mark `output_dir` as a shardwise run directory; returns the new run id."""
    rid = uuid.uuid4().hex
    atomic_write_json(os.path.join(output_dir, MARKER),
                      {"run_id": rid, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "tool": "shardwise"})
    return rid


def own_entries_present(output_dir: str) -> list[str]:
    """The run-directory entry names present in `output_dir`. A `.prep` holding only other
    nodes' `nodeK/` folders does not count: on a shared filesystem the nodes of one run
    prepare at the same time, and node 0 may find them before it marks the directory."""
    return [e for e in OWN_ENTRIES if os.path.lexists(os.path.join(output_dir, e))
            and not (e == PREP and _only_peer_nodes(os.path.join(output_dir, e)))]


def _only_peer_nodes(prep: str) -> bool:
    try:
        names = os.listdir(prep)
    except OSError:
        return False
    return all(n.startswith("node") and n[4:].isdigit() and int(n[4:]) > 0 for n in names)


def has_trained(output_dir: str) -> bool:
    """Whether a run trained in `output_dir` (logged a step, saved a checkpoint or a model)."""
    for e in TRAINED_ENTRIES:
        p = os.path.join(output_dir, e)
        if os.path.isdir(p) and os.listdir(p):
            return True
        if os.path.isfile(p) and os.path.getsize(p) > 0:
            return True
    return False


def within(path: str, parent: str) -> bool:
    """Whether `path` is `parent` or lies below it (both as given: normalise them first)."""
    return path == parent or path.startswith(parent.rstrip(os.sep) + os.sep)


def entry_holding(output_dir: str, path: str) -> str | None:
    """The run-directory entry of `output_dir` that `path` is or lies inside, as written or with links resolved,
    else None: what `clear` would delete (or unlink) with it."""
    paths = {os.path.abspath(path), os.path.realpath(path)}
    for e in OWN_ENTRIES:
        entry = os.path.join(os.path.abspath(output_dir), e)
        # a link entry: clear removes the link, not what it points to, so only paths through it are lost
        entries = {entry} if os.path.islink(entry) else {entry, os.path.realpath(entry)}
        if any(within(p, d) for p in paths for d in entries):
            return e
    return None


def enclosing_run(path: str) -> tuple[str, str] | None:
    """(run directory, entry) when `path` lies inside an entry of a marked run directory above it (its checkpoints/,
    final/, ...), which that run's `--overwrite` or checkpoint rotation deletes whole; else None."""
    real = os.path.realpath(path)
    cur = os.path.dirname(real)
    while True:
        if run_id(cur) is not None:
            entry = entry_holding(cur, real)
            if entry:
                return cur, entry
        if os.path.dirname(cur) == cur:
            return None
        cur = os.path.dirname(cur)


def protected(path: str) -> str | None:
    """Why `path` must never be cleared (a filesystem root, the home directory, the current
    directory or one of its parents), else None."""
    real = os.path.realpath(path)
    if os.path.dirname(real) == real:
        return "a filesystem root"
    if real == os.path.realpath(os.path.expanduser("~")):
        return "the home directory"
    cwd = os.path.realpath(os.getcwd())
    if cwd == real:
        return "the current directory"
    if within(cwd, real):
        return "a parent of the current directory"
    return None


def check_resume_target(output_dir: str, resume: str, where: str = "--output-dir", overwrite: bool = False,
                        resume_where: str = "--resume") -> None:
    """A resume writes config.yaml (when it starts fresh), metrics.jsonl and final/ into the output directory, so
    one into a directory holding such names that shardwise did not mark is refused, as a new run there is; unless
    the directory has checkpoints of its own to resume (a run of a shardwise older than the marker). `--resume
    auto` of a run that trained but saved no checkpoint would start again and replace it: refused unless
    --overwrite."""
    out = os.path.abspath(output_dir)
    if resume == "none" or not os.path.isdir(out):
        return
    ckpts = os.path.join(out, "checkpoints")
    own = os.path.isdir(ckpts) and any(os.path.isfile(os.path.join(ckpts, d, "meta.json")) for d in os.listdir(ckpts))
    if run_id(out) is not None:
        if resume == "auto" and not own and not overwrite and has_trained(out):
            raise ShardwiseError(f"{resume_where}: {out} holds a run that trained but no checkpoint to resume (it "
                                 "ran without --save-every), so --resume auto would start again and replace its "
                                 "final/ and metrics: pass --overwrite to replace it, or choose another --output-dir")
        return
    ours = own_entries_present(out)
    if not ours:
        return
    target = os.path.abspath(resume)
    if own and (resume == "auto" or (target != ckpts and within(target, ckpts))):
        return
    raise ShardwiseError(f"{where}: {out} holds {', '.join(ours)} that shardwise did not mark as its own (no "
                         f"{MARKER}) and no checkpoint there to resume; --resume would write over them: choose "
                         "another --output-dir")


def check_creatable(output_dir: str, where: str = "--output-dir", flag: str = "--output-dir",
                    writable: bool = True, if_file: str = "") -> None:
    """Refuse, in one line and before anything runs, an output directory that cannot be made: a file (or a
    dangling link) on its path, a name longer than the filesystem takes, and with `writable` a directory this user
    cannot write (what an existing one holds is judged by the launcher). The path itself being a file is refused
    with `if_file` as the line's advice; without it, that is left to the launcher, whose line says more."""
    path = os.path.abspath(output_dir)
    if any(len(os.fsencode(part)) > 255 for part in path.split(os.sep)):
        raise ShardwiseError(f"{where}: {output_dir}: a name in it is longer than 255 bytes; choose a shorter "
                             f"{flag}")
    cur = path
    while not os.path.lexists(cur) and os.path.dirname(cur) != cur:
        cur = os.path.dirname(cur)
    if not os.path.isdir(cur):
        if cur == path:
            if if_file:
                what = "a link to nothing" if os.path.islink(path) and not os.path.exists(path) else "a file"
                raise ShardwiseError(f"{where}: {output_dir} is {what}, not a directory; {if_file}")
            return  # the output directory itself is a file: the launcher's own line says so
        raise ShardwiseError(f"{where}: {cur} is a file, not a directory: nothing can be created under it; "
                             f"choose another {flag}")
    if writable and not os.access(cur, os.W_OK | os.X_OK):
        raise ShardwiseError(f"{where}: {cur} is not writable by this user, so {path} cannot be written; choose "
                             f"another {flag}")


def clear(output_dir: str) -> None:
    """Remove shardwise's own entries from a marked run directory; nothing else is touched.
    The caller has checked `run_id` and `protected`; checked again here because deleting is
    the one thing that cannot be undone."""
    if run_id(output_dir) is None or protected(output_dir):
        raise ShardwiseError(f"{output_dir}: refusing to clear a directory that is not a shardwise run directory")
    for e in OWN_ENTRIES:
        p = os.path.join(output_dir, e)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        elif os.path.lexists(p):
            os.remove(p)
    _clear_written_later(output_dir)


# Entries a run adds to its directory only sometimes: the record of each resume, --profile-steps's tables and
# traces, and --memory-snapshot's allocator histories. Cleared with the run (a replaced run's resumes described
# checkpoints gone), but they do not mark a directory as a run's (own_entries_present), and of profile/ and memory/
# only their own files go.
RESUMES = "resumes.jsonl"
PROFILE = "profile"
PROFILE_FILE = re.compile(r"step-\d+-rank\d+\.(txt|json\.gz)")
MEMORY = "memory"
MEMORY_FILE = re.compile(r"rank\d+\.pickle")


def _clear_written_later(output_dir: str) -> None:
    resumes = os.path.join(output_dir, RESUMES)
    if os.path.isfile(resumes) and not os.path.islink(resumes):
        os.remove(resumes)
    for folder, own in ((PROFILE, PROFILE_FILE), (MEMORY, MEMORY_FILE)):
        d = os.path.join(output_dir, folder)
        if not os.path.isdir(d) or os.path.islink(d):
            continue
        for name in os.listdir(d):
            p = os.path.join(d, name)
            if own.fullmatch(name) and os.path.isfile(p) and not os.path.islink(p):
                os.remove(p)
        with contextlib.suppress(OSError):
            os.rmdir(d)  # only when nothing else is left in it


def check_no_links(output_dir: str, where: str = "--output-dir") -> None:
    """Refuse a run directory where a path shardwise writes (or clears) is a symbolic link: the run would write
    through it into the link's target (a linked .prep has its errors/ removed and the preparation written there).
    The run directory itself may be a link: that is where the user put it."""
    names = [*OWN_ENTRIES, LOCK, RESUMES, PROFILE, MEMORY]
    prep = prep_dir(output_dir)
    inside = sorted(os.listdir(prep)) if os.path.isdir(prep) and not os.path.islink(prep) else []
    for path in [os.path.join(output_dir, n) for n in names] + [os.path.join(prep, n) for n in inside]:
        if os.path.islink(path):
            raise ShardwiseError(f"{where}: {path} is a symbolic link (to {os.readlink(path)}); shardwise writes "
                                 "there itself and never through a link: remove the link, or choose another "
                                 "--output-dir")


# ----------------------------------------------------------------------------- lock


class RunLock:
    """An exclusive flock on OUTPUT_DIR/.shardwise-lock, held for the life of the launcher
    (the file holds its PID). The kernel drops it when the process exits, so a dead owner's
    lock is never stale."""

    def __init__(self, output_dir: str):
        self.output_dir = output_dir
        self.path = os.path.join(output_dir, LOCK)
        self.fd: int | None = None

    def acquire(self, where: str = "output_dir") -> None:
        import fcntl

        try:  # never through a link: the PID is written into this file (a planted link would truncate its target)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o666)
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            raise ShardwiseError(f"{where}: {self.path} is a symbolic link, not shardwise's lock file; remove it "
                                 "(shardwise writes the file itself) or choose another --output-dir") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise
            pid = holder(self.output_dir)
            deadline = time.monotonic() + 2.0
            while pid is None and time.monotonic() < deadline:  # the holder writes its PID just after its flock
                time.sleep(0.02)
                pid = holder(self.output_dir)
            raise ShardwiseError(f"{where}: {self.output_dir} is in use by another shardwise run "
                                 f"(PID {pid or 'unknown'}); wait for it to finish or choose another --output-dir")
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the only descriptor drops the flock
            self.fd = None


def holder(output_dir: str) -> int | None:
    """The PID written into a run directory's lock file, if any."""
    try:
        with open(os.path.join(output_dir, LOCK)) as fh:
            text = fh.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def locked(output_dir: str) -> bool:
    """Whether a live process holds the run directory's lock (probed without taking it)."""
    import fcntl

    try:
        fd = os.open(os.path.join(output_dir, LOCK), os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


# ----------------------------------------------------------------------------- process setup


def quiet_libraries(transformers: bool = True) -> None:
    """Progress bars and accelerator banners of the libraries we drive are noise here. `transformers=False` sets
    the environment only (transformers reads it when imported): the launcher starts the workers before it imports
    transformers (launch.prep._begin)."""
    if "TOKENIZERS_PARALLELISM" not in os.environ:  # ours, not the user's: data/encode.py turns it on around batches
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        os.environ["SHARDWISE_TOKENIZERS_PARALLELISM_OURS"] = "1"
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    try:
        import torch

        if not torch.cuda.is_available():
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
    except ImportError:
        pass
    if not transformers:
        return
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:
        pass
