"""The run's parallel degrees (strategies/parallel.py) and the strategy's parallelize pipeline,
where no process group is needed: the product check, the ranks' layout, each strategy's
data-parallel split, the refusal of sequence/tensor parallelism before launch, and what
`build_model` leaves to `Strategy.setup`."""

import pytest
import torch

from shardwise import config, strategies
from shardwise.errors import ShardwiseError
from shardwise.strategies.base import DistEnv
from shardwise.strategies.parallel import ParallelDims


def cfg_of(**flags):
    return config.load_config(None, {k: (v, f"flag --{k.replace('_', '-')}") for k, v in flags.items()}).cfg


def test_degrees_that_do_not_multiply_to_the_world_are_one_line_naming_the_flags():
    with pytest.raises(ShardwiseError) as e:
        ParallelDims(dp_replicate=1, dp_shard=2, sp=1, tp=2, world_size=2, rank=0)
    msg = str(e.value)
    assert "\n" not in msg
    assert "multiply to 4, not the world size 2" in msg
    for flag in ("--sequence-parallel", "--tensor-parallel", "--fsdp-shard-group-size"):
        assert flag in msg


def test_sequence_times_tensor_must_divide_the_world():
    cfg = cfg_of(strategy="ddp")
    cfg.tensor_parallel = 3  # past validation, as a harness could set it
    with pytest.raises(ShardwiseError, match=r"--sequence-parallel 1 x --tensor-parallel 3 must divide the world size 4"):
        ParallelDims.from_config(cfg, 4, 0, 4, "cpu", strategies.get("ddp").dp_split)


def test_ranks_follow_the_mesh_layout():
    """dp_rank / sp_rank / tp_rank are the coordinates of the rank in the row-major
    (dp_replicate, dp_shard, sp, tp) grid, as init_device_mesh lays ranks out."""
    shape = (2, 2, 2, 2)
    grid = torch.arange(16).view(shape)
    for rank in range(16):
        d = ParallelDims(*shape, world_size=16, rank=rank)
        r, s, p, t = (int(i) for i in (grid == rank).nonzero()[0])
        assert (d.dp_rank, d.sp_rank, d.tp_rank) == (r * 2 + s, p, t)
        assert d.dp_size == 4
    pure = ParallelDims(1, 2, 1, 1, world_size=2, rank=1)
    assert (pure.dp_size, pure.dp_rank, pure.sp_rank, pure.tp_rank) == (2, 1, 0, 0)


@pytest.mark.parametrize("preset,flags,world,local,split", [
    ("single", {}, 1, 1, (1, 1)),
    ("ddp", {}, 4, 4, (4, 1)),
    ("fsdp", {}, 4, 4, (1, 4)),
    ("zero2", {}, 4, 4, (1, 4)),
    ("hybrid", {"fsdp.shard_group_size": 2}, 4, 4, (2, 2)),
    ("hybrid", {"nnodes": 2, "rdzv_endpoint": "127.0.0.1:29500"}, 8, 4, (2, 4)),  # a node per shard group
])
def test_each_strategy_lays_its_data_parallel_ranks_on_the_mesh(preset, flags, world, local, split):
    if preset.startswith("zero"):
        pytest.importorskip("deepspeed")
    cfg = cfg_of(strategy=preset, **flags)
    env = DistEnv(0, world, 0, local, torch.device("cpu"), "gloo")
    dims = strategies.get(preset).parallel_dims(cfg, env)
    assert (dims.dp_replicate, dims.dp_shard) == split
    assert (dims.sp, dims.tp, dims.dp_size, dims.world_size) == (1, 1, world, world)


def test_hybrid_shard_group_that_does_not_divide_the_ranks_is_refused():
    cfg = cfg_of(strategy="hybrid", **{"fsdp.shard_group_size": 3})
    env = DistEnv(0, 4, 0, 4, torch.device("cpu"), "gloo")
    with pytest.raises(ShardwiseError, match="fsdp.shard_group_size 3 must divide the world size 4"):
        strategies.get("hybrid").parallel_dims(cfg, env)


def test_tensor_parallel_is_accepted_with_single_and_fsdp_and_refused_elsewhere_in_one_line():
    """TP composes with single (pure TP, N processes) and the fsdp presets; DDP, ZeRO, auto, LoRA
    and SP > 1 with it are refused before launch, naming the flag (tests/dist/test_tensor_parallel.py
    runs it)."""
    assert cfg_of(strategy="fsdp", tensor_parallel=2, nproc_per_node=4).tensor_parallel == 2
    assert cfg_of(strategy="single", tensor_parallel=2, nproc_per_node=2).nproc_per_node == 2
    with pytest.raises(ShardwiseError, match="strategy 'single' runs one process"):
        cfg_of(strategy="single", tensor_parallel=2, nproc_per_node=4)
    with pytest.raises(ShardwiseError, match="tensor_parallel must be >= 1, got 0"):
        cfg_of(strategy="fsdp", tensor_parallel=0)
    for preset in ("ddp", "zero2", "zero3", "auto"):
        with pytest.raises(ShardwiseError) as e:
            cfg_of(strategy=preset, tensor_parallel=2, nproc_per_node=2)
        msg = str(e.value)
        assert msg.startswith("flag --tensor-parallel: tensor_parallel 2 composes with strategy single") and \
            f"not '{preset}'" in msg and "\n" not in msg, msg
    with pytest.raises(ShardwiseError) as e:
        cfg_of(strategy="fsdp", tensor_parallel=2, tuner="lora")
    msg = str(e.value)  # one line that says why: the adapters would have to be split like the linears they wrap
    assert msg.startswith("flag --tuner: tensor_parallel with lora is not built yet: PEFT wraps the attention") \
        or msg.startswith("flag --tensor-parallel: tensor_parallel with lora is not built yet: PEFT wraps the"), msg
    assert "lora_B by output features" in msg and "\n" not in msg, msg
    with pytest.raises(ShardwiseError, match="tensor_parallel with sequence_parallel > 1 is not built yet"):
        cfg_of(strategy="fsdp", tensor_parallel=2, sequence_parallel=2, nproc_per_node=4)
    with pytest.raises(ShardwiseError, match="tensor_parallel 3 must divide the 4 ranks"):
        cfg_of(strategy="fsdp", tensor_parallel=3, nproc_per_node=4)


def test_tensor_parallel_dims_leave_the_tp_ranks_on_one_data_parallel_rank():
    """fsdp on 4 ranks with TP 2: ranks 0-1 and 2-3 are tensor groups; each group reads one data share
    and gradients are averaged over the 2 data-parallel ranks only (the tp ranks compute one step together)."""
    cfg = cfg_of(strategy="fsdp", tensor_parallel=2, nproc_per_node=4)
    got = []
    for rank in range(4):
        dims = strategies.get("fsdp").parallel_dims(cfg, DistEnv(rank, 4, rank, 4, torch.device("cpu"), "gloo"))
        got.append((dims.dp_rank, dims.tp_rank))
        assert (dims.dp_size, dims.grad_size, dims.shard_size, dims.tp) == (2, 2, 2, 2)
    assert got == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_sequence_parallel_is_accepted_and_checked():
    """Sequence parallelism is supported (tests/dist/test_sequence_parallel.py); its config checks."""
    assert cfg_of(strategy="fsdp", sequence_parallel=2, nproc_per_node=2).sequence_parallel == 2
    with pytest.raises(ShardwiseError, match="sequence_parallel must be >= 1, got 0"):
        cfg_of(strategy="fsdp", sequence_parallel=0)
    with pytest.raises(ShardwiseError, match="sequence_parallel 3 must divide the 2 ranks"):
        cfg_of(strategy="fsdp", sequence_parallel=3, nproc_per_node=2)
    assert cfg_of(strategy="fsdp", sequence_parallel=2, nproc_per_node=2, sp_mode="ring").sp_mode == "ring"
    with pytest.raises(ShardwiseError, match="not single"):
        cfg_of(strategy="single", sequence_parallel=2)


def test_sequence_parallel_dims_shard_and_average_over_the_sequence_ranks_too():
    dims = ParallelDims(1, 2, 2, 1, world_size=4, rank=3)  # fsdp on 4 ranks, SP 2
    assert (dims.dp_size, dims.dp_rank, dims.sp_rank) == (2, 1, 1)
    assert (dims.grad_size, dims.shard_size) == (4, 4)


def test_build_model_leaves_checkpointing_and_compile_to_the_strategy(tiny_dir):
    """build_model loads and adds adapters; the strategy's parallelize pipeline enables
    activation checkpointing and compiles each block (compile is lazy: nothing runs here)."""
    from shardwise.models.speed import decoder_blocks
    from shardwise.train.loop import build_model

    cfg = cfg_of(strategy="single", model=tiny_dir, gradient_checkpointing=True, compile="on", mixed_precision="no")
    model = build_model(cfg, tiny_dir)
    blocks = decoder_blocks(model)
    assert not model.is_gradient_checkpointing
    assert all(b._compiled_call_impl is None for b in blocks)
    strategy = strategies.get("single")(cfg, DistEnv(0, 1, 0, 1, torch.device("cpu"), "gloo"))
    wrapped, _ = strategy.setup(model)
    assert wrapped.is_gradient_checkpointing
    assert all(b._compiled_call_impl is not None for b in blocks)
    assert (strategy.dims.dp_size, strategy.dims.dp_rank) == (1, 0)
