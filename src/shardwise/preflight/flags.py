"""The rules judged on the settings alone, before anything is read or started: every one a line naming its key.

config.load_config judges CHECKS, in order, on every config it builds (a run, `plan`, the UI's forms, bench); a
check gives the first of its rules that fails. Each reads the Resolved config duck-typed (cfg, where, origins,
explicit, restates_default): this package sits under config.py, which imports it.
"""

from __future__ import annotations

import json
import math
from typing import Any

from shardwise import presets
from shardwise.errors import ShardwiseError
from shardwise.preflight import Refusal, first, lines
from shardwise.preflight.degrees import one_replica, world_divides

MAX_NPROC_PER_NODE = 1024  # processes (GPUs) per node; `plan --gpus` shares the bound (plan/inputs.py)
MAX_NNODES = 65536
MAX_SEED = 2**32 - 1  # every RNG seeds from it (numpy's bound); the sampler adds the epoch to it
MAX_COLLECTIVE_TIMEOUT = 1e9  # seconds; beyond what a timedelta and the process group's milliseconds hold
SHOW_CHARS = 200  # longest value an error message prints
REPORT_TO = ("tensorboard", "wandb", "mlflow")
# how a refusal names a strategy family whose config section an option belongs to
SECTION_TITLES = {"fsdp": "FSDP", "deepspeed": "DeepSpeed"}


def show(value: Any) -> str:
    """repr(value) for an error message, cut to SHOW_CHARS."""
    text = repr(value)
    return text if len(text) <= SHOW_CHARS else f"{text[:SHOW_CHARS]}... ({len(text):,} characters)"


def parse_report_to(value: str) -> list[str]:
    """'tensorboard,wandb' -> ['tensorboard', 'wandb']; 'none' or '' -> []. ValueError names an unknown one."""
    names = [n.strip().lower() for n in value.split(",") if n.strip()]
    if names == ["none"]:
        return []
    bad = [n for n in names if n not in REPORT_TO]
    if bad:
        raise ValueError(f"unknown tracker {', '.join(bad)}; choose from {', '.join(REPORT_TO)} (comma-separated) "
                         "or none")
    return list(dict.fromkeys(names))


def _base(c) -> str:
    return presets.base_strategy(c.strategy) if c.strategy in presets.PRESETS else c.strategy


def _clash(c) -> dict[str, str]:
    """{config key: refusal} for the settings the strategy does not compose with (its registration says)."""
    return dict(presets.check_composition(c.strategy, {"float8": c.float8, "qlora": c.tuner == "qlora",
                                                       "tensor_parallel": c.tensor_parallel}))


def names(res) -> Refusal | None:
    c = res.cfg
    return first([
        (c.strategy in presets.known_names(), "strategy",
         f"unknown strategy '{c.strategy}'; known: {', '.join(presets.known_names())}"),
        (bool(c.model.strip()), "model", "model is empty; give a local Hugging Face model directory or 'tiny'"),
    ])


def training_numbers(res) -> Refusal | None:
    c = res.cfg
    return first(iter([
        (0 <= c.seed <= MAX_SEED, "seed", f"seed must be in [0, {MAX_SEED}], got {show(c.seed)}"),
        (c.seq_len >= 8, "seq_len", f"seq_len must be at least 8, got {c.seq_len}"),
        (c.micro_batch_size >= 1, "micro_batch_size", f"micro_batch_size must be >= 1, got {c.micro_batch_size}"),
        (c.grad_accum >= 1, "grad_accum", f"grad_accum must be >= 1, got {c.grad_accum}"),
        (c.max_steps == -1 or c.max_steps >= 1, "max_steps",
         f"max_steps must be -1 (use epochs) or >= 1, got {c.max_steps}"),
        (c.epochs >= 1, "epochs", f"epochs must be >= 1, got {c.epochs}"),
        (c.lr > 0, "lr", f"lr must be > 0, got {c.lr}"),
        (c.warmup_steps >= 0, "warmup_steps", f"warmup_steps must be >= 0, got {c.warmup_steps}"),
        (0 <= c.min_lr_ratio <= 1, "min_lr_ratio", f"min_lr_ratio must be in [0, 1], got {c.min_lr_ratio}"),
        (0 <= c.warmup_ratio < 1, "warmup_ratio", f"warmup_ratio must be in [0, 1), got {c.warmup_ratio}"),
        (not (c.warmup_ratio and c.warmup_steps), "warmup_ratio",
         f"give warmup_ratio or warmup_steps, not both (warmup_steps {c.warmup_steps} is also set)"),
        (c.max_samples >= 0, "max_samples", f"max_samples must be >= 0 (0 reads every record), got {c.max_samples}"),
        (c.max_grad_norm >= 0, "max_grad_norm",
         f"max_grad_norm must be >= 0 (0 disables clipping), got {c.max_grad_norm}"),
    ]))


def run_control(res) -> Refusal | None:
    c = res.cfg
    return first([
        (c.log_every >= 1, "log_every", f"log_every must be >= 1, got {c.log_every}"),
        (c.save_every >= 0, "save_every", f"save_every must be >= 0, got {c.save_every}"),
        (c.save_every_minutes >= 0, "save_every_minutes",
         f"save_every_minutes must be >= 0, got {c.save_every_minutes}"),
        (c.collective_timeout > 0, "collective_timeout",
         f"collective_timeout must be > 0 seconds, got {c.collective_timeout}"),
        (c.collective_timeout <= MAX_COLLECTIVE_TIMEOUT, "collective_timeout",
         f"collective_timeout must be at most {MAX_COLLECTIVE_TIMEOUT:.0e} seconds (about 31 years), got "
         f"{c.collective_timeout:g}"),
        (c.profile_steps >= 0, "profile_steps",
         f"profile_steps must be >= 0 (0 disables profiling), got {c.profile_steps}"),
        (c.profile_start >= 0, "profile_start",
         f"profile_start must be >= 0 (0 = the last profile_steps steps), got {c.profile_start}"),
        (c.max_steps == -1 or c.profile_start + c.profile_steps - 1 <= c.max_steps, "profile_start",
         f"profile_start {c.profile_start} + profile_steps {c.profile_steps} runs past max_steps {c.max_steps}; "
         "profile earlier steps, fewer of them, or set profile_start 0 (the last steps)"),
        (c.max_steps == -1 or c.profile_steps <= c.max_steps, "profile_steps",
         f"profile_steps {c.profile_steps} is more than max_steps {c.max_steps}"),
        (c.keep_checkpoints >= 1, "keep_checkpoints", f"keep_checkpoints must be >= 1, got {c.keep_checkpoints}"),
        (c.memory_snapshot >= 0, "memory_snapshot",
         f"memory_snapshot must be >= 0 (0 disables it), got {c.memory_snapshot}"),
        (c.max_steps == -1 or c.memory_snapshot <= c.max_steps, "memory_snapshot",
         f"memory_snapshot {c.memory_snapshot} is more than max_steps {c.max_steps}: the snapshot is written after "
         "that step"),
    ])


def processes(res) -> Refusal | None:
    c = res.cfg

    def rules():
        yield (0 <= c.nproc_per_node <= MAX_NPROC_PER_NODE, "nproc_per_node",
               f"nproc_per_node must be in 0..{MAX_NPROC_PER_NODE} (0 = auto; processes per node), got "
               f"{c.nproc_per_node}")
        yield 1 <= c.nnodes <= MAX_NNODES, "nnodes", f"nnodes must be in 1..{MAX_NNODES}, got {c.nnodes}"
        yield (0 <= c.node_rank < c.nnodes, "node_rank",
               f"node_rank must be in [0, nnodes={c.nnodes}), got {c.node_rank}")
        yield c.max_restarts >= 0, "max_restarts", f"max_restarts must be >= 0, got {c.max_restarts}"
        yield c.tensor_parallel >= 1, "tensor_parallel", f"tensor_parallel must be >= 1, got {c.tensor_parallel}"
        yield (c.nnodes == 1 or bool(c.rdzv_endpoint), "nnodes",
               "a multi-node run needs --rdzv-endpoint HOST:PORT (the address of node 0)")
        if c.rdzv_endpoint:
            host, _, port = c.rdzv_endpoint.rpartition(":")
            yield (bool(host) and port.isdigit(), "rdzv_endpoint",
                   f"rdzv_endpoint must be HOST:PORT, got '{c.rdzv_endpoint}'")
            low = 1 if c.nnodes > 1 else 0  # port 0 (any free port) only where no other node must find it
            yield (low <= int(port) <= 65535, "rdzv_endpoint",
                   f"rdzv_endpoint port must be in {low}..65535, got {port}: choose a free port there")

    return first(rules())


def outputs(res) -> Refusal | None:
    """Precision, resume and trackers."""
    c = res.cfg

    def rules():
        yield (c.mixed_precision != "fp16" or c.param_dtype != "bf16", "mixed_precision",
               "mixed_precision fp16 with param_dtype bf16 mixes two half types; use --mixed-precision bf16")
        yield (c.resume in ("auto", "none") or bool(c.resume), "resume",
               "resume must be auto, none or a checkpoint path")
        yield (not (c.overwrite and c.resume not in ("auto", "none")), "overwrite",
               f"--overwrite replaces the run in --output-dir and --resume {c.resume} continues from a checkpoint; "
               "give one of them (--resume auto --overwrite resumes the run's newest checkpoint, or replaces a run "
               "that has none)")
        try:
            parse_report_to(c.report_to)
        except ValueError as e:
            yield False, "report_to", f"report_to: {e}"

    return first(rules())


def validation_set(res) -> Refusal | None:
    c = res.cfg
    has_val = bool(c.val_data) or c.val_split > 0
    return first([
        (not (c.val_data and c.val_split), "val_split", "give either val_data or val_split, not both"),
        (0 <= c.val_split < 1, "val_split", f"val_split must be in [0, 1), got {c.val_split}"),
        (c.eval_every >= 0, "eval_every", f"eval_every must be >= 0 (0 = at the end only), got {c.eval_every}"),
        (has_val or c.eval_every == 0, "eval_every",
         "eval_every needs a validation set: --val-data PATH or --val-split 0.05"),
        (has_val or not c.keep_best, "keep_best",
         "keep_best needs a validation set: --val-data PATH or --val-split 0.05"),
        (not c.keep_best or (c.save_every > 0 and c.eval_every > 0 and c.save_every % c.eval_every == 0), "keep_best",
         f"keep_best compares checkpoints by their validation loss: set --save-every to a multiple of --eval-every "
         f"(now save_every {c.save_every}, eval_every {c.eval_every})"),
    ])


def adapters_and_wrapping(res) -> Refusal | None:
    """LoRA's options, FSDP's wrap unit, the chat loss options, padding-free rows, checkpointing."""
    c = res.cfg

    def rules():
        yield c.lora.r >= 1, "lora.r", f"lora.r must be >= 1, got {c.lora.r}"
        yield (c.lora.alpha > 0 and math.isfinite(c.lora.alpha), "lora.alpha",
               f"lora.alpha must be a positive number (the adapters are scaled by alpha / r), got {c.lora.alpha}")
        yield 0 <= c.lora.dropout < 1, "lora.dropout", f"lora.dropout must be in [0, 1), got {c.lora.dropout}"
        yield (c.tuner == "full" or any(t.strip() for t in c.lora.targets.split(",")), "lora.targets",
               "lora.targets is empty; give module names (e.g. q_proj,v_proj) or all-linear")
        wrap = c.fsdp.wrap
        yield (wrap == "block" or (wrap.startswith("size:") and wrap[5:].isdigit() and int(wrap[5:]) > 0),
               "fsdp.wrap", f"fsdp.wrap must be 'block' or 'size:N' with N > 0, got '{wrap}'")
        yield c.fsdp.shard_group_size >= 0, "fsdp.shard_group_size", "fsdp.shard_group_size must be >= 0"
        yield (not (c.train_on_prompt and c.last_turn_only), "last_turn_only",
               "train_on_prompt (loss on every turn) and last_turn_only (loss on the last assistant turn) contradict "
               "each other; set one of them")
        if c.padding_free == "on":
            yield (not c.packing, "padding_free",
                   "padding_free on lays a micro-batch's rows one after another in one sequence, and packing already "
                   "fills each row with several examples; use --padding-free auto (off with packing) or drop "
                   "--packing")
            yield (c.sequence_parallel == 1 and c.tensor_parallel == 1, "padding_free",
                   f"padding_free on is not built with sequence_parallel {c.sequence_parallel} / tensor_parallel "
                   f"{c.tensor_parallel} (their attention and sequence split take padded rows); use --padding-free "
                   "auto (off there) or set both to 1")
        yield (not (c.gradient_checkpointing and c.activation_checkpointing == "selective"), "activation_checkpointing",
               "activation_checkpointing selective contradicts gradient_checkpointing true (full checkpointing); "
               "set one of them")
        yield from _mlp_tiles(c)

    return first(rules())


def parse_mlp_tiles(value) -> int | str:
    """config `mlp_tiles`: 'auto' or a positive integer; ValueError otherwise."""
    text = str(value).strip().lower()
    if text == "auto":
        return "auto"
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"mlp_tiles must be a positive integer or auto, got {value!r}")
    return int(text)


def _mlp_tiles(c):
    """mlp_tiles: a positive count or auto; not with tensor parallelism (its MLP input and output are split)."""
    try:
        parse_mlp_tiles(c.mlp_tiles)
    except ValueError:
        yield False, "mlp_tiles", f"mlp_tiles must be a positive integer (1 = off) or auto, got '{c.mlp_tiles}'"
        return
    yield (str(c.mlp_tiles).strip() == "1" or c.tensor_parallel == 1, "mlp_tiles",
           f"mlp_tiles {c.mlp_tiles} with tensor_parallel {c.tensor_parallel} is not built (tensor parallelism splits "
           "the MLP's width and gathers its sequence already); use mlp_tiles 1 or tensor_parallel 1")


def float8(res) -> Refusal | None:
    c = res.cfg
    if not c.float8:
        return None
    clash = _clash(c)
    return first(iter([
        ("float8" not in clash, "float8", clash.get("float8", "")),
        (c.tuner == "full", "float8", f"float8 with tuner {c.tuner} is not built (peft wraps the linears that "
         "float8 converts); use --tuner full or drop --float8"),
        (c.tensor_parallel == 1, "float8", "float8 with tensor_parallel > 1 is not built (the float8 linears "
         "need their own tensor-parallel styles); use --tensor-parallel 1 or drop --float8"),
        (c.mixed_precision != "fp16", "float8", "float8 runs beside bf16 compute, not fp16 (its scaling and "
         "fp16's loss scaling do not compose here); use --mixed-precision bf16"),
        (c.compile != "off", "float8", "float8 without torch.compile runs torchao's scaling and casts unfused: "
         "slower than bf16 without float8; drop --compile off (compiled blocks fuse them) or drop --float8"),
    ]))


def strategy_options(res) -> Refusal | None:
    """Options of a strategy family's config section, set explicitly while another family runs, are a mistake worth
    a line (a default restated is harmless); then each family's own options against each other."""
    c, base = res.cfg, _base(res.cfg)
    if c.strategy in presets.PRESETS:  # auto chooses its family later
        for key in res.origins:
            sec = key.split(".", 1)[0] if "." in key else None
            if sec and not presets.section_applies(sec, base) and res.explicit(key) and not res.restates_default(key):
                owner = next(s for s in presets.SPECS.values() if s.section == sec)
                first_preset, *others = [p.name for p in owner.presets]
                also = f" (or {' / '.join(others)})" if others else ""
                return Refusal(key, f"'{key}' applies to {SECTION_TITLES.get(sec, sec)} but the strategy is "
                                    f"'{c.strategy}'; use --strategy {first_preset}{also} or drop the option")
    fsdp, deepspeed = presets.section_applies("fsdp", base), presets.section_applies("deepspeed", base)

    def rules():
        if fsdp and c.fsdp.hybrid:
            yield (c.nnodes > 1 or c.fsdp.shard_group_size > 0, "fsdp.hybrid",
                   "hybrid sharding needs more than one node (or fsdp.shard_group_size to split one node into groups)")
        if deepspeed:
            yield (not c.deepspeed.offload_params or c.deepspeed.stage == 3, "deepspeed.offload_params",
                   "deepspeed.offload_params needs ZeRO stage 3; use --strategy zero3-offload")
            yield (c.deepspeed.fetch == "block" or c.deepspeed.stage == 3, "deepspeed.fetch",
                   "deepspeed.fetch chooses ZeRO-3's fetch unit; use --strategy zero3 or drop the option")
            if c.deepspeed.config:  # its keys against the run's settings: launch.preflight.resolve_runtime
                check_json_object(c.deepspeed.config, res.where("deepspeed.config"))
        if fsdp and c.fsdp.hybrid and c.fsdp.shard_group_size and c.nproc_per_node:
            world, size = c.nproc_per_node * c.nnodes, c.fsdp.shard_group_size
            yield (world % size == 0, "fsdp.shard_group_size",
                   f"fsdp.shard_group_size {size} must divide the {world} ranks (nnodes x nproc_per_node)")

    return first(rules())


def tuner(res) -> Refusal | None:
    c, clash = res.cfg, _clash(res.cfg)
    # LoRA settings given for a full fine-tune would be dropped while every weight trains (ms-swift's default tuner
    # is lora, so `--lora_rank 8` alone means LoRA there)
    lora = [k for k in sorted(res.origins) if k.startswith("lora.") and res.explicit(k)]
    return first([
        (c.tuner != "full" or not lora, lora[0] if lora else "tuner",
         f"{', '.join(lora)} {'is' if len(lora) == 1 else 'are'} set but tuner is full, so every weight would train "
         "and the LoRA settings be dropped: pass --tuner lora (ms-swift's --tuner_type, LLaMA-Factory's "
         "finetuning_type) or drop the LoRA settings"),
        ("tuner" not in clash, "tuner", clash.get("tuner", "")),
        (not c.merge_lora or c.tuner == "lora", "merge_lora",
         "merge_lora needs --tuner lora (a full fine-tune is already a full model; a 4-bit QLoRA base is not merged)"),
    ])


def degrees(res) -> Refusal | None:
    """The tensor and sequence degrees: what they compose with, then (the world size given) the ranks they take."""
    c, clash = res.cfg, _clash(res.cfg)
    tp, sp = c.tensor_parallel, c.sequence_parallel
    one = presets.replica_world(c.strategy, tp, sp) is not None

    def rules():
        if tp > 1:
            yield "tensor_parallel" not in clash, "tensor_parallel", clash.get("tensor_parallel", "")
            yield (c.tuner == "full", "tensor_parallel",
                   f"tensor_parallel with {c.tuner} is not built yet: PEFT wraps the attention and MLP linears that "
                   "tensor parallelism splits, and the adapters would have to be split to match (lora_B by output "
                   "features on q/k/v/gate/up, lora_A by input features on o/down); use --tuner full or "
                   "--tensor-parallel 1")
        yield sp >= 1, "sequence_parallel", f"sequence_parallel must be >= 1, got {sp} (1 = off)"
        yield (sp == 1 or not one or tp > 1, "sequence_parallel",
               "sequence parallelism splits sequences over several ranks; use --strategy ddp, fsdp or zero*, not "
               "single (single takes it only beside --tensor-parallel: one replica of N x M processes)")

    def checks():
        yield one_replica(c.strategy, tp, sp, c.nnodes, c.nproc_per_node)
        yield first(rules())
        if c.nproc_per_node:  # else the launcher judges it once it has filled the world in
            yield world_divides(c.nproc_per_node * c.nnodes, tp, sp)

    return lines(checks())


def train_data(res) -> Refusal | None:
    """A model directory trains on the user's data: without --data it is an error, not a quiet run on the synthetic
    demo set (meant for the tiny model; `--data demo` asks for it explicitly)."""
    c = res.cfg
    if c.model != "tiny" and c.data == "demo" and "data" not in res.origins:
        return Refusal("model", "a model directory needs --data (a JSONL file or a directory of them); the built-in "
                                "synthetic set is for the tiny demo model (pass --data demo to train on it anyway)")
    return None


PREFERENCE_KEYS = ("beta", "loss_type", "simpo_gamma", "ref_model", "precompute_ref")
REFERENCE_FREE = ("simpo", "orpo")


def preference(res) -> Refusal | None:
    """task dpo's options against each other and against what a pair of rows in one micro-batch composes with."""
    c = res.cfg
    given = [k for k in PREFERENCE_KEYS if res.explicit(k) and not res.restates_default(k)]

    def rules():
        yield (c.task == "dpo" or not given, given[0] if given else "task",
               f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} to preference training; pass "
               "--task dpo (LLaMA-Factory's stage: dpo) or drop it")
        yield (c.beta > 0 and math.isfinite(c.beta), "beta", f"beta must be a positive number, got {show(c.beta)}")
        yield (c.simpo_gamma >= 0 and math.isfinite(c.simpo_gamma), "simpo_gamma",
               f"simpo_gamma must be a number >= 0, got {show(c.simpo_gamma)}")
        if c.task != "dpo":
            return
        yield (c.loss_type == "simpo" or "simpo_gamma" not in given, "simpo_gamma",
               f"simpo_gamma is SimPO's margin but loss_type is {c.loss_type}; pass --loss-type simpo or drop it")
        free = c.loss_type in REFERENCE_FREE
        for key in ("ref_model", "precompute_ref"):
            yield (not free or key not in given, key,
                   f"loss_type {c.loss_type} uses no reference model, so {key} does nothing; use --loss-type "
                   "sigmoid or ipo, or drop it")
        yield (c.tuner == "full" or not c.ref_model, "ref_model",
               f"with tuner {c.tuner} the reference is the base model with the adapters off (no second copy); drop "
               "--ref-model, or use --tuner full to compare against another model")
        yield (c.data_format == "auto", "data_format",
               "task dpo detects the preference format per file (LLaMA-Factory, TRL, ms-swift); use --data-format "
               "auto")
        yield (not c.packing, "packing", "task dpo keeps each prompt's chosen and rejected answer as two rows of one "
               "micro-batch, which packing would merge; drop --packing")
        yield (c.padding_free != "on", "padding_free",
               "task dpo sums each row's log-probabilities over padded rows; use --padding-free auto or off")
        yield (c.tensor_parallel == 1 and c.sequence_parallel == 1, "tensor_parallel" if c.tensor_parallel > 1
               else "sequence_parallel", "task dpo with tensor or sequence parallelism is not built (each row's "
               "log-probability sum would span ranks); set --tensor-parallel 1 and --sequence-parallel 1")
        yield (not (c.val_data or c.val_split), "val_data" if c.val_data else "val_split",
               "task dpo has no validation loss yet; drop --val-data / --val-split")

    return first(rules())


def check_json_object(path: str, where: str) -> None:
    """A JSON file the run reads later (deepspeed.config), checked now: before the run directory is written."""
    try:
        with open(path, encoding="utf-8") as fh:
            obj = json.load(fh)
    except FileNotFoundError:
        raise ShardwiseError(f"{where}: {path}: no such file; give the path of a DeepSpeed JSON config") from None
    except (OSError, ValueError) as e:
        why = e.strerror if isinstance(e, OSError) else str(e).splitlines()[0][:200]
        raise ShardwiseError(f"{where}: {path}: cannot read it as JSON ({why}); fix the file") from None
    if not isinstance(obj, dict):
        raise ShardwiseError(f"{where}: {path}: not a JSON object ({{\"key\": value, ...}}); fix the file")


# cheap and common first; each check gives the first of its rules that fails
CHECKS = (names, training_numbers, run_control, processes, outputs, validation_set, adapters_and_wrapping, float8,
          strategy_options, tuner, preference, degrees)
