"""What the planner's block backward at its norm (`memory.norm_backward`) stands on, traced on the CPU with the same
eager ops a GPU runs: one Hugging Face Llama decoder block in bf16, its MLP in 16 tiles (models/tiles.py), under
non-reentrant checkpointing, is recomputed and differentiated, and every tensor storage the ops make is followed
while it lives. The backward's peak is in the RMSNorm's variance branch (pow, mean and rsqrt's backward run op by
op in fp32), with five fp32 (tokens x hidden) tensors alive at once: the 5 x 4 bytes per token and channel the
planner adds at that moment (memory.norm_backward)."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint

from shardwise.models.tiles import tile_mlp
from shardwise.plan.memory import NORM_FP32_ROWS, Job, Opts, layer_activations, norm_backward
from shardwise.plan.model_spec import ModelSpec

T, H, MLP = 512, 512, 1792  # the 8B shape's ratios: intermediate 3.5 x hidden, 4 query heads per KV head


class _Live(TorchDispatchMode):
    """The storages every op makes, while they live; at the largest total: which op, and the fp32 (T, H) ones."""

    def __init__(self):
        super().__init__()
        self.current = self.peak = 0
        self.seen: weakref.WeakSet = weakref.WeakSet()
        self.fp32_rows: weakref.WeakSet = weakref.WeakSet()
        self.at_peak = ("", 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage() not in self.seen:
                st = t.untyped_storage()
                self.seen.add(st)
                self.current += st.nbytes()
                if t.dtype == torch.float32 and st.nbytes() == T * H * 4:
                    self.fp32_rows.add(st)
                weakref.finalize(st, self._gone, st.nbytes())
        if self.current > self.peak:
            self.peak = self.current
            self.at_peak = (str(func), len(self.fp32_rows))
        return out

    def _gone(self, n):
        self.current -= n


@pytest.fixture(scope="module")
def traced():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=H, intermediate_size=MLP, num_attention_heads=4, num_key_value_heads=1, head_dim=128,
                      num_hidden_layers=1, vocab_size=256)
    cfg._attn_implementation = "sdpa"
    block = LlamaDecoderLayer(cfg, 0).to(torch.bfloat16).requires_grad_(False)
    tile_mlp(block.mlp, 16)
    x = torch.randn(1, T, H, dtype=torch.bfloat16, requires_grad=True)
    pos = torch.arange(T)[None]
    rope = LlamaRotaryEmbedding(cfg)(x, pos)
    y = checkpoint(lambda h: block(h, attention_mask=None, position_ids=pos, position_embeddings=rope), x,
                   use_reentrant=False)
    y = y[0] if isinstance(y, tuple) else y
    g = torch.randn_like(y)
    live = _Live()
    with live:
        y.backward(g)
    return live


def test_the_eager_backward_peaks_in_the_norms_variance_branch_with_the_planned_fp32_rows_alive(traced):
    op, fp32_rows = traced.at_peak
    assert op.split(".")[1] in {"mul", "pow", "div"}, op  # the variance branch's elementwise backward, not a matmul
    saved = 2  # each RMSNorm's fp32 copy of its input, saved by the recomputed forward
    assert fp32_rows == saved + NORM_FP32_ROWS, f"{fp32_rows} fp32 (tokens x hidden) tensors alive at the peak"


def test_the_plan_counts_them_beside_the_blocks_saved_tensors_less_the_mlp_interior():
    spec = ModelSpec(name="llama-tiny-8b-ratios", source="this test", vocab_size=256, hidden_size=H,
                     intermediate_size=MLP, num_layers=2, num_heads=4, num_kv_heads=1, head_dim=128,
                     tied_embeddings=False)
    for compiled in (False, True):  # compiled blocks measured the same moment at 256K (norm_backward's docstring)
        job = Job(seq_len=T, micro_batch=1, checkpointing=True, tuner="lora", lora_dropout=0.0, mlp_tiles=16,
                  compile=compiled)
        layer = layer_activations(spec, job, Opts("single"))
        per_layer = sum(layer.values())
        held = norm_backward(spec, job, Opts("single"), per_layer)
        # beside the block's saved tensors less the MLP interior: the incoming gradient (bf16) and the fp32 rows
        assert held - (per_layer - layer["mlp"]) == T * H * (2 + 4 * NORM_FP32_ROWS)
