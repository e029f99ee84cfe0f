"""`--memory-snapshot` where torch's recording breaks the step: compiled blocks under activation checkpointing on the
torch releases of pytorch/pytorch#179536 are refused before launch (the GPU's end-to-end refusal:
tests/gpu/test_memory_snapshot.py)."""

from __future__ import annotations

import pytest

from shardwise.train.memsnap import refusal


@pytest.mark.parametrize("mode", ["full", "selective", "offload"])
def test_compiled_checkpointed_blocks_are_refused_from_torch_2_11(mode):
    why = refusal(True, mode, "2.11.0+cu130")
    assert why and "torch 2.11.0+cu130" in why and "pytorch/pytorch#179536" in why and "--compile off" in why
    assert f"({mode})" in why
    assert refusal(True, mode, "2.13.0") is not None  # no fixed release known: later ones are refused too


@pytest.mark.parametrize("compiled,mode,version", [
    (False, "full", "2.11.0"),     # eager blocks record fine
    (True, "off", "2.11.0"),       # no checkpointed region
    (True, "full", "2.10.1+cu128"),  # before the regression
])
def test_what_records_fine_is_not_refused(compiled, mode, version):
    assert refusal(compiled, mode, version) is None
