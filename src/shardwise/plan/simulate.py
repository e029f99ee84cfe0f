"""`plan --simulate`: exact per-rank memory of one training step, without the memory.

The real Hugging Face model is built from its config under PyTorch fake tensors
(`FakeTensorMode`: shapes and dtypes, no storage), wrapped as the engine wraps it, and run
for two optimizer steps on CPU as rank 0 of a fake process group of N ranks
(`FakeStore` + `init_process_group("fake")`: collectives return at once). `LiveBytes`, a
TorchDispatchMode, adds up the bytes of every live tensor storage (fake or real) and keeps
the peak of the second (steady-state) step. The same tracker measures real runs in
benchmarks/plan_accuracy.py.

What is simulated: ddp and the fsdp presets (fsdp, fsdp-grad-op, hybrid as its shard
group) with full fine-tuning or LoRA, with or without packing. LoRA is applied by the engine's
own `models/lora.apply_lora` on the meta device (peft's module moves cannot swap fake
parameters), then every parameter is made a fake CPU tensor, tied ones once. Packing passes the
engine's per-document position_ids; transformers builds its block-diagonal mask from them (under
fake tensors it cannot look at the values, so it always builds it, as it does for real packed data). DDP itself cannot be built on fake tensors (it checks
parameter shapes across ranks through real storage), so it is simulated as what it keeps:
the local model with gradients that persist between steps, as DDP's
gradient_as_bucket_view buckets do. Not simulated: DeepSpeed (its cost model's `not_simulated`), CPU offload, QLoRA (bitsandbytes
quantises on real CUDA storage), torch.compile (the blocks run eager; the fused loss head is
installed when the job has it). Kernels are the CPU ones (autocast's CPU op
lists, the CPU SDPA kernel): a few MiB from what CUDA would allocate; no CUDA context or
allocator rounding (the analytic allowance covers those).

Imports torch and transformers; never imported on the analytic path.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import replace

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from shardwise.plan.costs import cost_of
from shardwise.plan.facts import FSDP_REDUCE_DTYPE
from shardwise.plan.memory import GiB, Job, Opts, keeps_gathered
from shardwise.plan.model_spec import ModelSpec

QLORA_NOT_SIMULATED = ("QLoRA is not simulated: bitsandbytes quantises the base on real CUDA storage; its analytic "
                       "estimate stands")


def _storages(t: torch.Tensor) -> list:
    """The storages under a tensor, looking through wrapper subclasses such as DTensor."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        out = []
        for a in attrs:
            inner = getattr(t, a)
            if isinstance(inner, torch.Tensor):
                out += _storages(inner)
        return out
    try:
        return [t.untyped_storage()]
    except (RuntimeError, NotImplementedError):
        return []


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of live tensor storages (outputs of every op, plus what `track` is given)."""

    def __init__(self):
        super().__init__()
        self._sizes = WeakIdKeyDictionary()
        self._refs = []
        self.current = 0
        self.peak = 0
        self._orig_resize = torch.UntypedStorage.resize_

    def _add(self, st) -> None:
        if st in self._sizes:
            return
        n = st.nbytes()
        box = [n]
        self._sizes[st] = box
        self.current += n
        self.peak = max(self.peak, self.current)

        def gone(_ref, box=box):
            self.current -= box[0]

        self._refs.append(weakref.ref(st, gone))

    def track(self, *objs) -> None:
        """Count tensors that exist already (parameters, optimizer state, inputs)."""
        flat, _ = tree_flatten(list(objs))
        for t in flat:
            if isinstance(t, torch.Tensor):
                for st in _storages(t):
                    self._add(st)

    def track_module(self, module: torch.nn.Module, optimizer=None) -> None:
        self.track([p for p in module.parameters()], [b for b in module.buffers()],
                   [p.grad for p in module.parameters() if p.grad is not None])
        if optimizer is not None:
            self.track([v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)])

    def reset_peak(self) -> None:
        self.peak = self.current

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat, _ = tree_flatten(out)
        for t in flat:
            if isinstance(t, torch.Tensor):
                for st in _storages(t):
                    self._add(st)
        return out

    def __enter__(self):
        orig, me = self._orig_resize, self

        def resize_(st, size):
            before = st.nbytes()
            orig(st, size)
            box = me._sizes.get(st)
            if box is None:
                me._add(st)
            else:
                box[0] = st.nbytes()
                me.current += st.nbytes() - before
                me.peak = max(me.peak, me.current)

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *args):
        torch.UntypedStorage.resize_ = self._orig_resize
        return super().__exit__(*args)


# ----------------------------------------------------------------------------- the step


def train_steps(model, optimizer, batches, tracker: LiveBytes, autocast_dtype=None, no_sync=None, steps: int = 2,
                persistent_grads: bool = False, fused_head=None) -> int:
    """Run `steps` optimizer steps of len(batches) micro-batches; the peak of the last step, in bytes.
    fused_head: the output head with the engine's fused loss installed (models/speed.py), as train_step uses it."""
    for step in range(steps):
        if step == steps - 1:
            tracker.reset_peak()
        for i, (ids, tg, *pos) in enumerate(batches):
            extra = {"position_ids": pos[0]} if pos else {}
            last = i == len(batches) - 1
            if no_sync is not None:
                no_sync(not last)
            with torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast_dtype is not None):
                if fused_head is not None:
                    fused_head.loss_targets = tg
                    loss = model(input_ids=ids, **extra).logits  # the summed loss
                    fused_head.loss_targets = None
                else:  # as train.loop.train_step: the logits are not kept past the loss
                    loss = _loss_sum(model(input_ids=ids, **extra).logits, tg)
            loss.backward()
            del loss
        optimizer.step()
        optimizer.zero_grad(set_to_none=not persistent_grads)
    return tracker.peak


def _loss_sum(logits, targets):
    import torch.nn.functional as F

    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1), reduction="sum")


def build_model(spec: ModelSpec, dtype: torch.dtype, checkpointing: bool):
    from transformers import AutoConfig, AutoModelForCausalLM

    d = spec.to_hf_config()
    cfg = AutoConfig.for_model(d.pop("model_type"), **d)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=dtype)
    model.config.use_cache = False
    if checkpointing:
        from shardwise.models.checkpointing import enable_full

        enable_full(model)
    return model


def build_lora_model(spec: ModelSpec, job: Job, param: torch.dtype, compute: torch.dtype):
    """The model as train.loop.build_model makes it under LoRA (apply_lora, then checkpointing), with fake
    parameters: built and adapted on the meta device, then each parameter and buffer replaced by an empty tensor of
    its shape and dtype (call under FakeTensorMode; shared parameters stay shared)."""
    from types import SimpleNamespace

    from shardwise.models.lora import apply_lora

    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    cfg = SimpleNamespace(tuner="lora", mixed_precision=names[compute], param_dtype=names[param],
                          lora=SimpleNamespace(r=job.lora_r, alpha=2.0 * job.lora_r, dropout=job.lora_dropout,
                                               targets=job.lora_targets))
    with torch.device("meta"):
        model = apply_lora(build_model(spec, param, False), cfg)
    made: dict[int, torch.nn.Parameter] = {}
    for mod in model.modules():
        for k, p in list(mod._parameters.items()):
            if p is not None:
                if id(p) not in made:
                    made[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad)
                mod._parameters[k] = made[id(p)]
        for k, b in list(mod._buffers.items()):
            if b is not None:
                mod._buffers[k] = torch.empty(b.shape, dtype=b.dtype)
    if job.checkpointing:
        from shardwise.models.checkpointing import enable_full

        enable_full(model)
    return model


def packed_positions(micro_batch: int, seq_len: int) -> torch.Tensor:
    """position_ids of rows that each pack two documents (the engine restarts them per document)."""
    half = seq_len // 2
    row = torch.cat([torch.arange(half), torch.arange(seq_len - half)])
    return row.repeat(micro_batch, 1)


def wrap_fsdp(model, mesh, opts: Opts, compute: torch.dtype, param: torch.dtype):
    """Through strategies/fsdp.py's own sharding (shard_units): each decoder layer a unit, then the root."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from shardwise.strategies.fsdp import block_units, shard_units

    mp = MixedPrecisionPolicy(param_dtype=compute if compute != param else None,
                              reduce_dtype=getattr(torch, FSDP_REDUCE_DTYPE))
    reshard = opts.reshard_after_forward and not keeps_gathered(opts, mesh.shape[-1], compute.itemsize, param.itemsize)
    return shard_units(model, block_units(model), mesh, mp, reshard, prefetch=opts.prefetch)


def simulate(spec: ModelSpec, job: Job, opts: Opts, shard_ranks: int | None = None, steps: int = 2) -> dict:
    """Peak live tensor bytes of rank 0 in one steady-state step, under fake tensors and a fake process group."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    cost = cost_of(opts.base)
    if not cost.simulated or cost.offloads(opts) or job.tuner == "qlora":
        raise ValueError(f"cannot simulate {opts.base} (offload={opts.cpu_offload}, tuner={job.tuner})")
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    param = dtypes[job.param_dtype]
    compute = dtypes["bf16" if job.c == 2 and job.compute != "fp16" else ("fp16" if job.c == 2 else "fp32")]
    t0 = time.time()
    world = shard_ranks or job.world
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        mesh = None
        if cost.wraps_units:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (world,))  # outside fake mode: the mesh holds real rank ids
        tracker = LiveBytes()
        with FakeTensorMode():
            if job.tuner == "lora":
                model = build_lora_model(spec, job, param, compute)
            else:
                model = build_model(spec, param, job.checkpointing)
            fused = None
            if job.fused_loss:
                from shardwise.models.speed import install_fused_loss

                if install_fused_loss(model):
                    fused = model.get_output_embeddings()
            autocast_dtype, no_sync, persistent = None, None, False
            if cost.wraps_units:
                model = wrap_fsdp(model, mesh, opts, compute, param)
                no_sync = lambda skip: model.set_requires_gradient_sync(not skip)  # noqa: E731
            else:
                if compute != param and param == torch.float32:
                    autocast_dtype = compute
                if cost.persistent_grads:  # DDP(gradient_as_bucket_view=True): grads live in buckets all the time
                    for p in model.parameters():
                        if p.requires_grad:
                            p.grad = torch.zeros_like(p)
                    persistent = True
            train = [p for p in model.parameters() if p.requires_grad]
            decay = [p for p in train if p.ndim >= 2]
            rest = [p for p in train if p.ndim < 2]
            optimizer = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=1e-4,
                                          fused=True)  # the engine's kernel (strategies/base.py)
            batches = [(torch.randint(0, spec.vocab_size, (job.micro_batch, job.seq_len)),
                        torch.randint(0, spec.vocab_size, (job.micro_batch, job.seq_len)))
                       + ((packed_positions(job.micro_batch, job.seq_len),) if job.packing else ())
                       for _ in range(min(job.grad_accum, 2))]
            with tracker:
                tracker.track_module(model, optimizer)
                tracker.track(batches)
                peak = train_steps(model, optimizer, batches, tracker, autocast_dtype, no_sync, steps, persistent,
                                   fused)
    finally:
        dist.destroy_process_group()
    return {"peak_bytes": peak, "seconds": time.time() - t0, "ranks": world}


def simulate_plan(plan) -> dict:
    """Simulate the plan's ddp and fsdp-family strategies; compare with the analytic tensor peak."""
    from shardwise.plan.memory import estimate

    results, errors = [], []
    names = [s.strategy for s in plan.strategies
             if cost_of(s.base).simulated and not cost_of(s.base).offloads(s.opts)]
    skipped = sorted({s.base for s in plan.strategies if not cost_of(s.base).simulated})
    errors += [f"{', '.join(s.strategy for s in plan.strategies if s.base == b)}: {cost_of(b).not_simulated}"
               for b in skipped]
    job = replace(plan.job, compile=False)  # blocks run eager here: compared with the eager analytic peak
    if job.tuner == "qlora":
        return {"results": [], "errors": [QLORA_NOT_SIMULATED]}
    if job.tp > 1 or job.sp > 1:  # the fake run has no tp/sp mesh: it would measure another job
        return {"results": [], "errors": ["tensor and sequence parallelism are not simulated (the fake process "
                                          "group runs data parallelism only); the analytic plan stands"]}
    for name in names:
        sp = plan.for_strategy(name)
        from shardwise.plan.memory import shard_ranks

        n = shard_ranks(job, sp.opts) if cost_of(sp.base).wraps_units else job.world
        try:
            r = simulate(plan.spec, job, sp.opts, shard_ranks=n)
        except Exception as e:  # report, keep the analytic plan
            errors.append(f"{name}: simulation failed ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
            continue
        ana = estimate(plan.spec, job, sp.opts).peak_tensors
        results.append({"strategy": name, "peak_gib": r["peak_bytes"] / GiB, "analytic_gib": ana / GiB,
                        "diff_pct": 100 * (ana - r["peak_bytes"]) / max(r["peak_bytes"], 1),
                        "seconds": r["seconds"], "ranks": r["ranks"]})
    return {"results": results, "errors": errors,
            "note": "peak live tensor bytes of rank 0 in the second step; compare with the analytic peak before the "
                    "CUDA context / fragmentation allowance" + ("; blocks eager (torch.compile is not simulated: "
                    "the analytic side is the eager one here)" if plan.job.compile else "")}


def job_for(job: Job, **kw) -> Job:
    return replace(job, **kw)
