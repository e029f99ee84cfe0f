"""The rehearsal makes FSDP's shards real right after the wrap: on the rank's device, except under CPU offload
(`fsdp.cpu_offload`, the fsdp-offload preset), where an offloaded run holds them on the host and FSDP refuses them
anywhere else at its first forward (CPUOffloadPolicy checks that every parameter is on the CPU). Rank 0 of a fake world of 2,
the tiny model's shape built on meta, the strategy's own wrap; the device handed to the rehearsal is meta, which
materialize leaves as it is, so only the offload choice makes the shards real on the CPU."""

from __future__ import annotations

import pytest
import torch

from shardwise import config, strategies
from shardwise.plan.model_spec import tiny_config
from shardwise.train.rehearse import build_model, join_fake_group, rehearse_wrap


@pytest.fixture
def fake_rank0(monkeypatch):
    """Rank 0 of 2 in torch's fake process group; the launcher's variables it sets are put back afterwards."""
    import torch.distributed as dist

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.setenv(k, "0")
    env = join_fake_group(0, 2, 2)
    try:
        yield env
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize("preset, made_on", [("fsdp-offload", "cpu"), ("fsdp", "meta")])
def test_fsdp_shards_are_made_on_the_host_under_cpu_offload_else_on_the_given_device(fake_rank0, preset, made_on):
    cfg = config.load_config(None, {"strategy": (preset, "flag --strategy"), "compile": ("off", "flag --compile"),
                                    "seq_len": (64, "flag --seq-len"),
                                    "mixed_precision": ("bf16", "flag --mixed-precision")}).cfg
    assert cfg.fsdp.cpu_offload is (preset == "fsdp-offload")
    model = build_model({"hf_config": {"model_type": "llama", **tiny_config()}}, cfg)
    env = fake_rank0
    cls = strategies.get(cfg.strategy)
    env.dims = cls.parallel_dims(cfg, env, model.config.num_attention_heads)
    strategy = cls(cfg, env)

    rehearse_wrap(strategy, torch.device("meta"))
    model = strategy.wrap(model)
    # real buffers (the rotary table) stay where the wrap put them, whatever device the shards are made on: under
    # offload on a GPU the shards go to the host while the rotary table must stay on the GPU beside the activations
    buffers = dict(model.named_buffers())
    assert buffers and all(b.device.type == "cpu" for b in buffers.values()), {n: b.device for n, b in buffers.items()}

    shards = [p.to_local() for p in model.parameters()]
    assert shards and all(s.device.type == made_on for s in shards), {s.device for s in shards}
    if made_on == "cpu":  # real, and initialised as materialize does (norm weights ones, matrices ~N(0, 0.02))
        norm = model.model.norm.weight.to_local()
        assert torch.equal(norm, torch.ones_like(norm))
        emb = model.model.embed_tokens.weight.to_local()
        assert emb.shape[0] == model.config.vocab_size // 2 and 0 < emb.float().std() < 0.1
