"""FSDP on one rank: with compute narrower than the stored weights (bf16 over fp32) nothing is sharded, so the
strategy keeps each unit's gathered weights from forward to backward instead of making them twice; it must
train exactly as resharding does. A real one-rank gloo group in this process (conftest.py one_rank_group; this
test spawned a process for it, tests/dist/test_fsdp_one_rank.py)."""

import torch


def _grads_after_one_step(env, model_dir, mixed_precision, keep: bool = True, offload: bool = False):
    from torch.distributed.tensor import DTensor

    from shardwise import strategies
    from shardwise.config import load_config
    from shardwise.train.loop import build_model

    flags = {"model": model_dir, "strategy": "fsdp", "nproc_per_node": 1, "mixed_precision": mixed_precision,
             "fsdp.keep_gathered_one_rank": keep, "fsdp.cpu_offload": offload}
    cfg = load_config(None, {k: (v, "test") for k, v in flags.items()}).cfg
    strategy = strategies.get("fsdp")(cfg, env)
    torch.manual_seed(0)
    model, opt = strategy.setup(build_model(cfg, model_dir))
    first_block = model.model.layers[0]
    ids = torch.randint(5, 500, (2, 32), generator=torch.Generator().manual_seed(7))
    with strategy.sync(model, True), strategy.autocast():
        loss = model(input_ids=ids, labels=ids).loss
    # after forward: is the first block's weight still gathered (a plain tensor) or resharded (a DTensor)?
    gathered_after_forward = not isinstance(next(first_block.parameters()), DTensor)
    strategy.backward(loss)
    grads = {n: p.grad.full_tensor().tolist() for n, p in model.named_parameters()}
    return {"reshard": strategy.reshard, "describe": strategy.describe(), "gathered": gathered_after_forward,
            "loss": loss.item(), "grads": grads}


def test_one_rank_fsdp_keeps_gathered_weights_only_under_mixed_precision_and_trains_the_same(one_rank_group,
                                                                                             tiny_dir):
    env = one_rank_group
    assert (env.rank, env.world_size, env.backend) == (0, 1, "gloo")
    kept = _grads_after_one_step(env, tiny_dir, "bf16")
    resharded = _grads_after_one_step(env, tiny_dir, "bf16", keep=False)  # --no-fsdp-keep-gathered-one-rank
    fp32 = _grads_after_one_step(env, tiny_dir, "no")
    offload = _grads_after_one_step(env, tiny_dir, "bf16", offload=True)
    assert kept["reshard"] is False and kept["gathered"] is True
    assert "one rank: gathered weights kept from forward to backward" in kept["describe"]
    assert resharded["reshard"] is True and resharded["gathered"] is False
    # fp32 compute: the gathered weights are the stored ones; resharding stays (the fsdp preset's full shard)
    assert fp32["reshard"] is True and fp32["gathered"] is False and "full shard" in fp32["describe"]
    # CPU offload is chosen for the least GPU memory: it keeps resharding on one rank too
    assert offload["reshard"] is True and offload["gathered"] is False
    # keeping them changes when copies are made, not what is computed: identical loss and gradients
    assert kept["loss"] == resharded["loss"]
    assert kept["grads"] == resharded["grads"]
