"""Each strategy family's cost model (plan/costs/): every registered family names one, and a new family is one
registration plus its cost model, planned with no other planner edit."""

from __future__ import annotations

import pytest

from shardwise import presets
from shardwise.plan.collective import Coll
from shardwise.plan.costs import CostModel, cost_of
from shardwise.plan.inputs import make_setup
from shardwise.plan.memory import Job
from shardwise.plan.model_presets import resolve_model


def test_every_registered_family_has_a_cost_model():
    for name, spec in presets.SPECS.items():
        assert spec.cost, f"family '{name}' names no cost model"
        model = cost_of(name)
        assert isinstance(model, CostModel), name
        assert type(model).states is not CostModel.states, f"{name}'s cost model declares no states"


class ToyCost(CostModel):
    """A made-up family: every rank keeps the weights, half of the optimizer states (split over 2 ranks whatever
    the world), and all-reduces its gradients once per step, nothing overlapped."""

    def states(self, spec, job, o, N, st) -> None:
        st.params, st.grads, st.opt = st.frozen + st.tw * st.P_t, st.tw * st.P_t, st.tw * st.P_t

    def collectives(self, spec, job, o, shard_n, sizes) -> list:
        return [Coll("all_reduce", job.w * sizes.P_t, job.world, sizes.flat, 1, "step")]


@pytest.fixture
def toy_family():
    spec = presets.register(presets.StrategySpec(
        "toy", "tests.unit.test_plan_costs:NoClass", cost=ToyCost,
        presets=(presets.Preset("toy", "toy", {}, "a toy family", 11),)))
    try:
        yield spec
    finally:
        presets.SPECS.pop("toy")
        presets.PRESETS.pop("toy")


def test_a_new_family_is_planned_from_its_registration_and_cost_model(toy_family):
    from shardwise.plan.decide import plan_model

    spec = resolve_model("qwen2.5-0.5b")
    setup = make_setup(gpus=2, gpu_memory=80, gpu_type="H100", use_doctor=False)
    plan = plan_model(spec, Job(world=2, micro_batch=1, seq_len=512), setup)
    toy, ddp = plan.for_strategy("toy"), plan.for_strategy("ddp")
    P, w = spec.total_params, 4  # fp32 weights, gradients and Adam moments
    assert toy.memory.params == ddp.memory.params == P * w
    assert toy.memory.optimizer == P * w == ddp.memory.optimizer / 2  # what ToyCost declares
    [allreduce] = [c for c in toy.timing.collectives if not c.kind]
    assert (allreduce.op, allreduce.phase, allreduce.bytes) == ("all_reduce", "step", w * P)
    # nothing overlapped (the default exposure): its all-reduce is all exposed, unlike ddp's bucketed one
    assert toy.timing.exposed_comm_s > ddp.timing.exposed_comm_s
    assert toy.fits and toy.strategy in [s.strategy for s in plan.strategies]
