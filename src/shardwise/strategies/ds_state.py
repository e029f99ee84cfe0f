"""DeepSpeed state in the portable form every other strategy uses.

DeepSpeed keeps its fp32 master weights and optimizer states in flat, per-rank partitions;
its own checkpoints are tied to the stage and the world size. For a checkpoint that
resumes under ddp/fsdp (and the other way), we go through DeepSpeed's tensor-fragment API
(`safe_get_full_fp32_param` / `safe_get_full_optimizer_state` and their setters), one
parameter at a time, and hold each as a dim-0-sharded DTensor: the same shape of state
dict `torch.distributed.checkpoint.state_dict.get_state_dict` gives for FSDP2, keyed by
parameter name. Peak extra memory: one full parameter at a time plus 1/world of the state.

Every function here is collective: all ranks call it, in the same parameter order.
"""

from __future__ import annotations

import torch


def _mesh(strategy):
    """The 1-D mesh ZeRO partitions over (the run's dp_shard dimension, x sp with sequence parallelism)."""
    return strategy.dims.shard_mesh


def _shard(full: torch.Tensor, strategy):
    """This rank's dim-0 chunk of a full tensor (torch.chunk, as Shard(0) splits)."""
    from torch.distributed.tensor import DTensor, Shard

    if full.ndim == 0:
        return full.detach().clone().cpu()
    mesh = _mesh(strategy)
    world, rank = mesh.size(), mesh.get_local_rank()
    chunks = torch.chunk(full.detach(), world, dim=0)
    local = chunks[rank] if rank < len(chunks) else full.new_empty((0, *full.shape[1:]))
    return DTensor.from_local(local.contiguous().clone(), mesh, [Shard(0)], run_check=False,
                              shape=full.shape, stride=full.contiguous().stride())


def _full(t) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _entries(module):
    """(state-dict key, tensor) in module.state_dict() order; params as the Parameter."""
    params = dict(module.named_parameters(remove_duplicate=False))
    buffers = dict(module.named_buffers(remove_duplicate=False))
    for key in module.state_dict(keep_vars=True):
        yield key, params.get(key, buffers.get(key))


def _full_lp(p) -> torch.Tensor:
    """The full low-precision tensor of a parameter (gathered under ZeRO-3)."""
    if hasattr(p, "ds_id"):
        import deepspeed

        with deepspeed.zero.GatheredParameters([p]):
            return p.data.detach().clone()
    return p.detach().clone()


def _full_master(p) -> torch.Tensor:
    from deepspeed.utils import safe_get_full_fp32_param

    hp = safe_get_full_fp32_param(p) if p.requires_grad else None
    return _full_lp(p) if hp is None else hp


def _inner(engine):
    return engine.optimizer.optimizer  # our torch AdamW, on DeepSpeed's flat partitions


def _state_keys(engine) -> list[str]:
    st = _inner(engine).state
    return [k for k in next(iter(st.values())) if k != "step"] if st else []


def _init_optimizer_state(engine) -> None:
    """Run one zero-gradient, zero-lr step so AdamW's states exist (a fresh optimizer has
    none; a checkpoint is loaded into them). Gradient buffers are restored afterwards."""
    zopt, opt = engine.optimizer, _inner(engine)
    if hasattr(zopt, "fp32_partitioned_groups_flat"):
        # ZeRO-3 hands AdamW one flat fp32 sub-group at a time (params are [] in between)
        for sub, flat in enumerate(zopt.fp32_partitioned_groups_flat):
            if flat not in opt.state:
                _zero_step(opt, opt.param_groups[zopt.sub_group_to_group_id[sub]], [flat])
    elif not opt.state:
        for g in opt.param_groups:
            _zero_step(opt, g, g["params"])
    link = getattr(zopt, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:  # ZeRO-1/2: point each parameter's fragment map at the new states
        link()


def _zero_step(opt, group: dict, params: list) -> None:
    """One AdamW step of `group` over `params` with zero gradients and lr 0 (no change)."""
    saved = (group["params"], group["lr"], [p.grad for p in params])
    group["params"], group["lr"] = params, 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    others = [g for g in opt.param_groups if g is not group]
    hidden = [g["params"] for g in others]
    for g in others:
        g["params"] = []
    opt.step()
    for g, ps in zip(others, hidden):
        g["params"] = ps
    group["params"], group["lr"] = saved[0], saved[1]
    for p, grad in zip(params, saved[2]):
        p.grad = grad


def state_dict(strategy, engine, flat: bool = True) -> dict:
    """`flat`: the optimizer's state keyed by parameter name alone, as Strategy.state_dict's."""
    from deepspeed.utils import safe_get_full_optimizer_state

    _init_optimizer_state(engine)
    module, keys = engine.module, _state_keys(engine)
    names = {id(p): n for n, p in module.named_parameters()}
    msd, ostate = {}, {}
    inner = _inner(engine)
    step = next(iter(inner.state.values()))["step"]
    for key, t in _entries(module):
        if not isinstance(t, torch.nn.Parameter):
            msd[key] = _shard(t, strategy)
            continue
        msd[key] = _shard(_full_master(t).to(strategy.param_dtype), strategy)
        if t.requires_grad and names.get(id(t)) == key:
            ostate[key] = {"step": torch.tensor(float(step))}
            for k in keys:
                ostate[key][k] = _shard(safe_get_full_optimizer_state(t, k), strategy)
    groups = []
    for params, g in zip(strategy.groups, inner.param_groups):
        hyper = {k: v for k, v in g.items() if k != "params"}
        groups.append({**hyper, "params": [names[id(p)] for p in params]})
    optim = {"state": ostate, "param_groups": groups}
    return {"model": msd, "optim": flatten_optim(optim) if flat else optim}


def flatten_optim(osd: dict) -> dict:
    """The grouped optimizer state dict -> DCP's flat form (`state.<fqn>.<key>`, `param_groups.<fqn>.<key>`), the
    form `get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)` gives."""
    flat = {f"state.{fqn}.{k}": v for fqn, st in osd["state"].items() for k, v in st.items()}
    for g in osd["param_groups"]:
        for fqn in g["params"]:
            flat.update({f"param_groups.{fqn}.{k}": v for k, v in g.items() if k != "params"})
    return flat


def optim_state(optim: dict, fqn: str) -> dict:
    """One parameter's optimizer state from either form of the optimizer state dict."""
    if "state" in optim:
        return optim["state"][fqn]
    prefix = f"state.{fqn}."
    return {k[len(prefix):]: v for k, v in optim.items() if k.startswith(prefix) and "." not in k[len(prefix):]}


@torch.no_grad()
def load_state_dict(strategy, engine, state: dict) -> None:
    import deepspeed
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    module, msd, optim = engine.module, state["model"], state["optim"]
    names = {id(p): n for n, p in module.named_parameters()}
    step = None
    for key, t in _entries(module):
        full = _full(msd[key]).to(strategy.env.device)
        if not isinstance(t, torch.nn.Parameter):
            t.copy_(full.to(t.dtype))
            continue
        if names.get(id(t)) != key:
            continue  # a tied alias: loaded under its first name
        if hasattr(t, "ds_id"):  # ZeRO-3: write the low-precision partition through a gather
            with deepspeed.zero.GatheredParameters([t], modifier_rank=0):
                t.data.copy_(full.to(t.dtype))
        else:
            t.data.copy_(full.to(t.dtype))
        if t.requires_grad:
            safe_set_full_fp32_param(t, full.float())
            for k, v in optim_state(optim, key).items():
                if k == "step":
                    step = float(v)
                else:
                    safe_set_full_optimizer_state(t, _full(v).to(strategy.env.device), k)
    if step is not None:
        for st in _inner(engine).state.values():
            st["step"] = torch.tensor(step, dtype=st["step"].dtype, device=st["step"].device) \
                if torch.is_tensor(st["step"]) else step


def full_model_state_dict(strategy, engine) -> dict:
    """Full tensors (fp32 master weights where they exist) on rank 0's CPU; {} elsewhere."""
    out = {}
    for key, t in _entries(engine.module):
        full = _full_master(t) if isinstance(t, torch.nn.Parameter) else t.detach()
        if strategy.env.is_main:
            out[key] = full.to(strategy.param_dtype if full.is_floating_point() else full.dtype).cpu()
    return out
