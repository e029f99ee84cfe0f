"""`zero1`, `zero2`, `zero3`: DeepSpeed ZeRO. Stage 1 shards the optimizer states (and fp32
master weights), stage 2 also the gradients, stage 3 also the parameters; offload moves the
optimizer states and step (and, at stage 3, the parameters) to the CPU.

The DeepSpeed config is generated from ours (one source of truth: micro batch, gradient
accumulation, clipping, precision, stage, offload); keys in a user's `deepspeed.config`
JSON override it. The optimizer is ours (torch AdamW, the same groups as every strategy),
handed to DeepSpeed as a client optimizer, so the loop sets its learning rate through
`param_groups` as everywhere else. DeepSpeed averages gradients over ranks like DDP/FSDP, over the
mesh's groups (ds_mpu.py).

`deepspeed` is imported only inside methods: selecting `zero*` without it installed fails
in the registry with an install hint, before any worker starts.
"""

from __future__ import annotations

import contextlib
import functools
import sys

import torch

from shardwise.errors import ShardwiseError
from shardwise.strategies import ds_json, ds_state
from shardwise.strategies.base import Strategy
from shardwise.strategies.ds_mpu import MeshGroups
from shardwise.strategies.parallelize import compile_enabled


def _key_path(config: dict, loc: tuple) -> str:
    """The dotted key of `config` whose path ends with `loc` (DeepSpeed validates each section on its own, so a
    field's location is relative to its section: `reduce_bucket_size` is `zero_optimization.reduce_bucket_size`)."""
    def walk(node, path):
        if tuple(path[-len(loc):]) == tuple(loc):
            yield path
        if isinstance(node, dict):
            for k, v in node.items():
                yield from walk(v, [*path, str(k)])

    loc = tuple(str(x) for x in loc)
    return ".".join(next(walk(config, []), loc)) if loc else ""


def refused_line(path: str, config: dict, e) -> str:
    """One line for DeepSpeed's pydantic refusal of the merged config: the user's file, the key with its section, the
    value (shortened) and DeepSpeed's reason. A check over a whole section has no field: the section is named."""
    bad = e.errors()[0]
    why = str(bad.get("msg", "")).removeprefix("Value error, ")[:300]
    where = _key_path(config, tuple(bad.get("loc", ())))
    if not where:
        title = getattr(e, "title", "")
        section = {"DeepSpeedZeroConfig": "zero_optimization"}.get(title, title or "a section")
        return f"{path or 'the DeepSpeed config'}: DeepSpeed refuses {section}: {why}; fix that section"
    value = repr(bad.get("input"))
    value = value if len(value) <= 100 else value[:97] + "..."
    return f"{path or 'the DeepSpeed config'}: DeepSpeed refuses {where} = {value} ({why}); fix that key"


def ds_config(cfg, world: int, cuda: bool) -> dict:
    """The DeepSpeed JSON for this run, from our config; the user's file overrides keys.
    `world`: the ranks DeepSpeed averages over (dims.grad_size: data-parallel x sequence-parallel)."""
    ds = cfg.deepspeed
    zero: dict = {"stage": ds.stage}
    if ds.stage == 3 and ds.fetch == "block" and compile_enabled(cfg):
        # DeepSpeed's own F.linear (on by default at stage 3, patched process-wide) saves the weight parameter itself
        # for backward, so a released weight's gathered buffer is freed (torch's eager linear saves a view of it,
        # which keeps every released weight alive to backward: eager blocks keep it). A compiled block saves the
        # parameter itself too, and DeepSpeed's linear traced into it guards on each weight's ds_id: every block
        # recompiled until dynamo's limit (8) left the others eager (8 of the anchor's 16 blocks compiled;
        # docs/speed.md, "ZeRO-3"). So compiled blocks run torch's.
        zero["memory_efficient_linear"] = False
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": cuda}
    if ds.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": cuda}
    out = {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.grad_accum,
        "train_batch_size": cfg.micro_batch_size * cfg.grad_accum * world,
        "gradient_clipping": cfg.max_grad_norm,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,  # our torch AdamW also runs the offloaded step
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if cfg.mixed_precision == "bf16":
        out["bf16"] = {"enabled": True}
        if cfg.param_dtype == "bf16":  # pure bf16: no fp32 master copy or fp32 states
            out["bf16"].update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
        else:
            out["communication_data_type"] = "fp32"  # reduce in fp32, as FSDP does
    elif cfg.mixed_precision == "fp16":
        out["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
        out["communication_data_type"] = "fp32"
    if ds.config:  # the user's keys over ours, "auto" filled in as the HF Trainer does (ds_json.py)
        merge(out, ds_json.resolve(ds_json.UserConfig.read(ds.config), cfg, world))
    return out


def hidden_size(model_config) -> int | None:
    """The model's hidden size for DeepSpeed's "auto" bucket sizes (a multimodal model's text hidden size; the
    largest of `hidden_sizes`), as the HF Trainer finds it."""
    for c in (model_config, getattr(model_config, "text_config", None)):
        if c is None:
            continue
        if isinstance(getattr(c, "hidden_size", None), int):
            return c.hidden_size
        if getattr(c, "hidden_sizes", None):
            return max(c.hidden_sizes)
    return None


MUON = "deepspeed.runtime.zero.muon.muon_optimizer"


def import_deepspeed():
    """`import deepspeed` without the mlflow its autotuner imports at package import (a guarded import there:
    DeepSpeed's autotuning, which shardwise never runs, then goes without mlflow). mlflow costs 2.6 of the
    4.7 CPU-s of importing deepspeed on a 2-core CPU host, in every ZeRO process. Where mlflow is already
    imported (a run reporting to it) nothing is hidden; afterwards `import mlflow` works as usual."""
    if "deepspeed" in sys.modules:
        return sys.modules["deepspeed"]
    hide = "mlflow" not in sys.modules
    if hide:
        sys.modules["mlflow"] = None  # makes `import mlflow` raise ImportError
    try:
        import deepspeed
    finally:
        if hide and "mlflow" in sys.modules and sys.modules["mlflow"] is None:
            del sys.modules["mlflow"]
    return deepspeed


def import_muon_lazily() -> None:
    """Import DeepSpeed's Muon module with its kernels compiled on first use, not at import.

    ZeRO asks `isinstance(optimizer, MuonWithAuxAdam)` in `deepspeed.initialize` and in its
    gradient reduction, which imports that module; it applies torch.compile to three kernels
    at import, and torch.compile imports inductor there and then: ~3 CPU-s per rank, most of
    `initialize` on a CPU run, for an optimizer this tool never uses (ours is torch AdamW).
    Imported first here with DeepSpeed's own compile hook (`deepspeed.runtime.compiler.compile`,
    which already falls back to a no-op decorator) giving a decorator that calls torch.compile
    on the first call instead: the same kernels, compiled when, if ever, Muon runs."""
    if MUON in sys.modules:
        return
    from deepspeed.runtime import compiler

    eager = compiler.compile

    def lazy():
        def decorate(fn):
            compiled = None

            @functools.wraps(fn)
            def call(*args, **kwargs):
                nonlocal compiled
                if compiled is None:
                    compiled = eager()(fn)
                return compiled(*args, **kwargs)

            return call

        return decorate

    compiler.compile = lazy
    try:
        __import__(MUON)
    except ImportError:  # a DeepSpeed without Muon: nothing to import
        pass
    finally:
        compiler.compile = eager


def _input_needs_grad(module, args, kwargs):
    """Forward pre-hook: the first block's hidden states need a gradient while training (apply_leaves says why)."""
    hidden = args[0] if args else kwargs.get("hidden_states")
    if torch.is_grad_enabled() and torch.is_tensor(hidden) and hidden.is_floating_point() and not hidden.requires_grad:
        hidden.requires_grad_(True)
    return None


def merge(base: dict, over: dict) -> dict:
    """Recursive dict update: `over` wins, sections are merged key by key."""
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            merge(base[k], v)
        else:
            base[k] = v
    return base


class DeepSpeedStrategy(Strategy):
    name = "deepspeed"

    def __init__(self, cfg, env):
        super().__init__(cfg, env)
        self.scaler = None  # DeepSpeed scales fp16 losses itself
        self.engine = None
        self.config = ds_config(cfg, self.dims.grad_size, env.device.type == "cuda")

    def apply_data_parallel(self, model: torch.nn.Module):
        """DeepSpeed's engine around the model and our optimizer (it flattens the groups).
        Its process groups are the mesh's, handed over as its `mpu` (ds_mpu.MeshGroups): data
        parallelism (ZeRO's partitioning and gradient averaging) over dims.grad_group, the
        data-parallel and sequence-parallel ranks; model parallelism over dims.tp_group."""
        import_deepspeed()
        import deepspeed
        import deepspeed.ops

        if self.env.device.type == "cpu" and "__compatible_ops__" not in vars(deepspeed.ops):
            # DeepSpeed would JIT-compile (minutes) a shared-memory all-reduce used only for
            # inference; training on CPU uses gloo. An empty table means "no prebuilt ops".
            deepspeed.ops.__compatible_ops__ = {}
        import_muon_lazily()
        if self.cfg.deepspeed.stage == 3:
            self.apply_leaves(model)
        filled = ds_json.fill_hidden(self.config, hidden_size(getattr(model, "config", None)),
                                     self.cfg.deepspeed.config)
        if self.cfg.deepspeed.config:  # the run's header says what DeepSpeed got from the user's file
            said = [f"\"auto\" filled from hidden size: {filled}"] if filled else []
            said += ds_json.dropped_notes(ds_json.UserConfig.read(self.cfg.deepspeed.config).obj,
                                          self.cfg.min_lr_ratio)
            self.applied.append(f"DeepSpeed config: {self.cfg.deepspeed.config} over the generated one"
                                + (f" ({'; '.join(said)})" if said else ""))
        opt = self.build_optimizer(model)
        self.groups = [list(g["params"]) for g in opt.param_groups]  # before DeepSpeed flattens them
        from pydantic import ValidationError

        try:
            engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=self.config,
                                                           mpu=MeshGroups(self.dims), dist_init_required=False)
        except ValidationError as e:  # a value of the user's --deepspeed-config (ours are DeepSpeed's own types)
            raise ShardwiseError(refused_line(self.cfg.deepspeed.config, self.config, e)) from None
        self.engine = engine
        return engine, optimizer

    def wrap_frozen(self, model: torch.nn.Module) -> torch.nn.Module:
        """ZeRO-3: the reference model partitioned like the policy, by an engine of its own with no optimizer (its
        forward gathers each block's weights and releases them); stages 1 and 2 hold whole weights: one copy."""
        if self.cfg.deepspeed.stage != 3:
            return super().wrap_frozen(model)
        import deepspeed

        config = {k: v for k, v in self.config.items() if k not in ("gradient_clipping", "zero_allow_untested_optimizer",
                                                                    "zero_force_ds_cpu_optimizer")}
        config["zero_optimization"] = {k: v for k, v in config["zero_optimization"].items()
                                       if k != "offload_optimizer"}
        # the policy's fetch units: with DeepSpeed's per-submodule hooks instead, a compiled block traces its
        # submodules' fetch/release hooks (compile_hooks_eager leaves only a leaf's own hooks eager) and breaks into
        # several graphs, whose bf16 roundings differ from the policy's one graph (the first step's margin not 0)
        self.apply_leaves(model, trains=False)
        engine, *_ = deepspeed.initialize(model=model, config=config, mpu=MeshGroups(self.dims),
                                          dist_init_required=False)
        engine.eval()
        return engine

    def reference_dtype(self) -> torch.dtype:
        """The compute dtype where it is narrower: the engine runs the policy in it (its bf16/fp16 module)."""
        return min(self.param_dtype, self.compute_dtype, key=lambda d: d.itemsize)

    def reference_layout(self) -> str:
        return "partitioned like the policy (ZeRO-3)" if self.cfg.deepspeed.stage == 3 else "one copy per rank"

    @property
    def compile_hooks_eager(self) -> bool:
        """ZeRO-3 fetching whole blocks: each compiled block's fetch/release hooks run eagerly around its compiled
        forward, which is then one graph (the hooks are `torch.compiler.disable`d: traced inside they break it)."""
        return self.cfg.deepspeed.stage == 3 and self.cfg.deepspeed.fetch == "block"

    def apply_leaves(self, model: torch.nn.Module, trains: bool = True) -> None:
        """ZeRO-3's fetch units, as DeepSpeed leaf modules (their parameters gathered and released together by one
        pair of hooks on the leaf, none on what it holds). `deepspeed.fetch: block` (the default): each decoder
        block, as FSDP's per-block units. DeepSpeed's default (`module`) hooks every submodule holding parameters,
        nine per Llama block, and that host work outlasts the GPU's on a step of compiled blocks (docs/speed.md).
        Either way each sparse MoE block is fetched whole, so the gathers do not depend on which experts this
        rank's tokens chose (models/moe.py); a decoder block holding one already fetches it whole. `trains`: the
        policy's (named in the run's header, its first block's input made to need a gradient); else a frozen
        reference's, the same units."""
        from deepspeed.utils import set_z3_leaf_modules

        from shardwise.models.moe import moe_leaf_classes
        from shardwise.models.speed import decoder_blocks

        blocks = decoder_blocks(model) if self.cfg.deepspeed.fetch == "block" else []
        classes = list(dict.fromkeys(type(b) for b in blocks))
        # a sparse MoE block that no found block holds stays a leaf of its own (the found "blocks" are the experts
        # in a model that names no layer class in `_no_split_modules` and has more experts than layers)
        inside = {id(m) for b in blocks for m in b.modules()}
        moe = [c for c in moe_leaf_classes(model)
               if any(isinstance(m, c) and id(m) not in inside for m in model.modules())]
        classes += moe
        if classes:
            set_z3_leaf_modules(model, classes)
        if classes and trains:
            self.leaves = ("blocks" if blocks else "MoE blocks", [c.__name__ for c in classes])
        if blocks and trains:
            # DeepSpeed reduces (and frees) a leaf's gradients in the leaf's full backward hook, which torch runs
            # as soon as the gradients of the leaf's outputs exist when no input needs a gradient: under a frozen
            # embedding (LoRA) that is the first block, before its own backward has run (its adapters' gradients
            # then land in freed buffers). Its input needing a gradient makes the hook wait for the block's backward
            # (registered before DeepSpeed's own hooks, so they see it; on the block, not the embedding, whose
            # hook would then fetch the frozen embedding in every backward).
            blocks[0].register_forward_pre_hook(_input_needs_grad, with_kwargs=True)

    def autocast(self):
        return contextlib.nullcontext()  # DeepSpeed runs the whole module in its bf16/fp16

    def sync(self, model, enabled: bool):
        model.set_gradient_accumulation_boundary(enabled)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        # the loop has already normalised the loss for accumulation and world size
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self, model, optimizer) -> torch.Tensor:
        """Clip (DeepSpeed's gradient_clipping), step, zero; returns the pre-clip global norm."""
        model.step()
        norm = model.get_global_grad_norm()
        norm = torch.tensor(float("nan") if norm is None else float(norm))
        # (fp16: DeepSpeed's loss scaler skips and rescales by itself; not counted)
        self._nonfinite.append(not bool(torch.isfinite(norm)) and self.cfg.mixed_precision != "fp16")
        return norm

    # -- state: the same portable, name-keyed form as the other strategies ----------------
    def state_dict(self, model, optimizer, flat: bool = True) -> dict:
        return ds_state.state_dict(self, model, flat)

    def load_state_dict(self, model, optimizer, state: dict) -> None:
        ds_state.load_state_dict(self, model, state)

    def full_model_state_dict(self, model) -> dict:
        return ds_state.full_model_state_dict(self, model)

    def unwrap(self, model):
        return model.module

    def describe(self) -> str:
        ds = self.cfg.deepspeed
        off = [n for n, on in (("optimizer", ds.offload_optimizer), ("params", ds.offload_params)) if on]
        what, leaves = getattr(self, "leaves", ("", None))
        return (f"deepspeed ZeRO-{ds.stage}" + (f" (offload {', '.join(off)})" if off else "")
                + (f", {what} fetched whole ({', '.join(leaves)})" if leaves else ""))
