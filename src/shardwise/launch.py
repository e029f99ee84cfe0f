"""Config -> prepared run -> workers.

Everything a user can get wrong is checked here, in the launching process, before any
worker runs the job and before anything is written: config, hardware fit, model directory,
every data record. Then the run directory is written (config.yaml, the tokenized data, the
job) and the workers train: in this process for a one-process `single` run, otherwise through
torchrun's elastic agent (`torch.distributed.launcher.api.elastic_launch`) with c10d
rendezvous, so the same command works on one machine, across machines and under Slurm. On
one node the agent starts the workers while the checks run (_Early): they import, then wait
for the job, or leave when a check failed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shlex
import shutil
import sys
import time
import uuid

from shardwise import phases, presets, rundir
from shardwise.config import Config, Resolved, absolute_paths, split_source, to_yaml
from shardwise.errors import ShardwiseError
from shardwise.hardware import use_compile_cache
from shardwise.rundir import quiet_libraries


@dataclasses.dataclass
class Prepared:
    cfg: Config
    output_dir: str
    job_path: str
    world_size: int
    lock: rundir.RunLock | None = None  # held by node 0's launcher for the run's life


def say(msg: str) -> None:
    print(f"shardwise: {msg}", flush=True)


def resolve_runtime(res: Resolved) -> Config:
    """Fill the 'auto' values from the hardware at hand; refuse what it cannot run."""
    import torch

    from shardwise.hardware import bf16_supported

    cfg = dataclasses.replace(res.cfg)
    cuda = torch.cuda.is_available()
    n_gpu = torch.cuda.device_count() if cuda else 0
    if cfg.mixed_precision == "auto":
        cfg.mixed_precision = "bf16" if bf16_supported() else "no"
    if cfg.nproc_per_node == 0:
        cfg.nproc_per_node = presets.replica_world(cfg.strategy, cfg.tensor_parallel, cfg.sequence_parallel) \
            or (n_gpu if cuda else 2)
    if cuda and cfg.nproc_per_node > n_gpu:
        raise ShardwiseError(f"{res.where('nproc_per_node')}: {cfg.nproc_per_node} processes per node but this "
                             f"node has {n_gpu} GPU(s); one GPU per rank")
    if cfg.tuner == "qlora" and not cuda:
        raise ShardwiseError(f"{res.where('tuner')}: QLoRA needs a CUDA GPU (4-bit bitsandbytes kernels); "
                             "use --tuner lora on the CPU")
    if cfg.float8:
        from shardwise.models.float8 import refusal

        why = refusal(torch.device("cuda" if cuda else "cpu"))
        if why:
            raise ShardwiseError(f"{res.where('float8')}: {why}")
    if cfg.mixed_precision == "bf16" and cuda and not bf16_supported():
        raise ShardwiseError(f"{res.where('mixed_precision')}: this GPU has no bf16; use --mixed-precision fp16")
    if cfg.deepspeed.config and cfg.strategy in presets.PRESETS and presets.base_strategy(cfg.strategy) == "deepspeed":
        # its keys against this run's settings ("auto", keys a flag decides, sections of the wrong type), with the
        # precision and the ranks now known, before anything is written
        from shardwise.strategies import ds_json

        ds_json.resolve(ds_json.UserConfig.read(cfg.deepspeed.config), cfg, cfg.nproc_per_node * cfg.nnodes)
    if not cfg.output_dir:
        cfg.output_dir = os.path.join("runs", f"{cfg.strategy}-{time.strftime('%Y%m%d-%H%M%S')}")
    cfg.output_dir = os.path.abspath(cfg.output_dir)
    return cfg


def check_output_dir(cfg: Config, res: Resolved, lock: rundir.RunLock | None = None) -> bool:
    """Refuse an output directory this run must not write into; True when it holds a marked
    run that is to be cleared first (--overwrite, or a run that failed before training).

    Only a directory shardwise created and marked is ever cleared, and only of its own
    entries; a root, the home directory, the current directory and its parents never are.
    With `lock`, a live run's lock is taken (or the run refused) before anything is judged."""
    out, where = cfg.output_dir, res.where("output_dir")
    # a run found misplaced when it resumes is moved, not abandoned
    fix = ("move the run directory out of it, then resume it from there" if cfg.resume != "none"
           else "choose an --output-dir outside it")
    _check_outside_data_dirs(cfg, res, out, fix)
    inside = rundir.enclosing_run(out)
    if inside:
        raise ShardwiseError(f"{where}: {out} lies in {inside[1]}/ of the run directory {inside[0]}, which that "
                             f"run deletes whole when it is overwritten (or rotates its checkpoints): {fix}")
    if not os.path.isdir(out):
        if os.path.lexists(out):
            raise ShardwiseError(f"{where}: {out} exists and is not a directory; choose another --output-dir")
        return False
    why = rundir.protected(out)
    if why in ("a filesystem root", "the home directory"):
        raise ShardwiseError(f"{where}: {out} is {why}; a run needs a directory of its own: choose another --output-dir")
    if lock is not None and lock.fd is None and os.path.exists(lock.path):
        lock.acquire(where)  # a live run there is refused now, naming its PID
    if cfg.resume != "none" and not _replaces_without_checkpoint(cfg, res):
        return False
    ours = rundir.own_entries_present(out)
    marked = rundir.run_id(out) is not None
    if not marked:
        if not ours:
            return False  # a new or foreign-but-unrelated directory: the run adds its own entries
        raise ShardwiseError(
            f"{where}: {out} holds {', '.join(ours)} that shardwise did not mark as its own (no {rundir.MARKER}); "
            "nothing there is replaced" + (" (--overwrite only replaces a run directory shardwise created)"
                                           if cfg.overwrite else "") + ": choose another --output-dir")
    if not rundir.has_trained(out):
        if why is None:  # a run that stopped before its first step does not block a rerun
            _check_inputs_outside(cfg, res, out)
        return why is None
    if not cfg.overwrite:
        raise ShardwiseError(f"{where}: {out} holds another run; pass --resume auto to continue it, --overwrite "
                             "to replace it, or choose another --output-dir")
    if why:
        raise ShardwiseError(f"{where}: {out} is {why}; --overwrite never clears it: choose another --output-dir")
    _check_inputs_outside(cfg, res, out)
    return True


def _replaces_without_checkpoint(cfg: Config, res: Resolved) -> bool:
    """--resume auto --overwrite where the run has no checkpoint: the run is replaced, as --overwrite alone replaces
    it (it trained from the start over the old run's files, its profile/, tensorboard/ and run id kept). Where it
    has checkpoints and none can be resumed (each damaged), nothing is replaced: refused, naming them (a half-copied
    run, or one whose RNG file alone is damaged and whose weights still export, would be deleted without a word)."""
    if cfg.resume != "auto" or not cfg.overwrite:
        return False
    from shardwise.train import checkpoint as ckpt

    if ckpt.latest(cfg.output_dir) is not None:
        return False
    damaged = ckpt.skipped_newer(cfg.output_dir)
    if damaged:
        raise ShardwiseError(
            f"{res.where('overwrite')}: --resume auto finds no checkpoint it can resume in {cfg.output_dir} ("
            + "; ".join(f"{os.path.basename(p)}: {why}" for p, why in damaged) + "), and --overwrite would delete "
            "them; move them away (shardwise export reads a checkpoint whose RNG files are damaged) and run again, "
            "or pass --overwrite without --resume to replace the run")
    return True


def _check_outside_data_dirs(cfg: Config, res: Resolved, out: str, fix: str) -> None:
    """A data directory is read whole (its subdirectories too, as data/sources.data_files walks it: not those whose
    name starts with a dot, and a saved `datasets` directory only through its own files), so a run directory inside
    one would be read as data by the next run over it (its config.yaml repeating this run included)."""
    from shardwise.data.sources import is_saved_dataset

    for key, path in [*_data_paths(cfg), ("val_data", cfg.val_data)]:
        if not path or path == "demo" or not os.path.isdir(path) or is_saved_dataset(path):
            continue
        real, inside = os.path.realpath(path), os.path.realpath(out)
        if not rundir.within(inside, real):
            continue
        if any(part.startswith(".") for part in os.path.relpath(inside, real).split(os.sep) if part != "."):
            continue  # under a dot-directory, which the walk skips
        raise ShardwiseError(f"{res.where('output_dir')}: {out} is inside the data directory {path} "
                             f"({res.where(key)}), whose files are all read as data: the next run over it would "
                             f"read this run's files too; {fix}")


def _data_paths(cfg: Config) -> list[tuple[str, str]]:
    """("data", path) for each source of --data (a mixture's weights dropped)."""
    return [("data", split_source(item.strip())[0]) for item in cfg.data.split(",")]


def _check_inputs_outside(cfg: Config, res: Resolved, out: str) -> None:
    """A run directory about to be cleared must not hold what this run reads (e.g. --model OUT/final, the model
    the run being replaced trained): clearing would delete it before the run reads it."""
    inputs = [("model", cfg.model if cfg.model != "tiny" else ""), ("val_data", cfg.val_data),
              ("chat_template", cfg.chat_template if os.path.isfile(cfg.chat_template or "") else ""),
              ("deepspeed.config", cfg.deepspeed.config), *_data_paths(cfg)]
    for key, path in inputs:
        if not path or path == "demo":
            continue
        entry = rundir.entry_holding(out, os.path.expanduser(path))
        if entry:
            raise ShardwiseError(f"{res.where(key)}: {path} lies in {entry}/ of the run directory {out}, which "
                                 "this run deletes before reading it (it clears the run it replaces): copy it out "
                                 "first, or choose another --output-dir")


def prepare(res: Resolved, force: bool = False) -> Prepared:
    """Validate everything, then write the run directory. Returns what to launch."""
    cfg, lock, t0 = _begin(res)
    try:
        return _prepare(res, cfg, lock, force, t0)
    except BaseException:
        if lock is not None:
            lock.release()
        raise


def _begin(res: Resolved) -> tuple[Config, rundir.RunLock | None, float]:
    """The first checks: the runtime values, --strategy auto's choice, the output directory (node 0 takes the run's
    lock where a run was there). Enough to know how many workers start and how; writes nothing of the run (a run
    that compiles makes the compile cache's folder, hardware.use_compile_cache)."""
    t0 = time.time()
    quiet_libraries(transformers=False)  # _prepare imports it (on a thread, with early workers)
    cfg = resolve_runtime(res)
    from shardwise.strategies.parallelize import compile_enabled

    if compile_enabled(cfg):
        use_compile_cache()  # before the workers start: they inherit it
    if cfg.strategy == "auto":
        cfg = choose_strategy(cfg, res)
    lock = rundir.RunLock(cfg.output_dir) if cfg.node_rank == 0 else None
    try:
        if lock is not None:
            check_output_dir(cfg, res, lock)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return cfg, lock, t0


class _Cancelled(Exception):
    """The workers' group ended (a failure, a signal) before this run's prepare wrote anything."""


class _WriteGate:
    """Between a prepare on a thread (launch._Early) and the main thread: either the prepare passes `enter` and
    writes the run directory (then the main thread waits for it to end), or the main thread cancels first and the
    prepare writes nothing (then nobody waits for it: a long tokenization does not hold up a failed or interrupted
    launch)."""

    def __init__(self):
        import threading

        self._lock = threading.Lock()
        self.cancelled = False
        self.writing = False

    def enter(self) -> None:
        with self._lock:
            if self.cancelled:
                raise _Cancelled()
            self.writing = True

    def cancel(self) -> bool:
        """Cancel; True when the prepare is already writing (wait for it)."""
        with self._lock:
            self.cancelled = True
            return self.writing


def _prepare(res: Resolved, cfg: Config, lock: rundir.RunLock | None, force: bool, t0: float = 0.0,
             gate: _WriteGate | None = None, loaded: tuple | None = None, marks: dict | None = None) -> Prepared:
    quiet_libraries(transformers=False)  # transformers only where the tokenizer loads (_tokenized)
    from safetensors.torch import save_file

    from shardwise.train import checkpoint as ckpt

    node0 = lock is not None
    resume_from = None
    if cfg.resume not in ("auto", "none"):
        cfg.resume = os.path.abspath(cfg.resume)
        if not os.path.isfile(os.path.join(cfg.resume, ckpt.META)):
            raise ShardwiseError(f"{res.where('resume')}: {cfg.resume} is not a complete shardwise checkpoint "
                                 "(no meta.json); give a checkpoints/step_N directory or use --resume auto")
        resume_from = cfg.resume
    elif cfg.resume == "auto":
        resume_from = ckpt.latest(cfg.output_dir)  # the workers choose the same one
        if resume_from and cfg.overwrite:
            say(f"--resume auto --overwrite: {cfg.output_dir} has a checkpoint to resume, so nothing is replaced "
                "(--overwrite replaces a run only where --resume auto finds no checkpoint)")
        skipped = ckpt.skipped_newer(cfg.output_dir)
        if skipped:
            say("--resume auto: skipped " + "; ".join(f"{p} ({why})" for p, why in skipped)
                + f"; resuming from {resume_from or 'the start (no complete checkpoint left)'}")
    if resume_from:
        ckpt.verify(resume_from)  # complete, and nothing in it can run code when loaded
    world = cfg.nproc_per_node * cfg.nnodes
    check_single(cfg, res, world)
    from shardwise import strategies

    strategies.get(cfg.strategy)  # unknown / not installed -> one clear line now, not in N workers
    from shardwise.train.metrics import check_trackers

    check_trackers(cfg.report_to, res.where("report_to"))  # a missing tracker package: one line now

    model_dir = check_model(cfg, res)
    resume_notes = ckpt.check_resume(resume_from, cfg, model_dir) if resume_from else []
    if resume_from:
        resume_notes += _data_change_notes(resume_from, cfg)
    if loaded is None:  # else first_checks() checked the degrees
        check_tensor_parallel(cfg, res, world, model_dir)
        check_sequence_parallel(cfg, res, world, model_dir)
    check_fit(cfg, res, world, force)
    if loaded is None:
        loaded = read_data(cfg, res)
    records, stats, val = loaded
    encoded, tensors, hit, val, val_tensors = _tokenized(cfg, res, model_dir, records, val)
    if val is not None and not val.stats["loss_tokens"]:
        raise ShardwiseError(f"{res.where('val_data' if cfg.val_data else 'val_split')}: the validation set has no "
                             "loss token (every example empty or truncated away); give more or longer examples")
    global_batch = cfg.micro_batch_size * cfg.grad_accum * (world // (cfg.sequence_parallel * cfg.tensor_parallel))
    if len(encoded) < global_batch:
        raise ShardwiseError(f"the dataset has {len(encoded)} sequences, fewer than one global batch of "
                             f"{global_batch}; lower --micro-batch-size or --grad-accum, or add data")
    if resume_from:
        check_steps_left(cfg, res, resume_from, cfg.max_steps if cfg.max_steps > 0
                         else cfg.epochs * (len(encoded) // global_batch))

    # -- nothing has been written until here ---------------------------------------------
    if gate is not None:
        gate.enter()
    out = cfg.output_dir
    if node0:
        os.makedirs(out, exist_ok=True)
        if lock.fd is None:
            lock.acquire(res.where("output_dir"))
        if check_output_dir(cfg, res, lock):  # judged again under the lock: another run may have finished
            rundir.clear(out)
        if rundir.run_id(out) is None and not rundir.own_entries_present(out):
            rundir.mark(out)
    prep = os.path.join(rundir.prep_dir(out), f"node{cfg.node_rank}")
    os.makedirs(prep, exist_ok=True)
    if node0:
        rundir.clear_interrupted(out)  # a record left by the run this one resumes is not this run's
    data_file = os.path.join(prep, "data.safetensors")
    with rundir.atomic_path(data_file) as tmp:
        save_file(tensors, tmp)
    rundir.atomic_write(os.path.join(prep, "sources.json"), json.dumps(encoded.sources))
    val_file = ""
    if val is not None:
        val_file = os.path.join(prep, "val.safetensors")
        with rundir.atomic_path(val_file) as tmp:
            save_file(val_tensors, tmp)
        rundir.atomic_write(os.path.join(prep, "val_sources.json"), json.dumps(val.sources))
    st = encoded.stats
    src = "the built-in demo set" if stats is None else ", ".join(stats.files[:3]) + (" ..." if len(stats.files) > 3 else "")
    msg = (f"data: {st['records']} records from {src}; {st['sequences']} sequences, {st['tokens']:,} tokens, "
           f"{st['loss_tokens']:,} loss tokens; {st['truncated']} truncated to seq_len {cfg.seq_len}")
    if hit:
        msg += " (tokenized data from the cache; --no-data-cache tokenizes again)"
    if st["dropped_no_loss_tokens"]:
        msg += f"; {st['dropped_no_loss_tokens']} dropped (no loss token left after truncation)"
    if stats and stats.skipped:
        msg += f"; {stats.skipped} bad records skipped (first: {stats.first_skipped})"
    msg += f"; {stats.mix}" if stats and stats.mix else ""
    say(msg)
    for note in resume_notes:
        say(note)
    if val is not None:
        say(f"validation: {val.stats['sequences']} sequences, {val.stats['loss_tokens']:,} loss tokens "
            f"({'from ' + cfg.val_data if cfg.val_data else f'{cfg.val_split:g} of the records, held out'})")
    resume_record: dict = {}
    if node0:
        if resume_from and os.path.isfile(os.path.join(out, "config.yaml")):
            # the run's config.yaml stays as it was written; each resume is recorded beside it (resumes.jsonl), by
            # rank 0 once the checkpoint has loaded (train/loop.py): a checkpoint that fails to load records nothing
            resume_record = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "notes": resume_notes,
                             "config": absolute_paths(dataclasses.asdict(cfg))}
        else:
            rundir.atomic_write(os.path.join(out, "config.yaml"), to_yaml(cfg, out))
    # the workers' config holds absolute paths, so a checkpoint's meta.json names the data wherever it is resumed from
    job = {"config": absolute_paths(dataclasses.asdict(cfg)), "model_dir": model_dir, "data_file": data_file,
           "output_dir": out, "resume": cfg.resume, "val_file": val_file, "resume_record": resume_record,
           "timeline": {"process_start": phases.process_start(), "prepare_start": t0 or time.time(),
                        **(marks or {}), "prepared": time.time()}}
    job_path = os.path.join(prep, "job.json")
    rundir.atomic_write(job_path, json.dumps(job, indent=1))
    return Prepared(cfg, out, job_path, world, lock)


def _tokenized(cfg: Config, res: Resolved, model_dir: str, records: list, val: list) -> tuple:
    """(encoded, tensors, from the cache, validation encoded or None, its tensors or None). A launch whose sets a
    launch with the same source key (data/cache.py source_key) tokenized or read before takes them from the cache
    without loading the tokenizer; otherwise the tokenizer loads, its checks run, and each set not found so is
    tokenized or read from the cache by its entry key. Remote code always loads the tokenizer."""
    from shardwise.data import cache
    from shardwise.data.encode import ChatOptions, check_options
    from shardwise.data.templates import template_text, use_chat_template

    opts = ChatOptions.from_config(cfg)
    sets = [(records, cfg.packing)] + ([(val, False)] if val else [])
    digests, sources, got = [None] * len(sets), [None] * len(sets), [None] * len(sets)
    use_cache = cfg.data_cache
    why = cache.not_private() if use_cache else None
    if why:  # what is read from it becomes the training data
        say(f"data cache: {why}, so it is not used: the data is tokenized without it (set SHARDWISE_CACHE_DIR to a "
            "folder of your own, or pass --no-data-cache)")
        use_cache = False
    if use_cache and not cfg.trust_remote_code:
        template = template_text(cfg.chat_template, res.where("chat_template")) if cfg.chat_template else ""
        files = cache.model_files_digest(model_dir)
        digests = [cache.records_digest(recs) for recs, _ in sets]
        sources = [cache.source_key(recs, model_dir, template, cfg.seq_len, packing, opts, d, files)
                   for (recs, packing), d in zip(sets, digests)]
        got = [cache.cached_by_source(k) for k in sources]
    if all(g is not None for g in got):
        done = [(g[0], g[1], True) for g in got]
    else:
        from shardwise.models.load import load_tokenizer

        quiet_libraries()
        tokenizer = load_tokenizer(model_dir, cfg.trust_remote_code)
        use_chat_template(tokenizer, cfg.chat_template, res.where("chat_template"))
        check_options(tokenizer, opts, any(r.kind == "chat" for r in records + val))  # not hidden by a cache hit
        done = [(g[0], g[1], True) if g is not None else
                cache.encode_cached(recs, tokenizer, model_dir, cfg.seq_len, packing, opts, use_cache, say,
                                    source, d)
                for (recs, packing), source, d, g in zip(sets, sources, digests, got)]
    (encoded, tensors, hit), *rest = done
    if not val:
        return encoded, tensors, hit, None, None
    return encoded, tensors, hit, rest[0][0], rest[0][1]


def read_data(cfg: Config, res: Resolved) -> tuple[list, object, list]:
    """(training records, their read statistics, validation records), every record checked."""
    from shardwise.data.sources import load_records

    records, stats = load_records(cfg, res.where)
    records, val = validation_records(cfg, res, records)
    return records, stats, val


def first_checks(cfg: Config, res: Resolved) -> tuple[list, object, list]:
    """Before early workers start (_Early): what users most often get wrong and that needs neither a model class
    nor the tokenizer (the ranks for `single`, the model directory and its weights' headers, seq_len, the tensor-
    and sequence-parallel degrees against its heads, every data record), so such a run is refused without
    starting a worker. Returns read_data's records for _prepare, which checks everything else."""
    world = cfg.nproc_per_node * cfg.nnodes
    check_single(cfg, res, world)
    model_dir = check_model(cfg, res, shapes=False)
    check_tensor_parallel(cfg, res, world, model_dir)
    check_sequence_parallel(cfg, res, world, model_dir)
    return read_data(cfg, res)


def _data_change_notes(resume_from: str, cfg: Config) -> list[str]:
    """A note when a resume trains on other rows than the checkpoint's run (--data, or --val-split, which holds out
    other rows): allowed (a curriculum, a fixed file), but the saved data position (epoch, offset) then counts rows of
    the new data. Paths are compared as files (the checkpoint records them as typed, config.yaml absolute). Another
    validation set changes no training row: it gets its own note only when one set replaces another."""
    from shardwise.train import checkpoint as ckpt

    old = ckpt.read_meta(resume_from).get("config")
    if not isinstance(old, dict):
        return []
    changed = []
    if isinstance(old.get("data"), str) and _sources_key(old["data"]) != _sources_key(cfg.data):
        changed.append(f"data {old['data']} -> {cfg.data}")
    if isinstance(old.get("val_split"), (int, float)) and float(old["val_split"]) != cfg.val_split:
        changed.append(f"val_split {old['val_split']} -> {cfg.val_split}")
    notes = []
    if changed:
        notes.append(f"resuming {resume_from} on other data ({', '.join(changed)}); the data position it saved (epoch "
                     "and offset) is applied to the new data, so the rows it trains next are not those an "
                     "uninterrupted run would have")
    before = old.get("val_data")
    if isinstance(before, str) and before and cfg.val_data and _path_key(before) != _path_key(cfg.val_data):
        notes.append(f"resuming {resume_from} with another validation set ({before} -> {cfg.val_data}): its val loss "
                     "is not comparable with the one logged before the resume")
    return notes


def _path_key(path: str) -> str:
    return path if path in ("", "demo") else os.path.realpath(path)


def _sources_key(spec: str) -> list[tuple[str, float | int | None]]:
    """A data spec ('a.jsonl:0.7,demo:0.3') as (real path, count or weight) pairs, for comparing two specs (a weight
    written .5 is 0.5). A relative path in a checkpoint's meta.json is taken from here: meta.json records absolute
    paths, but a checkpoint written by an older shardwise may hold relative ones."""
    out = []
    for item in spec.split(","):
        path, num = split_source(item.strip())
        out.append((_path_key(path), None if not num else int(num) if num.isdigit() else float(num)))
    return out


def check_steps_left(cfg: Config, res: Resolved, resume_from: str, total: int) -> None:
    """A resume needs steps left: a checkpoint past the run's last step is refused (the loop would count down from
    it), and a run that already finished (its summary.json and final model written after that step) has nothing
    to do: NothingToDo, exit 0, nothing written. A checkpoint at the last step of a run that did not finish (stopped
    while saving its final model) goes on: the workers load it and write the final model and summary."""
    from shardwise.errors import NothingToDo
    from shardwise.train import checkpoint as ckpt

    step = ckpt.read_meta(resume_from).get("step")
    if not isinstance(step, int) or step < total:
        return
    where = res.where("max_steps") if cfg.max_steps > 0 else res.where("epochs")
    # an epochs-counted run trains on with more epochs (or a --max-steps past the checkpoint, which replaces them)
    more = (f"raise --max-steps above {step}" if cfg.max_steps > 0
            else f"raise --epochs above {cfg.epochs} (or give --max-steps above {step})")
    if step > total:
        raise ShardwiseError(f"{where}: this run has {total} steps, but the checkpoint it resumes ({resume_from}) is "
                             f"at step {step}; {more} to train on, or start a new run in another --output-dir")
    try:
        with open(os.path.join(cfg.output_dir, "summary.json")) as fh:
            summary = json.load(fh)
    except (OSError, ValueError):
        return
    if not isinstance(summary, dict):
        return
    final = summary.get("final_model")
    if summary.get("steps") == step and (not cfg.save_final or (isinstance(final, str) and os.path.isdir(final))):
        raise NothingToDo(f"{cfg.output_dir} already finished its {total} steps (checkpoint {resume_from}); nothing "
                          f"to train: {more} to train on")


def check_model(cfg: Config, res: Resolved, shapes: bool = True) -> str:
    """The model directory, checked: usable, weights complete and (with `shapes`: the model built on the meta
    device) shaped as config.json says, seq_len within its positions.
    Also used by `shardwise ui` before it starts a run."""
    from shardwise.models import load

    model_dir = load.resolve_model_dir(cfg.model, cfg.seed)
    _check_config_json(model_dir, res.where("model"))
    if cfg.padding_free == "on":  # the family, before the run directory is written (the workers check it again)
        from shardwise.data.batches import check_padding_free_family

        check_padding_free_family(cfg, load.model_family(model_dir, cfg.trust_remote_code), res.where("padding_free"))
    weights = load.check_weights(model_dir)
    if shapes:
        settings = [cfg.trust_remote_code, cfg.tuner, *([cfg.lora.targets, cfg.lora.r] if cfg.tuner != "full" else [])]
        key = load.checks_key(model_dir, weights, settings)
        if not load.passed_before(key):  # the same files and settings passed in an earlier run
            meta = load.check_shapes(model_dir, weights, cfg.trust_remote_code)
            if meta is not None and cfg.tuner != "full":  # the adapters' targets, before anything is written
                from shardwise.models.lora import check_rank, lora_targets

                targets = lora_targets(meta, cfg.lora.targets, res.where("lora.targets"))
                check_rank(meta, targets, cfg.lora.r, res.where("lora.r"))
            if meta is not None:  # None: not checked here (custom code, packed weights), the workers' load reports
                load.remember_passed(key, model_dir)
    limit = load.max_positions(model_dir)
    if limit and cfg.seq_len > limit:
        raise ShardwiseError(f"{res.where('seq_len')}: seq_len {cfg.seq_len} is larger than the model supports "
                             f"(max_position_embeddings {limit}); lower --seq-len, or extend the model's context "
                             "in its config.json: a rope_scaling entry (e.g. yarn with factor seq_len / "
                             f"{limit}) and max_position_embeddings raised to the new length (docs/long-context.md)")
    return model_dir


def _check_config_json(model_dir: str, where: str) -> None:
    """The model's config.json is one JSON object (every later check and the workers read it), its sizes positive
    integers (the checks below read heads and max_position_embeddings from it before transformers does)."""
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path, "rb") as fh:
            obj = json.load(fh)
    except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
        line = f":{e.lineno}" if isinstance(e, json.JSONDecodeError) else ""
        why = e.msg if isinstance(e, json.JSONDecodeError) else str(e).splitlines()[0][:200]
        raise ShardwiseError(f"{where}: {path}{line}: not valid JSON ({why}); fix or replace the file") from None
    except OSError as e:
        raise ShardwiseError(f"{where}: {path}: cannot read it ({e.strerror}); fix or replace the file") from None
    if not isinstance(obj, dict):
        raise ShardwiseError(f"{where}: {path}: not a JSON object ({{\"key\": value, ...}}); fix or replace the file")
    from shardwise.models.load import config_size_problem

    bad = config_size_problem(obj)  # read as numbers by the checks below (heads, max_position_embeddings)
    if bad:
        raise ShardwiseError(f"{where}: {path}: {bad}; fix it, or copy config.json from the model the weights "
                             "come from")


def validation_records(cfg: Config, res: Resolved, records: list) -> tuple[list, list]:
    """(training records, validation records): --val-data read like --data, or --val-split
    holding out a seeded random choice of the records (at least one)."""
    if cfg.val_data:
        from shardwise.data.sources import parse_columns, read_records

        cols = parse_columns(cfg.columns, res.where("columns"))
        return records, read_records(cfg.val_data, cfg.data_format, cfg.skip_bad_records, cols, flag="--val-data")[0]
    if cfg.val_split <= 0:
        return records, []
    import random

    n = max(1, round(len(records) * cfg.val_split))
    if n >= len(records):
        raise ShardwiseError(f"{res.where('val_split')}: val_split {cfg.val_split} leaves no training record "
                             f"of {len(records)}; lower it")
    held = set(random.Random(cfg.seed).sample(range(len(records)), n))
    return ([r for i, r in enumerate(records) if i not in held], [r for i, r in enumerate(records) if i in held])


def _attention_heads(model_dir: str, where: str, who: str, key: str) -> tuple[dict, int, int]:
    """(the model's text config, its attention heads, its KV heads) from config.json; a
    config without num_attention_heads is refused for `who`, which splits heads."""
    with open(os.path.join(model_dir, "config.json")) as fh:
        hf = json.load(fh)
    hf = hf.get("text_config", hf)
    heads = hf.get("num_attention_heads")
    if heads is None:
        raise ShardwiseError(f"{where}: the model's config.json names no num_attention_heads, so {who} cannot "
                             f"split its heads; use {key} 1")
    return hf, heads, hf.get("num_key_value_heads") or heads


def check_single(cfg: Config, res: Resolved, world: int) -> None:
    """`single` runs one process, or the tp x sp ranks of one replica (its gradients averaged over the sequence
    ranks, strategies/single.py); no data-parallel ranks (the planner offers it so: plan.decide.preset_names)."""
    replica = presets.replica_world(cfg.strategy, cfg.tensor_parallel, cfg.sequence_parallel)
    if replica is not None and world > replica:
        raise ShardwiseError(f"{res.where('strategy')}: strategy 'single' runs one process "
                             f"(or --tensor-parallel N processes, times --sequence-parallel M with it), not {world}; "
                             "use --strategy ddp")


def check_sequence_parallel(cfg: Config, res: Resolved, world: int, model_dir: str) -> None:
    """Refuse a sequence-parallel degree the ranks or the model's heads cannot take, with
    the model's numbers; say which mode runs. With tensor parallelism (checked first) each tp
    rank holds heads / tp of them, and those are what Ulysses splits."""
    n, tp = cfg.sequence_parallel, cfg.tensor_parallel
    if n == 1:
        return
    if world % (n * tp):
        raise ShardwiseError(f"{res.where('sequence_parallel')}: sequence_parallel {n}"
                             + (f" x tensor_parallel {tp}" if tp > 1 else "") + f" must divide the {world} "
                             "ranks (nnodes x nproc_per_node); the data-parallel degree is ranks / N")
    _, all_heads, all_kv = _attention_heads(model_dir, res.where("sequence_parallel"), "Ulysses", "sequence_parallel")
    heads, kv = all_heads // tp, max(all_kv // tp, 1)
    per_tp = f" ({all_heads} / tensor_parallel {tp} per tensor rank)" if tp > 1 else ""
    if heads % n and cfg.sp_mode == "ulysses":
        fits = [d for d in range(2, heads + 1) if heads % d == 0 and world % (d * tp) == 0]
        hint = f"use --sequence-parallel {fits[-1]}" if fits else "use --sequence-parallel 1"
        raise ShardwiseError(f"{res.where('sequence_parallel')}: Ulysses splits the model's {heads} attention heads"
                             f"{per_tp} over the {n} ranks of a sequence-parallel group, and {n} does not divide "
                             f"{heads}; {hint}, or --sp-mode ring / auto (ring attention for degrees beyond the heads)")
    from shardwise.models.sequence_parallel import split_degree

    u, r = split_degree(n, heads, cfg.sp_mode)
    why = f"chosen by --sp-mode auto: gcd({heads} heads{per_tp}, {n}) = {u}; " if cfg.sp_mode == "auto" else ""
    if r == 1:
        how = "KV heads replicated to " + str(math.lcm(kv, n)) if kv % n else f"{kv // n} KV head(s) per rank"
        mode = f"Ulysses ({why}{heads} heads{per_tp} divide by {n}), {heads // n} query heads per rank ({how})"
    elif u == 1:
        mode = f"ring attention ({why or 'by --sp-mode ring; '}{n - 1} KV exchanges per layer)"
    else:
        mode = f"Ulysses {u} x ring {r} ({why}{heads // u} query heads per rank, rings of {r})"
    say(f"sequence parallel: {mode} over groups of {n} ranks; "
        f"data-parallel degree {world // (n * tp)}; each rank holds {cfg.seq_len // n} of {cfg.seq_len} tokens"
        + (f" (split again over the {tp} tensor ranks between blocks)" if tp > 1 else ""))


def check_tensor_parallel(cfg: Config, res: Resolved, world: int, model_dir: str) -> None:
    """Refuse a tensor-parallel degree the ranks or the model's heads cannot take, with the
    model's numbers; say how the weights are split (strategies/parallelize.py)."""
    n = cfg.tensor_parallel
    if n == 1:
        return
    where = res.where("tensor_parallel")
    if world % n:
        raise ShardwiseError(f"{where}: tensor_parallel {n} must divide the {world} ranks (nnodes x nproc_per_node); "
                             "the data-parallel degree is ranks / N")
    hf, heads, kv = _attention_heads(model_dir, where, "tensor parallelism", "tensor_parallel")
    if heads % n or kv % n:
        fits = [d for d in range(2, kv + 1) if heads % d == 0 and kv % d == 0 and world % d == 0]
        hint = f"use --tensor-parallel {fits[-1]}" if fits else "use --tensor-parallel 1"
        raise ShardwiseError(f"{where}: tensor parallelism gives each of the {n} ranks whole attention heads, and {n} "
                             f"does not divide the model's {heads} attention heads and {kv} KV heads; {hint}")
    from shardwise.strategies.parallelize import TP_FAMILIES

    family = hf.get("model_type")
    if family not in TP_FAMILIES:
        raise ShardwiseError(f"{where}: tensor parallelism knows the decoder families {', '.join(TP_FAMILIES)}, "
                             f"not the model's '{family}' (model_type in its config.json); use tensor_parallel 1")
    inter = hf.get("intermediate_size")
    if inter and inter % n:
        raise ShardwiseError(f"{where}: tensor_parallel {n} does not divide the model's MLP width "
                             f"(intermediate_size {inter}); use a degree that divides it and the heads")
    say(f"tensor parallel: attention and MLP linears split over groups of {n} ranks ({heads // n} query heads and "
        f"{kv // n} KV head(s) per rank); embedding and head split over the vocabulary, norms over the sequence; "
        f"data-parallel degree {world // (n * cfg.sequence_parallel)}")


def check_fit(cfg: Config, res: Resolved, world: int, force: bool) -> None:
    """Refuse a run the planner says cannot fit the GPUs, unless --force."""
    try:
        from shardwise.plan import fit_advice, plan_run
    except ImportError:
        return
    import torch

    if not torch.cuda.is_available():
        return  # host RAM is not the planner's business on a CPU box
    plan = plan_run(cfg, None, world)
    sp = plan.for_strategy(cfg.strategy)
    if not sp.fits and not force:
        raise ShardwiseError(fit_advice(plan, cfg.strategy) + " (pass --force to launch anyway)")


def choose_strategy(cfg: Config, res: Resolved) -> Config:
    try:
        from shardwise.plan import plan_run
    except ImportError:
        raise ShardwiseError(f"{res.where('strategy')}: --strategy auto needs the planner, which this build lacks")
    world = cfg.nproc_per_node * cfg.nnodes
    plan = plan_run(dataclasses.replace(cfg, strategy="ddp"), None, world)
    par = plan.parallel  # the degrees the planner chose where data parallelism alone does not fit
    degrees = {}
    if par.get("chosen"):
        degrees = {"tensor_parallel": par["tensor_parallel"], "sequence_parallel": par["sequence_parallel"],
                   "sp_mode": par["sp_mode"]}
    how = "".join(f" {k} {v}" for k, v in degrees.items() if k != "sp_mode" and v > 1)
    say(f"--strategy auto chose '{plan.recommended}'{how and ' with' + how}: " + "; ".join(plan.reasons))
    return dataclasses.replace(cfg, strategy=plan.recommended, **degrees)


class Interrupted(Exception):
    def __init__(self, signum: int):
        self.signum = signum


def launch(p: Prepared) -> dict | None:
    cfg = p.cfg
    if presets.trains_in_process(cfg.strategy, p.world_size):
        quiet_libraries()
        import signal

        from shardwise.train.loop import Preempted
        from shardwise.train.worker import run_job

        try:
            return run_job(p.job_path)
        except Preempted:
            raise Interrupted(signal.SIGTERM) from None
    phases.release_full_gc()  # prepared: this process only runs the agent from here (phases.py)
    shutil.rmtree(rundir.error_dir(p.output_dir), ignore_errors=True)
    _agent(cfg, [p.job_path])
    return _after_agent(p)


def _agent(cfg: Config, worker_args: list[str]) -> None:
    """The workers `python -m shardwise.train.worker WORKER_ARGS`, through torchrun's elastic agent in this
    process; a failed group becomes one ShardwiseError line, a signal Interrupted."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    worker_environment(cfg)
    multi = cfg.nnodes > 1
    import tempfile

    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs

    if multi:
        register_rendezvous()
        where = dict(rdzv_backend=RDZV_BACKEND, rdzv_endpoint=cfg.rdzv_endpoint,
                     rdzv_configs={"is_host": cfg.node_rank == 0, "join_timeout": 300})
    else:
        where = loopback_only(int(cfg.rdzv_endpoint.rpartition(":")[2] or 0))
    # the agent's per-rank error files go to a temporary directory of this run's own, removed
    # after it (left to itself the agent leaves a $TMPDIR/torchelastic_* behind every run)
    agent_tmp = tempfile.mkdtemp(prefix="shardwise-agent-")
    from shardwise.train import zygote

    forked = zygote.enabled() and zygote.start(*(early_preload(cfg) if worker_args[0] == "--wait" else ("", False)))
    trouble = zygote.cuda_trouble() if forked else ""
    if trouble:  # the run goes on, its workers started as their own interpreters
        zygote.stop()
        forked = False
        say(f"note: the workers' fork server cannot be used ({trouble}); each worker starts as its own interpreter "
            "instead, a slower start (SHARDWISE_FORKSERVER_HIDE=torchao,PACKAGE hides a package that initialises "
            "CUDA as it is imported; SHARDWISE_FORKSERVER=0 skips the server)")
    lc = LaunchConfig(
        min_nodes=cfg.nnodes, max_nodes=cfg.nnodes, nproc_per_node=cfg.nproc_per_node,
        run_id=f"shardwise-{cfg.rdzv_endpoint}" if multi else f"shardwise-{uuid.uuid4().hex[:8]}",
        max_restarts=cfg.max_restarts, monitor_interval=0.1, start_method="forkserver" if forked else "spawn",
        logs_specs=DefaultLogsSpecs(log_dir=agent_tmp), **where,
    )

    quiet_agent()
    try:
        if forked:  # each worker a fork of one server that imported torch, transformers and the model (zygote.py)
            elastic_launch(lc, zygote.worker_main)(zygote.env_changes(), *worker_args)
        else:
            elastic_launch(lc, sys.executable)("-u", "-m", "shardwise.train.worker", *worker_args)
    except ChildFailedError as e:
        raise ShardwiseError(_failure_report(cfg.output_dir, e, cfg)) from None
    except SignalException as e:
        raise Interrupted(int(e.sigval)) from None
    finally:
        if forked:
            zygote.stop()
        shutil.rmtree(agent_tmp, ignore_errors=True)


def worker_environment(cfg: Config) -> None:
    """The environment the workers start with, beyond the agent's per-rank variables: threads per rank, the
    launcher they die with, and on one node gloo's and NCCL's sockets on the loopback interface (forked workers
    take it on too: train/zygote.env_changes)."""
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // cfg.nproc_per_node))
    os.environ["SHARDWISE_LAUNCHER_PID"] = str(os.getpid())  # workers die with this process
    if cfg.nnodes == 1:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")


def early_preload(cfg: Config) -> tuple[str, bool]:
    """What a worker imports before its job is known (train/worker.preload): the model family's module, as the
    absolute model directory or "tiny" (_model_arg), and, for compiled blocks, inductor's."""
    from shardwise.strategies.parallelize import compile_enabled

    return _model_arg(cfg), compile_enabled(cfg)


def _model_arg(cfg: Config) -> str:
    return os.path.abspath(os.path.expanduser(cfg.model)) if cfg.model != "tiny" else "tiny"


def _after_agent(p: Prepared) -> dict | None:
    if rundir.read_interrupted(p.output_dir) is not None:  # a worker received the signal; the agent did not
        import signal

        raise Interrupted(signal.SIGTERM)
    summary = os.path.join(p.output_dir, "summary.json")
    if p.cfg.node_rank == 0 and os.path.isfile(summary):
        with open(summary) as fh:
            return json.load(fh)
    return None


def early_workers(cfg: Config) -> bool:
    """Whether the workers start while this process still checks and tokenizes (_Early): every run through the
    agent on one node. Several nodes keep the order (checked, then started): a node whose checks fail must not
    leave the others' workers waiting in a group it never joins. SHARDWISE_EARLY_WORKERS=0 turns it off."""
    return (not presets.trains_in_process(cfg.strategy, cfg.nproc_per_node * cfg.nnodes) and cfg.nnodes == 1
            and os.environ.get("SHARDWISE_EARLY_WORKERS", "1") != "0")


class _Early:
    """`_prepare` on a thread while the agent starts the workers, to shorten the time to first step: each worker
    imports torch, transformers and the model's classes while this process checks the model and the data. The
    workers wait for `pointer`, a file in a directory of this launcher's own, which names the job once the run
    directory is written, or holds null when the checks failed (they leave; this process reports the one line;
    nothing was written). The agent keeps the main thread (it installs signal handlers)."""

    def __init__(self, res: Resolved, cfg: Config, lock, force: bool, t0: float, loaded: tuple):
        import tempfile
        import threading

        self.res, self.cfg, self.lock, self.force, self.t0, self.loaded = res, cfg, lock, force, t0, loaded
        self.dir = tempfile.mkdtemp(prefix="shardwise-job-")
        self.pointer = os.path.join(self.dir, "job")
        self.prepared: Prepared | None = None
        self.error: BaseException | None = None
        self.gate = _WriteGate()
        self.marks: dict[str, float] = {}  # the job's timeline: agent_start (the agent called, the workers to come)
        self.thread = threading.Thread(target=self._run, name="shardwise-prepare", daemon=True)

    def _run(self) -> None:
        job = None
        try:
            p = _prepare(self.res, self.cfg, self.lock, self.force, self.t0, gate=self.gate, loaded=self.loaded,
                         marks=self.marks)
            shutil.rmtree(rundir.error_dir(p.output_dir), ignore_errors=True)
            _say_run_dir(p)
            self.prepared, job = p, p.job_path
        except BaseException as e:  # noqa: BLE001 - re-raised by finish() in the main thread
            self.error = e
        finally:
            phases.release_full_gc()  # prepared: this process only runs the agent from here (phases.py)
            try:
                rundir.atomic_write(self.pointer, json.dumps({"job": job}))
            except OSError:
                pass  # the launch ended without waiting for this prepare (finish(failed=True)); nobody reads it

    def worker_args(self) -> list[str]:
        model, compile_blocks = early_preload(self.cfg)
        return ["--wait", self.pointer, model] + (["--compile"] if compile_blocks else [])

    def finish(self, failed: bool = False) -> Prepared:
        """Wait for the prepare; its error (a ShardwiseError: one line) is the run's. With `failed` (the group
        ended in a failure or a signal) the prepare is cancelled: if it is writing the run directory, that ends
        first; if not, it writes nothing and is not waited for."""
        if not failed or self.gate.cancel():
            self.thread.join()
        shutil.rmtree(self.dir, ignore_errors=True)
        if self.error is not None and not isinstance(self.error, _Cancelled):
            raise self.error
        return self.prepared


def _say_run_dir(p: Prepared) -> None:
    say(f"run directory: {p.output_dir} ({p.cfg.strategy}, {p.world_size} process(es), "
        f"mixed precision {p.cfg.mixed_precision})")
    note = oversubscribed(p.cfg.nproc_per_node)
    if note:
        say(note)


def oversubscribed(nproc: int) -> str | None:
    """A note when this node's ranks outnumber the CPU cores this process may use (torchrun starts them without a
    word): every rank then shares a core, and each step waits for the slowest."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    if nproc <= cores:
        return None
    return (f"note: {nproc} ranks on this node's {cores} CPU core(s): they share cores, so each step is slower than "
            f"with --nproc-per-node {cores} or fewer")


def _failure_report(output_dir: str, e, cfg: Config) -> str:
    """One line for a failed worker group: the rank that failed first and why. A rank that
    died (a signal, an exception, or an exit without a ShardwiseError) is the cause; the errors the other
    ranks then raise (a collective with a dead peer) are consequences and are only counted.

    What each rank left (train/worker.py) says more than the agent's failures: with forked workers the agent
    reports only the first failed process it finds, often a rank whose collective failed because another died.
    A rank's exception (rankN.exc), its one-line error (rankN.txt), or only its life mark (rankN.alive: it ended
    without a word, killed by a signal) name the cause."""
    errors, crashes = _worker_errors(output_dir), _worker_errors(output_dir, ".exc")
    failures = sorted(e.failures.items(), key=lambda kv: (kv[1].timestamp or 0, kv[0]))
    restarts = f" (after {cfg.max_restarts} restart(s), the --max-restarts limit)" if cfg.max_restarts else ""

    def blame(rank: int, line: str, also=()) -> str:
        others = sorted((set(errors) | set(crashes) | {r for r, _ in failures} | set(also)) - {rank})
        if others:
            line += f"; rank(s) {', '.join(map(str, others))} stopped after it"
        return line + restarts

    dead = [(r, f) for r, f in failures if r not in errors and r not in crashes and not _stopped_by_agent(f)]
    if dead:
        return blame(dead[0][0], _failure_line(*dead[0]))
    if crashes:
        rank = min(crashes)
        return blame(rank, _crash_line(rank, crashes[rank], None))
    own = {r: t for r, t in errors.items() if not _consequence(t)}
    if own:
        return own[min(own)]
    silent = sorted(_silent_ranks(output_dir) - set(errors))
    if silent and all(_consequence(t) == "died" for t in errors.values()):
        return blame(silent[0], f"training failed: rank {silent[0]} ended without an error of its own: killed by a "
                     "signal (SIGKILL, the out-of-memory killer) or crashed; its output above says more", silent[1:])
    if errors:
        return errors[min(errors)]
    return _failure_line(*failures[0])


def _consequence(error: str) -> str:
    """Whether a rank's one-line error is another rank's doing: "died" where a collective lost its peer (its
    connection reset or closed: the peer is gone), "hung" where it timed out (the peer may be alive), "" where the
    error is the rank's own."""
    text = error.lower()
    if LOST_PEER in error or "connection reset by peer" in text or "connection closed by peer" in text:
        return "died"
    return "hung" if "another rank is hung or dead" in text else ""


RDZV_BACKEND = "shardwise-c10d"


def register_rendezvous() -> None:
    """torchrun's c10d rendezvous, with its store listening on the rendezvous endpoint's
    address only (torch's own binds every interface): 127.0.0.1 on one node, the given
    --rdzv-endpoint host on several (a network the user must trust, as with torchrun)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as registry

    if RDZV_BACKEND not in getattr(registry, "_registry", {}):
        registry.register(RDZV_BACKEND, _rendezvous_handler)


def quiet_agent() -> None:
    """The elastic agent's own warnings ("Received 15 death signal, shutting down workers", a failed rank's report)
    repeat what shardwise's one line says; SHARDWISE_DEBUG=1 keeps them. torch gives each of its elastic modules'
    loggers a level of its own (LOGLEVEL, default WARNING), so a level on their parent logger is not enough."""
    import logging

    if os.environ.get("SHARDWISE_DEBUG"):
        return
    prefix = "torch.distributed.elastic"
    for name in [prefix, *(n for n in list(logging.root.manager.loggerDict) if n.startswith(prefix + "."))]:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    # forked workers (train/zygote.py) are torch.multiprocessing's: "Terminating process N via signal SIGTERM" when
    # one failed and the others are stopped
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.CRITICAL)


def loopback_only(port: int = 0) -> dict:
    """LaunchConfig arguments (and the environment) for a one-machine group that listens
    on 127.0.0.1 only: the rendezvous store, the workers' store (MASTER_ADDR) and gloo's or
    NCCL's own sockets."""
    register_rendezvous()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # as worker_environment, for doctor's group
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    return dict(rdzv_backend=RDZV_BACKEND, rdzv_endpoint=f"127.0.0.1:{port}", rdzv_configs={"is_host": True},
                local_addr="127.0.0.1")


def _rendezvous_handler(params):
    from datetime import timedelta

    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    from shardwise.train.dist import tcp_store

    class Backend(C10dRendezvousBackend):
        name = RDZV_BACKEND

    # The agent's store is never shared into the workers (torch's default shares it), for two reasons:
    # - torch makes that shared store with a plain TCPStore server, which listens on every interface;
    # - a group restarted by --max-restarts reads the previous attempt's unprefixed keys in it, and its gloo mesh
    #   hangs or is refused. The workers make their own store (train/dist.worker_store, on MASTER_ADDR only).
    # torch reads this at each rendezvous round; set here, it holds for train and doctor, one node or several, whatever
    # the environment said.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=29400)
    store = tcp_store(host, port, is_master=bool(params.get_as_bool("is_host", True)), multi_tenant=True,
                      timeout=timedelta(seconds=params.get_as_int("read_timeout", 60)))
    return create_handler(store, Backend(store, params.run_id), params)


def _stopped_by_agent(f) -> bool:
    """A rank the agent terminated (SIGTERM) because another rank failed."""
    import signal

    return f.exitcode is not None and f.exitcode == -signal.SIGTERM


def _worker_errors(output_dir: str, kind: str = ".txt") -> dict[int, str]:
    """{rank: the one-line ShardwiseError it left} (kind .txt), the first line of the exception it raised (.exc), or
    its PID where its life mark is still there (.alive; train/worker.py)."""
    d = rundir.error_dir(output_dir)
    out = {}
    if not os.path.isdir(d):
        return out
    for name in os.listdir(d):
        if not name.endswith(kind):
            continue
        digits = "".join(c for c in name if c.isdigit())
        with open(os.path.join(d, name)) as fh:
            text = fh.read().strip()
        if text and digits:
            out[int(digits)] = text
    return out


LOST_PEER = "a collective lost its peer"  # a rank's error when a peer died (train/loop.py), not when one hung


def _silent_ranks(output_dir: str) -> set[int]:
    """The ranks whose life mark (its PID) is still there (train/worker.life_marker): they ended without a word."""
    return set(_worker_errors(output_dir, ".alive"))


def _failure_line(rank: int, f) -> str:
    """One line for a rank that died without a ShardwiseError."""
    import signal

    msg = f.message
    if isinstance(msg, str) and msg.startswith("{"):
        try:
            msg = json.loads(msg)
        except ValueError:
            pass
    if isinstance(msg, dict):
        msg = msg.get("message", "")
    detail = str(msg or "").strip().splitlines()[0][:300] if msg else ""
    if f.exitcode is not None and f.exitcode < 0:
        try:
            name = signal.Signals(-f.exitcode).name
        except ValueError:
            name = "?"
        return f"training failed: rank {rank} was killed by signal {-f.exitcode} ({name}); its output above says more"
    return _crash_line(rank, detail, f.exitcode)


def _crash_line(rank: int, detail: str, exitcode) -> str:
    """One line for a rank that raised (`detail`: the exception's first line) or exited with `exitcode`."""
    if "OutOfMemoryError" in detail or "out of memory" in detail.lower():
        return (f"out of memory on rank {rank} ({detail}); lower --micro-batch-size or --seq-len, enable "
                "--gradient-checkpointing, or shard more (--strategy fsdp / zero3); `shardwise plan` estimates it")
    how = f"exited with code {exitcode}" if exitcode is not None else "raised an exception"
    return f"training failed: rank {rank} {how} ({detail or 'no message'}); its output above says more"


def train(res: Resolved, force: bool = False) -> int:
    forked = _start_zygote_early(res.cfg)  # before this process imports torch (_begin)
    try:
        cfg, lock, t0 = _begin(res)
        if not early_workers(cfg):
            _stop_zygote(forked)  # it trains in this process after all, or its workers start once it is prepared
            forked = False
    except BaseException:
        _stop_zygote(forked)
        raise
    try:
        if early_workers(cfg):
            try:
                loaded = first_checks(cfg, res)
            except BaseException:
                _stop_zygote(forked)
                raise
            return _train(None, _Early(res, cfg, lock, force, t0, loaded))
        return _train(_prepare(res, cfg, lock, force, t0))
    finally:
        if lock is not None:
            lock.release()


def _start_zygote_early(cfg: Config) -> bool:
    """The fork server the workers come from (train/zygote.py), started as the launcher begins where the run will
    clearly have early workers (early_workers: one node, through the agent), judged from the config before torch
    is imported: --nproc-per-node given, or a machine without NVIDIA devices (2 ranks). Its imports (3-4 CPU-s on
    the tiny CPU job) then overlap everything this process does before the workers run. Where it cannot be
    judged yet, the agent starts the server later (_agent). Returns whether it started."""
    from shardwise.train import zygote

    nvidia = os.path.exists("/dev/nvidiactl")
    nproc = cfg.nproc_per_node or (0 if nvidia else 2)
    if (not nproc or cfg.nnodes != 1 or os.environ.get("SHARDWISE_EARLY_WORKERS", "1") == "0"
            or cfg.strategy not in presets.PRESETS or presets.trains_in_process(cfg.strategy, nproc)
            or not zygote.enabled()):
        return False
    # as early_preload, judged without torch (compile_enabled imports it)
    return zygote.start(_model_arg(cfg), cfg.compile == "on" or (cfg.compile == "auto" and nvidia))


def _stop_zygote(started: bool) -> None:
    if started:
        from shardwise.train import zygote

        zygote.stop()  # mid-import perhaps: nothing of the run's is in it


def _add_exit_phase(p: Prepared, summary: dict) -> dict:
    """Rank 0 wrote its marks (.prep/timeline.json); add the exit (workers and agent gone),
    rewrite summary.json's phases_s and print them on one line."""
    path = os.path.join(p.output_dir, ".prep", "timeline.json")
    try:
        with open(path) as fh:
            marks = json.load(fh)
    except (OSError, ValueError):
        return summary
    marks["exited"] = time.time()
    summary = dict(summary, phases_s=phases.durations(marks))
    rundir.atomic_write(os.path.join(p.output_dir, "summary.json"), json.dumps(summary, indent=1))
    say(phases.line(summary["phases_s"]))
    return summary


def _train(p: Prepared | None, early: _Early | None = None) -> int:
    try:
        if early is None:
            _say_run_dir(p)
            summary = launch(p)
        else:
            early.marks["agent_start"] = time.time()
            early.thread.start()
            try:
                _agent(early.cfg, early.worker_args())
            except BaseException:
                early.finish(failed=True)  # the prepare's own error first: the workers only waited for it
                raise
            p = early.finish()
            summary = _after_agent(p)
    except Interrupted as e:
        from shardwise.train import checkpoint as ckpt

        out = p.output_dir if p is not None else early.cfg.output_dir
        last = ckpt.latest(out)
        print(f"shardwise: interrupted by signal {e.signum}; newest checkpoint: {last or 'none'}; resume with: "
              f"shardwise train {shlex.quote(out + '/config.yaml')} --output-dir {shlex.quote(out)} --resume auto",
              file=sys.stderr, flush=True)
        return 128 + e.signum
    if summary:
        summary = _add_exit_phase(p, summary)
        kind = "PEFT adapter directory" if p.cfg.tuner != "full" else "Hugging Face directory"
        final = f", final/ ({kind})" if summary.get("final_model") else ""
        say(f"outputs: {p.output_dir}/metrics.jsonl, summary.json{final}; "
            f"repeat with: shardwise train {shlex.quote(p.output_dir + '/config.yaml')}")
    return 0
