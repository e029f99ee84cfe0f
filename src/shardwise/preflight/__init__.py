"""The rules a run is judged by before anything is written, each defined once, in the order they are cheap to judge.

A rule is a small function that reads the run's settings (and, for the later stages, what the launcher found on
the machine and in the model directory) and gives a `Refusal`, the config key it points at and one line that says
what is wrong and what to do, or None. Rules are grouped by what they need to be judged:

    flags     the settings alone (config.load_config runs these: every run, `plan`, the UI and bench)
    runtime   the machine: GPUs, bf16, float8 (launch/preflight.py gathers the facts)
    model     the model directory: its heads, family and sizes (launch/preflight.py)
    data      the records (launch/prep.py)
    fit       the planner's estimate (launch/preflight.check_fit)

A rule that needs the world size (nnodes x nproc_per_node) is judged with the flags when --nproc-per-node is
given, else once the launcher has filled it in; `judged_with_flags` tells the launcher which. The composition of
strategies with settings is the registry's (presets.check_composition, replica_world, data_parallel_degree).

No torch and nothing of shardwise above the ground floor: config.py imports this package.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, NamedTuple

from shardwise.errors import ShardwiseError


class Refusal(NamedTuple):
    """Why a run is refused: the key the line points at (its flag, file:line or preset comes from the run's
    origins) and what is wrong, with what to do."""

    key: str
    message: str


def first(rules: Iterable[tuple[bool, str, str]]) -> Refusal | None:
    """The first of (ok, key, message) that is not ok. `rules` is read lazily (a generator), so a rule may rely on
    the ones before it (a degree checked >= 1 before something is divided by it)."""
    for ok, key, message in rules:
        if not ok:
            return Refusal(key, message)
    return None


def refuse(res, refusal: Refusal | None) -> None:
    """Raise the refusal as one line: where its key came from, then its message."""
    if refusal is not None:
        raise ShardwiseError(f"{res.where(refusal.key)}: {refusal.message}")


def run(res, checks: Iterable[Callable], *facts) -> None:
    """Judge `checks` in order (each takes the Resolved config and `facts`, and gives a Refusal or None); the first
    refusal is raised."""
    for check in checks:
        refuse(res, check(res, *facts))


def lines(refusals: Iterator[Refusal | None]) -> Refusal | None:
    """The first refusal a series of rule calls gives."""
    return next((r for r in refusals if r is not None), None)
