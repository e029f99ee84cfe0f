"""What only a CUDA GPU can show: QLoRA's 4-bit base, and the CUDA defaults (per-block
compile, fused loss head, fused AdamW) under every strategy with tied embeddings.

Skipped, with the reason, where there is no CUDA GPU (CI and the CPU machines); run on the
GPU machine with `python -m pytest -q tests/gpu`. Each test trains the built-in tiny model
(or a tied-embedding variant of it) for a few steps through the real CLI.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os

import pytest
import torch

from tests.helpers import chat_records, read_metrics, run_cli, write_jsonl

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_bnb = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None,
                               reason="needs bitsandbytes (pip install 'shardwise[qlora]')")
needs_ds = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")

STEPS = ("--max-steps", "12", "--log-every", "1", "--lr", "3e-3", "--warmup-steps", "0", "--seq-len", "128",
         "--micro-batch-size", "4", "--mixed-precision", "bf16")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(str(tmp_path_factory.mktemp("data") / "chat.jsonl"), chat_records(96))


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory, tiny_dir):
    """The tiny model with its output head tied to the input embeddings (as Llama 3.2 1B/3B,
    Qwen2.5 <= 3B and Gemma are)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(tmp_path_factory.mktemp("tied") / "model")
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, tie_word_embeddings=True)
    model.tie_weights()
    assert model.lm_head.weight is model.get_input_embeddings().weight
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_dir).save_pretrained(path)
    return path


def _train(out, model, data, *extra):
    run_cli("train", "--model", model, "--data", str(data), "--output-dir", str(out), "--overwrite", *STEPS, *extra,
            timeout=600)
    recs = read_metrics(str(out))
    assert len(recs) == 12 and all(math.isfinite(r["loss"]) for r in recs)
    return recs


@needs_bnb
@pytest.mark.parametrize("strategy", ["single", "ddp"])
def test_qlora_trains_adapters_on_a_4bit_base(strategy, tiny_dir, data, tmp_path):
    out = tmp_path / strategy
    recs = _train(out, tiny_dir, data, "--strategy", strategy, "--nproc-per-node", "1", "--tuner", "qlora",
                  "--lora-r", "8", "--save-every", "6")
    first, last = sum(r["loss"] for r in recs[:3]) / 3, sum(r["loss"] for r in recs[-3:]) / 3
    assert last < first - 0.1, (first, last)  # the adapters learn
    summary = json.load(open(out / "summary.json"))
    assert 0 < summary["trainable_params"] < summary["params"] / 5
    final = out / "final"
    assert (final / "adapter_model.safetensors").is_file() and (final / "adapter_config.json").is_file()
    from safetensors.torch import load_file

    adapter = load_file(str(final / "adapter_model.safetensors"))
    assert adapter and all("lora_" in k for k in adapter)
    assert any(name.startswith("step_") for name in os.listdir(out / "checkpoints"))  # a checkpoint was saved


@pytest.fixture(scope="module")
def tied_single(tied_dir, data, tmp_path_factory):
    """The reference: `single` on the tied model with the CUDA defaults."""
    return _train(tmp_path_factory.mktemp("tied-single"), tied_dir, data, "--strategy", "single",
                  "--nproc-per-node", "1")


def test_cuda_defaults_with_tied_embeddings_learn_under_single(tied_single):
    assert tied_single[-1]["loss"] < tied_single[0]["loss"]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", pytest.param("zero3", marks=needs_ds)])
def test_cuda_defaults_with_tied_embeddings(strategy, tied_dir, data, tied_single, tmp_path):
    """Per-block compile + fused loss head + fused AdamW on a tied head: every strategy
    gives the same first losses as `single` (bf16: to 2e-2) and learns."""
    recs = _train(tmp_path / strategy, tied_dir, data, "--strategy", strategy, "--nproc-per-node", "1", "--force")
    ref, got = [r["loss"] for r in tied_single[:4]], [r["loss"] for r in recs[:4]]
    for a, b in zip(ref, got):
        assert abs(a - b) <= 2e-2 * abs(a), (strategy, ref, got)
    assert recs[-1]["loss"] < recs[0]["loss"]
