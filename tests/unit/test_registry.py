"""The strategy registry (presets.py): a preset declared once is known to the config, the launcher's lookup,
the planner and bench; the planner and FSDPStrategy share one rule for what stays gathered."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from shardwise import config, presets, strategies
from shardwise.plan import plan_model, resolve_model
from shardwise.plan.inputs import make_setup
from shardwise.plan.memory import Job


@pytest.fixture
def registry():
    """Registrations made by a test are undone after it."""
    specs, known = dict(presets.SPECS), dict(presets.PRESETS)
    yield presets
    presets.SPECS.clear()
    presets.SPECS.update(specs)
    presets.PRESETS.clear()
    presets.PRESETS.update(known)


def test_a_new_preset_is_one_registration_and_every_layer_knows_it(registry):
    registry.add_preset(registry.Preset("fsdp-no-prefetch", "fsdp", {"fsdp.prefetch": False},
                                        "FSDP2 full shard without forward/backward prefetch", 11))
    # the config layer: accepted by --strategy, its option defaults applied under the user's
    res = config.load_config(None, {"strategy": ("fsdp-no-prefetch", "--strategy")})
    assert res.cfg.fsdp.prefetch is False and res.cfg.fsdp.reshard_after_forward is True
    assert "fsdp-no-prefetch" in registry.known_names()
    # the launcher's lookup: the family's class
    from shardwise.strategies.fsdp import FSDPStrategy

    assert strategies.get("fsdp-no-prefetch") is FSDPStrategy
    # the planner: planned with its options, described by its line
    setup = make_setup(gpus=8, gpu_memory=80, use_doctor=False)
    plan = plan_model(resolve_model("llama-3.2-1b"),
                      Job(world=8, nodes=1, micro_batch=1, seq_len=2048, device_mem_gib=80), setup)
    sp = plan.for_strategy("fsdp-no-prefetch")
    assert sp.opts.prefetch is False and sp.base == "fsdp" and "without" in sp.description
    # no prefetch hides less of the all-gathers behind compute than fsdp does
    assert sp.timing.exposed_comm_s > plan.for_strategy("fsdp").timing.exposed_comm_s
    # bench: the FSDP section applies to it, DeepSpeed's does not
    assert registry.section_applies("fsdp", "fsdp") and not registry.section_applies("deepspeed", "fsdp")


def test_names_are_registered_once(registry):
    with pytest.raises(ValueError, match="twice"):
        registry.add_preset(registry.Preset("zero2", "deepspeed", {}, "again", 99))
    with pytest.raises(ValueError, match="twice"):
        registry.register(registry.StrategySpec("fsdp", "x:Y"))
    with pytest.raises(ValueError, match="not registered"):
        registry.add_preset(registry.Preset("tp", "tensor", {}, "no such family", 99))


def test_every_preset_has_a_description_and_a_distinct_simplicity_with_single_simplest():
    ranks = [p.simplicity for p in presets.PRESETS.values()]
    assert len(set(ranks)) == len(ranks)
    assert min(presets.PRESETS.values(), key=lambda p: p.simplicity).name == "single"
    assert all(p.description and p.base in presets.SPECS for p in presets.PRESETS.values())


@pytest.mark.parametrize("keep,offload,ranks,c,w,expect", [
    (True, False, 1, 2, 4, True),  # one rank, bf16 over fp32: kept gathered
    (True, False, 2, 2, 4, False),  # sharded: reshard
    (True, True, 1, 2, 4, False),  # offload: reshard
    (False, False, 1, 2, 4, False),  # turned off
    (True, False, 1, 4, 4, False),  # fp32 compute: nothing to keep
])
def test_fsdp_strategy_and_planner_share_the_keeps_gathered_rule(keep, offload, ranks, c, w, expect):
    import torch

    from shardwise.plan.memory import Opts, keeps_gathered
    from shardwise.strategies.fsdp import FSDPStrategy

    cfg = config.Config()
    cfg.fsdp.keep_gathered_one_rank, cfg.fsdp.cpu_offload = keep, offload
    s = FSDPStrategy.__new__(FSDPStrategy)  # the rule only: no process group needed
    # the shard degree as the strategy reads it: its mesh's last dimension (or the run's ParallelDims.dp_shard)
    s.cfg, s.mesh, s.dims = cfg, SimpleNamespace(shape=(ranks,)), SimpleNamespace(dp_shard=ranks)
    s.compute_dtype = torch.bfloat16 if c == 2 else torch.float32
    s.param_dtype = torch.float32 if w == 4 else torch.bfloat16
    assert s.keeps_gathered() is expect
    assert keeps_gathered(Opts("fsdp", keep_gathered_one_rank=keep, cpu_offload=offload), ranks, c, w) is expect
