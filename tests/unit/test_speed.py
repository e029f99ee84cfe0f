import pytest
import torch
import torch.nn.functional as F

from shardwise.models.speed import compile_blocks, decoder_blocks, install_fused_loss, linear_cross_entropy


def reference(h, w, t):
    return F.cross_entropy((h @ w.t()).float(), t, ignore_index=-100, reduction="sum")


@pytest.mark.parametrize("chunk", [7, 64, 1000])
def test_chunked_linear_cross_entropy_matches_loss_and_gradients(chunk):
    g = torch.Generator().manual_seed(chunk)
    h = torch.randn(130, 24, generator=g, requires_grad=True)
    w = torch.randn(50, 24, generator=g, requires_grad=True)
    t = torch.randint(0, 50, (130,), generator=g)
    t[::5] = -100
    ref = reference(h, w, t)
    gh, gw = torch.autograd.grad(ref * 0.5, (h, w))
    out = linear_cross_entropy(h, w, t, chunk=chunk)
    oh, ow = torch.autograd.grad(out * 0.5, (h, w))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(oh, gh, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ow, gw, rtol=1e-4, atol=1e-5)


def test_bf16_compute_under_autocast_is_close():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(64, 32, generator=g, requires_grad=True)
    w = torch.randn(40, 32, generator=g, requires_grad=True)
    t = torch.randint(0, 40, (64,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = linear_cross_entropy(h, w, t, chunk=16)
        ref = F.cross_entropy((h @ w.t()).float(), t, reduction="sum")
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=0)
    out.backward()
    assert h.grad.dtype == torch.float32 and w.grad.dtype == torch.float32


def test_fused_head_in_the_real_model_gives_the_same_loss_and_grads(tiny_dir):
    from shardwise.models.load import load_model

    ids = torch.randint(0, 400, (2, 24), generator=torch.Generator().manual_seed(1))
    tg = torch.roll(ids, -1, 1)
    tg[:, -1] = -100
    plain = load_model(tiny_dir, torch.float32)
    fused = load_model(tiny_dir, torch.float32)
    assert install_fused_loss(fused)
    ref = F.cross_entropy(plain(input_ids=ids).logits.view(-1, plain.config.vocab_size), tg.view(-1), reduction="sum")
    fused.lm_head.loss_targets = tg
    out = fused(input_ids=ids).logits
    fused.lm_head.loss_targets = None
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)
    ref.backward()
    out.backward()
    for (n, a), (_, b) in zip(plain.named_parameters(), fused.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=n)
    assert fused(input_ids=ids).logits.shape == (2, 24, plain.config.vocab_size)  # targets unset: plain logits
    assert set(dict(fused.named_parameters())) == set(dict(plain.named_parameters()))


def test_compiled_blocks_match_eager(tiny_dir):
    """torch.compile per block (on by default with CUDA) computes the same function; on the
    CPU it needs a C++ compiler, which CI has."""
    from shardwise.models.load import load_model

    eager = load_model(tiny_dir, torch.float32)
    compiled = load_model(tiny_dir, torch.float32)
    assert compile_blocks(compiled) == len(decoder_blocks(eager)) == eager.config.num_hidden_layers
    ids = torch.randint(0, 400, (2, 16), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(compiled(input_ids=ids).logits, eager(input_ids=ids).logits, rtol=1e-4, atol=1e-4)


def test_fused_head_holds_one_chunk_of_logits_at_a_time():
    """Live bytes of the chunked head over 3 chunks (LiveBytes counts every tensor storage made): one chunk's fp32
    logits and bf16 copy (6 B per logit) plus the gradient buffers and casts, not two chunks (51.6 MiB here when the
    loop kept the previous chunk's logits bound while making the next; 30.6 MiB now). The planner counts one chunk
    (plan/memory.py fused_loss_terms)."""
    from shardwise.models.speed import _LinearCrossEntropy
    from shardwise.plan.simulate import LiveBytes

    torch.manual_seed(0)
    T, h, V, chunk = 3 * 512, 64, 8192, 512
    hidden = torch.randn(T, h, requires_grad=True)
    w = torch.randn(V, h, requires_grad=True)
    t = torch.randint(0, V, (T,))
    with LiveBytes() as lb:
        lb.track(hidden, w, t)
        base = lb.current
        _LinearCrossEntropy.apply(hidden, w, t, chunk, torch.bfloat16)
        peak = lb.peak - base
    one_chunk = chunk * V * (4 + 2)
    buffers = T * h * (4 + 2) + V * h * (4 + 2) + V * h * (2 + 4)  # grads + casts, the head-gradient matmul + upcast
    assert one_chunk < peak <= one_chunk + buffers + 2**20


def test_the_loop_drops_the_models_output_before_backward():
    """forward_backward_step keeps no reference to the model's output during backward: on the plain loss path it
    holds the full logits (B x S x V; fp32 here), which the loss does not need there. Kept bound, they were alive
    through the whole backward (+64 MiB at the 8 x 512 peak of the planner's CPU s-5M rows, 8 GiB for a 128k
    vocabulary at 8 x 2048 in bf16). (With the fused head the output is the summed loss itself.)"""
    import weakref

    from transformers import LlamaConfig, LlamaForCausalLM

    from shardwise import config
    from shardwise.data.batches import MicroBatch, StepBatch
    from shardwise.strategies.base import DistEnv, Strategy
    from shardwise.train.faults import Faults
    from shardwise.train.loop import forward_backward_step

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, use_cache=False))
    cfg = config.load_config(None, {"mixed_precision": ("no", "test")}).cfg
    strategy = Strategy(cfg, DistEnv(0, 1, 0, 1, torch.device("cpu"), "gloo"))
    outputs, alive_in_backward = [], []
    model.register_forward_hook(lambda m, a, out: outputs.append(weakref.ref(out.logits)))
    model.get_input_embeddings().weight.register_hook(
        lambda g: alive_in_backward.append([r() is not None for r in outputs]))
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))
    batch = StepBatch([MicroBatch(ids, ids.clone(), torch.arange(24).repeat(2, 1))], loss_tokens=48, tokens=48,
                      rows=[0, 1])
    loss = forward_backward_step(model, strategy, batch, 1, torch.device("cpu"), Faults(0), 1)
    assert torch.isfinite(loss) and model.get_input_embeddings().weight.grad is not None
    assert alive_in_backward == [[False]]  # the backward reached the embedding with the output already gone


def test_a_checkpointed_block_traces_as_one_graph_once_hub_kernel_routing_is_off():
    """transformers routes some modules' forward through the `kernels` package (use_kernelized_func: a context
    variable set on every call). Inside a checkpointed block dynamo refuses that side effect, and the compiled block
    breaks its graph there; compile_blocks gives those modules their own forward back. fullgraph=True turns a graph
    break into an error; the block computes the same either way."""
    from torch.utils.checkpoint import checkpoint
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from shardwise.models.speed import unroute_hub_kernels

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=1, vocab_size=32)
    cfg._attn_implementation = "sdpa"
    block = LlamaDecoderLayer(cfg, 0)
    x = torch.randn(1, 16, 64)
    pos = torch.arange(16)[None]
    rope = LlamaRotaryEmbedding(cfg)(x, pos)

    def run(h):
        out = checkpoint(lambda t: block(t, attention_mask=None, position_ids=pos, position_embeddings=rope), h,
                         use_reentrant=False)
        return out[0] if isinstance(out, tuple) else out

    routed = run(x)
    if any("_kernel_funcs" in m.__dict__ for m in block.modules()):  # this transformers routes through `kernels`
        torch._dynamo.reset()
        with pytest.raises(Exception, match="side effect"):
            torch.compile(run, fullgraph=True, backend="eager")(x.clone().requires_grad_(True))
    assert unroute_hub_kernels(block) == sum("_kernel_funcs" in m.__dict__ for m in block.modules())
    assert not any("_kernel_funcs" in m.__dict__ and "forward" not in m.__dict__ for m in block.modules())
    torch._dynamo.reset()
    compiled = torch.compile(run, fullgraph=True, backend="eager")
    h = x.clone().requires_grad_(True)
    out = compiled(h)
    out.sum().backward()
    torch.testing.assert_close(out, routed)
    assert h.grad is not None
