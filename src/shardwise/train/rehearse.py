"""`plan --rehearse`'s worker: one rank of the real N-rank job, in this process, on the local device.

    python -m shardwise.train.rehearse REQUEST.json RESULT.json

The request (plan/rehearse.py writes it) holds the job's resolved config for one plan row, the world size, the
GPUs per node, the model (a local directory's config.json, or the planner's shape of a preset) and how many steps
to run. This process joins torch's fake process group (`FakeStore` + `init_process_group("fake")`: every
collective returns at once, with no peers) as rank r of the world, so the engine's own code runs unchanged:
the strategy's parallel degrees and its one mesh (`Strategy.parallel_dims`), its parallelize pipeline (loss head,
float8, attention, tensor parallel, checkpointing, compile, the data-parallel wrap, the optimizer), the loop's
forward/backward (`train.loop.forward_backward_step`) and the strategy's step. What is missing is only the
communication: no bytes move, so the step's time is its compute (and the optimizer), and the memory is the
rank's own (its shards, its gathered buffers, its activations), since collectives still allocate their outputs.

The model is built on the meta device from its config (no weights are read or downloaded); its parameters are
made real only once the strategy has cut them to this rank's share (FSDP's shards, tensor parallelism's slices:
`to_empty` on the device, then a random init), so a 70B plan for 64 GPUs rehearses on a GPU that holds one
rank's share. Strategies that wrap a whole replica (single, ddp, DeepSpeed) get the rank's full model before
their wrap, as they would in a run. Buffers (rotary tables) are built for real from the config, as loading does.

The result is written to RESULT.json (never to a run directory): the rank's peak memory of the steady steps
(CUDA: the allocator's peak allocated and reserved bytes; CPU: live tensor bytes, `LiveBytes`), the median step
time after the first, and what stopped it if it did not run (out of memory, a strategy the fake group cannot
run).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import time

STEPS = 3  # the first step warms up (compile, lazy optimizer state); the others are measured


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as fh:
        request = json.load(fh)
    try:
        result = rehearse(request)
    except Exception as e:  # noqa: BLE001 - reported in the plan's row, in one line
        result = failure(e)
    tmp = argv[1] + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(result, fh)
    os.replace(tmp, argv[1])
    return 0


def machine() -> dict:
    """What this process runs on, as torch sees it: the plan compares like with like by it."""
    import torch

    if not torch.cuda.is_available():
        return {"accelerator": "cpu", "device": "cpu", "device_gib": 0.0}
    dev = torch.cuda.get_device_properties(0)
    return {"accelerator": "cuda", "device": dev.name, "device_gib": dev.total_memory / 2**30}


def failure(e: BaseException) -> dict:
    """One line for what stopped the rehearsal: out of memory apart (the plan says what it predicts)."""
    import torch

    first = (str(e).strip().splitlines() or [""])[0][:300]
    if isinstance(e, torch.OutOfMemoryError) or "out of memory" in first.lower():
        return {"ok": False, "oom": True, "error": first, **machine()}
    from shardwise.errors import ShardwiseError

    what = first if isinstance(e, ShardwiseError) else f"{type(e).__name__}: {first}".rstrip(": ")
    return {"ok": False, "oom": False, "error": what, **machine()}


# ----------------------------------------------------------------------------- the model


@contextlib.contextmanager
def params_on_meta():
    """Build modules with their parameters on the meta device and their buffers real (the rotary tables are
    computed from the config at construction, as loading a model computes them): accelerate's empty-weights
    context, which transformers itself uses for big models."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        yield


def hf_config(request: dict):
    """The transformers config: the model directory's own config.json (read locally, no code from it runs), or
    the planner's shape of a preset / the tiny model."""
    from transformers import AutoConfig

    if request.get("model_dir"):
        return AutoConfig.from_pretrained(request["model_dir"], local_files_only=True, trust_remote_code=False)
    d = dict(request["hf_config"])
    return AutoConfig.for_model(d.pop("model_type"), **d)


def build_model(request: dict, cfg, dtype=None, adapters: bool = True):
    """The model as train.loop.build_model makes it (storage dtype, adapters), with its parameters on meta;
    `dtype` and `adapters=False`: a frozen reference's (task dpo), in the strategy's reference dtype."""
    from transformers import AutoModelForCausalLM

    from shardwise.strategies.base import DTYPES

    hf = hf_config(request)
    with params_on_meta():
        model = AutoModelForCausalLM.from_config(hf, attn_implementation="sdpa",
                                                 dtype=dtype or DTYPES[cfg.param_dtype])
        model.config.use_cache = False
        if adapters and cfg.tuner != "full":
            from shardwise.models.lora import apply_lora

            model = apply_lora(model, cfg)
    return model


def materialize(model, device, recurse: bool = True) -> int:
    """Give every meta parameter storage on `device`, in the shape it has now (a DTensor's local shard after
    FSDP or tensor parallelism: only this rank's share), and a random init: normal(0, 0.02) for matrices and
    ones for vectors (norm weights), a scale at which a step's loss stays finite. Real buffers are kept where they
    are (to_empty empties and moves them too: the same tensors are put back, so a rotary table FSDP moved to the GPU
    stays there when the shards are made on the host under CPU offload). `recurse=False`: the module's own
    parameters only, its children left as they are. Returns the bytes made."""
    import torch

    metas = [p for p in model.parameters(recurse) if p.is_meta or getattr(p, "_local_tensor", p).is_meta]
    if not metas:
        return 0
    kept = {n: b for n, b in model.named_buffers(remove_duplicate=False, recurse=recurse) if not b.is_meta}
    model.to_empty(device=device, recurse=recurse)
    made = 0
    with torch.no_grad():
        for n, b in kept.items():  # shared buffers: each name
            owner, _, leaf = n.rpartition(".")
            model.get_submodule(owner)._buffers[leaf] = b
        seen: set[int] = set()
        for p in model.parameters(recurse):
            if id(p) in seen:
                continue
            seen.add(id(p))
            local = p.to_local() if hasattr(p, "to_local") else p
            if local.is_floating_point():
                local.normal_(0.0, 0.02) if local.ndim >= 2 else local.fill_(1.0)
            made += local.numel() * local.element_size()
    return made


def materialize_quantised(model, device) -> int:
    """A QLoRA replica: each 4-bit linear is made in the compute dtype on `device` and quantised there at once
    (bitsandbytes' Params4bit quantises on its first move to a device), one linear at a time, so the base's
    full-precision copy (140 GB at 70B, more than a host's RAM) never exists; then the rest of the model (embeddings,
    norms, head, adapters), module by module: a whole-model `to_empty` would empty the quantised weights again. The
    4-bit weight is made anew: `to_empty` turns a meta Params4bit into a plain parameter, which nothing quantises."""
    import bitsandbytes as bnb
    import torch

    made = 0
    for m in model.modules():
        w = getattr(m, "weight", None)
        if isinstance(m, bnb.nn.Linear4bit) and w is not None and w.is_meta:
            full = torch.empty(w.shape, dtype=w.dtype, device=device).normal_(0.0, 0.02)
            m.weight = bnb.nn.Params4bit(full, requires_grad=False, blocksize=w.blocksize,
                                         compress_statistics=w.compress_statistics, quant_type=w.quant_type,
                                         quant_storage=w.quant_storage, module=w.module).to(device)
            del full
            made += m.weight.numel() * m.weight.element_size()
    for m in model.modules():
        made += materialize(m, device, recurse=False)
    return made


def shards_on_wrap(strategy) -> bool:
    """Whether the strategy's data-parallel wrap cuts parameters to this rank's share by itself (FSDP's
    fully_shard takes meta parameters); the replica wrappers (single's and DDP's move to the device, DeepSpeed's
    engine) need the rank's model real first."""
    from shardwise.strategies.fsdp import FSDPStrategy

    return isinstance(strategy, FSDPStrategy)


def shard_home(strategy, device):
    """Where the rank's FSDP shards are made: on the host under CPU offload (`fsdp.cpu_offload`), as an offloaded
    run loads them there (FSDP's CPUOffloadPolicy refuses shards on the GPU at its first forward), else on
    `device`. FSDP pins the host shards itself where its policy asks (pin_memory on CUDA): its `_apply`, which
    to_empty goes through, re-registers each shard pinned (`FSDPParam.reset_sharded_param`)."""
    return "cpu" if strategy.cfg.fsdp.cpu_offload else device


def rehearse_wrap(strategy, device) -> None:
    """Make the meta parameters real where they hold this rank's share: right after FSDP's sharding (inside its
    `wrap`, before the optimizer is built over the shards), or just before a replica's data-parallel step
    (single's and DDP's wrap, DeepSpeed's engine); tensor parallelism's slices are cut before either."""
    if shards_on_wrap(strategy):
        own_wrap = strategy.wrap

        def wrap(model):
            model = own_wrap(model)
            materialize(model, shard_home(strategy, device))
            return model

        strategy.wrap = wrap
        return
    own = strategy.apply_data_parallel
    make = materialize_quantised if strategy.cfg.tuner == "qlora" else materialize

    def apply_data_parallel(model):
        make(model, device)
        model, optimizer = own(model)
        return local_reduction(model), optimizer

    strategy.apply_data_parallel = apply_data_parallel


def local_reduction(model):
    """DDP's reducer waits on its all-reduce's future for the bucket's values, which the fake group never fills
    (an internal assert); a communication hook that hands back the bucket as it is (what a one-rank all-reduce
    leaves) keeps DDP's buckets, its gradient views and its overlap logic, without the communication."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        import torch

        def hand_back(_state, bucket):
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut

        model.register_comm_hook(None, hand_back)
    return model


# ----------------------------------------------------------------------------- the batches


def synthetic_batch(cfg, dims, vocab: int, seed: int):
    """One optimizer step's batch for this rank, of the job's shape: grad_accum micro-batches of micro_batch_size
    full rows of seq_len tokens (this rank's 1/sp slice of each under sequence parallelism), random token ids;
    with packing each row holds two documents (positions restart halfway, as the packer leaves them). Task dpo:
    micro_batch_size pairs, two rows each (the chosen rows, then the rejected), as the pair sampler batches them."""
    import torch

    from shardwise.data.batches import MicroBatch, StepBatch

    g = torch.Generator().manual_seed(seed)
    width, part = cfg.seq_len, cfg.seq_len // dims.sp
    half = width // 2
    row = torch.cat([torch.arange(half), torch.arange(width - half)]) if cfg.packing else torch.arange(width)
    per = cfg.micro_batch_size * (2 if cfg.task == "dpo" else 1)
    micro = []
    for i in range(cfg.grad_accum):
        ids = torch.randint(0, vocab, (per, width), generator=g)
        tg = torch.roll(ids, -1, dims=1)
        pos = row.repeat(per, 1)
        cut = slice(dims.sp_rank * part, (dims.sp_rank + 1) * part)
        micro.append(MicroBatch(ids[:, cut].contiguous(), tg[:, cut].contiguous(), pos[:, cut].contiguous(),
                                rows=list(range(i * per, (i + 1) * per))))
    units = cfg.micro_batch_size * cfg.grad_accum * dims.dp_size
    rows = per * cfg.grad_accum * dims.dp_size
    return StepBatch(micro, rows * width, rows * width, list(range(rows)), units)


def rehearsal_objective(request: dict, cfg, strategy, policy, device, rows: int):
    """What the step optimises, as the run builds it (train/objective.py build), with a frozen reference of random
    weights: built on meta, wrapped by the strategy (sharded like the policy where it shards) and made real where it
    holds this rank's share, as the policy is. With --precompute-ref, the reference freed as the run frees it once
    its table of `rows` log-probabilities is made (the table's values are not computed: zeros)."""
    import torch

    from shardwise.train import objective

    def frozen():
        ref = build_model(request, cfg, dtype=strategy.reference_dtype(), adapters=False)
        sharded = shards_on_wrap(strategy)
        if not sharded:
            materialize(ref, device)
        wrapped, head = strategy.wrap_reference(ref)
        if sharded:
            materialize(wrapped, shard_home(strategy, device))
        return wrapped, head

    goal = objective.build(cfg, "", strategy, policy, frozen=frozen)
    if cfg.precompute_ref and getattr(goal, "reference", None) is not None:  # as the run does before its first step
        goal.reference.free()
        goal.reference = objective.Table(torch.zeros(rows, dtype=torch.float32, device=device))
    return goal


# ----------------------------------------------------------------------------- the run


def join_fake_group(rank: int, world: int, gpus_per_node: int):
    """This process as rank `rank` of `world` in torch's fake process group; the DistEnv the engine reads."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from shardwise.strategies.base import DistEnv

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if dist.is_initialized():
        dist.destroy_process_group()
    local_world = min(gpus_per_node, world)
    # what torchrun would set: DeepSpeed reads them (this process runs nothing else)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % local_world),
                      LOCAL_WORLD_SIZE=str(local_world))
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    return DistEnv(rank, world, rank % local_world, local_world, device, "fake")


class Meter:
    """The rank's peak memory over the measured steps: the CUDA allocator's, or live tensor bytes on the CPU."""

    def __init__(self, device, model, optimizer, held=()):
        """`held`: what else the rank keeps through the steps (task dpo: the frozen reference, or its table)."""
        import torch

        self.cuda = device.type == "cuda"
        self.tracker = None
        if self.cuda:
            torch.cuda.synchronize()
        else:
            from shardwise.plan.simulate import LiveBytes

            self.tracker = LiveBytes()
            self.tracker.__enter__()
            self.tracker.track_module(model, optimizer)
            for x in held:
                self.tracker.track_module(x) if isinstance(x, torch.nn.Module) else self.tracker.track(x)

    def steady(self) -> None:
        """From here on the peak counts (after the warm-up step: compile, the optimizer's lazy state)."""
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            self.tracker.reset_peak()

    def sync(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()

    def read(self) -> dict:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            return {"peak_allocated_bytes": torch.cuda.max_memory_allocated(),
                    "peak_reserved_bytes": torch.cuda.max_memory_reserved(), "memory": "cuda allocator"}
        self.tracker.__exit__(None, None, None)
        return {"peak_allocated_bytes": self.tracker.peak, "peak_reserved_bytes": None,
                "memory": "live tensor bytes (CPU)"}


def rehearse(request: dict) -> dict:
    where = machine()
    if request.get("needs_gpu") and where["accelerator"] != "cuda":
        return {"ok": False, "no_gpu": True, **where}
    import torch

    from shardwise import strategies
    from shardwise.config import from_dict
    from shardwise.models.moe import aux_loss_weight
    from shardwise.train.faults import Faults
    from shardwise.train.loop import forward_backward_step

    cfg = from_dict(request["config"])
    if where["accelerator"] != "cuda":
        cfg.compile = "off"  # eager on the CPU: inductor's CPU build would time the compiler, not the step
    rank, world, steps = request.get("rank", 0), request["world"], max(2, request.get("steps", STEPS))
    t0 = time.time()
    env = join_fake_group(rank, world, request["gpus_per_node"])
    try:
        torch.manual_seed(cfg.seed)
        model = build_model(request, cfg)
        heads = model.config.num_attention_heads
        strategy_cls = strategies.get(cfg.strategy)
        env.dims = dims = strategy_cls.parallel_dims(cfg, env, heads)
        strategy = strategy_cls(cfg, env)
        rehearse_wrap(strategy, env.device)
        model_ref, aux = model, aux_loss_weight(model)  # a mixture of experts' router loss, as the loop adds it
        model, optimizer = strategy.setup(model)
        head = model_ref.get_output_embeddings()
        fused_head = head if getattr(head, "loss_targets", "absent") is None else None
        batch = synthetic_batch(cfg, dims, model_ref.config.vocab_size, cfg.seed)
        goal = rehearsal_objective(request, cfg, strategy, model, env.device, len(batch.rows))
        faults = Faults(rank)
        ref = getattr(goal, "reference", None)
        meter = Meter(env.device, model, optimizer, held=[x for x in (getattr(ref, "model", None),
                                                                        getattr(ref, "values", None)) if x is not None])
        model.train()
        times = []
        for step in range(steps):
            if step == 1:
                meter.steady()
            start = time.perf_counter()
            loss = forward_backward_step(model, strategy, batch, dims.grad_size, env.device, faults, step + 1,
                                         fused_head, loss_replicas=dims.tp, aux_weight=aux, objective=goal)
            strategy.step(model, optimizer)
            strategy.take_nonfinite()
            meter.sync()
            times.append(time.perf_counter() - start)
        mem = meter.read()
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    # this rank's share of the last step's loss (finite: the random init is at a trainable scale; under sequence
    # parallelism the fake exchange leaves other ranks' slices unwritten, so it may not be)
    loss = loss[0] if loss.ndim else loss  # the objective's logged values: the loss first (task dpo: then rewards)
    return {"ok": True, "rank": rank, "world": world, "dims": dims.describe(), "steps": steps, "loss": float(loss),
            "step_s": statistics.median(times[1:]), "first_step_s": times[0], "seconds": time.time() - t0,
            **where, "applied": strategy.applied, "describe": strategy.describe(), **mem}


if __name__ == "__main__":
    sys.exit(main())
