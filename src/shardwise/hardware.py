"""Devices, memory, interconnect and peak FLOP/s.

Importing this module never initialises CUDA or a process group; `detect()` only reads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# Dense peak TFLOP/s by (device name substring, dtype), from the vendors' datasheets
# (NVIDIA A100/H100/H200/L40S/A10/4090 datasheets; the "without sparsity" figures).
PEAK_TFLOPS = {
    "H200": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "fp32": 91.6},
    "A10": {"bf16": 125.0, "fp16": 125.0, "fp32": 31.2},
    "4090": {"bf16": 165.2, "fp16": 165.2, "fp32": 82.6},
}


@dataclass
class Hardware:
    """What one node has."""

    accelerator: str  # "cuda" or "cpu"
    device_name: str
    device_count: int  # GPUs per node (0 on CPU)
    memory_gib: float  # per device (GPU memory, or host RAM on CPU)
    host_memory_gib: float


def peak_flops(device_name: str, dtype: str = "bf16") -> float | None:
    """Dense peak FLOP/s of one device for a compute dtype, or None when unknown (CPU)."""
    for key, table in PEAK_TFLOPS.items():
        if key in device_name:
            return table.get(dtype, table["bf16"]) * 1e12
    return None


def host_memory_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        return 0.0


def detect() -> Hardware:
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return Hardware("cuda", props.name, torch.cuda.device_count(), props.total_memory / 2**30, host_memory_gib())
    return Hardware("cpu", "cpu", 0, host_memory_gib(), host_memory_gib())


def bf16_supported() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
