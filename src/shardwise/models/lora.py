"""LoRA and QLoRA adapters (built on peft), applied before any strategy wraps the model.

Storage: the frozen base in the compute dtype (bf16 under bf16 mixed precision, fp32
otherwise; 4-bit NF4 under QLoRA), the adapters in the storage dtype (`param_dtype`, fp32
by default). Only adapter parameters require gradients, so every strategy puts only them
in the optimizer; FSDP and ZeRO-3 still shard the frozen base with them.

The final output is a PEFT adapter directory (adapter_config.json +
adapter_model.safetensors); with `merge_lora`, a merged full model is written next to it
in final/merged (W + (alpha / r) * B @ A for every adapted linear).
"""

from __future__ import annotations

import contextlib
import os
import warnings

import torch
from torch import nn

from shardwise.errors import ShardwiseError

DTYPES = {"no": torch.float32, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def lora_targets(model, targets: str, where: str = "lora.targets") -> str | list[str]:
    """The adapted modules: 'all-linear', or the named linear modules, each of which the model must have (checked on
    the meta-device model before launch too: launch.preflight.check_model)."""
    targets = targets.strip()
    if targets == "all-linear":
        return targets
    names = [t.strip() for t in targets.split(",") if t.strip()]
    linears = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    missing = [t for t in names if t not in linears]
    if missing:
        raise ShardwiseError(f"{where}: no linear module named {', '.join(missing)} in the model; "
                             f"its linear modules are {', '.join(sorted(linears))} (or use all-linear)")
    return names


def check_rank(model, targets: str | list[str], r: int, where: str = "lora.r") -> None:
    """A rank above an adapted linear's smaller dimension adds parameters, not rank (and a huge one only runs out of
    memory in the workers): refused with the model's numbers, on the meta-device model before launch."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    adapted = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and m is not head
               and (targets == "all-linear" or n.rsplit(".", 1)[-1] in targets)]
    if not adapted:
        return
    name, m = min(adapted, key=lambda nm: min(nm[1].in_features, nm[1].out_features))
    d = min(m.in_features, m.out_features)
    if r > d:
        raise ShardwiseError(f"{where}: lora.r {r} is larger than the smallest adapted linear allows "
                             f"({name.rsplit('.', 1)[-1]}: {m.in_features} -> {m.out_features}); a rank above "
                             f"min(in, out) adds parameters, not rank: choose --lora-r {d} or less")


def lora_config(model, cfg):
    from peft import LoraConfig

    targets = lora_targets(model, cfg.lora.targets)
    # 'all-linear': every linear layer except the output head, i.e. the blocks' projections
    return LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                      target_modules=targets, bias="none", task_type="CAUSAL_LM")


@contextlib.contextmanager
def quiet_peft():
    """peft reads the model's `is_gradient_checkpointing`, which transformers >= 5.2x deprecates in favour of
    `is_activation_checkpointing`: a FutureWarning in every LoRA run's, export's and chat's output that the user
    cannot act on. Silenced around peft's own calls only."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def apply_lora(model, cfg):
    """Freeze the base, cast it to the compute dtype (or quantize it), add adapters."""
    from peft import get_peft_model

    compute = DTYPES[cfg.mixed_precision]
    adapter_dtype = DTYPES[cfg.param_dtype]
    if cfg.tuner == "qlora":
        quantize_4bit(model, compute)
    for p in model.parameters():
        p.requires_grad_(False)
        if p.is_floating_point() and p.dtype != compute:
            p.data = p.data.to(compute)
    with quiet_peft():
        model = get_peft_model(model, lora_config(model, cfg))
    for n, p in model.named_parameters():
        if p.requires_grad:
            p.data = p.data.to(adapter_dtype)
    return model


def quantize_4bit(model, compute: torch.dtype) -> None:
    """Replace the blocks' linear layers by bitsandbytes NF4 layers; the weights are
    quantized when the strategy moves the model to the GPU."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise ShardwiseError("tuner qlora needs bitsandbytes; install it with: pip install 'shardwise[qlora]'")
    head = model.get_output_embeddings()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear) or child is head:
                continue
            q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                  compute_dtype=compute, quant_type="nf4", quant_storage=torch.uint8)
            q.weight = bnb.nn.Params4bit(child.weight.data.to(compute), requires_grad=False, quant_type="nf4")
            if child.bias is not None:
                q.bias = nn.Parameter(child.bias.data.to(compute), requires_grad=False)
            setattr(parent, name, q)


def merged_state_dict(full: dict, cfg) -> dict:
    """A plain Hugging Face state dict from a PEFT model's full state dict: every adapted
    linear's weight becomes W + (alpha / r) * B @ A (computed in fp32, stored in W's dtype)."""
    prefix, scale = "base_model.model.", cfg.lora.alpha / cfg.lora.r
    out = {}
    for key, t in full.items():
        if ".lora_" in key:
            continue
        k = key[len(prefix):] if key.startswith(prefix) else key
        if k.endswith(".base_layer.weight"):
            stem = key[: -len(".base_layer.weight")]
            a, b = full[f"{stem}.lora_A.default.weight"], full[f"{stem}.lora_B.default.weight"]
            t = (t.float() + scale * (b.float() @ a.float())).to(t.dtype)
        out[k.replace(".base_layer.", ".")] = t
    return out


def save_final(peft_model, full: dict, tokenizer, path: str, cfg) -> None:
    """Rank 0: the adapter directory at `path`, plus path/merged with `merge_lora`."""
    from shardwise.models.save import save_pretrained

    save_pretrained(peft_model, path, state_dict=full)
    if getattr(cfg, "merge_lora", False):
        if cfg.tuner == "qlora":
            raise ShardwiseError("merge_lora: a 4-bit base cannot be merged here; merge the adapter into the "
                                 "full-precision model with peft's merge_and_unload")
        base = peft_model.get_base_model()
        merged = os.path.join(path, "merged")
        save_pretrained(base, merged, state_dict=merged_state_dict(full, cfg))
        tokenizer.save_pretrained(merged)


ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def _positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def read_adapter_config(adapter_dir: str, what: str) -> dict:
    """adapter_config.json as a dict, its LoRA fields of the types peft needs (a bare TypeError from inside peft
    otherwise); one line naming the file and key (`what` names the directory)."""
    import json

    path = os.path.join(adapter_dir, ADAPTER_CONFIG)
    try:
        with open(path, "rb") as fh:
            cfg = json.load(fh)
    except json.JSONDecodeError as e:
        raise ShardwiseError(f"{what}: {ADAPTER_CONFIG}:{e.lineno}: not valid JSON ({e.msg}); fix the file, or copy "
                             "it from the run that made the adapter") from None
    except (OSError, ValueError) as e:
        raise ShardwiseError(f"{what}: {ADAPTER_CONFIG} is unreadable ({str(e).splitlines()[0][:200]}); fix the "
                             "file, or copy it from the run that made the adapter") from None
    if not isinstance(cfg, dict):
        raise ShardwiseError(f"{what}: {ADAPTER_CONFIG} is not a JSON object; fix the file, or copy it from the run "
                             "that made the adapter")
    checks = [("base_model_name_or_path", lambda v: v is None or isinstance(v, str), "a directory path (a string)"),
              ("peft_type", lambda v: v is None or isinstance(v, str), "a string such as \"LORA\"")]
    if cfg.get("peft_type") in (None, "LORA"):
        checks += [
            ("r", _positive_int, "a positive integer (the adapter's rank, e.g. 16)"),
            ("lora_alpha", lambda v: v is None or _number(v), "a number (e.g. 32)"),
            ("lora_dropout", lambda v: v is None or (_number(v) and 0 <= v <= 1), "a number in [0, 1]"),
            ("target_modules", lambda v: v is None or isinstance(v, str)
             or (isinstance(v, list) and all(isinstance(t, str) for t in v)), "a module name or a list of them"),
            ("rank_pattern", lambda v: v is None or (isinstance(v, dict) and all(map(_positive_int, v.values()))),
             "an object of module names to positive integers"),
            ("alpha_pattern", lambda v: v is None or (isinstance(v, dict) and all(map(_number, v.values()))),
             "an object of module names to numbers"),
        ]
    for key, ok, want in checks:
        if key in cfg and not ok(cfg[key]):
            raise ShardwiseError(f"{what}: {ADAPTER_CONFIG} {key} is {json.dumps(cfg[key])}; it must be {want}: fix it, or copy the "
                                 "file from the run that made the adapter")
    return cfg


def check_adapter_fits(adapter_dir: str, cfg: dict, meta_model, what: str, base_what: str) -> None:
    """The adapter's weights (their shapes, from the safetensors header) fit the base model (built on the meta
    device): each adapted linear has the base's in and out features and the config's rank, each saved whole module
    (modules_to_save: an embedding, a head) the base's shape. An adapter trained on another base is one line naming
    both directories, not peft's size-mismatch error."""
    from shardwise.models.load import safetensors_shapes

    shapes = safetensors_shapes(os.path.join(adapter_dir, ADAPTER_WEIGHTS), f"{what}: {ADAPTER_WEIGHTS}",
                                "copy it again from the run that made the adapter")
    recorded = cfg.get("base_model_name_or_path")
    other = ("the adapter was trained on another base model: pass --base with the model it was trained from"
             + (f" (adapter_config.json records {recorded})" if recorded else ""))
    modules = dict(meta_model.named_modules())
    state = {k: list(v.shape) for k, v in meta_model.state_dict().items()}
    rank = cfg.get("r") if not cfg.get("rank_pattern") else None
    prefix = "base_model.model."
    for key, shape in sorted(shapes.items()):
        if not key.startswith(prefix) or shape is None:
            continue
        name = key[len(prefix):]
        for part in (".lora_A.", ".lora_B."):
            if part in name and name.endswith(".weight") and len(shape) == 2:
                path = name.split(part)[0]
                m = modules.get(path)
                if not isinstance(m, nn.Linear):
                    break  # not a linear of this model (or another adapter kind): peft says what it makes of it
                got, want = (shape[1], m.in_features) if part == ".lora_A." else (shape[0], m.out_features)
                if got != want:
                    side = "in" if part == ".lora_A." else "out"
                    raise ShardwiseError(f"{what}: {ADAPTER_WEIGHTS} adapts {path} with {got} {side} features but "
                                         f"{base_what} has {want} there; {other}")
                r = shape[0] if part == ".lora_A." else shape[1]
                if rank is not None and r != rank:
                    raise ShardwiseError(f"{what}: {ADAPTER_CONFIG} r is {rank} but {ADAPTER_WEIGHTS} holds rank-{r} "
                                         f"weights ({path}); the two files are from different adapters: copy both "
                                         "from the run that made it")
                break
        else:
            whole = name.replace(".modules_to_save", "")
            if whole in state and list(shape) != state[whole]:
                raise ShardwiseError(f"{what}: {ADAPTER_WEIGHTS} holds {whole} of shape {list(shape)} but {base_what} "
                                     f"has {state[whole]} (another vocabulary or size); {other}")
