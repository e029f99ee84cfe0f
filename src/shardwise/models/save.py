"""Write a Hugging Face model directory with transformers' or peft's own `save_pretrained`, minus one import."""

from __future__ import annotations

import contextlib
import sys


@contextlib.contextmanager
def _no_deepspeed_import():
    """transformers' `save_pretrained` unwraps the model through accelerate's `extract_model_from_parallel`, which
    imports DeepSpeed whenever it is installed, to test `isinstance(model, DeepSpeedEngine)`: 1.3 s of CPU on every
    save of a ddp, fsdp or single run (docs/speed.md, "Time to first step"). A model can
    be a DeepSpeedEngine only once deepspeed is imported, so while it is not, accelerate is told it is not available
    for the duration of the call; with deepspeed imported (a zero run), nothing changes."""
    other = None
    if "deepspeed" not in sys.modules:
        try:
            from accelerate.utils import other
        except ImportError:
            pass
    real = getattr(other, "is_deepspeed_available", None)
    if real is None:
        yield
        return
    other.is_deepspeed_available = lambda: False
    try:
        yield
    finally:
        other.is_deepspeed_available = real


def save_pretrained(model, path: str, **kwargs) -> None:
    """`model.save_pretrained(path, **kwargs)` (a transformers or peft model), without importing DeepSpeed when no
    DeepSpeed engine can exist (_no_deepspeed_import)."""
    with _no_deepspeed_import():
        model.save_pretrained(path, **kwargs)
