"""`fsdp`: FSDP2 (`torch.distributed.fsdp.fully_shard`). Parameters, gradients and optimizer
states are sharded over the ranks (dim 0 of every tensor, as DTensors); each unit's
parameters are all-gathered before its forward and backward, and its gradients
reduce-scattered after backward.

The parallelize step is a short composition, as in torchtitan:

    mesh (env.dims) -> units (wrap policy) -> fully_shard(each unit) -> fully_shard(root) -> prefetch

Mixed precision is FSDP's MixedPrecisionPolicy (no autocast): parameters are cast to the
compute dtype when gathered, gradients reduced in fp32 and kept in the storage dtype.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from shardwise import presets
from shardwise.errors import ShardwiseError
from shardwise.plan.facts import FSDP_REDUCE_DTYPE
from shardwise.strategies.base import Strategy

log = logging.getLogger(__name__)


def tied_params(model: nn.Module) -> set[int]:
    """ids of parameters reachable under more than one name (e.g. tied embeddings)."""
    seen: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        seen[id(p)] = seen.get(id(p), 0) + 1
    return {k for k, n in seen.items() if n > 1}


def block_units(model: nn.Module) -> list[nn.Module]:
    """The decoder layers: modules whose class HF lists as never-split (`_no_split_modules`),
    else the children of the longest ModuleList. Embeddings, final norm and head stay with
    the root unit: sharding them as tiny units would add small all-gathers for no saving."""
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if blocks:
        return blocks
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        raise ShardwiseError("fsdp.wrap block: cannot find the model's decoder layers; use --fsdp-wrap size:N")
    return list(max(lists, key=len))


def size_units(model: nn.Module, min_params: int) -> list[nn.Module]:
    """Post-order: a module becomes a unit once it holds >= min_params parameters not already
    in a unit below it. Modules holding a tied parameter are never units (the tie spans
    modules, so the root keeps it)."""
    tied = tied_params(model)
    units: list[nn.Module] = []

    def visit(m: nn.Module) -> tuple[int, bool]:
        own = list(m.parameters(recurse=False))
        total, has_tied = sum(p.numel() for p in own), any(id(p) in tied for p in own)
        for c in m.children():
            n, t = visit(c)
            total, has_tied = total + n, has_tied or t
        if m is not model and not has_tied and total >= min_params:
            units.append(m)
            return 0, False
        return total, has_tied

    visit(model)
    return units


def shard_units(model: nn.Module, units: list[nn.Module], mesh, mp_policy, reshard: bool, prefetch: bool,
                offload_policy=None) -> nn.Module:
    """fully_shard each unit, then the root, on `mesh`; with `prefetch` (units that run in list order, as
    decoder blocks do) each unit prefetches the next one's all-gather in forward and the previous one's in
    backward. The last unit is gathered again first thing in backward, so it is kept gathered. Shared by
    FSDPStrategy.wrap and the planner's --simulate, so both shard the same way."""
    kw = dict(mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy or OffloadPolicy())
    for i, unit in enumerate(units):
        fully_shard(unit, reshard_after_forward=reshard and i < len(units) - 1, **kw)
    fully_shard(model, reshard_after_forward=reshard, **kw)
    if prefetch and len(units) > 1:
        for a, b in zip(units, units[1:]):
            a.set_modules_to_forward_prefetch([b])
            b.set_modules_to_backward_prefetch([a])
    return model


class FSDPStrategy(Strategy):
    name = "fsdp"

    def __init__(self, cfg, env):
        super().__init__(cfg, env)
        if self.scaler is not None:  # fp16: found-inf must be agreed on across shards
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(env.device.type)
        self.mesh = None

    def mp_policy(self) -> MixedPrecisionPolicy:
        """Compute in the mixed-precision dtype, reduce gradients in fp32, store as loaded."""
        param = self.compute_dtype if self.compute_dtype != self.param_dtype else None
        return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=getattr(torch, FSDP_REDUCE_DTYPE))

    def wrap(self, model: nn.Module) -> nn.Module:
        f = self.cfg.fsdp
        # no model.to(device): each fully_shard call moves its unit's tensors to the device and
        # shards them (and, with offload, moves the shards to the CPU), so setup never holds
        # more than one unit unsharded on the GPU
        self.mesh = self.dims.shard_mesh  # (dp_shard [x sp],), or (dp_replicate, dp_shard [x sp]) for HSDP
        units = block_units(model) if f.wrap == "block" else size_units(model, int(f.wrap[5:]))
        self.reshard = f.reshard_after_forward and not self.keeps_gathered()
        offload = CPUOffloadPolicy(pin_memory=self.env.device.type == "cuda") if f.cpu_offload else OffloadPolicy()
        shard_units(model, units, self.mesh, self.mp_policy(), self.reshard,
                    prefetch=f.prefetch and f.wrap == "block", offload_policy=offload)
        if self.env.is_main:
            log.info("fsdp: %d units + root on mesh %s", len(units), tuple(self.mesh.shape))
        self.n_units = len(units)
        return model

    def wrap_frozen(self, model: nn.Module) -> nn.Module:
        """The reference model sharded like the policy (its blocks and root on the same mesh), resharded after
        every forward: it runs no backward."""
        units = block_units(model) if self.cfg.fsdp.wrap == "block" else size_units(model, int(self.cfg.fsdp.wrap[5:]))
        offload = CPUOffloadPolicy(pin_memory=self.env.device.type == "cuda") if self.cfg.fsdp.cpu_offload \
            else OffloadPolicy()
        return shard_units(model, units, self.dims.shard_mesh, self.mp_policy(), True,
                           prefetch=self.cfg.fsdp.prefetch and self.cfg.fsdp.wrap == "block", offload_policy=offload)

    def reference_dtype(self) -> torch.dtype:
        """The compute dtype where it is narrower: the mixed-precision policy casts the policy's weights to it too."""
        return min(self.param_dtype, self.compute_dtype, key=lambda d: d.itemsize)

    def reference_layout(self) -> str:
        return f"sharded like the policy (FSDP, mesh {tuple(self.dims.shard_mesh.shape)})"

    def keeps_gathered(self) -> bool:
        """One rank per shard group, computing in a narrower dtype than the stored weights: nothing is sharded, so
        resharding after forward would only free the compute-dtype copies of the weights and make them again in
        backward (a cast and a copy per parameter, 3-4% of a step on one H200: benchmarks/one_gpu_levers.py). Keep
        them from forward to backward instead, as single's autocast keeps its casts (same memory as single's);
        fsdp.keep_gathered_one_rank false turns it off; CPU offload (a choice for the least GPU memory) keeps
        resharding. The rule is declared once, presets.FSDPSpec.keeps_gathered, which the planner calls too."""
        f = self.cfg.fsdp
        return presets.FSDP.keeps_gathered(f.keep_gathered_one_rank, f.cpu_offload, self.mesh.shape[-1],
                                           self.compute_dtype.itemsize, self.param_dtype.itemsize)

    @classmethod
    def host_collectives(cls, cfg) -> bool:
        return cfg.fsdp.cpu_offload  # the shards, gradients and step live on the host

    def optimizer_kernel(self) -> dict:
        # fp16 with the step offloaded from a GPU: the grad scaler hands a fused optimizer its found-inf flag on the
        # GPU, and the fused CPU kernel copies it back without waiting for it; with foreach the scaler reads it first
        if self.scaler is not None and self.cfg.fsdp.cpu_offload and self.env.device.type == "cuda":
            return {"foreach": True}
        return super().optimizer_kernel()

    def sync(self, model, enabled: bool):
        model.set_requires_gradient_sync(enabled)  # off: gradients accumulate unsharded, no reduce
        return contextlib.nullcontext()

    def autocast(self):
        return contextlib.nullcontext()  # MixedPrecisionPolicy casts

    def describe(self) -> str:
        f = self.cfg.fsdp
        mode = "full shard" if self.reshard else "shard grad op"
        if f.reshard_after_forward and not self.reshard:
            mode += " (one rank: gathered weights kept from forward to backward)"
        return (f"fsdp ({mode}, "
                f"{self.n_units} units + root, mesh {tuple(self.mesh.shape)}"
                + (", cpu offload" if f.cpu_offload else "") + ")")
