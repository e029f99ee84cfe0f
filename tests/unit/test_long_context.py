"""The long-context levers on one process: what offloaded checkpointing keeps where (models/offload.py), what the MLP
tiles let exist at once (models/tiles.py), that the fused loss and the attention never make a (tokens x vocab) or
(S x S) tensor at long lengths, the `mlp_tiles` setting's checks, and the planner's arithmetic for both levers
(plan/long_context.py, plan/memory.py, plan/decide.py)."""

from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class Largest(TorchDispatchMode):
    """The largest tensor any operator makes while active (elements), and the operator."""

    def __init__(self):
        super().__init__()
        self.numel, self.op = 0, ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.numel() > self.numel:
                self.numel, self.op = t.numel(), str(func)
        return out


def tiny_llama(layers=4, **over):
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardwise.models.tiny import TINY_CONFIG

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY_CONFIG, "num_hidden_layers": layers, "use_cache": False, **over}))
    return model.train()


def step(model, ids):
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


# -- offloaded checkpointing --------------------------------------------------------------


def block_inputs_alive(mode: str) -> tuple[int, object, tuple]:
    """(block inputs still alive between forward and backward, the host store, (loss, grads)) under `mode`."""
    from shardwise.models.checkpointing import checkpoint_blocks
    from shardwise.models.speed import decoder_blocks

    model = tiny_llama()
    checkpoint_blocks(model, mode)
    refs = []
    for block in decoder_blocks(model):
        block.register_forward_pre_hook(lambda m, args: refs.append(weakref.ref(args[0])))
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(1))
    out = model(input_ids=ids, labels=ids, use_cache=False)
    gc.collect()
    alive = sum(r() is not None for r in refs)
    store = getattr(model, "host_checkpoints", None)
    held = store.host_bytes if store else 0
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return alive, (store, held), (out.loss.detach(), grads)


def test_offload_moves_every_block_input_off_the_device_and_trains_like_full():
    """Full checkpointing keeps each block's input alive in autograd until backward; offload keeps a host copy
    instead, so the inputs themselves are freed (the first is the embedding's output, which the embedding's own
    backward does not keep either), and backward brings each back once: the same loss and gradients, bit for bit."""
    full_alive, _, (full_loss, full_grads) = block_inputs_alive("full")
    off_alive, (store, held), (loss, grads) = block_inputs_alive("offload")
    assert full_alive == 4
    assert off_alive == 0
    assert store.copies_out == 4 and store.copies_in == 4
    assert held == 4 * 2 * 64 * 128 * 4  # four (2, 64, 128) fp32 inputs, in the host store between the passes
    assert store.host_bytes == 0  # freed once backward used them
    assert torch.equal(loss, full_loss)
    for name, g in full_grads.items():
        assert torch.equal(grads[name], g), name


def test_offload_saves_nothing_under_no_grad():
    from shardwise.models.checkpointing import checkpoint_blocks

    model = tiny_llama()
    checkpoint_blocks(model, "offload")
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 16, dtype=torch.long), use_cache=False)
    assert model.host_checkpoints.copies_out == 0


# -- MLP tiles ------------------------------------------------------------------------------


def mlp_peak(tiles: int, mode: str) -> tuple[int, tuple]:
    """(largest tensor of the run's forward and backward, (loss, grads)) for a 1-block model whose MLP interior is
    the largest thing in it (1024 tokens x intermediate 2048, against the 1024 x 512 logits and 2048 x 128 weights)."""
    from shardwise.models.checkpointing import checkpoint_blocks
    from shardwise.models.tiles import tile_blocks

    model = tiny_llama(layers=1, intermediate_size=2048)
    if tiles > 1:
        assert tile_blocks(model, tiles, 1024, 4) == f"mlp tiles: {tiles} sequence tiles of ~128 tokens in 1 blocks"
    checkpoint_blocks(model, mode)
    ids = torch.randint(0, 512, (1, 1024), generator=torch.Generator().manual_seed(2))
    with Largest() as seen:
        result = step(model, ids)
    return seen.numel, result



def compiled_block_graphs(tiles: int) -> list:
    """The AOT forward and backward graphs of a 1-block tiny Llama (1024 tokens, intermediate 2048) whose block runs as
    the product runs it under `--activation-checkpointing offload --mlp-tiles N` with compile: tiles inside the
    offloaded checkpoint, the checkpointed forward torch.compile'd (models/speed.py compile_blocks), partitioned by
    inductor's own min-cut partitioner; the graphs themselves run uncompiled (no C++ toolchain needed)."""
    import functools

    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    from shardwise.models.checkpointing import checkpoint_blocks
    from shardwise.models.speed import decoder_blocks
    from shardwise.models.tiles import tile_blocks

    graphs = []

    def keep(kind):
        def compiler(gm, _inputs):
            graphs.append((kind, gm))
            return make_boxed_func(gm.forward)
        return compiler

    def backend(gm, inputs):
        partition = functools.partial(min_cut_rematerialization_partition, compiler="inductor")
        return aot_module_simplified(gm, inputs, fw_compiler=keep("fw"), bw_compiler=keep("bw"), partition_fn=partition)

    torch._dynamo.reset()
    model = tiny_llama(layers=1, intermediate_size=2048)
    if tiles > 1:
        tile_blocks(model, tiles, 1024, 4)
    checkpoint_blocks(model, "offload")
    for block in decoder_blocks(model):
        block.checkpointed_forward = torch.compile(block.checkpointed_forward, backend=backend)
    ids = torch.randint(0, 512, (1, 1024), generator=torch.Generator().manual_seed(2))
    step(model, ids)
    torch._dynamo.reset()
    return graphs


def interiors(gm) -> list[int]:
    """Token counts of the (1, tokens, 2048) MLP-interior tensors a graph makes."""
    return [n.meta["val"].shape[1] for n in gm.graph.nodes
            if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dim() == 3 and n.meta["val"].shape[-1] == 2048]


def test_compiled_block_keeps_the_mlp_tiles_one_at_a_time():
    """Compiled, the block's forward saves only each tile's input for backward, never a (tokens x intermediate)
    tensor, and its backward recomputes the interior one tile (128 tokens) at a time; untiled, the forward saves
    the whole interior (1024 tokens)."""
    whole = compiled_block_graphs(1)
    tiled = compiled_block_graphs(8)

    def saved(graphs):
        fw = next(gm for kind, gm in graphs if kind == "fw")
        outputs = next(n for n in fw.graph.nodes if n.op == "output").args[0]
        return [tuple(o.meta["val"].shape) for o in outputs if isinstance(o.meta.get("val"), torch.Tensor)]

    assert (1024, 2048) in saved(whole)
    assert not any(s[-1] == 2048 and 1024 in s for s in saved(tiled))  # only the (2048, 128) weights
    assert saved(tiled).count((1, 128, 128)) == 8  # the eight tile inputs
    bw = next(gm for kind, gm in tiled if kind == "bw")
    assert max(interiors(bw)) == 128
    assert max(interiors(next(gm for kind, gm in whole if kind == "bw"))) == 1024


def test_tiled_mlp_compiles_whole_when_the_sequence_length_changes():
    """A compiled block recompiles with dynamic shapes once the sequence length changes (unpacked data pads each
    batch to its own length); the tiling must trace symbolically there, or dynamo gives up on the whole block and
    runs it eager, with eager's speed and memory. fullgraph=True turns such a fallback into an error."""
    from torch import nn

    from shardwise.models.tiles import tile_mlp

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(8, 32), nn.Linear(32, 8)

        def forward(self, x):
            return self.down(torch.relu(self.up(x)))

    torch.manual_seed(0)
    plain = MLP()
    tiled = MLP()
    tiled.load_state_dict(plain.state_dict())
    tile_mlp(tiled, 4)
    run = torch.compile(tiled, dynamic=True, fullgraph=True, backend="eager")
    for tokens in (37, 50):  # not multiples of the tile count: the first tiles are one token longer
        x = torch.randn(1, tokens, 8, requires_grad=True)
        out = run(x)
        torch.testing.assert_close(out, plain(x))
        out.sum().backward()
        assert x.grad is not None and x.grad.shape == x.shape


@pytest.mark.parametrize("mode", ["off", "full"])
def test_mlp_tiles_make_the_mlp_interior_one_tile_at_a_time(mode):
    whole, (loss, grads) = mlp_peak(1, mode)
    tiled, (tloss, tgrads) = mlp_peak(8, mode)
    assert whole == 1024 * 2048  # the MLP's (tokens x intermediate) interior is the largest tensor untiled
    assert tiled == 1024 * 512  # now the logits are: a tile's interior is 128 x 2048
    torch.testing.assert_close(tloss, loss, rtol=1e-6, atol=0)
    for name, g in grads.items():
        torch.testing.assert_close(tgrads[name], g, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


def test_auto_tiles_follow_the_length():
    from shardwise.plan.long_context import auto_mlp_tiles, parse_mlp_tiles, resolve_mlp_tiles

    h, i = 4096, 14336  # the Llama-3.1-8B shape, bf16
    assert auto_mlp_tiles(4096, h, i, 2) == 1  # 336 MiB of MLP interior: not worth tiling
    assert auto_mlp_tiles(65536, h, i, 2) == 8  # 5.25 GiB: to under 1 GiB (the floor of the budget)
    assert auto_mlp_tiles(262144, h, i, 2) == 16  # 21 GiB: to under the 2 GiB residual stream
    assert auto_mlp_tiles(2048, 128, 131072, 4) == 2  # 3 GiB, but never tiles shorter than 1024 tokens
    assert resolve_mlp_tiles("3", 10, h, i, 2) == 3
    assert parse_mlp_tiles(" Auto ") == "auto"
    for bad in ("0", "-2", "two", "1.5", ""):
        with pytest.raises(ValueError):
            parse_mlp_tiles(bad)


def test_mlp_tiles_setting_is_checked():
    from shardwise.config import Config
    from shardwise.preflight.flags import adapters_and_wrapping

    class Res:
        def __init__(self, **kw):
            self.cfg = Config(**kw)

        def where(self, key):
            return f"--{key.replace('_', '-')}"

    assert adapters_and_wrapping(Res(mlp_tiles="auto")) is None
    why = adapters_and_wrapping(Res(mlp_tiles="zero"))
    assert why is not None and "mlp_tiles must be a positive integer (1 = off) or auto, got 'zero'" in str(why)
    why = adapters_and_wrapping(Res(mlp_tiles="4", tensor_parallel=2))
    assert why is not None and "tensor_parallel 2 is not built" in str(why)


@pytest.mark.parametrize("mode, user, expect", [
    ("offload", None, "expandable_segments:True"),  # the launcher's choice under offloaded checkpoints
    ("full", None, None),  # other runs keep torch's default allocator
    ("offload", "garbage_collection_threshold:0.8", "garbage_collection_threshold:0.8"),  # the user's own stays
])
def test_workers_get_expandable_segments_only_under_offloaded_checkpoints(mode, user, expect, monkeypatch):
    from shardwise.config import Config
    from shardwise.launch.agent import worker_environment

    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "SHARDWISE_LAUNCHER_PID", "OMP_NUM_THREADS",
                 "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(name, raising=False)  # restored by monkeypatch: worker_environment writes os.environ
    if user:
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", user)
    worker_environment(Config(activation_checkpointing=mode, nproc_per_node=1))
    assert os.environ.get("PYTORCH_CUDA_ALLOC_CONF") == expect


# -- loss and attention at long lengths -------------------------------------------------------


def test_fused_loss_never_makes_the_full_logits_at_256k_tokens():
    """262,144 tokens over a 1,024-entry vocabulary: the full fp32 logits would be 1 GiB; the chunked loss makes one
    4,096-token chunk of them at a time, forward and backward, and its loss equals the plain one's."""
    from shardwise.models.speed import linear_cross_entropy

    T, h, V = 262144, 8, 1024
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(T, h, generator=g, requires_grad=True)
    weight = torch.randn(V, h, generator=g, requires_grad=True)
    targets = torch.randint(0, V, (T,), generator=g)
    with Largest() as seen:
        loss = linear_cross_entropy(hidden, weight, targets, chunk=4096)
        loss.backward()
    assert seen.numel <= 4096 * V, seen.op
    sub = slice(0, 4096)  # the plain loss on the first chunk's tokens agrees with the fused one there
    want = torch.nn.functional.cross_entropy(hidden[sub] @ weight.t(), targets[sub], reduction="sum")
    got = linear_cross_entropy(hidden[sub], weight, targets[sub], chunk=1024)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-3)


def test_attention_on_the_cpu_makes_no_s_by_s_tensor():
    """transformers' SDPA path on the CPU runs the flash kernel for an unpacked causal sequence (no mask tensor):
    at 4,096 tokens the largest tensor of forward and backward is far below S x S (16.8M elements)."""
    model = tiny_llama(layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                       vocab_size=256, max_position_embeddings=4096)
    model.config._attn_implementation = "sdpa"  # (eager attention's largest tensor here: 2 x S x S scores)
    ids = torch.randint(0, 256, (1, 4096), generator=torch.Generator().manual_seed(4))
    with Largest() as seen:
        step(model, ids)
    assert seen.numel < 4096 * 4096 // 8, seen.op


# -- the planner ------------------------------------------------------------------------------


@pytest.fixture()
def _no_doctor_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDWISE_CACHE_DIR", str(tmp_path / "cache"))


def one_gpu(seq_len, host_gib=256.0, **kw):
    """A plan of the Llama-3.1-8B shape, LoRA, checkpointed, on one 80 GiB H100 with `host_gib` of host RAM."""
    from dataclasses import replace

    from shardwise.plan import plan_model, resolve_model
    from shardwise.plan.inputs import make_setup
    from shardwise.plan.memory import Job

    setup = replace(make_setup(gpus=1, gpu_memory=80.0, gpu_type="H100", use_doctor=False), host_mem_gib=host_gib)
    job = Job(world=1, micro_batch=1, seq_len=seq_len, tuner="lora", checkpointing=True, compile=True,
              fused_loss=True, compute="bf16", device_mem_gib=80.0, host_mem_gib=host_gib, **kw)
    return plan_model(resolve_model("llama-3.1-8b"), job, setup, configured="single")


@pytest.mark.usefixtures("_no_doctor_cache")
def test_plan_offload_keeps_two_block_inputs_on_the_device_and_all_on_the_host():
    plain = one_gpu(262144).for_strategy("single")
    off = one_gpu(262144, offload_checkpoints=True).for_strategy("single")
    block_input = 262144 * 4096 * 2  # tokens x hidden x bf16 (LoRA: the residual stream in the compute dtype)
    assert plain.memory.detail["act.layers_kept"] == 32 * block_input and plain.memory.host == 0
    assert off.memory.detail["act.layers_kept"] == 2 * block_input
    assert off.memory.host == 32 * block_input  # 64 GiB pinned per rank
    assert plain.memory.total - off.memory.total > 25 * block_input
    # torch's pinned-memory cache rounds each block up to a power of two: 384K inputs of 3 GiB take 4 GiB each
    assert one_gpu(393216, offload_checkpoints=True).for_strategy("single").memory.host == 32 * 4 * 2**30
    # the copies (1 GiB each way per block over the host link) hide under a block's compute at this length
    assert off.timing.step_s == pytest.approx(plain.timing.step_s, rel=1e-6)


@pytest.mark.usefixtures("_no_doctor_cache")
def test_plan_256k_fits_one_gpu_only_with_both_levers_and_enough_host_ram():
    """Without adapter dropout (with it 256K does not fit one 80 GiB card: measured out of memory; without, 59.1 GiB,
    benchmarks/results/long_context_1gpu_h100_2026-12-07b.md)."""
    from shardwise.plan.decide import fit_advice

    nodrop = dict(lora_dropout=0.0)
    levers = dict(offload_checkpoints=True, mlp_tiles=0, **nodrop)
    assert not one_gpu(262144, **nodrop).for_strategy("single").fits
    assert not one_gpu(262144, offload_checkpoints=True, **nodrop).for_strategy("single").fits
    both = one_gpu(262144, **levers)
    assert both.for_strategy("single").fits
    assert both.job.mlp_tiles == 16  # auto: the size rule's count where the run does not fit without tiles
    assert one_gpu(65536, **levers).job.mlp_tiles == 1  # fits without: tiles would only cost time
    tiled = both.for_strategy("single").timing.step_s
    offloaded = one_gpu(262144, offload_checkpoints=True, **nodrop).for_strategy("single").timing.step_s
    assert tiled > offloaded  # the MLP's recompute
    advice = fit_advice(one_gpu(262144, **nodrop), "single")
    assert "Cheapest change that fits: --activation-checkpointing offload --mlp-tiles auto" in advice
    # 64 GiB of checkpoints do not go into 64 GiB of host RAM (90% of it is counted usable): refused, and said why
    small = one_gpu(262144, host_gib=64.0, **levers)
    assert not small.for_strategy("single").fits
    assert "host RAM: 64.0 GiB per node to hold, of 64 GiB (90% usable) (offloaded checkpoints)" in \
        fit_advice(small, "single")


@pytest.mark.usefixtures("_no_doctor_cache")
def test_plan_names_the_levers_before_optimizer_offload():
    """At 128K the states fit and the activations do not: an optimizer-offload preset fits (and is recommended,
    being the only strategy family that fits as asked), and the reasons name offloaded checkpointing, which keeps
    the states on the device."""
    plan = one_gpu(131072)
    assert not plan.for_strategy("single").fits
    said = [r for r in plan.reasons if r.startswith("activations are what does not fit")]
    assert len(said) == 1 and "--activation-checkpointing offload" in said[0] and "optimizer offload" in said[0]


def test_plan_counts_only_the_copy_time_compute_does_not_hide():
    """A block input's copy (2 GiB at 256K) against the block's compute: hidden at the planned 20 GB/s host link,
    exposed (each way, per block) when the link is slower than the block's compute can cover."""
    from shardwise.plan import resolve_model
    from shardwise.plan.collective import Links
    from shardwise.plan.comm import offload_exposed_s
    from shardwise.plan.memory import Job, Opts

    spec = resolve_model("llama-3.1-8b")
    job = Job(world=1, seq_len=262144, tuner="lora", checkpointing=True, offload_checkpoints=True, compute="bf16")
    t_fwd, t_bwd = 32 * 1.0, 32 * 3.0  # one second of forward, three of backward per block
    assert offload_exposed_s(spec, job, Opts("single"), Links(1e11, 1e10), t_fwd, t_bwd) == 0
    slow = Links(1e11, 1e10, host_bw=2**30 / 1.5)  # a 2 GiB copy takes 3 s: 2 s exposed in forward, 0 in backward
    assert abs(offload_exposed_s(spec, job, Opts("single"), slow, t_fwd, t_bwd) - 32 * 2.0) < 1e-6
    assert offload_exposed_s(spec, replace_job(job, offload_checkpoints=False), Opts("single"), slow, t_fwd, t_bwd) == 0


def replace_job(job, **kw):
    from dataclasses import replace

    return replace(job, **kw)


@pytest.mark.usefixtures("_no_doctor_cache")
def test_plan_takes_lora_dropout_and_counts_each_dropped_adapter_input():
    """`plan --lora-dropout 0` plans what `train --lora-dropout 0` runs: without dropout the adapters read the
    projections' own inputs, with it each of a block's 7 adapters keeps its dropped-out copy and mask (3 bytes a
    value on CUDA), 28.5 GiB a block at 256K for the Llama-3.1-8B shape against 6.5 without."""
    from shardwise import cli
    from shardwise.plan import command as plan_cmd

    def peak(*extra):
        args = cli.build_parser().parse_args(["plan", "--model", "llama-3.1-8b", "--gpus", "1", "--gpu-memory", "80",
                                              "--gpu-type", "H100", "--seq-len", "262144", "--micro-batch-size", "1", "--strategy", "single",
                                              "--tuner", "lora", "--activation-checkpointing", "offload",
                                              "--mlp-tiles", "16", *extra])
        p = plan_cmd.build(args)[0]
        assert p.job.lora_dropout == (0.0 if extra else 0.05)
        m = p.for_strategy("single").memory
        return m.peak_tensors, m.detail["act.per_layer"]

    (drop, drop_layer), (nodrop, nodrop_layer) = peak(), peak("--lora-dropout", "0")
    T, width = 262144, 6 * 4096 + 14336  # the adapters' input widths: q, k, v, o, gate, up and down
    shared = T * 2 * (4096 + 4096 + 4096 + 14336 / 16)  # q/k/v's, o's, gate/up's and one tile of down's inputs
    assert drop_layer - nodrop_layer == pytest.approx(T * width * 3 - shared, rel=1e-9)
    assert drop - nodrop == pytest.approx(drop_layer - nodrop_layer, rel=0.01)  # one recomputed block at the peak


@pytest.mark.usefixtures("_no_doctor_cache")
def test_no_adapter_dropout_is_offered_after_every_change_that_keeps_the_training():
    """fit_advice ranks `--lora-dropout 0` (a change to the training) after every change that keeps it: at 192K the
    activation levers fit and are named; at 256K they fit only without the adapters' dropout (measured: out of
    memory with it, 59.1 GiB without), and the line says it changes the training; with both levers already on, the
    frozen base offloaded to the host (fsdp-offload) keeps the training and is the cheapest change named."""
    from shardwise.plan.decide import fit_advice

    advice = fit_advice(one_gpu(196608), "single")
    assert "Cheapest change that fits: --activation-checkpointing offload --mlp-tiles auto (" in advice, advice
    advice = fit_advice(one_gpu(262144), "single")
    assert ("Cheapest change that fits: --lora-dropout 0 --activation-checkpointing offload --mlp-tiles auto "
            "(no adapter dropout)") in advice, advice
    both = one_gpu(262144, offload_checkpoints=True, mlp_tiles=16)
    assert not both.for_strategy("single").fits
    assert one_gpu(262144, offload_checkpoints=True, mlp_tiles=16, lora_dropout=0.0).for_strategy("single").fits
    assert "Cheapest change that fits: --strategy fsdp-offload" in fit_advice(both, "single")
