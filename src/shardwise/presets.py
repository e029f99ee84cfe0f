"""Named strategy presets: one string selects a strategy plus its options.

Pure data, no torch import, so the planner and the config layer can use it freely.
Each preset maps to a base strategy (the file in strategies/) and option defaults
(config keys, dotted for sections). Options a user sets explicitly win over a preset's.
"""

from __future__ import annotations

# name -> (base strategy, {config key: value}, one-line description)
PRESETS: dict[str, tuple[str, dict, str]] = {
    "single": ("single", {}, "one process, no wrapping"),
    "ddp": ("ddp", {}, "DistributedDataParallel: full replica per rank, one all-reduce of gradients per step"),
    "fsdp": ("fsdp", {"fsdp.reshard_after_forward": True},
             "FSDP2 fully_shard, full shard (ZeRO-3-like): params, grads and optimizer states sharded"),
    "fsdp-grad-op": ("fsdp", {"fsdp.reshard_after_forward": False},
                     "FSDP2, params kept gathered between forward and backward (ZeRO-2-like)"),
    "fsdp-offload": ("fsdp", {"fsdp.reshard_after_forward": True, "fsdp.cpu_offload": True},
                     "FSDP2 full shard with parameters, gradients and optimizer step on the CPU"),
    "hybrid": ("fsdp", {"fsdp.reshard_after_forward": True, "fsdp.hybrid": True},
               "HSDP: shard within a node, replicate across nodes (2-D device mesh)"),
    "zero1": ("deepspeed", {"deepspeed.stage": 1}, "DeepSpeed ZeRO-1: optimizer states sharded"),
    "zero2": ("deepspeed", {"deepspeed.stage": 2}, "DeepSpeed ZeRO-2: optimizer states and gradients sharded"),
    "zero3": ("deepspeed", {"deepspeed.stage": 3}, "DeepSpeed ZeRO-3: parameters, gradients and optimizer states sharded"),
    "zero2-offload": ("deepspeed", {"deepspeed.stage": 2, "deepspeed.offload_optimizer": True},
                      "DeepSpeed ZeRO-2 with the optimizer states and step on the CPU"),
    "zero3-offload": ("deepspeed", {"deepspeed.stage": 3, "deepspeed.offload_optimizer": True,
                                    "deepspeed.offload_params": True},
                      "DeepSpeed ZeRO-3 with parameters and optimizer states on the CPU"),
}

# Names accepted by --strategy besides the presets.
SPECIAL = ("auto",)


def base_strategy(name: str) -> str:
    """The strategy file a preset name runs on ('zero3-offload' -> 'deepspeed')."""
    return PRESETS[name][0]


def trains_in_process(name: str, world_size: int) -> bool:
    """Whether `shardwise train` trains in its own process (one `single` rank) rather than in
    workers started by torchrun's elastic agent (every other strategy, even on one rank)."""
    return world_size == 1 and base_strategy(name) == "single"


def known_names() -> list[str]:
    return list(PRESETS) + list(SPECIAL)
