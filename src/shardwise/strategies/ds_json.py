"""A user's DeepSpeed JSON (`deepspeed.config`), read the way the Hugging Face Trainer reads one.

Users come with the files of ms-swift, LLaMA-Factory or the HF examples (ms-swift's zero3.json: batch sizes,
clipping, precision and three bucket sizes all "auto"). The Trainer's rule, which those files are written for:

- `"auto"` means "the trainer's own value": here the flag's (`--micro-batch-size`, `--grad-accum`,
  `--max-grad-norm`, `--mixed-precision`, the strategy's ZeRO stage and offload);
- a value given for one of those keys must agree with the flag: the data loader, the loop and the run's record
  follow the flag, so a disagreeing key would train another run than the one shown. It is refused, naming both;
- the three bucket sizes that depend on the model (`zero_optimization.reduce_bucket_size`,
  `stage3_prefetch_bucket_size`, `stage3_param_persistence_threshold`) are filled from its hidden size with the
  Trainer's formulas (hidden², 0.9·hidden², 10·hidden), so the same file runs the same engine under both;
- any other key overrides shardwise's generated config, as before.

An `optimizer` or `scheduler` section is the one thing read otherwise: shardwise trains every strategy with its own
AdamW and schedule, so ddp, fsdp and zero* stay comparable (`--lr`, `--weight-decay`, `--warmup-steps`). A section
that asks for nothing of its own (the HF examples': an Adam/AdamW or Warmup* type, every parameter "auto") is dropped
and the run's header says so; one with a value or another type is refused. So is `zero_force_ds_cpu_optimizer: true`
dropped (it would make DeepSpeed refuse our AdamW under offload). `"auto"` anywhere else is refused too
(there is nothing to fill it with).

Pure Python (no torch, no deepspeed): the launcher checks the file before anything is written, and the worker
resolves it again with the model's hidden size (strategies/deepspeed.py).
"""

from __future__ import annotations

import difflib
import json
import re

from shardwise.errors import ShardwiseError

AUTO = "auto"
HIDDEN_KEYS = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")
# sections DeepSpeed reads as JSON objects (a string or a number there was a TypeError deep inside DeepSpeed)
OBJECT_SECTIONS = ("zero_optimization", "bf16", "bfloat16", "fp16", "amp", "optimizer", "scheduler", "pipeline",
                   "checkpoint", "data_types", "compile", "activation_checkpointing", "flops_profiler", "comms_logger",
                   "tensorboard", "wandb", "csv_monitor", "comet", "aio", "data_efficiency", "compression_training",
                   "elasticity", "autotuning", "hybrid_engine", "torch_autocast", "weight_quantization", "nebula",
                   "curriculum_learning", "progressive_layer_drop", "eigenvalue", "sparse_attention", "timers")
# DeepSpeed's other top-level keys (deepspeed/runtime/constants.py and config.py, 0.19): DeepSpeed ignores a key it
# does not know, so a misspelt one (`zero_optimisation`) silently ran without its settings; a key close to one of
# these is refused with the likely spelling (an unknown key close to none is left to DeepSpeed, for newer keys)
SCALAR_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
               "gradient_clipping", "steps_per_print", "wall_clock_breakdown", "memory_breakdown",
               "communication_data_type", "seq_parallel_communication_data_type", "prescale_gradients",
               "gradient_predivide_factor", "gradient_allreduce_op", "disable_allgather", "dump_state",
               "disable_python_gc", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
               "dataloader_drop_last", "sparse_gradients", "use_data_before_expert_parallelism",
               "use_node_local_storage", "load_universal", "graph_harvesting", "tensor_parallel",
               "sequence_parallel_size", "mics_shard_size", "mics_hierarchical_params_gather", "vocabulary_size",
               "zero_quantized_weights", "zero_quantized_gradients", "seed")
REFUSED_SECTIONS = {
    "optimizer": "shardwise trains every strategy with its own AdamW; remove the section and set --lr, "
                 "--weight-decay (and the others of `shardwise train --help`), or leave its every parameter \"auto\"",
    "scheduler": "shardwise runs its own schedule (warm-up, then cosine decay) on every strategy; remove the section "
                 "and set --warmup-steps, --min-lr-ratio, or leave its every parameter \"auto\"",
}
# the types a section with every parameter "auto" may name and still be dropped for ours (DeepSpeed's names,
# compared without case): an AdamW, and a warm-up schedule (ours decays by a cosine, theirs linearly or not at all)
AUTO_SECTION_TYPES = {"optimizer": ("adam", "adamw"), "scheduler": ("warmuplr", "warmupdecaylr", "warmupcosinelr")}


# sections of LLaMA-Factory's DeepSpeed files that LLaMA-Factory reads itself (DeepSpeed ignores them): left in, the
# run would silently go without what they ask for; asked for (not "enabled": false), they are refused with
# shardwise's way to the same thing
FOREIGN_SECTIONS = {
    "sequence_parallel": "LLaMA-Factory's own sequence-parallel settings (ALST/Ulysses), which DeepSpeed does not "
                         "read; shardwise splits sequences itself: remove the section and pass --sequence-parallel N "
                         "(docs/long-context.md)",
    "fp8": "LLaMA-Factory's own FP8 switch, which DeepSpeed does not read; shardwise's float8 matmuls are --float8 "
           "(torchao, on Hopper GPUs): remove the section, or set its \"enabled\" false",
}
# true makes DeepSpeed refuse any optimizer but its DeepSpeedCPUAdam under offload (a ZeRORuntimeException in every
# rank: LLaMA-Factory's ds_z3_partial_offload_config.json sets it); shardwise's AdamW runs the offloaded step as
# torch's fused CPU kernel, and DeepSpeedCPUAdam needs a C++ build at run time: the key is dropped, with a word
FORCE_DS_CPU = "zero_force_ds_cpu_optimizer"


def _forces_ds_cpu(obj: dict) -> bool:
    """The file sets FORCE_DS_CPU to anything but false (DeepSpeed takes any truthy value, "false" too, as true)."""
    return FORCE_DS_CPU in obj and obj[FORCE_DS_CPU] is not False


def _off(v) -> bool:
    """An "enabled" value that switches a section off (JSON false, 0, null, or such a string)."""
    return v is None or v is False or (isinstance(v, (int, float)) and v == 0) or \
        (isinstance(v, str) and v.strip().lower() in ("false", "0", "off", "no", "null", "none"))


def dropped_notes(obj: dict, min_lr_ratio: float) -> list[str]:
    """What `resolve` drops from the user's file, in words for the run's header."""
    out = []
    dropped = auto_sections(obj)
    if dropped:
        out.append(f"its {' and '.join(dropped)} section{'s' if len(dropped) > 1 else ''}, every parameter \"auto\", "
                   "dropped: shardwise's AdamW and schedule run with --lr, --weight-decay, --warmup-steps, then a "
                   f"cosine decay to --min-lr-ratio {min_lr_ratio:g} (1 holds the rate, as WarmupLR does)")
    if _forces_ds_cpu(obj):
        out.append(f"{FORCE_DS_CPU} {json.dumps(obj[FORCE_DS_CPU])} dropped: shardwise's AdamW runs the offloaded "
                   "step (torch's fused CPU kernel), where DeepSpeed would refuse any optimizer but its "
                   "DeepSpeedCPUAdam")
    return out


def auto_sections(obj: dict) -> list[str]:
    """The optimizer/scheduler sections of a DeepSpeed JSON object that ask for nothing of their own: a type of
    AUTO_SECTION_TYPES and every parameter "auto" (the HF examples'). shardwise's AdamW and schedule take their
    place, with the run's --lr, --weight-decay and --warmup-steps, as the Trainer fills those "auto"s."""
    out = []
    for section, types in AUTO_SECTION_TYPES.items():
        sec = obj.get(section)
        if not isinstance(sec, dict) or set(sec) - {"type", "params"}:
            continue
        params = sec.get("params", {})
        if (str(sec.get("type", "")).lower() in types and isinstance(params, dict)
                and all(v == AUTO for v in params.values())):
            out.append(section)
    return out


def line_of(text: str, dotted: str) -> int | None:
    """The 1-based line where `dotted`'s last key is written in the JSON `text` (each key searched after its
    parent's), or None."""
    pos, found = 0, None
    for part in dotted.split("."):
        m = re.compile(r'"' + re.escape(part) + r'"\s*:').search(text, pos)
        if m is None:
            return found
        pos, found = m.end(), text.count("\n", 0, m.start()) + 1
    return found


class UserConfig:
    """The file's object and text (for line numbers)."""

    def __init__(self, path: str, obj: dict, text: str):
        self.path, self.obj, self.text = path, obj, text

    @classmethod
    def read(cls, path: str) -> UserConfig:
        try:
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
            obj = json.loads(text)
        except (OSError, ValueError) as e:
            raise ShardwiseError(f"deepspeed.config {path}: cannot read it as JSON ({e})") from None
        if not isinstance(obj, dict):
            raise ShardwiseError(f"deepspeed.config {path}: not a JSON object ({{\"key\": value, ...}}); fix the file")
        return cls(path, obj, text)

    def where(self, dotted: str) -> str:
        line = line_of(self.text, dotted)
        return f"{self.path}:{line}" if line else self.path

    def refuse(self, dotted: str, why: str) -> ShardwiseError:
        return ShardwiseError(f"{self.where(dotted)}: {dotted}: {why}")


def _get(d: dict, dotted: str):
    for part in dotted.split("."):
        if not isinstance(d, dict) or part not in d:
            return None
        d = d[part]
    return d


def _pop(d: dict, dotted: str) -> None:
    *parents, last = dotted.split(".")
    for part in parents:
        d = d.get(part)
        if not isinstance(d, dict):
            return
    d.pop(last, None)


def _same(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    return a == b


def _decided(cfg, world: int | None) -> list[tuple[str, object, str]]:
    """(key, shardwise's value, where it comes from) for each key a shardwise setting decides; a value None is not
    known yet (the launcher's check before the hardware is read: precision auto, processes per node 0)."""
    mp = None if cfg.mixed_precision == AUTO else cfg.mixed_precision
    out = [("train_micro_batch_size_per_gpu", cfg.micro_batch_size, f"--micro-batch-size {cfg.micro_batch_size}"),
           ("gradient_accumulation_steps", cfg.grad_accum, f"--grad-accum {cfg.grad_accum}"),
           ("gradient_clipping", cfg.max_grad_norm, f"--max-grad-norm {cfg.max_grad_norm}"),
           ("zero_optimization.stage", cfg.deepspeed.stage, f"--strategy {cfg.strategy} (ZeRO stage "
                                                            f"{cfg.deepspeed.stage})")]
    out.append(("train_batch_size", cfg.micro_batch_size * cfg.grad_accum * world if world else None,
                f"--micro-batch-size {cfg.micro_batch_size} x --grad-accum {cfg.grad_accum} x {world} "
                "data-parallel ranks"))
    for section, name in (("fp16", "fp16"), ("bf16", "bf16"), ("bfloat16", "bf16")):
        out.append((f"{section}.enabled", None if mp is None else mp == name, f"--mixed-precision {mp}"))
    return out


def _offload(cfg) -> list[tuple[str, bool, str]]:
    ds = cfg.deepspeed
    return [("offload_optimizer", ds.offload_optimizer,
             f"--strategy {cfg.strategy} (deepspeed.offload_optimizer {str(ds.offload_optimizer).lower()})"),
            ("offload_param", ds.offload_params,
             f"--strategy {cfg.strategy} (deepspeed.offload_params {str(ds.offload_params).lower()})")]


def _flag_fix(key: str, value) -> str:
    """How to make the run agree with the file's value of `key`."""
    if key == "zero_optimization.stage":
        if _is_int(value) and value in (1, 2, 3):
            return f"run --strategy zero{value}"
        return "remove the key (shardwise runs ZeRO stages 1, 2 and 3: --strategy zero1, zero2, zero3)"
    return "change the flag"


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _offload_fix(sub: str, cfg, wants: bool) -> str:
    """The flag that makes this run agree with the file's offload device for `sub` (offload_optimizer or
    offload_param): a flag, not a preset (zero3-offload offloads both, which could turn the refusal onto the other
    key); parameters offload only at stage 3."""
    if sub == "offload_optimizer":
        return f"pass --{'' if wants else 'no-'}deepspeed-offload-optimizer"
    if not wants:
        return "pass --no-deepspeed-offload-params"
    if cfg.deepspeed.stage != 3:
        return (f"remove the key (ZeRO-{cfg.deepspeed.stage} does not offload parameters; --strategy zero3-offload "
                "does)")
    return "pass --deepspeed-offload-params"


def resolve(user: UserConfig, cfg, world: int | None = None) -> dict:
    """The user's keys to merge over shardwise's generated config: the keys a shardwise setting decides checked and
    dropped (the generated config has them), "auto" elsewhere refused, the hidden-size keys left "auto" for
    `fill_hidden` (or dropped below ZeRO-3 where they are stage-3 keys). Raises a ShardwiseError naming the file,
    line and key."""
    obj = json.loads(json.dumps(user.obj))  # a copy
    known = OBJECT_SECTIONS + SCALAR_KEYS
    for key, why in FOREIGN_SECTIONS.items():
        if key not in obj or _off(obj[key].get("enabled", True) if isinstance(obj[key], dict) else obj[key]):
            continue
        if isinstance(obj[key], dict) or not difflib.get_close_matches(key, known, n=1, cutoff=0.85):
            raise user.refuse(key, why)  # (a number for sequence_parallel: the near-miss check below names it)
    for key in obj:
        foreign = key in FOREIGN_SECTIONS and isinstance(obj[key], dict)  # switched off, left for DeepSpeed to ignore
        close = (difflib.get_close_matches(key, known, n=1, cutoff=0.85)
                 if key not in known and not foreign else [])
        if close:
            raise user.refuse(key, f"not a DeepSpeed key (DeepSpeed would ignore it); did you mean '{close[0]}'?")
    for section in OBJECT_SECTIONS:
        if section in obj and not isinstance(obj[section], dict):
            raise user.refuse(section, f"DeepSpeed reads this as a JSON object ({{\"key\": value, ...}}), got "
                                       f"{json.dumps(obj[section])[:60]}; fix that key")
    for section in auto_sections(obj):
        obj.pop(section)  # ours in its place (the run's header says so)
    if _forces_ds_cpu(obj):
        obj.pop(FORCE_DS_CPU)  # it would refuse our AdamW (the header says so)
    for section, why in REFUSED_SECTIONS.items():
        if section in obj:
            raise user.refuse(section, why)
    zero = obj.get("zero_optimization", {})
    for sub in ("offload_optimizer", "offload_param"):
        if sub in zero and zero[sub] is not None and not isinstance(zero[sub], dict):
            raise user.refuse(f"zero_optimization.{sub}", "DeepSpeed reads this as a JSON object ({\"device\": "
                                                          f"\"cpu\", ...}}), got {json.dumps(zero[sub])[:60]}; fix "
                                                          "that key")
    for key, ours, source in _decided(cfg, world):
        value = _get(obj, key)
        if value is None:
            continue
        if value != AUTO and ours is not None and not _same(value, ours):
            raise user.refuse(key, f"{json.dumps(value)} here, but this run's {source} sets it to "
                                   f"{json.dumps(ours)}; write \"auto\" (shardwise fills it in, as the HF Trainer "
                                   f"does) or {_flag_fix(key, value)}")
        _pop(obj, key)
    for sub, ours, source in _offload(cfg):
        key = f"zero_optimization.{sub}.device"
        value = _get(obj, key)
        if value is None:
            continue
        if value != AUTO and (value != "none") != ours:
            raise user.refuse(key, f"{json.dumps(value)} here, but this run's {source} "
                                   f"{'offloads' if ours else 'does not offload'}; write \"auto\", or "
                                   f"{_offload_fix(sub, cfg, wants=value != 'none')}")
        if not ours:
            zero.pop(sub)  # no offload, as the generated config says (no section)
        elif value == AUTO:
            _pop(obj, key)  # the generated config's device
    stage3 = cfg.deepspeed.stage == 3
    for name in HIDDEN_KEYS:
        if _get(zero, name) == AUTO and not stage3 and name.startswith("stage3_"):
            zero.pop(name)  # read only at stage 3
    for key, value in _walk(obj):
        if value == AUTO and not (key.startswith("zero_optimization.") and key.split(".", 1)[1] in HIDDEN_KEYS):
            raise user.refuse(key, "\"auto\" is filled in only for the batch sizes, gradient_clipping, "
                                   "fp16/bf16.enabled, zero_optimization.stage, the offload devices and "
                                   f"{', '.join('zero_optimization.' + k for k in HIDDEN_KEYS)}; give a value")
    for sub in ("offload_optimizer", "offload_param"):
        if sub in zero and not zero[sub]:
            zero.pop(sub)
    return obj


def _walk(d: dict, prefix: str = ""):
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            yield from _walk(v, key + ".")
        else:
            yield key, v


def fill_hidden(config: dict, hidden_size: int | None, path: str) -> str:
    """The hidden-size keys still "auto" in the merged `config`, filled as the HF Trainer fills them: reduce bucket
    hidden², stage-3 prefetch bucket 0.9·hidden², stage-3 persistence threshold 10·hidden. Returns what it filled
    ("key value, ..."; "" for nothing)."""
    zero = config.get("zero_optimization", {})
    autos = [k for k in HIDDEN_KEYS if zero.get(k) == AUTO]
    if not autos:
        return ""
    if not hidden_size:
        raise ShardwiseError(f"deepspeed.config {path}: zero_optimization.{autos[0]} is \"auto\", which is filled "
                             "from the model's hidden_size, and its config.json has none; give a number")
    values = {"reduce_bucket_size": hidden_size * hidden_size,
              "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
              "stage3_param_persistence_threshold": 10 * hidden_size}
    for k in autos:
        zero[k] = values[k]
    return ", ".join(f"{k} {values[k]}" for k in autos)
