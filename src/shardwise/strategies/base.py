"""The strategy interface: the one place that knows how a backend wraps and steps a model.

The training loop calls only these methods and never branches on the strategy:

    model, optimizer = strategy.setup(model)         # the parallelize pipeline, then the optimizer
    with strategy.sync(model, last_micro), strategy.autocast(), strategy.loss_parallel():
        loss = ...
    strategy.backward(loss)
    grad_norm = strategy.step(model, optimizer)       # unscale, clip, step, zero grads
    skipped = strategy.take_nonfinite()               # per step since the last call: update skipped?
    state = strategy.state_dict(model, optimizer)     # portable: torch.distributed.checkpoint
    strategy.load_state_dict(model, optimizer, state)
    full = strategy.full_model_state_dict(model)      # rank 0: full tensors on the CPU

`setup` runs the strategy's parallelize pipeline, in this order (strategies/parallelize.py):
float8 -> tensor parallel -> MLP tiles -> activation checkpointing -> compile -> data-parallel wrapping (`wrap`, or
DeepSpeed's engine) + the optimizer. Every degree, rank and group comes from `env.dims`
(strategies/parallel.py), which owns the one device mesh; no strategy builds its own.

Gradient reduction across data-parallel ranks is a mean (DDP, FSDP and ZeRO all average), so
the loop scales each rank's loss by the data-parallel degree after dividing by the global
loss-token count.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from shardwise import presets
from shardwise.config import Config
from shardwise.strategies.gradnorm import host_grad_norm, scale_grads_
from shardwise.strategies.parallel import ParallelDims
from shardwise.strategies.parallelize import (
    apply_activation_checkpointing,
    apply_attention,
    apply_compile,
    apply_float8,
    apply_loss_head,
    apply_mlp_tiles,
    apply_tensor_parallel,
)

DTYPES = {"no": torch.float32, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str
    dims: ParallelDims | None = None  # the run's parallel degrees and mesh (train.loop sets it)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


class Strategy:
    name = "base"
    # the compile step traces each block's forward only, its module hooks left eager (models/speed.py compile_blocks)
    compile_hooks_eager = False

    @classmethod
    def dp_split(cls, cfg: Config, dp: int, local_world_size: int) -> tuple[int, int]:
        """(dp_replicate, dp_shard): how this strategy lays its data-parallel ranks on the mesh, as its registration
        declares it (presets.StrategySpec.dp_split), which the launcher's RunPlan reads too."""
        spec = presets.SPECS.get(cls.name)  # the base class (a harness's bare strategy) replicates
        return spec.dp_split(cfg, dp, local_world_size) if spec is not None else (dp, 1)

    @classmethod
    def parallel_dims(cls, cfg: Config, env: DistEnv, heads: int | None = None) -> ParallelDims:
        """The run's degrees and mesh, with this strategy's data-parallel layout (`heads`: the model's
        attention heads, which decide the sequence group's Ulysses x ring split)."""
        return ParallelDims.from_config(cfg, env.world_size, env.rank, env.local_world_size, env.device.type,
                                        cls.dp_split, heads)

    def __init__(self, cfg: Config, env: DistEnv):
        self.cfg, self.env = cfg, env
        # the run's dims (the loop builds them once); a harness's bare DistEnv: this strategy's, from the config
        self.dims = env.dims if env.dims is not None else self.parallel_dims(cfg, env)
        self.compute_dtype = DTYPES[cfg.mixed_precision]
        self.param_dtype = DTYPES[cfg.param_dtype]
        self.scaler = None
        self.applied: list[str] = []  # parallelize's steps that are on
        self._nonfinite: list = []  # one flag per step() not read yet: a bool, a tensor, or (pinned copy, event)
        if cfg.mixed_precision == "fp16":
            self.scaler = torch.amp.GradScaler(env.device.type)

    # -- setup -------------------------------------------------------------------------
    def setup(self, model: torch.nn.Module):
        """The loaded model (adapters added) -> (the model to train, its optimizer)."""
        return self.parallelize(model)

    def parallelize(self, model: torch.nn.Module):
        """What happens to the model, in order; the mesh is read from self.dims, never built here."""
        cfg = self.cfg
        apply_loss_head(model, cfg)
        done = [apply_float8(model, cfg, self.env.device)]
        apply_attention(model, cfg, self.dims)
        done += [apply_tensor_parallel(model, self.dims),
                 apply_mlp_tiles(model, cfg, self.dims, self.env.device),
                 apply_activation_checkpointing(model, cfg),
                 apply_compile(model, cfg, self.dims, hooks_eager=self.compile_hooks_eager)]
        # what is on, for the run's header (the loop prints it): "compile: 16 blocks", "activation checkpointing: ..."
        # (the loss head and the attention are the run's header's own words: the loop's strategy line says them)
        self.applied = [d for d in done if not d.endswith(": off")]
        model, optimizer = self.apply_data_parallel(model)
        return model, optimizer

    def apply_data_parallel(self, model: torch.nn.Module):
        """The data-parallel wrapper (`wrap`) and the optimizer over the wrapped parameters."""
        model = self.wrap(model)
        return model, self.build_optimizer(model)

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.to(self.env.device)

    def build_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        """AdamW; no weight decay on biases and norm weights (1-D tensors). Parameters on different
        meshes (tensor parallelism: DTensor weights beside replicated plain ones) go in separate
        groups, since one foreach/fused kernel call cannot mix them; one mesh: the same two groups."""
        decay: dict = {}
        no_decay: dict = {}
        for p in model.parameters():
            if p.requires_grad:
                (decay if p.ndim >= 2 else no_decay).setdefault(getattr(p, "device_mesh", None), []).append(p)
        groups = [*({"params": ps, "weight_decay": self.cfg.weight_decay} for ps in decay.values()),
                  *({"params": ps, "weight_decay": 0.0} for ps in no_decay.values())]
        return torch.optim.AdamW([g for g in groups if g["params"]], lr=self.cfg.lr, betas=(0.9, 0.999),
                                 eps=1e-8, **self.optimizer_kernel())

    def wrap_reference(self, model: torch.nn.Module):
        """A frozen reference model (task dpo) -> (the module to call, its fused head or None): the loss head and
        compile steps of `parallelize`, no gradients, eval mode, then `wrap_frozen`; no optimizer."""
        apply_loss_head(model, self.cfg)
        model.requires_grad_(False)
        model.eval()
        apply_compile(model, self.cfg, self.dims, hooks_eager=self.compile_hooks_eager)
        head = model.get_output_embeddings()
        fused = head if getattr(head, "logp_targets", "absent") is None else None
        return self.wrap_frozen(model), fused

    def wrap_frozen(self, model: torch.nn.Module) -> torch.nn.Module:
        """A frozen model on this rank's device: one whole copy per rank (single, ddp, zero1/2)."""
        return model.to(self.env.device)

    def reference_layout(self) -> str:
        """How the reference model is held, for the run's header."""
        return "one copy per rank"

    def reference_dtype(self) -> torch.dtype:
        """The reference model's storage dtype: the policy's. Under autocast the residual stream runs in the stored
        dtype, so a narrower copy would not compute what the policy computes: at the first step the log-ratios would
        not be 0. A wrapper that casts the weights to the compute dtype (FSDP's policy, DeepSpeed's engine) stores the
        frozen copy in that dtype instead (fsdp.py, deepspeed.py)."""
        return self.param_dtype

    @classmethod
    def host_collectives(cls, cfg: Config) -> bool:
        """Whether torch runs collectives on host tensors of this strategy on GPUs (the process group then gets
        gloo beside NCCL: train/dist.py init_distributed). FSDP's CPU offload does."""
        return False

    def optimizer_kernel(self) -> dict:
        """The fused AdamW, wherever the step runs: on the GPU one kernel per parameter group; on the CPU (a CPU
        run, or a step offloaded to the host) one pass over each tensor instead of foreach's dozen (3.9M
        parameters: 3.3 against 11.1 ms a step on one core; 1.14B on a 16-core host: 4.1x, benchmarks/host_adamw.py).
        FSDP keeps foreach in one case (fsdp.py)."""
        return {"fused": True}

    # -- per step ----------------------------------------------------------------------
    def autocast(self):
        """Autocast when compute is in a lower precision than the stored weights."""
        if self.compute_dtype != torch.float32 and self.param_dtype == torch.float32:
            return torch.autocast(self.env.device.type, dtype=self.compute_dtype)
        return contextlib.nullcontext()

    def loss_parallel(self):
        """Context for the forward pass and backward of one micro-batch: with tensor parallelism the head's
        logits are sharded over the vocabulary (strategies/parallelize.py), and torch's `loss_parallel`
        takes their cross-entropy without gathering them; nothing otherwise."""
        if self.dims.tp == 1:
            return contextlib.nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    def sync(self, model: torch.nn.Module, enabled: bool):
        """Context for one micro-batch; gradients are synchronised only when enabled."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        with self.loss_parallel():
            (self.scaler.scale(loss) if self.scaler else loss).backward()

    def clip_grad_norm(self, model: torch.nn.Module, optimizer, scale: bool = True) -> torch.Tensor:
        """Clip to the global gradient norm; returns the pre-clip norm (a plain tensor). `scale=False` only
        measures it (the fused AdamW then applies the clip itself: `step`).

        torch's clip_grad_norm_ needs every gradient on one mesh (or none). Tensor parallelism
        leaves several: DTensors over the tp mesh (or FSDP's 2-D mesh) beside the replicated
        plain tensors (norms, embeddings, head) or FSDP's 1-D DTensors. Then each group's norm is
        taken on its own (a DTensor norm is reduced over its mesh: a sharded weight's pieces are
        summed, a replicated one counted once), the groups' norms combined, and every group
        scaled by the same coefficient.

        Gradients on the host take strategies/gradnorm.py's path instead: torch's is single-threaded there, and
        over an NCCL-only group a host DTensor's reduction fails."""
        params = [p for p in model.parameters() if p.grad is not None]
        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm > 0 else float("inf")
        grads = [p.grad for p in params]
        norm = host_grad_norm(grads)  # gradients on the host (a CPU run, FSDP's CPU offload): strategies/gradnorm.py
        if norm is not None:
            if scale and max_norm < float("inf"):
                scale_grads_(grads, norm, max_norm)
            return norm
        groups: dict = {}
        for p in params:
            groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
        if len(groups) <= 1:
            if scale:
                norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
            else:
                norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
            return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        norms = [torch.nn.utils.get_total_norm([p.grad for p in g], foreach=True) for g in groups.values()]
        norm = torch.linalg.vector_norm(torch.stack([n.full_tensor() if hasattr(n, "full_tensor") else n
                                                     for n in norms]))
        for g in groups.values() if scale else ():
            torch.nn.utils.clip_grads_with_norm_(g, max_norm, norm, foreach=True)
        return norm

    def clip_divisor(self, norm: torch.Tensor) -> torch.Tensor | None:
        """What the fused AdamW divides every gradient by to clip it (its `grad_scale`): 1 / torch's clamped clip
        coefficient, max(1, (norm + 1e-6) / max_norm) (a non-finite norm's step is skipped through found_inf or
        not taken). None without clipping."""
        if self.cfg.max_grad_norm <= 0:
            return None
        return torch.clamp((norm.float() + 1e-6) / self.cfg.max_grad_norm, min=1.0)

    def step(self, model: torch.nn.Module, optimizer) -> torch.Tensor:
        """Unscale (fp16), clip, step, zero the gradients; returns the pre-clip global norm.

        A non-finite global norm (NaN/inf loss or gradients) skips the update and records it for
        `take_nonfinite` (the loop applies --on-nan). With a fused AdamW (the default) the kernel
        skips it itself (its `found_inf`); on CUDA the flag is copied to pinned host memory behind
        an event, so neither the step nor reading the flag a step later waits for the GPU to drain.
        Any other kernel (an optimizer a subclass builds) cannot skip by itself: the norm is read here,
        which is free on the CPU; `sync_step` does that everywhere. Under fp16 the grad scaler
        skips and rescales by itself (not counted: it is how loss scaling works).

        With the fused AdamW and no grad scaler the clip rides in the kernel: its `grad_scale` divides each
        gradient as the step reads it (`clip_divisor`), one pass over the gradients fewer than scaling them
        first (on an offloaded step, a pass over the host's fp32 gradients)."""
        if self.scaler:
            self.scaler.unscale_(optimizer)
        fused = all(g.get("fused") for g in optimizer.param_groups)
        fold = fused and not self.scaler
        with torch.profiler.record_function("shardwise/clip_grad_norm"):  # a named range in a profiled step's trace
            norm = self.clip_grad_norm(model, optimizer, scale=not fold)
        if fold and (divisor := self.clip_divisor(norm)) is not None:
            optimizer.grad_scale = divisor
        try:
            if self.scaler:
                self.scaler.step(optimizer)
                self.scaler.update()
                self._nonfinite.append(False)
            elif fused and not self.cfg.sync_step:
                bad = ~torch.isfinite(norm)
                optimizer.found_inf = bad.to(torch.float32)  # the kernel skips the update (and undoes its step count)
                try:
                    optimizer.step()
                finally:
                    del optimizer.found_inf  # as GradScaler does: never left for another step() to see
                self._nonfinite.append(_host_flag(bad))
            elif bool(torch.isfinite(norm)):
                optimizer.step()
                self._nonfinite.append(False)
            else:
                self._nonfinite.append(True)
        finally:
            if hasattr(optimizer, "grad_scale"):
                del optimizer.grad_scale
        with torch.profiler.record_function("shardwise/zero_grad"):
            optimizer.zero_grad(set_to_none=True)
        return norm

    def take_nonfinite(self) -> list[bool]:
        """For each `step` since the last call, in order: whether its update was skipped as non-finite.
        A CUDA flag waits only for its own step's event (long done when the loop reads it a step late)."""
        flags, self._nonfinite = self._nonfinite, []
        out = []
        for f in flags:
            if isinstance(f, tuple):  # (pinned host copy, event after the copy)
                f[1].synchronize()
                f = f[0]
            out.append(bool(f))
        return out

    # -- state -------------------------------------------------------------------------
    def state_dict(self, model, optimizer, flat: bool = True) -> dict:
        """Model and optimizer state keyed by parameter names, sharded where the backend
        shards: the form torch.distributed.checkpoint saves and reshards on load.

        `flat` (every checkpoint written now): the optimizer's state and hyper-parameters are keyed
        by parameter name alone (`state.<fqn>.exp_avg`, `param_groups.<fqn>.lr`: DCP's
        flatten_optimizer_state_dict), so the saved form does not depend on how this run grouped its
        parameters (one group per mesh with tensor parallelism, two without): a TP 2 checkpoint
        resumes with TP 1 and back. `flat=False`: the grouped form (`param_groups.<index>.*`) that
        checkpoints written before it hold, to load those (train.checkpoint.optimizer_layout)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        msd, osd = get_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=flat))
        return {"model": msd, "optim": osd}

    def load_state_dict(self, model, optimizer, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        # either form of `state_dict` (DCP tells them apart by the "state" key of the grouped one)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        # the saved param groups carry the saving run's kernel (foreach from a CPU or offload run, fused from a GPU
        # one); keep this run's own
        kernel = self.optimizer_kernel()
        for g in optimizer.param_groups:
            g["fused"], g["foreach"] = kernel.get("fused"), kernel.get("foreach")

    def full_model_state_dict(self, model) -> dict:
        """Full (unsharded) tensors on the CPU, on rank 0; empty elsewhere."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The Hugging Face module inside any wrapper."""
        return getattr(model, "module", model)

    def describe(self) -> str:
        return self.name


def _host_flag(bad: torch.Tensor):
    """The flag as the loop will read it: on CUDA a non-blocking copy to pinned memory and the event after it
    (reading waits for this step only, not for everything queued since); elsewhere the tensor itself."""
    if bad.device.type != "cuda":
        return bad
    host = torch.empty((), dtype=torch.bool, pin_memory=True)
    host.copy_(bad, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event
