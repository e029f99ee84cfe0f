"""The launcher's checks before anything is written: the runtime values this machine fills in, the output
directory, the model directory, the parallel degrees against the model's heads, the planner's fit and its
--strategy auto choice, a resume's steps left. The UI, bench and doctor call these too."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import re
import time

from shardwise import presets, rundir
from shardwise.config import Config, Resolved, split_source
from shardwise.errors import ShardwiseError
from shardwise.launch.common import say
from shardwise.preflight import lines, refuse
from shardwise.preflight.degrees import (
    judged_with_flags,
    one_replica,
    per_tensor_rank,
    tensor_heads,
    ulysses_heads,
    world_divides,
)


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """One run as the checks before writing leave it: the config with the machine's values filled in and
    --strategy auto's choice applied, the mesh degrees (world = dp_replicate x dp_shard x sp x tp, the data-parallel
    ranks laid out by the strategy's own dp_split, as the workers' ParallelDims lays them), the model directory and
    where the prepared data goes. The launcher writes the run directory and the job from this one value."""

    cfg: Config  # a copy of its own: nothing changes it after the checks
    world: int
    dp_replicate: int
    dp_shard: int
    sp: int
    tp: int
    model_dir: str
    data_file: str  # .prep/nodeN/data.safetensors
    val_file: str = ""  # .prep/nodeN/val.safetensors, "" without a validation set

    @property
    def strategy(self) -> str:
        return self.cfg.strategy

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def in_process(self) -> bool:
        """One `single` process trains in the launcher; every other run through torchrun's agent."""
        return presets.trains_in_process(self.strategy, self.world)


def plan_of(res: Resolved) -> RunPlan:
    """The plan a named strategy runs on this machine, judged before its model and data are read (bench plans each
    strategy so before it launches it): the machine's values filled in, the degrees as the launcher lays them. The
    model directory and data paths are empty until the launcher prepares the run."""
    cfg = resolve_runtime(res)
    return run_plan(cfg, cfg.nproc_per_node * cfg.nnodes, "", "")


def run_plan(cfg: Config, world: int, model_dir: str, data_file: str, val_file: str = "") -> RunPlan:
    """The run's plan once its checks passed; the data-parallel layout is the registration's (torch-free)."""
    tp, sp = cfg.tensor_parallel, cfg.sequence_parallel
    dp = presets.data_parallel_degree(world, tp, sp)
    replicate, shard = presets.spec_of(cfg.strategy).dp_split(cfg, dp, cfg.nproc_per_node)
    return RunPlan(copy.deepcopy(cfg), world, replicate, shard, sp, tp, model_dir, data_file, val_file)


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
    if cfg.memory_snapshot and not cuda:
        raise ShardwiseError(f"{res.where('memory_snapshot')}: the memory snapshot records the CUDA allocator, and "
                             "this machine has no CUDA GPU; on the CPU, `shardwise plan --rehearse` measures a rank's "
                             "tensor memory instead")
    if cfg.memory_snapshot:
        from shardwise.config import checkpointing_mode
        from shardwise.plan.inputs import compile_on
        from shardwise.train.memsnap import refusal as snapshot_refusal

        why = snapshot_refusal(compile_on(cfg.compile, "cuda"), checkpointing_mode(cfg))
        if why:
            raise ShardwiseError(f"{res.where('memory_snapshot')}: {why}")
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
    if (cfg.deepspeed.config and cfg.strategy in presets.PRESETS
            and presets.section_applies("deepspeed", presets.base_strategy(cfg.strategy))):
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
    return [("data", re.sub(r"#\d+$", "", split_source(item.strip())[0])) for item in cfg.data.split(",")]


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
    check_reference(cfg, res, model_dir)
    limit = load.max_positions(model_dir)
    if limit and cfg.seq_len > limit:
        raise ShardwiseError(f"{res.where('seq_len')}: seq_len {cfg.seq_len} is larger than the model supports "
                             f"(max_position_embeddings {limit}); lower --seq-len, or extend the model's context "
                             "in its config.json: a rope_scaling entry (e.g. yarn with factor seq_len / "
                             f"{limit}) and max_position_embeddings raised to the new length (docs/long-context.md)")
    return model_dir


def check_reference(cfg: Config, res: Resolved, model_dir: str) -> None:
    """task dpo's --ref-model: a model directory whose config.json and weights are whole, with the policy's vocabulary
    (the reference scores the policy's tokens)."""
    if cfg.task != "dpo" or not cfg.ref_model or cfg.loss_type in ("simpo", "orpo") or cfg.tuner != "full":
        return
    from shardwise.models import load

    where = res.where("ref_model")
    try:
        ref_dir = load.resolve_model_dir(cfg.ref_model, cfg.seed)
    except ShardwiseError as e:  # its line names --model: here the option is the reference's
        raise ShardwiseError(str(e).replace(f"--model {cfg.ref_model}", f"{where} {cfg.ref_model}", 1)) from None
    _check_config_json(ref_dir, where)
    load.check_weights(ref_dir, f"{where} {ref_dir}")
    vocab = [_vocab_size(d) for d in (model_dir, ref_dir)]
    if vocab[0] != vocab[1]:
        raise ShardwiseError(f"{where}: the reference model's vocab_size {vocab[1]} is not the policy's {vocab[0]} "
                             f"(config.json of {ref_dir} and {model_dir}): the reference must score the same tokens; "
                             "give a reference with the policy's tokenizer")


def _vocab_size(model_dir: str):
    with open(os.path.join(model_dir, "config.json"), "rb") as fh:
        obj = json.load(fh)
    return obj.get("vocab_size", (obj.get("text_config") or {}).get("vocab_size"))


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


def check_ranks(cfg: Config, res: Resolved, world: int) -> None:
    """The rules on the ranks (preflight/degrees.py: a one-replica strategy's tp x sp processes, the world split
    into whole tensor x sequence groups), where the flags could not judge them: --nproc-per-node filled in from
    the machine, or --strategy auto's choice."""
    if judged_with_flags(res.cfg, cfg):
        return
    tp, sp = cfg.tensor_parallel, cfg.sequence_parallel
    refuse(res, lines(iter([one_replica(cfg.strategy, tp, sp, cfg.nnodes, cfg.nproc_per_node),
                            world_divides(world, tp, sp)])))


def check_sequence_parallel(cfg: Config, res: Resolved, world: int, model_dir: str) -> None:
    """Refuse a sequence-parallel degree the model's heads cannot take, with the model's numbers; say which mode
    runs. With tensor parallelism (checked first) each tp rank holds heads / tp of them, and those are what
    Ulysses splits. The ranks are check_ranks'."""
    n, tp = cfg.sequence_parallel, cfg.tensor_parallel
    if n == 1:
        return
    _, all_heads, all_kv = _attention_heads(model_dir, res.where("sequence_parallel"), "Ulysses", "sequence_parallel")
    refuse(res, ulysses_heads(all_heads, tp, n, world, cfg.sp_mode))
    heads, kv = all_heads // tp, max(all_kv // tp, 1)
    per_tp = per_tensor_rank(all_heads, tp)
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
        f"data-parallel degree {presets.data_parallel_degree(world, tp, n)}; each rank holds {cfg.seq_len // n} of "
        f"{cfg.seq_len} tokens" + (f" (split again over the {tp} tensor ranks between blocks)" if tp > 1 else ""))


def check_tensor_parallel(cfg: Config, res: Resolved, world: int, model_dir: str) -> None:
    """Refuse a tensor-parallel degree the model cannot take (its heads, its family, its MLP width), with the
    model's numbers; say how the weights are split (strategies/parallelize.py). The ranks are check_ranks'."""
    n = cfg.tensor_parallel
    if n == 1:
        return
    where = res.where("tensor_parallel")
    hf, heads, kv = _attention_heads(model_dir, where, "tensor parallelism", "tensor_parallel")
    refuse(res, tensor_heads(heads, kv, n, world))
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
        f"data-parallel degree {presets.data_parallel_degree(world, n, cfg.sequence_parallel)}")


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


def choose_mlp_tiles(cfg: Config) -> Config:
    """--mlp-tiles auto on GPUs: the planner's count for this run (plan/decide.py auto_tiles: none where it fits
    without, else the size rule's), said and written into the run's config. On a machine without CUDA (or without
    the planner) the engine's size rule decides (models/tiles.py)."""
    if str(cfg.mlp_tiles).strip().lower() != "auto":
        return cfg
    import torch

    if not torch.cuda.is_available():
        return cfg
    try:
        from shardwise.plan import plan_run
    except ImportError:
        return cfg
    plan = plan_run(cfg, None, cfg.nproc_per_node * cfg.nnodes)
    n = plan.job.mlp_tiles
    row = plan.for_strategy(cfg.strategy)
    why = ("the run fits without tiles" if n == 1 else
           f"the run does not fit without; with them {row.memory.total / 2**30:.1f} of "
           f"{plan.setup.device_mem_gib:.1f} GiB per GPU" if row.fits else "the run does not fit even with them")
    say(f"--mlp-tiles auto chose {n} ({why})")
    return dataclasses.replace(cfg, mlp_tiles=str(n))


RESHAPE_FIELDS = ("seq_len", "micro_batch_size", "grad_accum")


def keep_global_batch(path: str, cfg: Config, world: int) -> list[str]:
    """A resume on another number of data-parallel ranks keeps the checkpoint's global batch (sequences per
    optimizer step), and so its learning-rate schedule and steps per epoch: where the micro-batch and accumulation
    are the saved ones, the accumulation is raised or lowered to keep it (a note says so); where none keeps it, one
    line gives the flags that do. A micro-batch or accumulation changed on purpose changes the global batch; the run
    keeps its schedule in sequences (train/schedule.py), and a note says so."""
    from shardwise.train import checkpoint as ckpt

    meta = ckpt.read_meta(path)
    old = meta.get("config") or {}
    keys = ("micro_batch_size", "grad_accum", "tensor_parallel", "sequence_parallel")
    if not isinstance(meta.get("world_size"), int) or not all(isinstance(old.get(k, 1), int) for k in keys):
        return []
    old_dp = presets.data_parallel_degree(meta["world_size"], old.get("tensor_parallel", 1),
                                          old.get("sequence_parallel", 1))
    dp = presets.data_parallel_degree(world, cfg.tensor_parallel, cfg.sequence_parallel)
    mbs, ga = old.get("micro_batch_size"), old.get("grad_accum")
    if not (mbs and ga) or old_dp < 1 or dp < 1:
        return []
    saved, now = mbs * ga * old_dp, cfg.micro_batch_size * cfg.grad_accum * dp
    if saved == now:
        return []
    if (cfg.micro_batch_size, cfg.grad_accum) != (mbs, ga):  # changed on purpose
        return [f"the global batch changes from {saved} to {now} sequences a step (micro-batch {mbs} x grad-accum "
                f"{ga} x {old_dp} data-parallel rank(s) -> {cfg.micro_batch_size} x {cfg.grad_accum} x {dp}): the "
                "run keeps its length and learning-rate schedule as saved, counted in sequences (the workers say "
                "the steps left and the learning rate it goes on from)"]
    per_step = cfg.micro_batch_size * dp
    if saved % per_step == 0:
        was, cfg.grad_accum = cfg.grad_accum, saved // per_step
        return [f"resuming on {dp} data-parallel rank(s) (the checkpoint ran {old_dp}): --grad-accum {was} -> "
                f"{cfg.grad_accum} keeps its global batch of {saved} sequences, so its schedule and epoch hold"]
    # the largest micro-batch not above this run's (its memory is known to fit), else the smallest that keeps it
    fits = [m for m in range(1, saved + 1) if saved % (m * dp) == 0]
    fits = [max([m for m in fits if m <= cfg.micro_batch_size] or fits[:1])] if fits else []
    how = (f"--micro-batch-size {fits[0]} --grad-accum {saved // (fits[0] * dp)} keeps it" if fits
           else f"no micro-batch keeps it on {dp} data-parallel ranks: resume on a number of ranks that divides it")
    raise ShardwiseError(f"--resume {path}: the checkpoint's global batch is {saved} sequences (micro-batch {mbs} x "
                         f"grad-accum {ga} x {old_dp} data-parallel rank(s)), and on {dp} rank(s) no --grad-accum "
                         f"keeps it at micro-batch {cfg.micro_batch_size}; {how} (or pass other values to change "
                         "the batch on purpose)")


def check_resume(path: str, cfg, model_dir: str) -> list[str]:
    """A checkpoint judged against the run that resumes it. Refuse resuming `path` into a different model or
    adapter (naming the differing fields); return one note per allowed change of the run's shape."""
    from shardwise.train import checkpoint as ckpt

    meta = ckpt.read_meta(path)
    saved = meta.get("model_arch")
    if saved is None and os.path.isfile(os.path.join(path, "hf", "config.json")):
        saved = ckpt.model_arch(os.path.join(path, "hf"))  # written before model_arch was recorded
    diff = []
    if saved is not None:
        now = ckpt.model_arch(model_dir)
        diff = [f"{k} {saved.get(k)} -> {now.get(k)}" for k in ckpt.ARCH_FIELDS if saved.get(k) != now.get(k)]
    old = meta.get("config") or {}
    old_lora = old.get("lora") or {}
    for key, before, after in (("tuner", old.get("tuner"), cfg.tuner), ("lora.r", old_lora.get("r"), cfg.lora.r),
                               ("lora.targets", old_lora.get("targets"), cfg.lora.targets)):
        if before is not None and before != after and (key == "tuner" or cfg.tuner != "full"):
            diff.append(f"{key} {before} -> {after}")
    if diff:
        raise ShardwiseError(f"--resume {path}: the checkpoint was trained with a different model: {', '.join(diff)}; "
                             f"resume with the model and tuner it was saved with (--model {old.get('model', '?')}), "
                             "or start a new run in another --output-dir")
    tp_before = old.get("tensor_parallel", 1) if old else cfg.tensor_parallel
    if tp_before != cfg.tensor_parallel and not ckpt.optimizer_is_flat(path):
        raise ShardwiseError(f"--resume {path}: the checkpoint was saved with tensor_parallel {tp_before}, this run has "
                             f"{cfg.tensor_parallel}, and it was written before checkpoints keyed the optimizer's "
                             f"state by parameter name (its parameter groups differ per degree); resume with "
                             f"--tensor-parallel {tp_before}")
    changed = [f"{k} {old[k]} -> {getattr(cfg, k)}" for k in RESHAPE_FIELDS if k in old and old[k] != getattr(cfg, k)]
    if changed:
        return [(f"resuming {path} with a changed run shape ({', '.join(changed)}); the data order and the "
                 "loss trajectory differ from an uninterrupted run")]
    return []
