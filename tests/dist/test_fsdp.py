"""FSDP2 (and ZeRO) really shard: measured from the tensors each rank holds, on real gloo
groups of 2 (and 4, for HSDP) ranks started with torch.multiprocessing.

Each worker builds the tiny model through the strategy, runs one forward/backward/step on
its own batch, and reports the bytes of its local parameter and optimizer-state tensors
(`_local_tensor` of FSDP's DTensors, `ds_tensor` of ZeRO-3 partitions, the states of the
optimizer on DeepSpeed's flat partitions). Before the step, FSDP workers also gather their
gradients and compare them with the mean of one process's gradients over every rank's
batch: sharded (and, under HSDP, replicated) reduction must equal plain averaging.
"""

import importlib.util
import json
import os

import pytest
import torch
import torch.multiprocessing as mp

from tests.helpers import forked_ranks


def _local(t: torch.Tensor) -> torch.Tensor:
    return getattr(t, "ds_tensor", None) if hasattr(t, "ds_tensor") else getattr(t, "_local_tensor", t)


def _batch(rank: int) -> torch.Tensor:
    return torch.randint(5, 500, (2, 32), generator=torch.Generator().manual_seed(100 + rank))


def _worker(rank, world, init_file, model_dir, runs, out_dir):
    """Run each (strategy, flags) in `runs` in this rank's process, one after the other."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", DS_ACCELERATOR="cpu")
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    reports = {}
    for flags in runs:
        if flags["strategy"].startswith("zero") and importlib.util.find_spec("deepspeed") is None:
            continue
        label = flags["strategy"] + ("+" + flags["tuner"] if "tuner" in flags else "")
        reports[label] = _measure_one(rank, world, model_dir, flags)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(reports, fh)
    dist.destroy_process_group()


def _measure_one(rank, world, model_dir, flags) -> dict:
    from shardwise import strategies
    from shardwise.config import load_config
    from shardwise.models.load import load_model
    from shardwise.strategies.base import DistEnv
    from shardwise.train.loop import build_model

    cfg = load_config(None, {k: (v, "test") for k, v in {**flags, "model": model_dir, "mixed_precision": "no",
                                                         "nproc_per_node": world}.items()}).cfg
    env = DistEnv(rank, world, rank, world, torch.device("cpu"), "gloo")
    strategy = strategies.get(cfg.strategy)(cfg, env)
    torch.manual_seed(0)
    model, opt = strategy.setup(build_model(cfg, model_dir))  # the loop's path: dtype, LoRA
    ids = _batch(rank)
    with strategy.sync(model, True), strategy.autocast():
        loss = model(input_ids=ids, labels=ids).loss
    strategy.backward(loss)
    report = {}
    in_optimizer = {id(p) for g in opt.param_groups for p in g["params"]}
    report["optim_params_all_lora"] = all("lora_" in n for n, p in model.named_parameters() if id(p) in in_optimizer)
    report["optim_params"] = len(in_optimizer)
    report["lora_params"] = sum("lora_" in n for n, _ in model.named_parameters())
    if cfg.strategy in ("fsdp", "hybrid") and cfg.tuner == "full":
        got = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        ref_model = load_model(model_dir, torch.float32)
        for r in range(world):
            ids = _batch(r)
            (ref_model(input_ids=ids, labels=ids).loss / world).backward()
        report["max_grad_err"] = max((got[n] - p.grad).abs().max().item() for n, p in ref_model.named_parameters())
        report["mesh"] = list(strategy.mesh.shape)
        report["placements"] = [str(pl) for pl in next(model.parameters()).placements]
    strategy.step(model, opt)
    states = getattr(opt, "optimizer", opt).state  # DeepSpeed: our AdamW on its flat partitions
    report["param_bytes"] = sum(_local(p).numel() * p.element_size() for p in model.parameters())
    report["optim_bytes"] = sum(_local(v).numel() * v.element_size() for st in states.values()
                                for v in st.values() if torch.is_tensor(v) and v.ndim > 0)
    report["model_bytes"] = sum(p.numel() * 4 for p in strategy.unwrap(model).parameters()) \
        if cfg.strategy == "ddp" else None
    return report


def measure(tmp_path, tiny_dir, world: int, runs: list[dict]) -> list[dict]:
    with forked_ranks("tests.dist.test_fsdp", "shardwise.strategies", "shardwise.train.loop"):
        mp.start_processes(_worker, args=(world, str(tmp_path / "init"), tiny_dir, runs, str(tmp_path)),
                           nprocs=world, start_method="forkserver")
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, tiny_dir):
    """ddp, fsdp, zero1, zero3 and fsdp+LoRA measured in one 2-rank group (one start-up)."""
    runs = [{"strategy": s} for s in ("ddp", "fsdp", "zero1", "zero3")]
    runs.append({"strategy": "fsdp", "tuner": "lora", "lora.r": 4})
    return measure(tmp_path_factory.mktemp("two"), tiny_dir, 2, runs)


def test_fsdp_holds_half_the_parameters_and_optimizer_states_of_ddp_on_two_ranks(two_ranks):
    ddp = two_ranks[0]["ddp"]
    assert ddp["param_bytes"] == ddp["model_bytes"]  # a full replica
    ranks = [r["fsdp"] for r in two_ranks]
    for r in ranks:
        assert r["mesh"] == [2] and r["placements"] == ["S(0)"]
        assert r["max_grad_err"] < 1e-6  # reduce-scatter averages exactly like one process would
        assert 0.45 < r["param_bytes"] / ddp["param_bytes"] < 0.55
        assert 0.45 < r["optim_bytes"] / ddp["optim_bytes"] < 0.55
    # the two shards together are the whole model
    assert abs(sum(r["param_bytes"] for r in ranks) - ddp["param_bytes"]) < 0.01 * ddp["param_bytes"]


@pytest.mark.parametrize("strategy,params_ratio,optim_ratio", [("zero1", 1.0, 0.5), ("zero3", 0.5, 0.5)])
def test_zero_stages_shard_what_they_claim(strategy, params_ratio, optim_ratio, two_ranks):
    pytest.importorskip("deepspeed")
    ddp = two_ranks[0]["ddp"]
    for r in two_ranks:
        assert r[strategy]["param_bytes"] / ddp["param_bytes"] == pytest.approx(params_ratio, abs=0.05)
        assert r[strategy]["optim_bytes"] / ddp["optim_bytes"] == pytest.approx(optim_ratio, abs=0.05)


def test_hybrid_builds_a_2d_mesh_shards_within_groups_and_averages_over_all(tmp_path, tiny_dir):
    """HSDP on 4 ranks as 2 groups of 2 (shard_group_size stands in for a node): each rank
    holds half the model (its group's shard), and gradients average over all 4 ranks."""
    ranks = measure(tmp_path, tiny_dir, 4, [{"strategy": "hybrid", "fsdp.shard_group_size": 2}])
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        n = sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_dir)).parameters())
    for r in (r["hybrid"] for r in ranks):
        assert r["mesh"] == [2, 2] and r["placements"] == ["R", "S(0)"]
        assert r["max_grad_err"] < 1e-6
        assert 0.45 < r["param_bytes"] / (4 * n) < 0.55


def test_lora_under_fsdp_shards_the_frozen_base_and_optimizes_only_adapters(two_ranks):
    ddp = two_ranks[0]["ddp"]
    for r in (r["fsdp+lora"] for r in two_ranks):
        assert r["optim_params_all_lora"] and r["optim_params"] == r["lora_params"] > 0
        # the whole model (base + rank-4 adapters, ~4% more) is split over the 2 ranks
        assert 0.45 < r["param_bytes"] / ddp["param_bytes"] < 0.6
