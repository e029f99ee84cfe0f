"""The rules on the parallel degrees, each written once: how many processes a one-replica strategy runs, that the
world splits into whole tensor x sequence groups, that tensor and Ulysses ranks get whole attention heads.
The flags stage judges the first two where the world size is given; the launcher judges them where it filled the
world in (judged_with_flags), and the heads rules once it has read the model's config.json."""

from __future__ import annotations

from shardwise import presets
from shardwise.preflight import Refusal

WORLD = "(nnodes x nproc_per_node)"


def judged_with_flags(flagged, cfg) -> bool:
    """Whether the flags stage (config.load_config, on `flagged`) already judged the world rules for `cfg`: the
    world size was given and neither it, the strategy nor the degrees changed since (--nproc-per-node 0 is filled
    in from the machine, --strategy auto chooses a strategy and may choose degrees)."""
    def key(c):
        return c.strategy, c.tensor_parallel, c.sequence_parallel, c.nproc_per_node, c.nnodes

    return bool(flagged.nproc_per_node) and key(flagged) == key(cfg)


def one_replica(strategy: str, tp: int, sp: int, nnodes: int, nproc: int) -> Refusal | None:
    """A one-replica strategy (single) runs its tp x sp ranks on one node, no data-parallel ranks
    (presets.replica_world); `nproc` 0 is filled in with them, 1 runs one process."""
    replica = presets.replica_world(strategy, tp, sp)
    if replica is None or (nnodes == 1 and nproc in (0, 1, replica)):
        return None
    given = f", not {nproc * nnodes}" if nproc else ""
    return Refusal("strategy", f"strategy '{strategy}' runs one process (or --tensor-parallel N processes, one "
                               f"replica, times --sequence-parallel M with it){given}; use --strategy ddp (or fsdp) "
                               "for more than one")


def world_divides(world: int, tp: int, sp: int) -> Refusal | None:
    """The ranks split into whole tensor x sequence groups, each reading the same rows; the groups are the
    data-parallel ranks (presets.data_parallel_degree)."""
    rest = f" must divide the {world} ranks {WORLD}; the rest are data-parallel"
    if world % tp:
        return Refusal("tensor_parallel", f"tensor_parallel {tp}{rest}")
    if world % sp:
        return Refusal("sequence_parallel", f"sequence_parallel {sp}{rest}")
    if world % (sp * tp):
        return Refusal("sequence_parallel", f"sequence_parallel {sp} x tensor_parallel {tp}{rest}")
    return None


def tensor_heads(heads: int, kv: int, tp: int, world: int) -> Refusal | None:
    """Tensor parallelism gives each rank whole attention and KV heads."""
    if not (heads % tp or kv % tp):
        return None
    fits = [d for d in range(2, kv + 1) if heads % d == 0 and kv % d == 0 and world % d == 0]
    hint = f"use --tensor-parallel {fits[-1]}" if fits else "use --tensor-parallel 1"
    return Refusal("tensor_parallel", f"tensor parallelism gives each of the {tp} ranks whole attention heads, and "
                                      f"{tp} does not divide the model's {heads} attention heads and {kv} KV heads; "
                                      f"{hint}")


def ulysses_heads(all_heads: int, tp: int, sp: int, world: int, mode: str) -> Refusal | None:
    """Ulysses (--sp-mode ulysses) gives each rank of a sequence group whole query heads of those its tensor rank
    holds (heads / tp); ring and auto take any degree."""
    heads = all_heads // tp
    if mode != "ulysses" or not heads % sp:
        return None
    fits = [d for d in range(2, heads + 1) if heads % d == 0 and world % (d * tp) == 0]
    hint = f"use --sequence-parallel {fits[-1]}" if fits else "use --sequence-parallel 1"
    return Refusal("sequence_parallel", f"Ulysses splits the model's {heads} attention heads{per_tensor_rank(all_heads, tp)}"
                                        f" over the {sp} ranks of a sequence-parallel group, and {sp} does not divide "
                                        f"{heads}; {hint}, or --sp-mode ring / auto (ring attention for degrees beyond "
                                        "the heads)")


def per_tensor_rank(all_heads: int, tp: int) -> str:
    return f" ({all_heads} / tensor_parallel {tp} per tensor rank)" if tp > 1 else ""
