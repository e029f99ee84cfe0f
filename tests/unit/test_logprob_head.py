"""Task dpo's per-token log-probability head (models/speed.py linear_token_logprobs): its chunk sizes, its values and
gradients against autograd through a plain log_softmax, the memory it holds, and its compiled form (what a CUDA run
takes by default), whose policy and frozen reference must agree bit for bit."""

import types

import pytest
import torch

from shardwise.models.speed import IGNORE, _LinearTokenLogProbs, even_chunks, linear_token_logprobs


def test_chunks_are_even_never_above_the_limit_and_cover_every_token():
    assert even_chunks(4128, 4096) == [(0, 2064), (2064, 4128)]  # not 4096 + a 32-token chunk
    assert even_chunks(4096, 4096) == [(0, 4096)]
    assert even_chunks(0, 4096) == []
    for n in range(1, 60):
        for chunk in (1, 3, 4, 7, 16, 64):
            b = even_chunks(n, chunk)
            sizes = [e - s for s, e in b]
            assert len(b) == -(-n // chunk)
            assert b[0][0] == 0 and b[-1][1] == n and all(b[i][1] == b[i + 1][0] for i in range(len(b) - 1))
            assert max(sizes) <= chunk and max(sizes) - min(sizes) <= 1


def problem(seed, T=37, H=16, V=300):
    """Hidden states, a head, targets with an ignored prompt, upstream gradients of both signs and some zeros."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, H, generator=g, requires_grad=True)
    w = torch.randn(V, H, generator=g) / H ** 0.5
    t = torch.randint(0, V, (T,), generator=g)
    t[:6] = IGNORE
    up = torch.randn(T, generator=g)
    up[[10, 20]] = 0.0  # scored tokens without an upstream gradient
    return h, w, t, up


def plain(h, w, t):
    valid = t != IGNORE
    return torch.log_softmax(h @ w.t(), dim=-1).gather(1, torch.where(valid, t, 0)[:, None]).squeeze(1) * valid


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("chunk", [5, 16, 64])
@pytest.mark.parametrize("train_head", [True, False])
def test_values_and_gradients_match_autograd_through_log_softmax(chunk, train_head, compiled):
    h, w, t, up = problem(chunk)
    w.requires_grad_(train_head)
    wrt = (h, w) if train_head else (h,)
    want = plain(h, w, t)
    want_grads = torch.autograd.grad((want * up).sum(), wrt)
    got = linear_token_logprobs(h, w, t, chunk, compile=compiled)
    got_grads = torch.autograd.grad((got * up).sum(), wrt)
    torch.testing.assert_close(got, want, rtol=1.3e-6, atol=1e-5)  # fp32's defaults
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1.3e-6, atol=1e-5)
    assert (got[:6] == 0).all()
    assert (got_grads[0][:6] == 0).all() and (got_grads[0][[10, 20]] == 0).all()  # no gradient, exactly


def test_the_head_holds_one_chunk_of_fp32_logits_forward_and_backward():
    """Live bytes (LiveBytes counts every tensor storage an op makes) over 3 chunks, fp32: the logits are consumed in
    place, so neither pass holds a chunk-sized tensor beside them. A softmax made beside the backward's recomputed
    logits would be a second chunk (2.15 chunks measured that way)."""
    from shardwise.plan.simulate import LiveBytes

    torch.manual_seed(0)
    T, H, V, chunk = 3 * 512, 64, 8192, 512
    hidden = torch.randn(T, H, requires_grad=True)
    w = torch.randn(V, H, requires_grad=True)
    t = torch.randint(0, V, (T,))
    up = torch.randn(T)
    one_chunk = chunk * V * 4
    with LiveBytes() as lb:
        lb.track(hidden, w, t, up)
        base = lb.current
        out = _LinearTokenLogProbs.apply(hidden, w, t, chunk, torch.float32, False)
        forward = lb.peak - base
        lb.reset_peak()
        base = lb.current
        torch.autograd.grad((out * up).sum(), (hidden, w))
        backward = lb.peak - base
    assert one_chunk < forward <= one_chunk + 2**20
    # beside the logits: the weight gradient and one chunk's share of it (a share kept bound while the next is made
    # would be a third V x h matrix), the hidden gradient
    assert one_chunk < backward <= one_chunk + 2 * V * H * 4 + 2 * T * H * 4 + 2**20


def test_a_compiled_policy_and_its_frozen_reference_give_bit_equal_log_probabilities(tiny_dir):
    """The run's fused head with --compile on (parallelize.apply_loss_head, as a CUDA run's auto): the per-chunk
    bodies are compiled (dynamo makes graphs), and the trained policy and a frozen eval copy of it, under bf16
    autocast, give the same summed log-probabilities exactly, so the first step's margin is 0. With compile off no
    graph is made."""
    from torch._dynamo.utils import counters

    from shardwise import config
    from shardwise.models.load import load_model
    from shardwise.strategies.parallelize import apply_loss_head
    from shardwise.train.objective import sequence_logps

    def head_graphs(compile_key):
        cfg = config.load_config(None, {"compile": (compile_key, "test")}).cfg
        policy, ref = load_model(tiny_dir, torch.float32), load_model(tiny_dir, torch.float32)
        assert apply_loss_head(policy, cfg) == apply_loss_head(ref, cfg) == "fused loss head"
        ref.requires_grad_(False).eval()
        ids = torch.randint(0, policy.config.vocab_size, (4, 21), generator=torch.Generator().manual_seed(3))
        targets = torch.roll(ids, -1, 1)
        targets[:, :7] = IGNORE
        targets[:, -1] = IGNORE
        mb = types.SimpleNamespace(input_ids=ids, targets=targets, position_ids=torch.arange(21).expand(4, 21))
        before = counters["stats"]["unique_graphs"]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with torch.no_grad():
                r = sequence_logps(ref, mb, ref.lm_head)[0]
            p, _ = sequence_logps(policy, mb, policy.lm_head)
        assert torch.equal(p.detach(), r)
        p.sum().backward()
        assert policy.lm_head.weight.grad is not None and policy.lm_head.weight.grad.abs().sum() > 0
        return counters["stats"]["unique_graphs"] - before

    assert head_graphs("on") > 0
    assert head_graphs("off") == 0


@pytest.mark.parametrize("compute, base", [(torch.float32, "fsdp"), (torch.bfloat16, "single")])
def test_the_planner_counts_the_heads_measured_peak(compute, base):
    """plan/memory.py preference_head_terms against the head's live bytes over 3 planner-sized chunks (eager, a
    trained head): fp32 compute (FSDP's wrapper, no casts), and bf16 autocast over fp32 hidden states and weight
    (single: the casts of both live through the passes, the fp32 copy of each chunk's logits beside the bf16 ones)."""
    from shardwise.plan.facts import FUSED_LOSS_CHUNK
    from shardwise.plan.memory import Job, Opts, preference_head_terms
    from shardwise.plan.model_spec import from_hf_config, tiny_config
    from shardwise.plan.simulate import LiveBytes

    T, H, V = 3 * FUSED_LOSS_CHUNK, 32, 4096
    spec = from_hf_config({**tiny_config(), "hidden_size": H, "vocab_size": V}, "head", "test")
    job = Job(micro_batch=1, seq_len=T, task="dpo", compute="fp32" if compute == torch.float32 else "bf16")
    planned = preference_head_terms(spec, job, Opts(base))["loss_transient"]
    torch.manual_seed(0)
    hidden = torch.randn(T, H, requires_grad=True)
    w = torch.randn(V, H, requires_grad=True)
    t = torch.randint(0, V, (T,))
    up = torch.randn(T)
    with LiveBytes() as lb:
        lb.track(hidden, w, t, up)
        base_bytes = lb.current
        out = _LinearTokenLogProbs.apply(hidden, w, t, FUSED_LOSS_CHUNK, compute, False)
        torch.autograd.grad((out * up).sum(), (hidden, w))
        measured = lb.peak - base_bytes
    assert measured == pytest.approx(planned, rel=0.1)
