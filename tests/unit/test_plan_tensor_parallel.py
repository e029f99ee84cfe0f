"""The planner's view of tensor parallelism (plan/memory.py): the block linears' parameters,
gradients and optimizer states divided by the degree, the replicated rest (embeddings, norms,
head) not; FSDP shards over the data-parallel ranks only; the config's degree reaches the Job."""

from __future__ import annotations

import pytest

from shardwise import config
from shardwise.plan import resolve_model
from shardwise.plan.inputs import job_from_config, make_setup
from shardwise.plan.memory import Job, Opts, estimate


def _job(**kw):
    return Job(micro_batch=1, seq_len=2048, device_mem_gib=141.0, compute="bf16", param_dtype="bf16",
               fused_loss=True, **kw)


@pytest.mark.parametrize("model", ["llama-3.1-8b", "qwen2.5-0.5b"])
def test_single_tp_divides_the_block_linears_states_and_keeps_the_replicated_rest(model):
    spec = resolve_model(model)
    one, two = estimate(spec, _job(world=1), Opts("single")), estimate(spec, _job(world=2, tp=2), Opts("single"))
    linear = spec.num_layers * spec.layer_linear_params
    rest = spec.total_params - linear
    for key in ("params", "grads", "optimizer"):
        per_param = getattr(one, key) / spec.total_params  # bytes per parameter of this state
        assert getattr(two, key) == pytest.approx(per_param * (rest + linear / 2), rel=1e-9), key
        assert getattr(two, key) < getattr(one, key)
    assert two.activations == one.activations  # activations are not divided yet (docs/tensor-parallel.md)


def test_fsdp_with_tp_shards_over_the_data_parallel_ranks_only():
    spec = resolve_model("llama-3.1-8b")
    fsdp4 = estimate(spec, _job(world=4), Opts("fsdp"))  # 4 shards
    fsdp2x2 = estimate(spec, _job(world=4, tp=2), Opts("fsdp"))  # 2 shards of the tp-split weights
    assert fsdp2x2.detail["shard_ranks"] == 2 and fsdp4.detail["shard_ranks"] == 4
    linear = spec.num_layers * spec.layer_linear_params
    keep = (spec.total_params - linear + linear / 2) / spec.total_params
    assert fsdp2x2.optimizer == pytest.approx(fsdp4.optimizer * 2 * keep, rel=1e-9)


def test_the_configured_degree_reaches_the_plan():
    res = config.load_config(None, {"strategy": ("fsdp", "flag"), "tensor_parallel": (2, "flag"),
                                    "nproc_per_node": (4, "flag")})
    setup = make_setup(gpus=4, gpu_memory=141.0, gpu_type="H200", use_doctor=False)
    assert job_from_config(res.cfg, setup).tp == 2
