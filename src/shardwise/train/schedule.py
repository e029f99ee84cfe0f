"""The learning-rate schedule, and where a resumed run stands in it.

A run's schedule (warm-up, then cosine/linear decay or constant) is laid over its optimizer steps. A resume that
keeps the global batch (sequences per optimizer step) keeps the steps as they are. A resume that changes it on purpose
(another micro-batch or accumulation on another number of ranks) keeps the schedule as saved counted in sequences,
as Megatron-LM counts a run whose batch changes (consumed samples; its learning-rate decay is set in samples): the
run's length is the same number of sequences (its epochs, or max_steps of the batch the schedule counts in), the
learning rate at each step is the one the saved run would have had after as many sequences, and the step count
follows from the sequences left divided by the new batch. Each checkpoint records the schedule's batch, its length
in steps of that batch and the sequences trained (meta.json "schedule"), so later resumes count the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def warmup_steps(cfg, total: float) -> int:
    """The warm-up's optimizer steps: warmup_steps, or warmup_ratio of the run's steps rounded up (as the HF
    Trainer counts it)."""
    return cfg.warmup_steps or math.ceil(cfg.warmup_ratio * total)


def lr_at(cfg, step: float, total: float) -> float:
    """Linear warm-up to lr, then lr_schedule: cosine or linear decay to min_lr_ratio * lr at the last step, or
    constant. `step` may be fractional (a resumed run's place in the schedule's own steps)."""
    warm = warmup_steps(cfg, total)
    if warm and step < warm:
        return cfg.lr * (step + 1) / warm
    if cfg.lr_schedule == "constant":
        return cfg.lr
    progress = min(max(step - warm, 0) / max(total - warm, 1), 1.0)
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.lr_schedule == "cosine" else 1 - progress
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape)


@dataclass
class Schedule:
    """The schedule in steps of `batch` sequences (`steps` of them), and this launch's batch `now` from optimizer
    step `base_step`, when `base_seq` sequences were trained."""

    batch: int
    steps: int
    now: int
    base_step: int = 0
    base_seq: int = 0

    def sequences(self, step: int) -> int:
        return self.base_seq + (step - self.base_step) * self.now

    def position(self, step: int) -> float:
        """Optimizer step `step` of this launch as a step of the schedule (the same where the batch is)."""
        if self.now == self.batch and self.base_seq == self.base_step * self.batch:
            return step
        return self.sequences(step) / self.batch

    def lr(self, cfg, step: int) -> float:
        return lr_at(cfg, self.position(step), self.steps)

    def record(self, step: int) -> dict:
        """What a checkpoint at `step` keeps (meta.json "schedule")."""
        return {"batch": self.batch, "steps": self.steps, "sequences": self.sequences(step)}


def saved_batch(meta: dict) -> int | None:
    """The global batch a checkpoint's schedule counts in: its own record, else its run's micro-batch x accumulation x
    data-parallel ranks (checkpoints written before the record); None where the meta cannot say."""
    from shardwise import presets

    sched = meta.get("schedule")
    if isinstance(sched, dict) and isinstance(sched.get("batch"), int) and sched["batch"] > 0:
        return sched["batch"]
    old = meta.get("config") or {}
    vals = [old.get(k, 1) for k in ("micro_batch_size", "grad_accum", "tensor_parallel", "sequence_parallel")]
    if not isinstance(meta.get("world_size"), int) or not all(isinstance(v, int) and v > 0 for v in vals):
        return None
    dp = presets.data_parallel_degree(meta["world_size"], vals[2], vals[3])
    return vals[0] * vals[1] * dp if dp >= 1 else None


def resumed(cfg, meta: dict, rows: int, batch: int) -> tuple[Schedule, int]:
    """(the schedule, this run's last optimizer step) for a run of `batch` sequences a step over `rows` sequences,
    resuming a checkpoint whose meta.json is `meta`. The run's length is the config's (epochs, or max_steps counted in
    the schedule's batch); where the batch is the schedule's, everything is as without a resume."""
    step = meta["step"]
    ref = saved_batch(meta) or batch
    sched = meta.get("schedule")
    seq = sched["sequences"] if isinstance(sched, dict) and isinstance(sched.get("sequences"), int) else step * ref
    length = cfg.max_steps if cfg.max_steps > 0 else cfg.epochs * (rows // ref)
    s = Schedule(ref, length, batch, step, seq)
    if ref == batch and seq == step * ref:
        return s, cfg.max_steps if cfg.max_steps > 0 else cfg.epochs * (rows // batch)
    if cfg.max_steps > 0:  # the sequences max_steps of the schedule's batch hold
        return s, step + max(math.ceil((length * ref - seq) / batch), 0)
    pos = meta.get("data_position") or {}
    epoch, offset = int(pos.get("epoch", 0)), int(pos.get("offset", 0))
    return s, step + (rows - offset) // batch + max(cfg.epochs - 1 - epoch, 0) * (rows // batch)
