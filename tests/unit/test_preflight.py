"""The preflight rules (src/shardwise/preflight) and the launcher's RunPlan: each rule written once refuses in one
line naming its key, the world rules are judged once (with the flags where the world size is given, else by the
launcher), and the plan the launcher writes the run from is frozen and carries the mesh degrees."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from shardwise import config
from shardwise.errors import ShardwiseError
from shardwise.launch import preflight
from shardwise.preflight import Refusal, degrees
from shardwise.preflight import flags as flag_rules


def load(**values):
    return config.load_config(None, {k: (v, f"flag --{k.replace('_', '-').replace('.', '-')}")
                                     for k, v in values.items()})


def test_the_run_plan_is_frozen_and_carries_the_mesh_degrees(tmp_path):
    res = load(strategy="hybrid", nproc_per_node=4, nnodes=2, rdzv_endpoint="node0:29500")
    plan = preflight.run_plan(res.cfg, 8, "tiny", str(tmp_path / "data.safetensors"))
    assert (plan.world, plan.dp_replicate, plan.dp_shard, plan.sp, plan.tp) == (8, 2, 4, 1, 1)
    assert plan.dp == 8 and plan.strategy == "hybrid" and not plan.in_process
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.world = 4
    res.cfg.strategy = "ddp"  # the plan holds a copy of its own
    assert plan.cfg.strategy == "hybrid"

    res = load(strategy="fsdp", tensor_parallel=2, sequence_parallel=2, nproc_per_node=8)
    plan = preflight.run_plan(res.cfg, 8, "tiny", "d")
    assert (plan.dp_replicate, plan.dp_shard, plan.sp, plan.tp) == (1, 2, 2, 2)
    res = load(strategy="ddp", nproc_per_node=4)
    assert (preflight.run_plan(res.cfg, 4, "tiny", "d").dp_replicate, preflight.run_plan(res.cfg, 4, "tiny", "d")
            .dp_shard) == (4, 1)
    res = load(strategy="single")
    assert preflight.run_plan(res.cfg, 1, "tiny", "d").in_process


@pytest.mark.parametrize("rule, want", [
    (lambda: degrees.one_replica("single", 2, 1, 1, 4), ("strategy", "strategy 'single' runs one process (or "
                                                         "--tensor-parallel N processes, one replica, times "
                                                         "--sequence-parallel M with it), not 4; use --strategy ddp")),
    (lambda: degrees.world_divides(4, 3, 1), ("tensor_parallel", "tensor_parallel 3 must divide the 4 ranks")),
    (lambda: degrees.world_divides(2, 1, 3), ("sequence_parallel", "sequence_parallel 3 must divide the 2 ranks")),
    (lambda: degrees.world_divides(6, 2, 2), ("sequence_parallel",
                                              "sequence_parallel 2 x tensor_parallel 2 must divide the 6 ranks")),
    (lambda: degrees.tensor_heads(28, 4, 8, 8), ("tensor_parallel", "tensor parallelism gives each of the 8 ranks "
                                                 "whole attention heads, and 8 does not divide the model's 28 "
                                                 "attention heads and 4 KV heads; use --tensor-parallel 4")),
    (lambda: degrees.ulysses_heads(4, 2, 4, 8, "ulysses"), ("sequence_parallel", "Ulysses splits the model's 2 "
                                                            "attention heads (4 / tensor_parallel 2 per tensor rank)")),
])
def test_each_degree_rule_refuses_with_its_key_and_line(rule, want):
    got = rule()
    assert isinstance(got, Refusal) and got.key == want[0] and got.message.startswith(want[1]), got
    assert "\n" not in got.message


def test_the_degree_rules_pass_what_they_allow():
    assert degrees.one_replica("single", 2, 2, 1, 4) is None and degrees.one_replica("single", 2, 1, 1, 0) is None
    assert degrees.one_replica("ddp", 2, 1, 1, 8) is None
    assert degrees.world_divides(8, 2, 2) is None and degrees.tensor_heads(28, 4, 4, 8) is None
    assert degrees.ulysses_heads(28, 1, 8, 8, "auto") is None and degrees.ulysses_heads(28, 1, 4, 8, "ulysses") is None


def test_the_launcher_judges_the_world_rules_where_the_flags_could_not():
    """--nproc-per-node 0 leaves the world size to the machine: the config passes tensor_parallel 3, and the
    launcher refuses it once the world is known, with the same line; where the flags judged it, it is not judged
    again."""
    res = load(strategy="fsdp", tensor_parallel=3)
    cfg = dataclasses.replace(res.cfg, nproc_per_node=4)
    assert not degrees.judged_with_flags(res.cfg, cfg)
    with pytest.raises(ShardwiseError, match=r"^flag --tensor-parallel: tensor_parallel 3 must divide the 4 ranks"):
        preflight.check_ranks(cfg, res, 4)
    with pytest.raises(ShardwiseError, match=r"^flag --tensor-parallel: tensor_parallel 3 must divide the 4 ranks"):
        load(strategy="fsdp", tensor_parallel=3, nproc_per_node=4)
    res = load(strategy="fsdp", tensor_parallel=2, nproc_per_node=4)
    assert degrees.judged_with_flags(res.cfg, res.cfg)
    auto = dataclasses.replace(res.cfg, strategy="single")  # what --strategy auto may change
    assert not degrees.judged_with_flags(res.cfg, auto)
    with pytest.raises(ShardwiseError, match="strategy 'single' runs one process .* not 4"):
        preflight.check_ranks(dataclasses.replace(auto, tensor_parallel=1), res, 4)


def test_a_section_option_under_another_family_names_that_familys_presets_from_the_registry():
    with pytest.raises(ShardwiseError) as e:
        load(strategy="ddp", **{"deepspeed.stage": 3})
    assert str(e.value) == ("flag --deepspeed-stage: 'deepspeed.stage' applies to DeepSpeed but the strategy is 'ddp'; "
                            "use --strategy zero1 (or zero2 / zero3 / zero2-offload / zero3-offload) or drop the option")
    with pytest.raises(ShardwiseError, match=r"applies to FSDP but the strategy is 'zero2'; use --strategy fsdp \(or "
                                             r"fsdp-grad-op / fsdp-offload / hybrid\)"):
        load(strategy="zero2", **{"fsdp.cpu_offload": True})
    load(strategy="ddp", **{"fsdp.cpu_offload": False})  # a default restated is harmless


def test_the_flag_checks_run_cheap_first_and_stop_at_the_first_refusal():
    """A config wrong twice is refused for the earlier check's rule only (the strategy's name before its degrees)."""
    assert flag_rules.CHECKS[0] is flag_rules.names and flag_rules.CHECKS[-1] is flag_rules.degrees
    with pytest.raises(ShardwiseError, match="unknown strategy 'fsdp3'"):
        load(strategy="fsdp3", tensor_parallel=3, nproc_per_node=4)
    res = load()
    res.cfg.seed = -1
    assert flag_rules.training_numbers(res) == Refusal("seed", f"seed must be in [0, {flag_rules.MAX_SEED}], got -1")


def test_the_rules_and_the_config_import_no_torch():
    code = ("import sys, json; import shardwise.config, shardwise.preflight.flags, shardwise.preflight.degrees; "
            "print(json.dumps([m for m in ('torch', 'transformers') if m in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == []


def test_the_plan_is_the_registrys_layout_and_the_workers_mesh_is_the_same():
    """The data-parallel split is declared once, on the registry: the launcher's plan (torch-free, no strategy class)
    and the workers' ParallelDims (through the strategy class) lay the same ranks the same way."""
    from shardwise import strategies
    from shardwise.strategies.parallel import ParallelDims

    for values, world in (({"strategy": "hybrid", "nproc_per_node": 4, "nnodes": 2, "rdzv_endpoint": "n0:29500"}, 8),
                          ({"strategy": "zero3", "nproc_per_node": 4}, 4), ({"strategy": "ddp", "nproc_per_node": 4}, 4),
                          ({"strategy": "fsdp", "sequence_parallel": 2, "nproc_per_node": 4}, 4)):
        cfg = load(**values).cfg
        plan = preflight.run_plan(cfg, world, "tiny", "d")
        dims = ParallelDims.from_config(cfg, world, 0, cfg.nproc_per_node, "cpu", strategies.get(cfg.strategy).dp_split)
        assert (plan.dp_replicate, plan.dp_shard, plan.sp) == (dims.dp_replicate, dims.dp_shard, dims.sp), values


def test_bench_plans_each_strategy_as_the_launcher_lays_it(tmp_path):
    """bench's preflight is the launcher's plan: the world and degrees it records are the RunPlan's, and a layout
    the registry refuses (a shard group that does not divide the ranks) is refused before anything launches."""
    plan = preflight.plan_of(load(strategy="hybrid", nproc_per_node=2, nnodes=2, rdzv_endpoint="n0:29500"))
    assert (plan.world, plan.dp_replicate, plan.dp_shard) == (4, 2, 2) and plan.model_dir == plan.data_file == ""
    with pytest.raises(ShardwiseError, match="fsdp.shard_group_size 3 must divide the"):
        preflight.plan_of(load(strategy="hybrid", nproc_per_node=2, nnodes=2, rdzv_endpoint="n0:29500",
                               **{"fsdp.shard_group_size": 3}))
