"""The planner: per-rank memory, communication and step time for every strategy preset.

Pure functions, no process group, no torch import (except `simulate`, which is opt-in).

    plan = plan_run(cfg)                       # what `train` would run, on this machine
    plan.recommended, plan.reasons
    plan.for_strategy("ddp").fits / .mem_gib / .step_time_s / .tokens_per_s
    fit_advice(plan, "ddp")                    # one line: estimate + cheapest change that fits
"""

from __future__ import annotations

from shardwise.plan.decide import Plan, StrategyPlan, fit_advice, plan_model
from shardwise.plan.model_presets import resolve_model
from shardwise.plan.model_spec import ModelSpec

__all__ = ["Plan", "StrategyPlan", "ModelSpec", "fit_advice", "plan_model", "plan_run", "resolve_model"]


def plan_run(cfg, hw=None, world_size: int | None = None) -> Plan:
    """Plan a training Config on given (or detected) hardware.

    hw None -> detect without torch (nvidia-smi); on a CPU-only machine the per-rank "GPU memory" is host RAM
    divided by the ranks of the node. world_size None -> nproc_per_node (0: one per GPU, 2 on CPU) x nnodes.
    """
    from shardwise import presets
    from shardwise.errors import ShardwiseError
    from shardwise.plan.inputs import job_from_config, make_setup

    nodes = max(1, cfg.nnodes)
    per_node = None
    if world_size is not None:
        if world_size < 1:
            raise ShardwiseError(f"world size must be >= 1, got {world_size}")
        if world_size % nodes:
            raise ShardwiseError(f"world size {world_size} is not a multiple of nnodes {nodes}")
        per_node = world_size // nodes
    elif cfg.nproc_per_node:
        per_node = cfg.nproc_per_node
    replica = presets.replica_world(cfg.strategy, getattr(cfg, "tensor_parallel", 1),
                                    getattr(cfg, "sequence_parallel", 1))
    if replica is not None:  # one process, or the tp x sp ranks of one replica (launch.preflight.resolve_runtime)
        per_node, nodes = replica, 1
    setup = make_setup(hw, nodes=nodes, ranks_per_node=per_node)
    spec = resolve_model(cfg.model)
    job = job_from_config(cfg, setup)
    return plan_model(spec, job, setup, configured=cfg.strategy if cfg.strategy != "auto" else None, cfg=cfg)
