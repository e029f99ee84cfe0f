"""Sequence parallelism and long packed sequences on CUDA (the CPU parity tests are in
tests/dist/test_sequence_parallel.py).

- One GPU: at 16k tokens (past the dense-mask limit), packed documents go through
  FlexAttention's block mask; every document's logits equal the document run alone, so no
  token attends across a boundary, and no (S x S) mask is ever built.
- Two GPUs, through the real CLI: SP = 2 (NCCL all-to-all) trains like one GPU on the same
  batch, plain and packed at a length where the block mask is used (compile off, see _train).

Skipped, with the reason, without CUDA (the two-GPU tests without 2 GPUs):
`python -m pytest -x -s -p no:logging --timeout 400 tests/gpu/test_sequence_parallel.py`.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from tests.helpers import read_metrics, run_cli, write_jsonl

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")

LONG = 16384  # 16k^2 pairs: past models/sequence_parallel.py's DENSE_MASK_LIMIT


def _model(max_pos: int = 4 * LONG):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos,
                      attn_implementation="sdpa", use_cache=False)
    return LlamaForCausalLM(cfg).cuda().float().eval()


def test_long_packed_sequence_never_attends_across_documents():
    from shardwise.models import sequence_parallel as sp

    model = _model()
    sp.apply_sequence_parallel(model, None, 1)
    lengths = [5000, 37, 3000, 8347]  # sums to LONG; the short one sits between two long ones
    assert sum(lengths) == LONG
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (1, LONG), generator=g).cuda()
    pos = torch.cat([torch.arange(n) for n in lengths])[None].cuda()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=pos).logits
        # read before the per-document forwards below: each is one document, which resets the
        # per-forward cache (no mask at all), so the block mask is only there now
        block_mask = sp._state.cached_block_mask
        packed_peak = torch.cuda.max_memory_allocated() - before
        start = 0
        for n in lengths:
            alone = model(input_ids=ids[:, start:start + n], position_ids=pos[:, start:start + n]).logits
            torch.testing.assert_close(packed[:, start:start + n], alone, rtol=2e-4, atol=2e-4)
            start += n
    assert block_mask is not None  # the packed forward took the flex path
    assert block_mask.shape[-2:] == (LONG, LONG)
    # causal alone would skip about half of the 128 x 128 tiles; the document boundaries
    # skip most of the rest (about 80% here)
    assert block_mask.sparsity() > 70
    # a dense boolean mask alone would be LONG^2 bytes (256 MiB) per layer call; the packed
    # forward stays well under it above the logits (LONG x vocab fp32 = 32 MiB)
    assert packed_peak < LONG * LONG


@pytest.fixture(scope="module")
def long_model(tmp_path_factory, tiny_dir):
    """The tiny model with room for long sequences (max_position_embeddings raised)."""
    path = str(tmp_path_factory.mktemp("long") / "model")
    shutil.copytree(tiny_dir, path)
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as fh:
        cfg = json.load(fh)
    cfg["max_position_embeddings"] = 4 * LONG
    with open(cfg_path, "w") as fh:
        json.dump(cfg, fh)
    return path


@pytest.fixture(scope="module")
def long_data(tmp_path_factory):
    """Text documents of 500-6000 words (the tiny tokenizer makes several tokens of each)."""
    import random

    rng = random.Random(0)
    words = ["apple", "river", "stone", "cloud", "green", "quiet", "music", "north", "paper", "light"]
    recs = [{"text": " ".join(rng.choice(words) for _ in range(rng.randrange(500, 6000)))} for _ in range(160)]
    return write_jsonl(str(tmp_path_factory.mktemp("data") / "long.jsonl"), recs)


def _train(out, model, data, *extra):
    # compile off: the parity is about the exchange and the masks, and a cold torch.compile of
    # every new width of the unpacked rows (dynamic-shape recompiles) costs minutes on a fresh
    # machine. A hung collective becomes an error naming the rank and phase within
    # --collective-timeout, and a run that still does not finish fails with its output.
    run_cli("train", "--model", model, "--data", str(data), "--data-format", "text", "--output-dir", str(out),
            "--overwrite", "--max-steps", "6", "--log-every", "1", "--lr", "1e-3", "--warmup-steps", "0",
            "--mixed-precision", "no", "--micro-batch-size", "1", "--no-save-final", "--compile", "off",
            "--collective-timeout", "120", *extra, timeout=170)
    return read_metrics(str(out))


@two_gpus
@pytest.mark.parametrize("packing,mode", [(False, "ulysses"), (True, "ulysses"), (True, "ring")],
                         ids=["plain", "packed", "ring-packed"])
def test_sp2_on_two_gpus_trains_like_one_gpu(packing, mode, long_model, long_data, tmp_path):
    seq = ("--seq-len", str(LONG), *(("--packing",) if packing else ()), "--sp-mode", mode)
    one = _train(tmp_path / "one", long_model, long_data, "--strategy", "single", "--grad-accum", "2",
                 "--gradient-checkpointing", *seq)
    two = _train(tmp_path / "sp2", long_model, long_data, "--strategy", "fsdp", "--nproc-per-node", "2",
                 "--sequence-parallel", "2", "--grad-accum", "2", "--gradient-checkpointing", *seq)
    assert len(one) == len(two) == 6
    # fp32 on the GPU: kernels differ between one and two ranks (attention over half the heads)
    torch.testing.assert_close(torch.tensor([r["loss"] for r in two]), torch.tensor([r["loss"] for r in one]),
                               rtol=1e-3, atol=0)
    assert two[-1]["peak_mem_gib"] < one[-1]["peak_mem_gib"]  # each rank holds half of every activation
