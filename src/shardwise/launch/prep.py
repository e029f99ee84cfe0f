"""Preparing a run: reading and tokenizing the data, the checks that need the model directory or the data, then
writing the run directory (config.yaml, .prep/nodeN: the tokenized data and job.json) under the run's lock.
Nothing is written until every check has passed; a prepare on a thread (launch.early) writes only past its
_WriteGate."""

from __future__ import annotations

import dataclasses
import json
import os
import time

from shardwise import phases, rundir
from shardwise.config import Config, Resolved, absolute_paths, split_source, to_yaml
from shardwise.errors import ShardwiseError
from shardwise.hardware import use_compile_cache
from shardwise.launch.common import Progress, oversubscribed, say
from shardwise.launch.preflight import (
    RunPlan,
    check_fit,
    check_model,
    check_output_dir,
    check_ranks,
    check_resume,
    check_sequence_parallel,
    check_steps_left,
    check_tensor_parallel,
    choose_mlp_tiles,
    choose_strategy,
    keep_global_batch,
    resolve_runtime,
    run_plan,
)
from shardwise.rundir import quiet_libraries


@dataclasses.dataclass
class Prepared:
    """A run whose directory is written: its plan, where the job is, and node 0's lock on the run directory."""

    plan: RunPlan
    output_dir: str
    job_path: str
    lock: rundir.RunLock | None = None  # held by node 0's launcher for the run's life

    @property
    def cfg(self) -> Config:
        return self.plan.cfg

    @property
    def world_size(self) -> int:
        return self.plan.world


def _say_run_dir(p: Prepared) -> None:
    say(f"run directory: {p.output_dir} ({p.plan.strategy}, {p.plan.world} process(es), "
        f"mixed precision {p.cfg.mixed_precision})")
    note = oversubscribed(p.cfg.nproc_per_node)
    if note:
        say(note)


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
    cfg = choose_mlp_tiles(cfg)
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
    """Between a prepare on a thread (launch.early._Early) and the main thread: either the prepare passes `enter` and
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
    """Check what is left (the resume, the model, the degrees unless first_checks ran them, the fit, the data), then
    write the run directory. `loaded`: the records first_checks read; `gate`: the write gate of a prepare on a
    thread; `marks`: the job's timeline so far."""
    quiet_libraries(transformers=False)  # transformers only where the tokenizer loads (_tokenized)
    resume_from = _resume_source(cfg, res)
    world = cfg.nproc_per_node * cfg.nnodes
    model_dir, resume_notes = _check_run(res, cfg, world, force, resume_from, degrees_checked=loaded is not None)
    if loaded is None:
        loaded = read_data(cfg, res)
    records, stats, val = loaded
    encoded, tensors, hit, val, val_tensors = _encode(res, cfg, world, model_dir, records, val, resume_from)
    out = cfg.output_dir
    prep = os.path.join(rundir.prep_dir(out), f"node{cfg.node_rank}")
    plan = run_plan(cfg, world, model_dir, os.path.join(prep, "data.safetensors"),
                    os.path.join(prep, "val.safetensors") if val is not None else "")

    # -- nothing has been written until here ---------------------------------------------
    if gate is not None:
        gate.enter()
    node0 = lock is not None
    with rundir.full_disk_is_one_line("the prepared data", prep,
                                      "free space there or choose another --output-dir; nothing was trained"):
        if node0:
            _claim_run_dir(res, plan.cfg, lock)
        os.makedirs(prep, exist_ok=True)
        if node0:
            rundir.clear_interrupted(out)  # a record left by the run this one resumes is not this run's
        _write_data(plan, encoded, tensors, val, val_tensors)
        _say_data(plan.cfg, encoded, stats, hit, val, resume_notes)
        resume_record = _write_config(plan.cfg, out, resume_from, resume_notes) if node0 else {}
    # the workers' config holds absolute paths, so a checkpoint's meta.json names the data wherever it is resumed from
    job = {"config": absolute_paths(dataclasses.asdict(plan.cfg)), "model_dir": plan.model_dir,
           "data_file": plan.data_file, "output_dir": out, "resume": plan.cfg.resume, "val_file": plan.val_file,
           "resume_record": resume_record,
           "timeline": {"process_start": phases.process_start(), "prepare_start": t0 or time.time(),
                        **(marks or {}), "prepared": time.time()}}
    job_path = os.path.join(prep, "job.json")
    with rundir.full_disk_is_one_line("the prepared data", prep, "free space there or choose another --output-dir; "
                                      "nothing was trained"):
        rundir.atomic_write(job_path, json.dumps(job, indent=1))
    return Prepared(plan, out, job_path, lock)


def _resume_source(cfg: Config, res: Resolved) -> str | None:
    """The checkpoint this run resumes (--resume PATH, or the newest one --resume auto finds), verified; None for a
    run from the start. Makes a --resume PATH absolute in `cfg`."""
    from shardwise.train import checkpoint as ckpt

    resume_from = None
    if cfg.resume not in ("auto", "none"):
        cfg.resume = os.path.abspath(cfg.resume)
        if not os.path.lexists(cfg.resume):
            raise ShardwiseError(f"{res.where('resume')}: {cfg.resume} does not exist; give a checkpoints/step_N "
                                 "directory of a run, or use --resume auto")
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
    return resume_from


def _check_run(res: Resolved, cfg: Config, world: int, force: bool, resume_from: str | None,
               degrees_checked: bool) -> tuple[str, list[str]]:
    """The checks before the data is read: the ranks, the strategy's class, the trackers, the model directory,
    the checkpoint against this run, the parallel degrees against the model, the fit; the ranks and the degrees
    not where first_checks judged them (`degrees_checked`). Returns (the model directory, the resume's notes)."""

    if not degrees_checked:  # else first_checks() judged the ranks and the degrees
        check_ranks(cfg, res, world)
    from shardwise import strategies

    strategies.get(cfg.strategy)  # unknown / not installed -> one clear line now, not in N workers
    from shardwise.train.metrics import check_trackers

    check_trackers(cfg.report_to, res.where("report_to"))  # a missing tracker package: one line now

    model_dir = check_model(cfg, res)
    resume_notes = check_resume(resume_from, cfg, model_dir) if resume_from else []  # judged as given, then:
    resume_notes = (keep_global_batch(resume_from, cfg, world) if resume_from else []) + resume_notes
    if resume_from:
        resume_notes += _data_change_notes(resume_from, cfg)
    if not degrees_checked:
        check_tensor_parallel(cfg, res, world, model_dir)
        check_sequence_parallel(cfg, res, world, model_dir)
    check_fit(cfg, res, world, force)
    return model_dir, resume_notes


def _encode(res: Resolved, cfg: Config, world: int, model_dir: str, records: list, val: list,
            resume_from: str | None) -> tuple:
    """The records tokenized (_tokenized), and the checks on what came out: a validation set with loss tokens, at
    least one global batch, a resume with steps left."""
    encoded, tensors, hit, val, val_tensors = _tokenized(cfg, res, model_dir, records, val)
    if val is not None and not val.stats["loss_tokens"]:
        raise ShardwiseError(f"{res.where('val_data' if cfg.val_data else 'val_split')}: the validation set has no "
                             "loss token (every example empty or truncated away); give more or longer examples")
    global_batch = cfg.micro_batch_size * cfg.grad_accum * (world // (cfg.sequence_parallel * cfg.tensor_parallel))
    units, what = (len(encoded) // 2, "preference pairs") if cfg.task == "dpo" else (len(encoded), "sequences")
    if units < global_batch:
        raise ShardwiseError(f"the dataset has {units} {what}, fewer than one global batch of "
                             f"{global_batch}; lower --micro-batch-size or --grad-accum, or add data")
    if resume_from:  # the run's last step as the workers count it (another global batch: train/schedule.py)
        from shardwise.train import checkpoint as ckpt
        from shardwise.train.schedule import resumed

        check_steps_left(cfg, res, resume_from, resumed(cfg, ckpt.read_meta(resume_from), units, global_batch)[1])
    return encoded, tensors, hit, val, val_tensors


def _claim_run_dir(res: Resolved, cfg: Config, lock: rundir.RunLock) -> None:
    """Node 0: the output directory made, its lock held, judged again under the lock (another run may have finished
    meanwhile) and cleared where this run replaces one, and marked as shardwise's."""
    out = cfg.output_dir
    os.makedirs(out, exist_ok=True)
    if lock.fd is None:
        lock.acquire(res.where("output_dir"))
    if check_output_dir(cfg, res, lock):  # judged again under the lock: another run may have finished
        rundir.clear(out)
    if rundir.run_id(out) is None and not rundir.own_entries_present(out):
        rundir.mark(out)


def _write_data(plan: RunPlan, encoded, tensors: dict, val, val_tensors: dict | None) -> None:
    """The tokenized sets and their sources where the plan puts them (.prep/nodeN)."""
    from safetensors.torch import save_file

    prep = os.path.dirname(plan.data_file)
    with rundir.atomic_path(plan.data_file) as tmp:
        save_file(tensors, tmp)
    rundir.atomic_write(os.path.join(prep, "sources.json"), json.dumps(encoded.sources))
    if val is not None:
        with rundir.atomic_path(plan.val_file) as tmp:
            save_file(val_tensors, tmp)
        rundir.atomic_write(os.path.join(prep, "val_sources.json"), json.dumps(val.sources))


def _say_data(cfg: Config, encoded, stats, hit: bool, val, resume_notes: list[str]) -> None:
    """The data line (records, sequences, tokens, what was truncated, dropped or skipped), the resume's notes and the
    validation line."""
    st = encoded.stats
    src = "the built-in demo set" if stats is None else ", ".join(stats.files[:3]) + (" ..." if len(stats.files) > 3 else "")
    pairs = f" ({st['pairs']} preference pairs: chosen and rejected)" if "pairs" in st else ""
    msg = (f"data: {st['records']} records from {src}; {st['sequences']} sequences{pairs}, {st['tokens']:,} tokens, "
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


def _write_config(cfg: Config, out: str, resume_from: str | None, resume_notes: list[str]) -> dict:
    """Node 0: config.yaml for a new run; for a resume of a run that has one, the record of this resume instead
    (returned, for the job)."""
    if resume_from and os.path.isfile(os.path.join(out, "config.yaml")):
        # the run's config.yaml stays as it was written; each resume is recorded beside it (resumes.jsonl), by
        # rank 0 once the checkpoint has loaded (train/loop.py): a checkpoint that fails to load records nothing
        return {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "notes": resume_notes,
                "config": absolute_paths(dataclasses.asdict(cfg))}
    rundir.atomic_write(os.path.join(out, "config.yaml"), to_yaml(cfg, out))
    return {}


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
        done = []
        for (recs, packing), source, d, g, what in zip(sets, sources, digests, got, ("tokenizing", "tokenizing the validation set")):
            if g is not None:
                done.append((g[0], g[1], True))
                continue
            progress = Progress(what, len(recs), "records")
            try:
                done.append(cache.encode_cached(recs, tokenizer, model_dir, cfg.seq_len, packing, opts, use_cache,
                                                say, source, d, progress))
            finally:
                progress.close()
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
