"""Typed configuration: dataclasses, YAML + flag overrides, one validation pass.

Layering, lowest first: dataclass defaults < strategy preset options < the demo recipe
(only for the demo itself: no CONFIG file, the model `tiny` and the data `demo`; printed
when applied) < the YAML file < flags.

YAML keys and flags spell the same thing the same way: a top-level key `micro_batch_size`
is the flag `--micro-batch-size`; a key in a section (`fsdp: {cpu_offload: true}`) is the
flag `--fsdp-cpu-offload`. Every field's `help` is its documentation (docs/config.md is
generated from it by `shardwise config-docs`).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import os
import re
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Callable

import yaml

from shardwise import foreign, preflight, presets
from shardwise.errors import ShardwiseError
from shardwise.preflight import flags as flag_rules
from shardwise.preflight.flags import show


def _f(default, help: str, choices: tuple | None = None, **kw):
    return field(default=default, metadata={"help": help, "choices": choices, **kw})


@dataclass
class FSDPConfig:
    """FSDP2 (`fully_shard`) options; used by the fsdp presets."""

    reshard_after_forward: bool = _f(True, "Free gathered parameters after forward (full shard, ZeRO-3-like); false keeps them until backward (shard grad op, ZeRO-2-like). See keep_gathered_one_rank for one rank.")
    keep_gathered_one_rank: bool = _f(True, "On one shard rank computing narrower than the stored weights (bf16 over fp32), keep gathered weights from forward to backward whatever reshard_after_forward says: nothing is sharded there, so resharding only makes the bf16 copies twice (faster; +2 bytes per parameter until backward, as single's autocast keeps). Not with cpu_offload (the least GPU memory comes first there). false: reshard as on several ranks.")
    hybrid: bool = _f(False, "HSDP: shard within a group of ranks (a node by default), replicate across groups, on a 2-D device mesh.")
    shard_group_size: int = _f(0, "Ranks per shard group under hybrid; 0 means the ranks of one node (nproc_per_node).")
    cpu_offload: bool = _f(False, "Keep sharded parameters, gradients and the optimizer step on the CPU.")
    wrap: str = _f("block", "Sharding units: 'block' (each decoder layer one unit; embeddings and head grouped with the root) or 'size:N' (units of at least N parameters).")
    prefetch: bool = _f(True, "Explicit forward/backward prefetch of the next unit's all-gather.")


@dataclass
class DeepSpeedConfig:
    """DeepSpeed ZeRO options; used by the zero* presets."""

    stage: int = _f(2, "ZeRO stage: 1 (optimizer states), 2 (+ gradients), 3 (+ parameters).", (1, 2, 3))
    offload_optimizer: bool = _f(False, "Offload optimizer states and step to the CPU (ZeRO-Offload).")
    offload_params: bool = _f(False, "Offload parameters to the CPU (ZeRO-3 only).")
    fetch: str = _f("block", "ZeRO-3's parameter fetch unit: 'block' gathers each decoder block's parameters at once (the blocks are DeepSpeed leaf modules, as FSDP's per-block units: one hook per block, and compiled blocks stay one graph); 'module' is DeepSpeed's own default, one fetch per submodule holding parameters (a smaller gathered peak with very large blocks, but host-bound hooks: docs/speed.md).", ("block", "module"))
    config: str = _f("", "Path to a DeepSpeed JSON (an ms-swift / HF Trainer file works as it is): \"auto\" takes this run's value (batch sizes, clipping, precision, stage, offload; the bucket sizes from the model's hidden size, as the HF Trainer fills them), a value on a key a flag decides must agree with it, other keys override the generated config; optimizer and scheduler sections are refused (docs/strategies/deepspeed.md).")


@dataclass
class LoRAConfig:
    """LoRA / QLoRA adapter options (used when tuner is lora or qlora)."""

    r: int = _f(16, "LoRA rank.")
    alpha: float = _f(32.0, "LoRA scaling numerator (scale = alpha / r).")
    dropout: float = _f(0.05, "Dropout on the adapter input.")
    targets: str = _f("all-linear", "Comma-separated module names to adapt, or 'all-linear' (every linear projection of the blocks).")


@dataclass
class Config:
    """One training run."""

    # model
    model: str = _f("tiny", "A local Hugging Face model directory, or 'tiny' for the built-in demo model.")
    trust_remote_code: bool = _f(False, "Allow custom modelling code from the model directory (off: never run code from a model dir).")
    tuner: str = _f("full", "What to train: all weights, LoRA adapters, or LoRA on a 4-bit base (QLoRA, CUDA only).", ("full", "lora", "qlora"))
    # data
    data: str = _f("demo", "What to train on: a data file (JSONL, JSON array, CSV/TSV, Parquet, Arrow), a directory of them, a saved `datasets` directory, or 'demo' (the built-in synthetic instruction set); several mixed as PATH:WEIGHT,... (a decimal weight) or PATH:COUNT (a number of examples), in YAML also a list. See docs/data.md.")
    data_format: str = _f("auto", "Record format; 'auto' detects it per file from the first record.", ("auto", "messages", "sharegpt", "alpaca", "text"))
    seq_len: int = _f(1024, "Maximum tokens per sequence; longer examples are truncated (counted and reported).")
    packing: bool = _f(False, "Pack several examples into one sequence; attention never crosses example boundaries.")
    padding_free: str = _f("auto", "Lay each micro-batch's rows one after another in one sequence, positions restarting at each row, instead of padding every row to the longest: the same loss and gradients without computing on padding (attention never crosses rows). auto: on when training on the CPU a model family that supports it, with micro_batch_size > 1 and no packing, sequence or tensor parallelism; off on a GPU (docs/data.md).", ("auto", "on", "off"))
    skip_bad_records: bool = _f(False, "Skip malformed records (and report how many) instead of stopping at the first.")
    columns: str = _f("", "Rename data columns before the format is detected: COLUMN=NAME,... with NAME one of messages, conversations, instruction, input, output, system, history, text (in YAML also a mapping).")
    chat_template: str = _f("", "Chat template for chat data, replacing the tokenizer's own: a shipped NAME (chatml, gemma, llama3, mistral, qwen) or a Jinja FILE; empty keeps the tokenizer's.")
    system: str = _f("", "Default system prompt, added to conversations that have none.")
    train_on_prompt: bool = _f(False, "Put loss on every token of a conversation (system and user turns too), not only on the assistant turns.")
    last_turn_only: bool = _f(False, "Put loss on the last assistant turn of each conversation only; earlier turns are context.")
    data_cache: bool = _f(True, "Keep the tokenized data under $SHARDWISE_CACHE_DIR/data (default ~/.cache/shardwise/data), keyed by the records, the tokenizer's files, the chat template and the encoding settings, so a repeat run with the same inputs skips tokenizing; --no-data-cache tokenizes every run and writes nothing there.")
    # preference training (task dpo; docs/dpo.md)
    task: str = _f("sft", "What to train for: sft (supervised fine-tuning on the answers) or dpo (preference training on pairs of a chosen and a rejected answer to the same prompt; loss_type picks DPO, IPO, SimPO or ORPO).", ("sft", "dpo"))
    beta: float = _f(0.1, "With task dpo: the preference loss's temperature. DPO/IPO: how far the policy may move from the reference (beta, and IPO's 1/(2 beta) target margin); SimPO: the scale of the length-normalised reward; ORPO: the weight (lambda) of the odds-ratio term beside the chosen answers' NLL.")
    loss_type: str = _f("sigmoid", "With task dpo: sigmoid (DPO), ipo (IPO: squared distance of the log-ratio margin to 1/(2 beta)), simpo (SimPO: length-normalised log-probabilities, margin simpo_gamma, no reference model) or orpo (ORPO: NLL of the chosen answer plus beta x the odds-ratio loss, no reference model).", ("sigmoid", "ipo", "simpo", "orpo"))
    simpo_gamma: float = _f(0.5, "With loss_type simpo: the target reward margin gamma between the chosen and the rejected answer.")
    ref_model: str = _f("", "With task dpo (sigmoid, ipo): the frozen reference model's local directory; empty: the starting model (--model). It is sharded like the policy under fsdp and zero3, one copy per rank under ddp and single; with tuner lora the reference is the base model with the adapters off (no second copy).")
    precompute_ref: bool = _f(False, "With task dpo (sigmoid, ipo): compute the reference model's log-probabilities of every pair in one pass before training, then free the reference model (no reference memory or forward during training).")
    # strategy and launch
    strategy: str = _f("ddp", "Strategy or preset: " + ", ".join(presets.known_names()) + ".")
    nproc_per_node: int = _f(0, "Processes per node; 0 means one per GPU, or 2 on a CPU-only machine.")
    nnodes: int = _f(1, "Number of nodes (machines).")
    node_rank: int = _f(0, "This node's rank; node 0 hosts the rendezvous store.")
    rdzv_endpoint: str = _f("", "HOST:PORT of the c10d rendezvous (needed when nnodes > 1).")
    collective_timeout: float = _f(1800.0, "Seconds before a collective that does not complete (a hung or dead rank) becomes an error naming the rank and operation.")
    max_restarts: int = _f(0, "Restart the worker group this many times after a failure; the run resumes from its newest checkpoint.")
    sequence_parallel: int = _f(1, "Ranks that split each sequence (sequence parallelism; 1 = off); the data-parallel degree is the world size / (sequence_parallel x tensor_parallel). How attention is split is sp_mode's: only ulysses needs the attention heads (per tensor-parallel rank) divisible by it; ring and auto take any degree.")
    tensor_parallel: int = _f(1, "Ranks that split each weight matrix (tensor parallelism, DTensor; 1 = off): attention and MLP linears split over N ranks, the embedding and output head over the vocabulary (the loss is vocabulary-parallel, full logits never gathered), with strategy single (pure TP: N processes; N x M with sequence_parallel M) or the fsdp presets (FSDP over the other ranks; sequence_parallel too). Needs the attention and KV heads and the MLP width divisible by N (docs/tensor-parallel.md).")
    sp_mode: str = _f("auto", "How sequence parallelism splits attention: ulysses (all-to-all to head shards; heads divisible by N), ring (ring attention over the group; any degree, packing kept), or auto (Ulysses for gcd(heads, N), ring for the rest; the choice is printed).", ("auto", "ulysses", "ring"))
    # optimisation
    max_steps: int = _f(-1, "Optimizer steps to run; -1 means as many as `epochs` take.")
    epochs: int = _f(1, "Passes over the data (used when max_steps is -1).")
    micro_batch_size: int = _f(4, "Sequences per rank per forward pass.")
    grad_accum: int = _f(1, "Micro-batches per optimizer step (gradients are synchronised only on the last).")
    lr: float = _f(2e-5, "Peak learning rate (AdamW).")
    warmup_steps: int = _f(0, "Linear warm-up steps, then lr_schedule (cosine decay to min_lr_ratio * lr by default).")
    min_lr_ratio: float = _f(0.1, "Final learning rate as a fraction of lr.")
    # settings under the names LLaMA-Factory and the Hugging Face Trainer give them
    lr_schedule: str = _f("cosine", "The learning rate after warm-up: cosine or linear decay to min_lr_ratio * lr at the last step, or constant (lr throughout). Also --lr_scheduler_type (constant_with_warmup is constant).", ("cosine", "linear", "constant"))
    warmup_ratio: float = _f(0.0, "Warm-up as a fraction of the run's optimizer steps (rounded up), as the HF Trainer counts it; give it or warmup_steps, not both.")
    max_samples: int = _f(0, "Read at most this many records of each data source, the first in the file (LLaMA-Factory's max_samples); 0 reads all. PATH#N samples N instead (data/sources.py).")
    dataset_dir: str = _f("", "A directory holding LLaMA-Factory's dataset_info.json: the entries of data named there are read as it describes them (file_name, formatting alpaca/sharegpt/openai, columns, tags); other entries stay paths (docs/data.md).")
    weight_decay: float = _f(0.0, "AdamW weight decay.")
    max_grad_norm: float = _f(1.0, "Clip the global gradient norm to this; 0 disables clipping.")
    on_nan: str = _f("stop", "On a non-finite loss or gradient: skip the step (and count it) or stop, naming the step, the batch's records and the last good checkpoint.", ("skip", "stop"))
    sync_step: bool = _f(False, "Read the non-finite check on the host in every optimizer step (the GPU waits for it). Off: with the fused AdamW (CUDA) a non-finite update is skipped on the device and the loop reads the flag one step late; --on-nan still acts before any later update.")
    seed: int = _f(42, "Seed for initialisation, shuffling and dropout.")
    mixed_precision: str = _f("auto", "Compute dtype: no (fp32), bf16, fp16; auto is bf16 on a GPU that has it, else no.", ("auto", "no", "bf16", "fp16"))
    param_dtype: str = _f("fp32", "Storage dtype of weights, gradients and optimizer states: fp32 (master weights) or bf16 (pure bf16, half the memory).", ("fp32", "bf16"))
    gradient_checkpointing: bool = _f(False, "Recompute each block's activations in backward (non-reentrant): less memory, ~20-30% more compute; the same as activation_checkpointing full.")
    compile: str = _f("auto", "torch.compile each decoder block: on, off, or auto (on with CUDA, off on the CPU).", ("auto", "on", "off"))
    fused_loss: bool = _f(True, "Compute the output projection and cross-entropy in chunks, gradients included, so the full fp32 logits never exist.")
    activation_checkpointing: str = _f("off", "What each decoder block keeps for backward: off (everything), full (only its input; the block runs forward again in backward, as gradient_checkpointing true), selective (op-level: the outputs of its matmuls and attention are kept, the norms, rotary and activation functions between them recomputed; memory between the two, almost no extra FLOPs), or offload (full, with each block's kept input in host memory: copied out on a side stream in forward and back one block ahead in backward; the device holds about two block inputs instead of all; needs host RAM for them: shardwise plan says how much; docs/long-context.md).", ("off", "full", "selective", "offload"))
    mlp_tiles: str = _f("1", "Run each block's MLP over N tiles of the sequence, each tile checkpointed, so the MLP's intermediates (3 x tokens x intermediate size) exist for one tile at a time, in forward and in backward (recomputed per tile; costs one more MLP forward). 1 = off; auto: none where the planner fits the run without (on GPUs; the launcher prints its choice), else tiles that keep one tile's intermediates under the block's residual stream (none where the MLP is small). Not with tensor_parallel > 1 (TP splits the MLP already).")
    float8: bool = _f(False, "Run the decoder blocks' large linears as float8 matmuls with dynamic tensorwise scaling (torchao's float8 training; weights, gradients and optimizer states stay as they are); needs a CUDA GPU of compute capability 8.9+ (Ada, Hopper) and `pip install 'shardwise[float8]'`; full fine-tuning with single, ddp or fsdp.")
    # outputs
    output_dir: str = _f("", "Where the run writes; empty means runs/<strategy>-<date>-<time>.")
    log_every: int = _f(10, "Log (terminal, metrics.jsonl, TensorBoard) every N steps.")
    profile_steps: int = _f(0, "Profile this many optimizer steps with torch.profiler; each is logged on its own with its communication time and the part no compute hides (comm_total_s, comm_exposed_s, profiled: true; its step time includes the profiler's overhead), and each rank leaves the step's operator table and Chrome trace in the run's profile/ (step-N-rankR.txt, step-N-rankR.json.gz: chrome://tracing or ui.perfetto.dev); 0 disables.")
    profile_start: int = _f(0, "First profiled step (1-based) when profile_steps > 0; 0 means the last profile_steps steps of the run.")
    memory_snapshot: int = _f(0, "Record the CUDA allocator's history (every allocation with its Python stack) over the first N optimizer steps and write it to the run's memory/rankR.pickle after step N, or when a step runs out of memory first; drag it into pytorch.org/memory_viz to see what was alive at the peak and which line made it. CUDA only; 0 disables. Refused for compiled blocks under activation checkpointing on torch 2.11 and later, whose recording fails that step (pytorch/pytorch#179536): record with --compile off.")
    save_every: int = _f(0, "Save a checkpoint every N steps (and at the end); 0 disables periodic checkpoints.")
    save_every_minutes: float = _f(0.0, "Also save a checkpoint when this many minutes have passed since the last one; 0 disables.")
    keep_checkpoints: int = _f(2, "Keep the newest K checkpoints.")
    resume: str = _f("none", "Resume from 'auto' (newest complete checkpoint in output_dir), 'none', or a checkpoint path.")
    overwrite: bool = _f(False, "Replace a run that shardwise created in output_dir: only its own entries (config.yaml, metrics, checkpoints, final/, ...) are removed; a directory shardwise did not mark, the current directory and its parents are never cleared (docs/run-directory.md).")
    save_final: bool = _f(True, "Save the final model under output_dir/final: a Hugging Face directory, or with tuner lora/qlora the PEFT adapter directory.")
    merge_lora: bool = _f(False, "With tuner lora: also write the adapter merged into the base as a full Hugging Face model in output_dir/final/merged (final/ itself is the PEFT adapter directory).")
    report_to: str = _f("tensorboard", "Where logged metrics also go, comma-separated: tensorboard, wandb (offline unless WANDB_MODE=online), mlflow (output_dir/mlruns unless MLFLOW_TRACKING_URI), or none. metrics.jsonl is always written.")
    val_data: str = _f("", "A validation set (same formats as data) whose loss is measured during training; empty: none, or see val_split.")
    val_split: float = _f(0.0, "Hold out this fraction of the training records (a seeded random choice) as the validation set; 0 disables.")
    eval_every: int = _f(0, "Measure the validation loss every N steps and at the end (logged as val_loss); 0 means at the end only.")
    keep_best: bool = _f(False, "Keep the checkpoint with the lowest validation loss (named in checkpoints/best.json) whatever keep_checkpoints says; needs save_every a multiple of eval_every.")
    # sections
    fsdp: FSDPConfig = field(default_factory=FSDPConfig, metadata={"help": "FSDP2 options."})
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig, metadata={"help": "DeepSpeed options."})
    lora: LoRAConfig = field(default_factory=LoRAConfig, metadata={"help": "LoRA options."})


SECTIONS = {"fsdp": FSDPConfig, "deepspeed": DeepSpeedConfig, "lora": LoRAConfig}
# Keys that control this invocation rather than describe the run: not written to config.yaml.
RUN_CONTROL_KEYS = ("output_dir", "resume", "overwrite")


# ----------------------------------------------------------------------------- fields


@dataclass(frozen=True)
class FieldInfo:
    key: str  # dotted: "lr", "fsdp.cpu_offload"
    flag: str  # "--lr", "--fsdp-cpu-offload"
    type: type
    default: Any
    help: str
    choices: tuple | None


def fields_info() -> list[FieldInfo]:
    """Every settable key, in declaration order."""
    out = []
    for f in dataclasses.fields(Config):
        if f.name in SECTIONS:
            for sf in dataclasses.fields(SECTIONS[f.name]):
                out.append(_info(f"{f.name}.{sf.name}", sf))
        else:
            out.append(_info(f.name, f))
    return out


def _info(key: str, f: dataclasses.Field) -> FieldInfo:
    typ = {"bool": bool, "int": int, "float": float, "str": str}[f.type if isinstance(f.type, str) else f.type.__name__]
    return FieldInfo(key, "--" + key.replace(".", "-").replace("_", "-"), typ, f.default,
                     f.metadata["help"], f.metadata.get("choices"))


FIELDS = {fi.key: fi for fi in fields_info()}


# ----------------------------------------------------------------------------- parsing


# Spellings users bring from Hugging Face Trainer, ms-swift, LLaMA-Factory and TRL: extra flags
# for a key (every flag's underscore spelling, `--max_steps`, is accepted as well).
FLAG_ALIASES = {
    "model": ("--model_name_or_path",),
    "data": ("--dataset",),
    "tuner": ("--train_type", "--tuner_type", "--finetuning_type"),
    "seq_len": ("--max_length", "--max_seq_length", "--cutoff_len"),
    "epochs": ("--num_train_epochs",),
    "micro_batch_size": ("--per_device_train_batch_size",),
    "grad_accum": ("--gradient_accumulation_steps",),
    "lr": ("--learning_rate", "--learning-rate"),
    "log_every": ("--logging_steps",),
    "save_every": ("--save_steps",),
    "keep_checkpoints": ("--save_total_limit",),
    "resume": ("--resume_from_checkpoint",),
    "lora.r": ("--lora_rank",),
    "lora.targets": ("--target_modules", "--lora_target"),
    "lr_schedule": ("--lr_scheduler_type",),
    "eval_every": ("--eval_steps",),
    "val_split": ("--val_size", "--split_dataset_ratio"),
    "beta": ("--pref_beta",),
    "loss_type": ("--pref_loss",),
}


YAML_ALIASES = foreign.yaml_aliases(FIELDS, FLAG_ALIASES)
BOOL_WORDS = foreign.BOOL_WORDS
bool_values = foreign.bool_values  # cli.py: `--flag true|false` rewritten before argparse reads argv


def foreign_keys(layer: dict[str, tuple[Any, str]]) -> dict[str, tuple[Any, str]]:
    """A YAML file's or the flags' layer with LLaMA-Factory / ms-swift / HF Trainer keys in shardwise's terms
    (foreign.py), and a DeepSpeed JSON given as `deepspeed: FILE` (LLaMA-Factory's) read as --deepspeed FILE."""
    out = foreign.foreign_keys(layer, FIELDS, YAML_ALIASES)
    if "alias:deepspeed" in out:
        value, where = out.pop("alias:deepspeed")
        _deepspeed_alias(str(value), out, where)
    return out


def _default_text(fi: FieldInfo) -> str:
    if fi.type is bool:
        return "true" if fi.default else "false"
    return "''" if fi.default == "" else str(fi.default)


class _Given(argparse.Action):
    """Stores the value and remembers which spelling the user typed (for error messages)."""

    def __init__(self, option_strings, dest, const=None, nargs=None, **kw):
        self.const_value = const
        super().__init__(option_strings, dest, nargs=0 if const is not None else nargs, **kw)

    def __call__(self, parser, ns, values, option_string=None):
        setattr(ns, self.dest, self.const_value if self.const_value is not None else values)
        setattr(ns, "flag:" + self.dest[4:], option_string)


# `--deepspeed VALUE` as ms-swift and the HF Trainer take it: ms-swift's name of a built-in config is a strategy
# preset here; anything else is a DeepSpeed JSON file (`--deepspeed-config`), whose ZeRO stage and offload devices
# choose the strategy when no --strategy is given (the Trainer runs the stage its file says)
DEEPSPEED_NAMES = {"zero1": "zero1", "zero2": "zero2", "zero3": "zero3", "zero2_offload": "zero2-offload",
                   "zero3_offload": "zero3-offload", "default-zero2": "zero2", "default-zero3": "zero3"}


def add_flags(parser: argparse.ArgumentParser, only: list[str] | None = None) -> None:
    """Add one flag per config key (help ends with its default), plus its hidden underscore
    spelling and FLAG_ALIASES; unset flags are absent from the namespace (SUPPRESS)."""
    taken = set(parser._option_string_actions)
    if (only is None or {"strategy", "deepspeed.config"} <= set(only)) and "--deepspeed" not in taken:
        parser.add_argument("--deepspeed", dest="alias:deepspeed", default=argparse.SUPPRESS, metavar="NAME|FILE",
                            help="ms-swift / HF Trainer spelling: a built-in name (zero1, zero2, zero3, zero2_offload, "
                                 "zero3_offload) is --strategy; a DeepSpeed JSON file is --deepspeed-config, and its "
                                 "zero_optimization stage and offload devices pick the strategy when no --strategy "
                                 "is given")
    for fi in FIELDS.values():
        if only is not None and fi.key not in only:
            continue
        dest = "cfg:" + fi.key
        named = [a for a in FLAG_ALIASES.get(fi.key, ()) if a not in taken]
        text = fi.help + (f" Choices: {', '.join(map(str, fi.choices))}." if fi.choices and fi.type is not bool else "")
        text += f" (default: {_default_text(fi)}" + (f"; also {', '.join(named)}" if named else "") + ")"
        text = text.replace("%", "%%")  # argparse %-formats help strings
        hidden = [fi.flag.replace("-", "_").replace("__", "--", 1)] + [a for a in named if "_" not in a]
        hidden_named = [a for a in named if "_" in a]
        if fi.type is bool:
            parser.add_argument(fi.flag, dest=dest, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=text)
            for flag in hidden + hidden_named:
                if flag in taken or flag == fi.flag:
                    continue
                parser.add_argument(flag, dest=dest, action=_Given, const=True, default=argparse.SUPPRESS,
                                    help=argparse.SUPPRESS)
                parser.add_argument("--no_" + flag[2:], dest=dest, action=_Given, const=False,
                                    default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        else:
            parser.add_argument(fi.flag, dest=dest, action=_Given, default=argparse.SUPPRESS,
                                metavar=fi.type.__name__.upper(), help=text)
            for flag in dict.fromkeys(hidden + hidden_named):
                if flag in taken or flag == fi.flag:
                    continue
                # ms-swift's --dataset takes several sources one after another (joined as --data A,B)
                parser.add_argument(flag, dest=dest, action=_Given, default=argparse.SUPPRESS, help=argparse.SUPPRESS,
                                    nargs="+" if flag == "--dataset" else None)
    if only is None:
        foreign.add_flags(parser, FIELDS)


def flags_from_namespace(ns: argparse.Namespace) -> dict[str, tuple[Any, str]]:
    """{dotted key: (raw value, where)} for the flags the user gave ('where' names the spelling typed)."""
    out = {}
    given = vars(ns)
    for k, v in given.items():
        if k.startswith("cfg:"):
            key = k[4:]
            typed = given.get("flag:" + key) or FIELDS[key].flag
            where = f"flag {FIELDS[key].flag}" if typed == FIELDS[key].flag else f"flag {typed} (= {FIELDS[key].flag})"
            if isinstance(v, list):  # --dataset A B
                v = ",".join(v)
            out[key] = (v, where)
        elif k.startswith("foreign:"):
            out[k[8:]] = (v, f"flag --{k[8:]}")
    if "alias:deepspeed" in given:
        _deepspeed_alias(str(given["alias:deepspeed"]), out)
    return foreign_keys(out)


def _deepspeed_alias(value: str, out: dict[str, tuple[Any, str]], where: str = "") -> None:
    """`--deepspeed NAME|FILE` (or a YAML `deepspeed: FILE`) into the keys it means (see DEEPSPEED_NAMES), refusing a
    contradiction in one line."""
    where = where or f"flag --deepspeed {value}"
    name = value.strip().lower().replace("-", "_").replace("default_", "default-")
    if name in ("zero0", "default-zero0"):
        raise ShardwiseError(f"{where}: ms-swift's zero0 is plain data parallelism; use --strategy ddp")
    if name in DEEPSPEED_NAMES:
        want = DEEPSPEED_NAMES[name]
        if "strategy" in out and out["strategy"][0] != want:
            raise ShardwiseError(f"{where}: it means --strategy {want}, but {out['strategy'][1]} gives "
                                 f"{out['strategy'][0]}; give one of them")
        out["strategy"] = (want, f"{where} (= --strategy {want})")
        return
    if "deepspeed.config" in out:
        raise ShardwiseError(f"{where}: {out['deepspeed.config'][1]} gives another DeepSpeed config; give one of them")
    out["deepspeed.config"] = (value, f"{where} (= --deepspeed-config)")
    if "strategy" in out:
        return
    try:  # the stage the file asks for (a file that cannot be read is named when the config is validated)
        with open(os.path.expanduser(value), encoding="utf-8") as fh:
            zero = json.load(fh).get("zero_optimization", {})
        stage = zero.get("stage")
    except (OSError, ValueError, AttributeError):
        return
    if isinstance(stage, int) and not isinstance(stage, bool) and stage == 0:  # LLaMA-Factory's ds_z0_config.json
        raise ShardwiseError(f"{where}: its zero_optimization.stage 0 is plain data parallelism (no ZeRO sharding); "
                             "use --strategy ddp without the DeepSpeed file, or a file of stage 1, 2 or 3")
    if not (isinstance(stage, int) and not isinstance(stage, bool) and stage in (1, 2, 3)):
        return  # "auto" or none: validation asks for a ZeRO strategy
    src = f"{where} (its zero_optimization.stage {stage})"
    out["strategy"] = (f"zero{stage}", src)
    for sub, key in (("offload_optimizer", "deepspeed.offload_optimizer"), ("offload_param", "deepspeed.offload_params")):
        device = zero.get(sub, {}).get("device") if isinstance(zero.get(sub), dict) else None
        if isinstance(device, str) and device != "auto" and key not in out:
            out[key] = (device != "none", f"{where} (its zero_optimization.{sub}.device {device})")


MAX_YAML_VALUES = 10_000  # a config holds a few dozen; more (e.g. through aliases) is refused


def bounded_yaml(text: str, path: str) -> tuple[Any, yaml.Node | None]:
    """(the data, its node tree) of YAML text, read with the safe loader once its nodes passed the bound (merge
    keys refused, at most MAX_YAML_VALUES values however aliases expand): the CLI's configs and the UI's listing of
    runs read YAML this one way. YAML errors and RecursionError pass through; the bound is a ShardwiseError."""
    node = yaml.compose(text, Loader=yaml.SafeLoader)
    if node is not None:
        _check_yaml_nodes(node, path)
    return yaml.safe_load(text), node


def _check_yaml_nodes(root: yaml.Node, path: str) -> None:
    """Refuse merge keys (`<<:`) and documents that expand (through aliases) to more than
    MAX_YAML_VALUES values, before anything is built from them."""
    count, stack = 0, [root]
    while stack:
        node = stack.pop()
        count += 1
        if count > MAX_YAML_VALUES:
            raise ShardwiseError(f"{path}: the YAML expands to more than {MAX_YAML_VALUES:,} values (through aliases "
                                 "or sheer size); a config is a short mapping of keys to values")
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if k.tag == "tag:yaml.org,2002:merge":
                    raise ShardwiseError(f"{path}:{k.start_mark.line + 1}: YAML merge keys (<<) are not supported "
                                         "in a config; write the keys out")
                stack += (k, v)
        elif isinstance(node, yaml.SequenceNode):
            stack += node.value


def _yaml_with_lines(path: str) -> dict[str, tuple[Any, str]]:
    """Read a YAML config into {dotted key: (value, 'file:line')}; safe loader only."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except FileNotFoundError:
        raise ShardwiseError(f"{path}: config file not found; give an existing YAML file or omit it to use flags only")
    except OSError as e:
        raise ShardwiseError(f"{path}: cannot read config file ({e.strerror})")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ShardwiseError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); "
                             "save the config as UTF-8")
    try:
        data, node = bounded_yaml(text, path)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else path
        raise ShardwiseError(f"{where}: invalid YAML ({getattr(e, 'problem', e)}); fix the syntax")
    except RecursionError:
        raise ShardwiseError(f"{path}: the YAML is nested too deeply to read; a config is a mapping of keys to "
                             "values (one level of sections)")
    if data is None or data == {}:  # nothing but comments or blanks (load_config judges it with the flags)
        return {}
    if not isinstance(data, dict) or node is None or not isinstance(node, yaml.MappingNode):
        raise ShardwiseError(f"{path}:1: a config file must be a mapping of keys to values")
    out: dict[str, tuple[Any, str]] = {}
    lines: dict[str, int] = {}  # key -> the line it was first given on

    def once(key: str, knode: yaml.Node) -> None:
        line = knode.start_mark.line + 1
        if key in lines:  # PyYAML keeps the last silently; a repeated key is an edit gone wrong
            raise ShardwiseError(f"{path}:{line}: key '{key}' is given twice (first on line {lines[key]}); "
                                 "keep one of them")
        lines[key] = line

    for knode, vnode in node.value:
        if not isinstance(knode, yaml.ScalarNode) or knode.value not in data:
            raise ShardwiseError(f"{path}:{knode.start_mark.line + 1}: a config key must be a plain name")
        key = knode.value
        where = f"{path}:{knode.start_mark.line + 1}"
        once(key, knode)
        if key in SECTIONS:
            if isinstance(vnode, yaml.MappingNode):
                section = data[key] or {}
                for sk, sv in vnode.value:
                    if not isinstance(sk, yaml.ScalarNode) or sk.value not in section:
                        raise ShardwiseError(f"{path}:{sk.start_mark.line + 1}: a config key must be a plain name")
                    once(f"{key}.{sk.value}", sk)
                    out[f"{key}.{sk.value}"] = (section[sk.value], f"{path}:{sk.start_mark.line + 1}")
            elif key == "deepspeed" and isinstance(data[key], str):  # a DeepSpeed JSON, as LLaMA-Factory gives it
                out["alias:deepspeed"] = (data[key], where)
            elif not (isinstance(vnode, yaml.ScalarNode) and data[key] is None):
                raise ShardwiseError(f"{where}: key '{key}' must be a mapping of {key} options")
        else:
            out[key] = (data[key], where)
    return out


def _data_list(value: Any, where: str) -> str:
    """A YAML list of data sources -> the flag form 'a.jsonl:0.7,b.parquet:300'."""
    if not isinstance(value, list):
        raise ShardwiseError(f"{where}: 'data' must be a path, PATH:WEIGHT,... or a list of sources")
    items = []
    for i, v in enumerate(value, 1):
        if isinstance(v, dict):
            extra = set(v) - {"path", "weight", "count"}
            if not isinstance(v.get("path"), str) or extra or ("weight" in v and "count" in v):
                raise ShardwiseError(f"{where}: data source {i} must be {{path: P}} with one of weight: W or "
                                     f"count: N, got {show(v)}")
            item = v["path"]
            try:
                if "weight" in v:
                    w = float(v["weight"])
                    if not (math.isfinite(w) and w > 0):
                        raise ShardwiseError(f"{where}: data source {i}: weight must be a number > 0 (a share of "
                                             f"the mix), got {show(v['weight'])}")
                    text = repr(w) if "e" not in repr(w) else f"{w:.15f}".rstrip("0")
                    item += ":" + text
                elif "count" in v:
                    if isinstance(v["count"], bool) or int(v["count"]) != v["count"]:
                        raise ValueError
                    if v["count"] < 1:
                        raise ShardwiseError(f"{where}: data source {i}: count must be >= 1 (a number of examples), "
                                             f"got {show(v['count'])}")
                    item += f":{int(v['count'])}"
            except (TypeError, ValueError):
                raise ShardwiseError(f"{where}: data source {i}: weight must be a number and count an integer, "
                                     f"got {show(v)}") from None
        elif isinstance(v, str):
            item = v
        else:
            raise ShardwiseError(f"{where}: data source {i} must be a path or {{path, weight|count}}, got {show(v)}")
        if "," in item:
            raise ShardwiseError(f"{where}: data source {i} ({show(item)}) has a ',' in its path; rename it")
        items.append(item)
    return ",".join(items)


def _columns_map(value: Any, where: str) -> str:
    """A YAML mapping {column: name} -> the flag form 'column=name,...'."""
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ShardwiseError(f"{where}: 'columns' must map column names to names (e.g. prompt: instruction)")
    return ",".join(f"{k}={v}" for k, v in value.items())


# string keys whose YAML value may also be a list or a mapping, and how it becomes the string
STRUCTURED = {"data": _data_list, "columns": _columns_map}


# string keys that hold paths (data: several, comma-separated): a leading `~` is the home directory, as in a
# shell, also where no shell expands it (a YAML value, `--output-dir=~/runs`), never a directory named `~`
PATH_KEYS = ("model", "data", "val_data", "output_dir", "resume", "chat_template", "deepspeed.config", "dataset_dir")


def _expand_home(value: str) -> str:
    return ",".join(os.path.expanduser(s.strip()) if s.strip().startswith("~") else s for s in value.split(","))


def _coerce(key: str, value: Any, where: str) -> Any:
    fi = FIELDS.get(key)
    if fi is None:
        close = difflib.get_close_matches(key[:100], list(FIELDS), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else f"; known keys: {', '.join(FIELDS)}"
        raise ShardwiseError(f"{where}: unknown key {show(key)}{hint}")
    if key in STRUCTURED and isinstance(value, (list, dict)):
        value = STRUCTURED[key](value, where)
    t = fi.type
    try:
        if t is bool:
            if isinstance(value, bool):
                v = value
            elif isinstance(value, str) and value.lower() in BOOL_WORDS:
                v = BOOL_WORDS[value.lower()]
            else:
                raise ValueError
        elif t is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            v = int(value)
        elif t is float:
            if isinstance(value, bool):
                raise ValueError
            v = float(value)
            if not math.isfinite(v):
                raise ShardwiseError(f"{where}: '{key}' must be a finite number, got {show(value)}")
        else:
            if value is None:
                value = ""
            if isinstance(value, (dict, list)):
                raise ValueError
            v = str(value)
            try:
                if key not in PATH_KEYS:  # a path may be any bytes (argv's surrogate escapes open the file)
                    v.encode("utf-8")
            except UnicodeEncodeError as e:  # a non-UTF-8 byte of argv, or a "\udcff" escape in the YAML
                c = ord(v[e.start])
                what = f"byte 0x{c - 0xDC00:02x}" if 0xDC80 <= c <= 0xDCFF else f"an unpaired surrogate \\u{c:04x}"
                raise ShardwiseError(f"{where}: '{key}' is not valid text: {what} at character {e.start + 1}; "
                                     "give UTF-8 text") from None
    except (TypeError, ValueError):
        raise ShardwiseError(f"{where}: '{key}' must be {'a' if t is not int else 'an'} {t.__name__}, got {show(value)}")
    if key in PATH_KEYS:
        v = _expand_home(v)
    if fi.choices is not None and v not in fi.choices:
        raise ShardwiseError(f"{where}: '{key}' must be one of {', '.join(map(str, fi.choices))}; got {show(v)}")
    return v


# ----------------------------------------------------------------------------- building


@dataclass
class Resolved:
    """A config plus where each explicitly given key came from."""

    cfg: Config
    origins: dict[str, str]  # dotted key -> "flag --x" / "file.yaml:3" / "preset zero3"
    notes: list[str] = field(default_factory=list)  # what the run prints once about its config (keys ignored)

    def where(self, key: str) -> str:
        return self.origins.get(key, f"key '{key}'")

    def explicit(self, key: str) -> bool:
        return key in self.origins and not self.origins[key].startswith(("preset ", "demo recipe"))

    def restates_default(self, key: str) -> bool:
        """Whether the key holds its default value (given or not)."""
        return get(self.cfg, key) == FIELDS[key].default


def demo_recipe_path() -> str:
    return str(resources.files("shardwise").joinpath("demo.yaml"))


def load_config(path: str | None = None, flags: dict[str, tuple[Any, str]] | None = None,
                skip: Callable[[str], bool] | None = None) -> Resolved:
    """Build and validate a Config from an optional YAML file and flag overrides. `skip(key)` leaves keys of the
    file out (those a caller replaces: `shardwise bench` checks the user's file as each strategy runs it)."""
    flags = flags or {}
    layers: list[dict[str, tuple[Any, str]]] = []
    file_layer = foreign_keys(_yaml_with_lines(path)) if path else {}
    named = [k for k in ("model", "data") if k in flags and not str(flags[k][1]).startswith("set by")]  # by the user
    if path and not file_layer and not named:
        # nothing but comments, blanks or {}, and no flag names a model or data: the run would be the built-in tiny
        # model on the demo data, unasked (with --model or --data it is a file of settings still to come)
        raise ShardwiseError(f"{path}: the config file is empty (no key in it) and no --model or --data is given; "
                             "give the run's keys (docs/config.md), or leave the file out and use flags")
    if skip is not None:
        file_layer = {k: v for k, v in file_layer.items() if not skip(k)}
    user = {**file_layer, **flags}
    model_name = user["model"][0] if "model" in user else FIELDS["model"].default
    data_name = user["data"][0] if "data" in user else FIELDS["data"].default
    if path is None and model_name == "tiny" and data_name == "demo":
        demo = _yaml_with_lines(demo_recipe_path())
        layers.append({k: (v, "demo recipe " + w) for k, (v, w) in demo.items()})
    layers += [file_layer, flags]
    # strategy preset options sit under everything the user or the demo recipe gave
    strategy = FIELDS["strategy"].default
    for layer in layers:
        if "strategy" in layer:
            strategy = str(layer["strategy"][0])
    preset_layer = {}
    if strategy in presets.PRESETS:
        preset_layer = {k: (v, f"preset {strategy}") for k, v in presets.PRESETS[strategy].options.items()}
    cfg = Config()
    origins: dict[str, str] = {}
    ignored: dict[str, str] = {}
    for layer in [preset_layer] + layers:
        for key, (raw, where) in layer.items():
            if key.startswith("ignored:"):
                ignored[key[8:]] = raw
                continue
            _set(cfg, key, _coerce(key, raw, where))
            origins[key] = where
    res = Resolved(cfg, origins)
    if ignored:
        res.notes.append("ignored, as they change nothing here: " + ", ".join(f"{k} ({why})"
                                                                             for k, why in ignored.items()))
    foreign.eval_steps_alone(res)
    validate(res)
    return res


def demo_note(res: Resolved) -> str | None:
    """The line that says which of the demo recipe's settings this run took (None: not the demo)."""
    took = [k for k, w in res.origins.items() if w.startswith("demo recipe") and k not in ("model", "data")]
    if not took:
        return None
    vals = ", ".join(f"{k} {get(res.cfg, k)}" for k in took)
    return (f"the built-in demo (tiny model, synthetic data) with its settings from demo.yaml: {vals}; "
            "flags override them, a CONFIG file or another --model/--data does not use them")


def check_train_data(res: Resolved) -> None:
    """`shardwise train`'s rule beyond the config's own (preflight/flags.train_data): a model directory needs --data."""
    preflight.run(res, (flag_rules.train_data,))


def _set(cfg: Config, key: str, value: Any) -> None:
    if "." in key:
        sec, name = key.split(".", 1)
        setattr(getattr(cfg, sec), name, value)
    else:
        setattr(cfg, key, value)


def get(cfg: Config, key: str) -> Any:
    if "." in key:
        sec, name = key.split(".", 1)
        return getattr(getattr(cfg, sec), name)
    return getattr(cfg, key)


def checkpointing_mode(cfg: Config) -> str:
    """off, full, selective or offload: activation_checkpointing, with gradient_checkpointing true meaning full."""
    return "full" if cfg.gradient_checkpointing and cfg.activation_checkpointing == "off" else cfg.activation_checkpointing


def validate(res: Resolved) -> None:
    """Every rule that needs no hardware (preflight/flags.py), in order; the first that fails is raised, naming its
    key and where the key came from."""
    preflight.run(res, flag_rules.CHECKS)


def split_source(item: str) -> tuple[str, str]:
    """One entry of the `data` key, 'PATH:N' / 'PATH:W' -> (PATH, 'N' or 'W'), a bare PATH -> (PATH, ''): an integer
    N counts examples, a number with a decimal point is a weight (data/sources.py parse_data_spec reads them)."""
    path, colon, num = item.rpartition(":")
    if colon and path and re.fullmatch(r"\d+|(\d+\.\d*|\.\d+)(e-?\d+)?", num):
        return path, num
    return item, ""


def _absolute_sources(spec: str, names: set[str] = frozenset()) -> str:
    """'a.jsonl:0.7,demo:0.3,b/c.jsonl' -> the same with each path absolute (the built-in 'demo' and the dataset_info
    `names` stay names; a '#N' stays after its path)."""
    out = []
    for item in spec.split(","):
        path, num = split_source(item.strip())
        bare = re.sub(r"#\d+$", "", path)
        keep = path == "demo" or not path or bare in names
        out.append((path if keep else os.path.abspath(path)) + (":" + num if num else ""))
    return ",".join(out)


def absolute_paths(d: dict) -> dict:
    """A config dict (dataclasses.asdict) with its paths made absolute, in place: what config.yaml, the workers'
    job and so every checkpoint's meta.json record (a path as typed means nothing once the directory changes)."""
    if d["model"] != "tiny":
        d["model"] = os.path.abspath(d["model"])
    names: set[str] = set()
    if d.get("dataset_dir"):
        names = foreign.dataset_names(d["dataset_dir"])
        d["dataset_dir"] = os.path.abspath(d["dataset_dir"])
    d["data"] = _absolute_sources(d["data"], names)
    if d["val_data"]:
        d["val_data"] = os.path.abspath(d["val_data"])
    if d.get("ref_model") and d["ref_model"] != "tiny":
        d["ref_model"] = os.path.abspath(d["ref_model"])
    ct = d["chat_template"]
    # a shipped template's name stays a name (data/templates.template_text reads the name first, even where a file of
    # that name lies in the working directory): made a path, the workers and a repeat run would read the file
    if ct and os.path.isfile(ct) and not resources.files("shardwise").joinpath("data", "templates",
                                                                               f"{ct}.jinja").is_file():
        d["chat_template"] = os.path.abspath(ct)
    if d.get("deepspeed", {}).get("config"):
        d["deepspeed"]["config"] = os.path.abspath(d["deepspeed"]["config"])
    return d


def to_yaml(cfg: Config, where: str = "") -> str:
    """The resolved config as YAML; run-control keys are left out so the file repeats the run."""
    d = dataclasses.asdict(cfg)
    for k in RUN_CONTROL_KEYS:
        d.pop(k, None)
    base = presets.base_strategy(cfg.strategy) if cfg.strategy in presets.PRESETS else cfg.strategy
    # sections that do not apply to this run are left out (they hold defaults)
    for spec in presets.SPECS.values():
        if spec.section and base not in (spec.name, "auto"):
            d.pop(spec.section)
    if cfg.tuner == "full":
        d.pop("lora")
    absolute_paths(d)  # paths as typed are relative to where this run started; the file is run from anywhere
    head = "# shardwise resolved config; `shardwise train THIS_FILE` repeats the run into a new output_dir.\n"
    if where:
        head += f"# written by the run in {where}\n"
    return head + yaml.safe_dump(d, sort_keys=False)


def config_docs() -> str:
    """Markdown table of every key (docs/config.md)."""
    lines = ["| key | flag | default | what it does |", "|---|---|---|---|"]
    for fi in FIELDS.values():
        choices = f" ({' / '.join(map(str, fi.choices))})" if fi.choices else ""
        default = "''" if fi.default == "" else fi.default
        lines.append(f"| `{fi.key}` | `{fi.flag}` | `{default}` | {fi.help}{choices} |")
    return "\n".join(lines) + "\n"


def from_dict(d: dict) -> Config:
    """Rebuild a Config written by dataclasses.asdict (trusted, already validated)."""
    d = dict(d)
    secs = {name: cls(**d.pop(name, {})) for name, cls in SECTIONS.items()}
    return Config(**d, **secs)
