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
    with pytest.raises(ShardwiseError, match=r"^--tensor-parallel: tensor_parallel 3 must divide the 4 ranks \(nnodes x nproc_per_node\); the rest "
                                                   r"are data-parallel$"):
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
    """TP composes with single (pure TP, N processes; N x M with SP M) and the fsdp presets (with SP too); DDP,
    ZeRO, auto and LoRA are refused before launch, naming the flag (tests/dist/test_tensor_parallel.py
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
    # TP x SP: the fsdp presets, and single as one replica of tp x sp processes (it averages over the sp ranks)
    assert cfg_of(strategy="fsdp", tensor_parallel=2, sequence_parallel=2, nproc_per_node=4).sequence_parallel == 2
    assert cfg_of(strategy="single", tensor_parallel=2, sequence_parallel=2, nproc_per_node=4).sequence_parallel == 2
    with pytest.raises(ShardwiseError, match="strategy 'single' runs one process .or --tensor-parallel N processes, one "
                                             "replica, times --sequence-parallel M with it."):
        cfg_of(strategy="single", tensor_parallel=2, sequence_parallel=2, nproc_per_node=2)
    with pytest.raises(ShardwiseError, match="sequence_parallel 2 x tensor_parallel 2 must divide the 6 ranks"):
        cfg_of(strategy="fsdp", tensor_parallel=2, sequence_parallel=2, nproc_per_node=6)
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
    from shardwise.models.checkpointing import is_checkpointing
    from shardwise.models.speed import decoder_blocks
    from shardwise.train.loop import build_model

    cfg = cfg_of(strategy="single", model=tiny_dir, gradient_checkpointing=True, compile="on", mixed_precision="no")
    model = build_model(cfg, tiny_dir)
    blocks = decoder_blocks(model)
    assert not is_checkpointing(model)
    assert all(b._compiled_call_impl is None for b in blocks)
    strategy = strategies.get("single")(cfg, DistEnv(0, 1, 0, 1, torch.device("cpu"), "gloo"))
    wrapped, _ = strategy.setup(model)
    assert is_checkpointing(wrapped)
    assert all(b._compiled_call_impl is not None for b in blocks)
    assert (strategy.dims.dp_size, strategy.dims.dp_rank) == (1, 0)


def test_from_config_splits_the_sequence_group_by_the_heads_per_tensor_rank():
    """--sp-mode decides sp = ring x ulysses when the dims are made, from the model's heads per tp rank:
    the mesh is then built with that split (the attention never makes a group of its own)."""
    def dims(heads, sp, tp=1, mode="auto"):
        cfg = cfg_of(strategy="fsdp", sequence_parallel=sp, tensor_parallel=tp, sp_mode=mode, nproc_per_node=sp * tp)
        return ParallelDims.from_config(cfg, sp * tp, 0, sp * tp, "cpu", strategies.get("fsdp").dp_split, heads)

    assert dims(4, 4).sp_shape == (1, 4)  # ring 1 x ulysses 4
    assert dims(2, 4).sp_shape == (2, 2)  # auto: gcd(2, 4) = 2 Ulysses, a ring of 2
    assert dims(4, 4, mode="ring").sp_shape == (4, 1)
    assert dims(8, 2, tp=2, mode="ulysses").sp_shape == (1, 2)  # 8 heads / tp 2 = 4 per rank, over sp 2
    assert dims(4, 4, tp=2).sp_shape == (2, 2)  # 2 heads per tp rank: auto gives Ulysses 2 x ring 2
    with pytest.raises(ShardwiseError, match="splits the 2 attention heads over 4 ranks"):
        dims(4, 4, tp=2, mode="ulysses")  # 4 heads / tp 2 = 2 per rank cannot take Ulysses 4
    with pytest.raises(ShardwiseError, match="Ulysses degree 3 must divide the sequence-parallel degree 4"):
        ParallelDims(1, 1, 4, 1, world_size=4, rank=0, sp_ulysses=3)


def test_the_mesh_gives_the_sequence_group_and_its_ulysses_and_ring_subgroups():
    """One process stands for rank 5 of 16 (torch's fake process group: no peers needed to build the
    mesh): dp_shard 2 x sp 4 (ring 2 x ulysses 2) x tp 2. Its Ulysses group is two consecutive sp
    ranks (one contiguous chunk of the sequence), its ring every second sp rank, both inside its
    sequence group, which holds one tp index; FSDP shards and gradients average over dp_shard x sp."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=16)
    try:
        d = ParallelDims(1, 2, 4, 2, world_size=16, rank=5, sp_ulysses=2)
        assert (d.dp_rank, d.sp_rank, d.tp_rank, d.sp_shape) == (0, 2, 1, (2, 2))
        assert d.mesh.mesh_dim_names == ("dp_replicate", "dp_shard", "sp_ring", "sp_ulysses", "tp")

        def ranks(group):
            return dist.get_process_group_ranks(group)

        assert ranks(d.sp_group) == [1, 3, 5, 7]  # sp ranks 0..3 of tp index 1, data-parallel rank 0
        assert ranks(d.ulysses_group) == [5, 7]  # sp ranks 2, 3
        assert ranks(d.ring_group) == [1, 5]  # sp ranks 0, 2: the same head shard, each chunk
        assert ranks(d.tp_group) == [4, 5]
        assert d.shard_mesh.mesh.tolist() == [1, 3, 5, 7, 9, 11, 13, 15] and d.shard_size == 8
        assert ranks(d.grad_group) == [1, 3, 5, 7, 9, 11, 13, 15] and d.grad_size == 8
        assert d.describe() == "dp_replicate 1 x dp_shard 2 x sp 4 x tp 2 (sp = ring 2 x ulysses 2)"
    finally:
        dist.destroy_process_group()


def test_tensor_times_sequence_parallel_is_checked_before_launch_with_the_models_numbers(tiny_dir, capsys):
    """The tiny model (4 heads, 2 KV heads): TP 2 leaves 2 heads per tensor rank, which Ulysses 2 splits (the
    launch line says so); Ulysses 4 cannot, and is refused in one line with the model's numbers; auto turns it
    into Ulysses 2 x ring 2 (tests/dist/test_tensor_parallel.py's slow test trains TP 2 x SP 2 on 4 ranks)."""
    from shardwise.launch.preflight import check_sequence_parallel, check_tensor_parallel

    def check(world, sp, mode):
        res = config.load_config(None, {k: (v, f"flag --{k.replace('_', '-')}") for k, v in {
            "strategy": "fsdp", "tensor_parallel": 2, "sequence_parallel": sp, "sp_mode": mode,
            "nproc_per_node": world, "seq_len": 64}.items()})
        check_tensor_parallel(res.cfg, res, world, tiny_dir)
        check_sequence_parallel(res.cfg, res, world, tiny_dir)
        return capsys.readouterr().out

    said = check(4, 2, "ulysses")
    assert "Ulysses (2 heads (4 / tensor_parallel 2 per tensor rank) divide by 2), 1 query heads per rank" in said
    assert "data-parallel degree 1; each rank holds 32 of 64 tokens (split again over the 2 tensor ranks" in said
    assert "data-parallel degree 1" in said.split("tensor parallel:")[1]
    with pytest.raises(ShardwiseError) as e:
        check(8, 4, "ulysses")
    msg = str(e.value)
    assert msg.startswith("flag --sequence-parallel: Ulysses splits the model's 2 attention heads (4 / tensor_parallel "
                          "2 per tensor rank) over the 4 ranks of a sequence-parallel group, and 4 does not divide 2; "
                          "use --sequence-parallel 2"), msg
    assert "\n" not in msg
    assert "Ulysses 2 x ring 2 (chosen by --sp-mode auto: gcd(2 heads (4 / tensor_parallel 2" in check(8, 4, "auto")
