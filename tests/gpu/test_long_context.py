"""The long-context levers on a GPU (models/offload.py, models/tiles.py): the block inputs go to pinned host memory on
a side stream and come back one block ahead, and the training is full checkpointing's in fp32 (the same kernels,
only where the inputs wait differs); compiled blocks too; and the device holds what the plan says
(the block inputs leave it).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def model_and_ids(layers=6, seq=4096):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=2048, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=seq, use_cache=False)
    model = LlamaForCausalLM(cfg).cuda().train()
    ids = torch.randint(0, 1024, (1, seq), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    return model, ids


def run(mode: str, tiles: int = 1, compiled: bool = False):
    from shardwise.models.checkpointing import checkpoint_blocks
    from shardwise.models.speed import compile_blocks
    from shardwise.models.tiles import tile_blocks

    model, ids = model_and_ids()
    if tiles > 1:
        tile_blocks(model, tiles, ids.shape[1], 4)
    checkpoint_blocks(model, mode)
    if compiled:
        compile_blocks(model)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = model(input_ids=ids, labels=ids, use_cache=False)
    torch.cuda.synchronize()
    torch.empty(1, device="cuda")  # the allocator takes back blocks whose side-stream use has ended
    after_forward = torch.cuda.memory_allocated() - base
    out.loss.backward()
    torch.cuda.synchronize()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return out.loss.detach(), grads, after_forward, getattr(model, "host_checkpoints", None)


def test_offload_on_cuda_trains_like_full_checkpointing_and_frees_the_block_inputs():
    loss, grads, held, _ = run("full")
    oloss, ograds, oheld, store = run("offload")
    torch.testing.assert_close(oloss, loss, rtol=1e-6, atol=0)
    for name, g in grads.items():
        torch.testing.assert_close(ograds[name], g, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    assert store.copies_out == 6 and store.copies_in == 6
    assert store.prefetched == 5  # every block but the last to run backward found its input already fetched
    assert store.peak_host_bytes == 6 * 4096 * 512 * 4
    # the five inputs that are not in flight at the end of forward left the device
    assert held - oheld >= 4 * 4096 * 512 * 4


def test_offload_and_tiles_compiled_on_cuda_train_like_full_checkpointing():
    loss, grads, _, _ = run("full")
    tloss, tgrads, _, store = run("offload", tiles=4, compiled=True)
    torch.testing.assert_close(tloss, loss, rtol=1e-5, atol=0)
    for name, g in grads.items():
        torch.testing.assert_close(tgrads[name], g, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    assert store.copies_out == 6
