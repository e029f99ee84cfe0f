"""Float8 matmuls for training (config `float8`): torchao's float8 recipe with dynamic tensorwise scaling swaps the
chosen `nn.Linear`s for its `Float8Linear`, which casts the input, the weight and the output gradient to float8
with one scale per tensor and runs the three matmuls of forward and backward in float8 (torch._scaled_mm, twice
the bf16 rate on Hopper's tensor cores). Weights, gradients and optimizer states keep their dtype and their
parameter names, so strategies, checkpoints and exports are unchanged.

Which linears (`float8_targets`): only those inside the decoder blocks (the output head computes the loss in
chunks with its own matmuls, models/speed.py; the embedding is no matmul), only where both dimensions are
multiples of 16 (the float8 kernels' requirement), and not the narrow ones, where the casts and scale
reductions cost more than the faster matmul saves: out_features <= 1024 with in_features <= 4096, torchao's
threshold from its H100 measurements of tensorwise scaling. On a Llama-1B shape (hidden 2048, 8 KV heads of
128) that keeps q, o, gate, up and down and leaves k and v in bf16.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from shardwise.plan.facts import FLOAT8_NARROW_IN, FLOAT8_NARROW_OUT

MIN_CAPABILITY = (8, 9)  # Ada and Hopper: the first GPUs with float8 tensor cores
NARROW_OUT, NARROW_IN = FLOAT8_NARROW_OUT, FLOAT8_NARROW_IN


def refusal(device: torch.device) -> str | None:
    """Why float8 cannot run here (one line), or None."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return ("float8 needs a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper); this run has none "
                f"(device {device.type}): drop --float8")
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        return (f"float8 needs a GPU of compute capability 8.9 or newer (Ada, Hopper); {torch.cuda.get_device_name(device)} "
                f"is {cap[0]}.{cap[1]}: drop --float8")
    if importlib.util.find_spec("torchao") is None:
        return "float8 needs torchao (its float8 training recipe): pip install 'shardwise[float8]', or drop --float8"
    return None


def wanted(module: nn.Module) -> bool:
    """Whether one linear is worth running in float8 (see the module docstring)."""
    if not isinstance(module, nn.Linear):
        return False
    out_f, in_f = module.weight.shape
    if out_f % 16 or in_f % 16:
        return False
    return not (out_f <= NARROW_OUT and in_f <= NARROW_IN)


def float8_targets(model: nn.Module) -> list[str]:
    """Qualified names of the linears `convert` turns into float8 linears: those of the decoder blocks
    that `wanted` accepts."""
    from shardwise.models.speed import decoder_blocks

    in_blocks = {id(m) for b in decoder_blocks(model) for m in b.modules()}
    return [name for name, m in model.named_modules() if id(m) in in_blocks and wanted(m)]


def convert(model: nn.Module) -> list[str]:
    """Swap the targets for torchao's Float8Linear (tensorwise dynamic scaling) in place; returns their names."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    names = set(float8_targets(model))
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("tensorwise"),
                               module_filter_fn=lambda m, fqn: fqn in names)
    return sorted(names)
