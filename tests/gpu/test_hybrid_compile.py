"""A hybrid model's compiled blocks on a GPU: Jamba's layer list mixes two declared decoder-layer classes (Mamba and
attention, MoE in every other layer). `decoder_blocks` takes both as blocks (tests/unit/test_decoder_blocks.py), so
`--compile on` compiles all of them; on the CPU machines that path only ever ran eagerly or compiled on the CPU.

Checked through the real CLI on CUDA: every layer is compiled (the run header's parallelize line), the compiled run's first loss
is the eager run's (same weights, same first batch), and both train (finite, falling) under `single` and `fsdp`.
Jamba runs its Mamba layers through transformers' PyTorch path (`use_mamba_kernels=False`: no mamba-ssm kernels on
the machine), a Python loop over positions that dynamo unrolls per sequence length."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from tests.helpers import read_metrics, run_cli, write_jsonl

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

LAYERS = 4
# every text is longer than --seq-len: each row is cut to 48 tokens, so each block compiles once (the Mamba loop is
# unrolled per length; chat rows of a dozen lengths recompiled each block until dynamo's limit, minutes on the H200)
STEPS = ("--max-steps", "8", "--log-every", "1", "--lr", "3e-3", "--warmup-steps", "0", "--seq-len", "48",
         "--micro-batch-size", "4", "--mixed-precision", "bf16", "--data-format", "text")
WORDS = ["apple", "river", "stone", "cloud", "green", "quiet", "music", "forest", "light", "paper"]


@pytest.fixture(scope="module")
def jamba(tmp_path_factory):
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardwise.models.tiny import build_tokenizer

    root = tmp_path_factory.mktemp("jamba")
    tok = build_tokenizer()
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(
        "jamba", vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
        expert_layer_offset=1, num_experts=4, mamba_d_state=8, mamba_expand=1, use_mamba_kernels=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(str(root / "model"))
    tok.save_pretrained(str(root / "model"))
    texts = [{"text": " ".join(WORDS[(i * 3 + k) % 10] for k in range(40))} for i in range(64)]
    return str(root / "model"), write_jsonl(str(root / "text.jsonl"), texts)


def _train(jamba, out, *extra):
    model, data = jamba
    p = run_cli("train", "--model", model, "--data", data, "--output-dir", str(out), "--overwrite", *STEPS, *extra,
                timeout=600)
    recs = read_metrics(str(out))
    assert len(recs) == 8 and all(math.isfinite(r["loss"]) for r in recs)
    assert recs[-1]["loss"] < recs[0]["loss"] - 0.3, [r["loss"] for r in recs]
    return recs, p.stdout + p.stderr


@pytest.fixture(scope="module")
def eager(jamba, tmp_path_factory):
    recs, log = _train(jamba, tmp_path_factory.mktemp("eager") / "run", "--strategy", "single", "--compile", "off")
    assert "compile:" not in log  # the header lists the parallelize steps that are on
    return recs


@pytest.mark.parametrize("strategy", ["single", "fsdp"])
def test_a_hybrid_models_blocks_compile_and_train_on_cuda(strategy, jamba, eager, tmp_path):
    recs, log = _train(jamba, tmp_path / "run", "--strategy", strategy, "--compile", "on")
    assert f"shardwise: compile: {LAYERS} blocks" in log, log[-3000:]
    # the first step's loss is taken before any update: the compiled blocks compute the eager model's loss
    assert recs[0]["loss"] == pytest.approx(eager[0]["loss"], rel=2e-2)
