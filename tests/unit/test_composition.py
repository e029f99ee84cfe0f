"""What combines with what is declared once, on the strategy registry (presets.StrategySpec.composes): the config
refuses exactly the pairings the registry does not declare, with the refusal the registry's Feature generates,
and the planner lists exactly the presets that compose."""

from __future__ import annotations

import pytest

from shardwise import config, presets
from shardwise.errors import ShardwiseError
from shardwise.plan.decide import preset_names
from shardwise.plan.inputs import make_setup

# each feature turned on as a user would, with what else it needs to pass the config's other rules
ON = {"float8": {"float8": True},
      "qlora": {"tuner": "qlora"},
      "tensor_parallel": {"tensor_parallel": 2, "nproc_per_node": 2}}


def _load(strategy: str, **flags):
    return config.load_config(None, {"strategy": (strategy, "flag --strategy"),
                                     **{k: (v, f"flag --{k.replace('_', '-').replace('.', '-')}") for k, v in flags.items()}}).cfg


@pytest.mark.parametrize("feature", sorted(presets.FEATURES))
@pytest.mark.parametrize("strategy", presets.known_names())
def test_the_config_refuses_exactly_the_pairings_the_registry_does_not_declare(strategy, feature):
    flags = dict(ON[feature])
    if strategy == "single" and feature == "tensor_parallel":
        pass  # one replica of 2 ranks
    elif presets.replica_world(strategy, 1, 1) == 1:
        flags.pop("nproc_per_node", None)
    if strategy == "hybrid":
        flags["fsdp.shard_group_size"] = 1  # hybrid groups within one node
    refusals = presets.check_composition(strategy, {feature: next(iter(ON[feature].values()))})
    if presets.composes(strategy, feature):
        assert refusals == []
        _load(strategy, **flags)  # no refusal of the pairing (nothing else is wrong with these flags)
    else:
        (key, why), = refusals
        assert key == presets.FEATURES[feature].key and f"'{strategy}'" in why and "\n" not in why
        with pytest.raises(ShardwiseError) as e:
            _load(strategy, **flags)
        assert str(e.value) == f"flag --{key.replace('_', '-')}: {why}"


def test_each_family_declares_only_known_features_and_single_is_one_replica():
    for spec in presets.SPECS.values():
        assert set(spec.composes) <= set(presets.FEATURES), spec.name
    assert presets.replica_world("single", 2, 2) == 4 and presets.replica_world("fsdp", 2, 2) is None
    assert presets.data_parallel_degree(8, 2, 2) == 2
    assert presets.family_names("float8") == "single, ddp or the fsdp presets"


@pytest.mark.parametrize("tp,sp,world", [(1, 1, 8), (2, 1, 8), (2, 1, 2), (2, 2, 4)])
@pytest.mark.parametrize("float8", [False, True])
def test_the_planner_lists_the_presets_that_compose(tp, sp, world, float8):
    setup = make_setup(None, gpus=world, nodes=1, gpu_memory=80, use_doctor=False)
    names = preset_names(setup, tp=tp, sp=sp, float8=float8)
    settings = {"float8": float8, "tensor_parallel": tp}
    for name in presets.PRESETS:
        one = presets.replica_world(name, tp, sp)
        expected = not presets.check_composition(name, settings) and (
            one == world if tp > 1 and one is not None else presets.PRESETS[name].planned_for(world, 1))
        assert (name in names) == expected, (name, names)
