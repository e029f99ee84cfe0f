"""The strategy registry: every strategy family declared once, with its presets and planner rules.

Pure data and pure functions, no torch import, so the config layer, the CLI, bench and the
planner (which must not import torch.distributed) read it freely; `strategies.get` imports the
class it names only when a run needs it.

A family (`StrategySpec`) says which class runs it, which cost model the planner prices it with
(plan/costs/), the config section its options live in, the optional package it needs, and the
rules the planner shares with the class (how many ranks share the sharded state, whether FSDP
keeps gathered weights). A preset (`Preset`) is one
string that selects a family plus option defaults (config keys, dotted for sections), with a
one-line description and its rank in the planner's tie-break (lower is simpler). Options a
user sets explicitly win over a preset's. Adding a strategy is one class in strategies/, its cost
model in plan/costs/, and one `register(StrategySpec(...))` below naming both
(docs/strategies/README.md, "Adding a strategy").
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Preset:
    """One `--strategy` name: a family plus option defaults."""

    name: str
    base: str  # the StrategySpec (family) it runs on
    options: dict  # config key (dotted for a section) -> value, under what the user sets
    description: str  # one line, shown by `plan`, `bench` and the docs
    simplicity: int  # the planner's tie-break among equally fast presets: lower is simpler
    planned_on: str = "any"  # where `plan` lists it: any | one-rank | multi-node

    def planned_for(self, world: int, nodes: int) -> bool:
        """Whether `plan` lists this preset for a setup (the configured one is planned anyway)."""
        return {"any": True, "one-rank": world == 1, "multi-node": nodes > 1}[self.planned_on]


@dataclass(frozen=True)
class StrategySpec:
    """A strategy family: the class that runs it and what the rest of shardwise needs to know about it."""

    name: str  # base strategy name, e.g. 'fsdp'
    cls: str  # "module:Class", imported lazily by strategies.get
    presets: tuple = ()  # its Preset entries, in listing order
    section: str | None = None  # the config section holding its options ('fsdp', 'deepspeed'), if any
    requires: tuple | None = None  # (importable module, how to install it) for an optional backend
    shards_state: bool = False  # whether parameters/gradients/optimizer states are split across ranks
    composes: tuple = ()  # the FEATURES it composes with (check_composition refuses the others)
    one_replica: bool = False  # its world is one replica: tp x sp ranks, no data-parallel ranks (replica_world)
    # the planner's cost model of the family: "module:Class" (imported by plan.costs.cost_of when a plan needs it, as
    # strategies.get imports `cls`), or a plan.costs.CostModel class or instance
    cost: object = None

    @property
    def replicates(self) -> bool:
        """Data-parallel replicas: every rank of several holds all of the state (ddp)."""
        return not self.shards_state and not self.one_replica

    @property
    def tp_in_data_parallel(self) -> bool:
        """Tensor parallelism inside data-parallel ranks (FSDP x TP); a one-replica family's TP has no such ranks."""
        return "tensor_parallel" in self.composes and not self.one_replica

    def dp_split(self, cfg, dp: int, local_world_size: int) -> tuple[int, int]:
        """(dp_replicate, dp_shard): how the family lays its `dp` data-parallel ranks on the mesh. A family that
        shards its state shards over every data-parallel rank; any other holds a full replica on each."""
        return (1, dp) if self.shards_state else (dp, 1)

    def shard_ranks(self, world: int, gpus_per_node: int, hybrid: bool = False, shard_group_size: int = 0) -> int:
        """How many ranks share one copy of the sharded state (1: every rank holds all of it)."""
        if not self.shards_state:
            return 1
        if hybrid:
            return shard_group_size or gpus_per_node
        return world


@dataclass(frozen=True)
class FSDPSpec(StrategySpec):
    def dp_split(self, cfg, dp: int, local_world_size: int) -> tuple[int, int]:
        """Shard over every data-parallel rank, or for HSDP (fsdp.hybrid) within groups of fsdp.shard_group_size
        ranks (a node by default) and replicate across the groups."""
        f = cfg.fsdp
        if not f.hybrid:
            return 1, dp
        sgs = f.shard_group_size or local_world_size
        if sgs < 1 or dp % sgs:
            from shardwise.errors import ShardwiseError

            raise ShardwiseError(f"fsdp.shard_group_size {sgs} must divide the world size {dp}")
        return dp // sgs, sgs

    @staticmethod
    def keeps_gathered(keep_gathered_one_rank: bool, cpu_offload: bool, shard_ranks: int,
                       compute_bytes: int, stored_bytes: int) -> bool:
        """Whether FSDP keeps the gathered compute-dtype weights from forward to backward instead of resharding:
        on one rank per shard group, computing in a narrower dtype than the stored weights, nothing is sharded, so
        resharding would only free the casts and make them again in backward (the memory single's autocast casts
        take). Not with CPU offload (that preset is for the least GPU memory), not with
        fsdp.keep_gathered_one_rank false. FSDPStrategy and the planner both call this."""
        return keep_gathered_one_rank and not cpu_offload and shard_ranks == 1 and compute_bytes < stored_bytes


SPECS: dict[str, StrategySpec] = {}  # base name -> spec, in registration order
PRESETS: dict[str, Preset] = {}  # preset name -> preset, in registration order (the order `plan` lists them)


def register(spec: StrategySpec) -> StrategySpec:
    """Add a strategy family and its presets; names must be new."""
    if spec.name in SPECS:
        raise ValueError(f"strategy family '{spec.name}' is registered twice")
    if any(p.base != spec.name for p in spec.presets):
        raise ValueError(f"a preset of family '{spec.name}' names another family")
    SPECS[spec.name] = spec
    for p in spec.presets:
        add_preset(p)
    return spec


def add_preset(preset: Preset) -> Preset:
    """Add one preset to a registered family (register() does this for the presets a spec lists)."""
    if preset.name in PRESETS or preset.name in SPECIAL:
        raise ValueError(f"strategy preset '{preset.name}' is registered twice")
    if preset.base not in SPECS:
        raise ValueError(f"preset '{preset.name}' names family '{preset.base}', which is not registered")
    PRESETS[preset.name] = preset
    return preset


# Names accepted by --strategy besides the presets.
SPECIAL = ("auto",)

@dataclass(frozen=True)
class Feature:
    """A setting that composes with some strategy families only (StrategySpec.composes lists those)."""

    key: str  # the config key that turns it on: where its refusal points
    refusal: str  # the refusal under a family that does not compose: {strategy}, {value}, {families} filled in
    with_auto: bool = False  # whether --strategy auto takes it (auto then picks among the families that compose)


FEATURES: dict[str, Feature] = {
    "float8": Feature(
        "float8", "float8 linears run under {families}, not '{strategy}' (DeepSpeed swaps the linears' parameters "
        "itself; auto picks its own strategy); use --strategy single, ddp or fsdp"),
    "qlora": Feature(
        "tuner", "QLoRA's 4-bit base is not sharded by '{strategy}'; use --strategy ddp (or single) for QLoRA, "
        "or --tuner lora with fsdp/zero*", with_auto=True),
    "tensor_parallel": Feature(
        "tensor_parallel", "tensor_parallel {value} composes with strategy single (pure TP) or the fsdp presets "
        "(FSDP x TP), not '{strategy}' (DDP and ZeRO do not wrap DTensor weights; auto chooses its own TP degree: "
        "leave tensor_parallel at 1 with it); use --strategy fsdp"),
}

SINGLE = register(StrategySpec(
    "single", "shardwise.strategies.single:SingleStrategy", cost="shardwise.plan.costs.replica:SingleCost",
    composes=("float8", "qlora", "tensor_parallel"),
    one_replica=True,
    presets=(Preset("single", "single", {}, "one process, no wrapping", 0, planned_on="one-rank"),)))

DDP = register(StrategySpec(
    "ddp", "shardwise.strategies.ddp:DDPStrategy", cost="shardwise.plan.costs.replica:DDPCost",
    composes=("float8", "qlora"),
    presets=(Preset("ddp", "ddp", {},
                    "DistributedDataParallel: full replica per rank, one all-reduce of gradients per step", 1),)))

FSDP = register(FSDPSpec(
    "fsdp", "shardwise.strategies.fsdp:FSDPStrategy", cost="shardwise.plan.costs.fsdp:FSDPCost", section="fsdp",
    shards_state=True,
    composes=("float8", "tensor_parallel"),
    presets=(
        Preset("fsdp", "fsdp", {"fsdp.reshard_after_forward": True},
               "FSDP2 fully_shard, full shard (ZeRO-3-like): params, grads and optimizer states sharded", 2),
        Preset("fsdp-grad-op", "fsdp", {"fsdp.reshard_after_forward": False},
               "FSDP2, params kept gathered between forward and backward (ZeRO-2-like)", 3),
        Preset("fsdp-offload", "fsdp", {"fsdp.reshard_after_forward": True, "fsdp.cpu_offload": True},
               "FSDP2 full shard with parameters, gradients and optimizer step on the CPU", 8),
        Preset("hybrid", "fsdp", {"fsdp.reshard_after_forward": True, "fsdp.hybrid": True},
               "HSDP: shard within a node, replicate across nodes (2-D device mesh)", 4, planned_on="multi-node"),
    )))

DEEPSPEED = register(StrategySpec(
    "deepspeed", "shardwise.strategies.deepspeed:DeepSpeedStrategy", cost="shardwise.plan.costs.deepspeed:DeepSpeedCost",
    section="deepspeed", shards_state=True,
    requires=("deepspeed", "pip install 'shardwise[deepspeed]'"),
    presets=(
        Preset("zero1", "deepspeed", {"deepspeed.stage": 1}, "DeepSpeed ZeRO-1: optimizer states sharded", 5),
        Preset("zero2", "deepspeed", {"deepspeed.stage": 2},
               "DeepSpeed ZeRO-2: optimizer states and gradients sharded", 6),
        Preset("zero3", "deepspeed", {"deepspeed.stage": 3},
               "DeepSpeed ZeRO-3: parameters, gradients and optimizer states sharded", 7),
        Preset("zero2-offload", "deepspeed", {"deepspeed.stage": 2, "deepspeed.offload_optimizer": True},
               "DeepSpeed ZeRO-2 with the optimizer states and step on the CPU", 9),
        Preset("zero3-offload", "deepspeed", {"deepspeed.stage": 3, "deepspeed.offload_optimizer": True,
                                              "deepspeed.offload_params": True},
               "DeepSpeed ZeRO-3 with parameters and optimizer states on the CPU", 10),
    )))


def spec_of(name: str) -> StrategySpec:
    """The family of a preset name ('zero3-offload' -> the deepspeed spec)."""
    return SPECS[PRESETS[name].base]


def base_strategy(name: str) -> str:
    """The strategy family a preset name runs on ('zero3-offload' -> 'deepspeed')."""
    return PRESETS[name].base


def section_applies(section: str | None, base: str) -> bool:
    """Whether options of a config section (None: a top-level key) apply to a strategy family."""
    owners = {s.section: s.name for s in SPECS.values() if s.section}
    return section not in owners or owners[section] == base


def trains_in_process(name: str, world_size: int) -> bool:
    """Whether `shardwise train` trains in its own process (one `single` rank) rather than in
    workers started by torchrun's elastic agent (every other strategy, even on one rank)."""
    return world_size == 1 and base_strategy(name) == "single"


def known_names() -> list[str]:
    return list(PRESETS) + list(SPECIAL)


def composes(strategy: str, feature: str) -> bool:
    """Whether a --strategy name (a preset or auto) runs with a FEATURES setting on."""
    if strategy in SPECIAL:
        return FEATURES[feature].with_auto
    return feature in spec_of(strategy).composes


def family_names(feature: str) -> str:
    """The families a feature composes with, as a refusal names them: 'single, ddp or the fsdp presets'."""
    names = [s.name if [p.name for p in s.presets] == [s.name] else f"the {s.name} presets"
             for s in SPECS.values() if feature in s.composes]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def check_composition(strategy: str, settings: dict) -> list[tuple[str, str]]:
    """(config key, one-line refusal) for each FEATURES setting that is on in `settings` (feature name -> its
    value; falsy or 1 is off) and that `strategy` does not compose with. The config, the planner's preset list and
    the UI all ask this one question."""
    out = []
    for name, value in settings.items():
        on = value not in (None, False, 0, 1, "") if name == "tensor_parallel" else bool(value)
        if on and not composes(strategy, name):
            f = FEATURES[name]
            out.append((f.key, f.refusal.format(strategy=strategy, value=value, families=family_names(name))))
    return out


def replica_world(strategy: str, tp: int, sp: int) -> int | None:
    """The world size a one-replica family (single) runs: its tp x sp ranks; None for the families whose other
    ranks are data-parallel."""
    if strategy in PRESETS and spec_of(strategy).one_replica:
        return tp * sp
    return None


def data_parallel_degree(world: int, tp: int, sp: int) -> int:
    """The data-parallel ranks of a world: what is left once every rank of a tp x sp group reads the same rows."""
    return world // (tp * sp)
