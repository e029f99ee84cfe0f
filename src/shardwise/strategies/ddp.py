"""`ddp`: DistributedDataParallel. A full replica per rank; one bucketed all-reduce of the
gradients per optimizer step, overlapped with backward. Mixed precision is autocast over
fp32 master weights (or pure bf16 weights with param_dtype bf16)."""

from __future__ import annotations

import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from shardwise.plan.facts import DDP_GRADIENT_AS_BUCKET_VIEW
from shardwise.strategies.base import Strategy


class DDPStrategy(Strategy):
    name = "ddp"

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        model = model.to(self.env.device)
        device_ids = [self.env.device.index] if self.env.device.type == "cuda" else None
        # The engine compiles each decoder block on its own. Dynamo's default DDP mode
        # ("ddp_optimizer") would split every block's graph again at DDP bucket boundaries
        # (25 MB: several cuts per block of a 1B model), which costs fusion, speed and memory
        # (measured on one H200: docs/speed.md). Whole-block graphs keep DDP's overlap at
        # block granularity: a block's gradients are ready, and their buckets all-reduced,
        # as soon as its backward finishes.
        torch._dynamo.config.optimize_ddp = False
        # gradient_as_bucket_view: gradients live in the all-reduce buckets (no second copy)
        return DDP(model, device_ids=device_ids, gradient_as_bucket_view=DDP_GRADIENT_AS_BUCKET_VIEW,
                   process_group=self.dims.grad_group)

    def sync(self, model, enabled: bool):
        return contextlib.nullcontext() if enabled else model.no_sync()
