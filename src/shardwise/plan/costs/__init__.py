"""Each strategy family's cost model: what the planner asks a family instead of testing its name.

A family's registration (presets.StrategySpec.cost) names its cost model as "module:Class"; `cost_of` imports it
when a plan first needs it, as strategies.get does for the class that runs the family. A cost model declares
- its states: which of parameters, gradients and optimizer states it shards and what buffers it keeps at each
  moment of a step (`states`, filling a memory.States);
- how it runs mixed precision (`autocast`: autocast over the stored weights, or weights cast by the wrapper) and
  what else changes the activations (`linear_saves_input`, `compile_factor`, `gathers_root`);
- its collectives per optimizer step (`collectives`) and what of them overlaps with compute (`exposed`);
- its fixed per-step work (`overhead`) and where its optimizer step runs (`host_step_rate`).
Options that tell presets of one family apart (offload, hybrid, stage) are fields of memory.Opts, read here.
"""

from __future__ import annotations

import importlib

from shardwise import presets
from shardwise.plan.calibration import value
from shardwise.plan.collective import coll_time


class CostModel:
    """The defaults: a family whose every rank holds everything, under autocast, with no collective of its own."""

    autocast = True  # mixed precision by autocast over the stored weights (fp32 residual stream over fp32 weights)
    adapters_in_compute_dtype = False  # eager LoRA adapters computed in the compute dtype (no fp32 casts of inputs)
    gathers_root = False  # the root unit (embedding, final norm, head) is gathered while the loss head runs
    counts_own_accumulation = False  # states() counts the earlier micro-batches' gradients itself
    wraps_units = False  # shards in units under a wrap policy (fsdp.wrap), each gathered around its use
    hybrid_preset = None  # the preset that shards within a node and replicates across nodes, if the family has one
    persistent_grads = False  # gradients allocated once and kept between steps (DDP's bucket views)
    simulated = True  # `plan --simulate` runs it under fake tensors
    not_simulated = ""  # why not, when simulated is False (one line)

    def linear_saves_input(self, job, o) -> bool:
        """Whether the linears save their uncast input and weight (no autocast weight copies kept)."""
        return False

    def compile_factor(self, o) -> float:
        """Saved activations of a compiled block relative to eager."""
        return value("compile_act_factor")

    def offloads(self, o) -> bool:
        """Whether this preset's state lives in host RAM (an offload preset)."""
        return False

    def without_offload(self, o) -> tuple[str, str]:
        """(the preset that runs this one without offload, the config key that turns its offload on)."""
        raise NotImplementedError

    def gathers_params(self, o) -> bool:
        """Whether parameters are sharded and all-gathered around their use (a slow link hurts every step)."""
        return False

    def states(self, spec, job, o, N, st) -> None:
        """Fill `st` (a memory.States): params, grads and optimizer bytes per rank (N ranks share a shard), what
        offload keeps in host RAM, and the buffers alive at moment A (end of forward), B (end of backward) or all
        step (plan/memory.py's docstring names the moments). Every family declares this."""
        raise NotImplementedError

    def extra_moment(self, spec, job, o, N, st, states, per_layer, act_detail) -> tuple[float, str, dict]:
        """A moment of the step the family adds to the peak's (bytes, phase label, its buffers); none by default."""
        return 0.0, "", {}

    def collectives(self, spec, job, o, shard_n, sizes) -> list:
        """The family's collectives of one optimizer step (collective.Coll: op, full-buffer bytes, ranks, link,
        times per step, phase; host transfers on the "host" link); `sizes` is comm.Sizes. None by default."""
        return []

    def exposed(self, spec, job, o, net, links, t_fwd, t_bwd, acc: float) -> float:
        """`acc` plus the seconds of the data-parallel collectives `net` not hidden behind compute (added in this
        order, term by term): by default none is hidden."""
        return acc + sum(coll_time(cl, links) * cl.per_step for cl in net)

    def overhead(self, spec, job, o, shard_n, comp, gpu_s) -> float:
        """Seconds per optimizer step of the family's own work on a GPU (beside FLOPs, collectives, optimizer)."""
        return 0.0

    def host_step_rate(self, o) -> float | None:
        """Parameters per second per node of an optimizer step run on the host; None: on the device."""
        return None


_LOADED: dict[tuple, CostModel] = {}  # (family, its cost reference) -> the model


def cost_of(family: str) -> CostModel:
    """The cost model a registered family names (presets.StrategySpec.cost: "module:Class" or a CostModel)."""
    ref = presets.SPECS[family].cost
    model = _LOADED.get((family, ref))
    if model is None:
        made = ref
        if isinstance(made, str):
            mod, _, cls = made.partition(":")
            made = getattr(importlib.import_module(mod), cls)
        model = made() if isinstance(made, type) else made
        _LOADED[(family, ref)] = model
    return model
