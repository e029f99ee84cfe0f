"""The opt-in speed and memory levers: selective activation checkpointing and float8 linears."""

import dataclasses

import pytest
import torch
from torch import nn

from shardwise.config import Config, checkpointing_mode, load_config
from shardwise.errors import ShardwiseError
from shardwise.models import float8
from shardwise.models.checkpointing import checkpoint_blocks
from shardwise.plan.comm import flops_per_microbatch
from shardwise.plan.memory import Job, Opts, estimate
from shardwise.plan.model_presets import resolve_model


def _run(tiny_dir, mode):
    """The tiny model (fp32) through strategy single's parallelize pipeline with this checkpointing mode:
    (loss, bytes forward leaves for backward, gradients, model)."""
    from shardwise import strategies
    from shardwise.models.load import load_model
    from shardwise.plan.simulate import LiveBytes
    from shardwise.strategies.base import DistEnv

    model = load_model(tiny_dir, torch.float32)
    model.train()
    cfg = Config(activation_checkpointing=mode, compile="off", mixed_precision="no", strategy="single")
    strategy = strategies.get("single")(cfg, DistEnv(0, 1, 0, 1, torch.device("cpu"), "gloo"))
    model, _ = strategy.setup(model)
    ids = torch.randint(0, 500, (2, 48), generator=torch.Generator().manual_seed(3))
    live = LiveBytes()
    with live:
        live.track_module(model)
        before = live.current
        loss = model(input_ids=ids, labels=ids).loss
        kept = live.current - before  # what forward leaves alive for backward
        loss.backward()
    return loss.detach(), kept, {n: p.grad for n, p in model.named_parameters()}, model


def test_selective_checkpointing_same_loss_and_grads_memory_between_full_and_none(tiny_dir):
    runs = {m: _run(tiny_dir, m) for m in ("off", "full", "selective")}
    loss, kept, grads, model = runs["selective"]
    from shardwise.models.speed import decoder_blocks

    assert all(b.forward.__name__ == "checkpointed_forward" for b in decoder_blocks(model))  # the pipeline's step
    assert checkpoint_blocks(torch.nn.Module(), "selective").endswith("in 0 blocks")
    ref_loss, ref_grads = runs["off"][0], runs["off"][2]
    assert set(grads) == set(ref_grads)  # parameter names unchanged
    for mode in ("full", "selective"):
        torch.testing.assert_close(runs[mode][0], ref_loss, rtol=0, atol=0)
        for n, g in runs[mode][2].items():
            torch.testing.assert_close(g, ref_grads[n], rtol=1e-6, atol=1e-7, msg=f"{mode} {n}")
    assert runs["full"][1] < kept < runs["off"][1], {m: r[1] for m, r in runs.items()}
    # selective keeps the matmul/attention outputs: well above full's block inputs alone
    assert kept > 2 * runs["full"][1]


def test_activation_checkpointing_key_and_the_boolean():
    assert checkpointing_mode(Config()) == "off"
    assert checkpointing_mode(Config(gradient_checkpointing=True)) == "full"
    assert checkpointing_mode(Config(activation_checkpointing="selective")) == "selective"
    assert checkpointing_mode(load_config(None, {"activation_checkpointing": ("full", "--activation-checkpointing")})
                              .cfg) == "full"
    with pytest.raises(ShardwiseError, match="--activation-checkpointing.*contradicts gradient_checkpointing"):
        load_config(None, {"activation_checkpointing": ("selective", "--activation-checkpointing"),
                           "gradient_checkpointing": (True, "--gradient-checkpointing")})
    with pytest.raises(ShardwiseError, match="choose from|one of|off, full, selective|allowed"):
        load_config(None, {"activation_checkpointing": ("some", "--activation-checkpointing")})


def test_planner_puts_selective_between_full_and_off():
    spec = resolve_model("llama-3.1-8b")
    job = Job(micro_batch=4, seq_len=4096, compute="bf16", device_mem_gib=141.0, compile=True)
    o = Opts(base="single")
    off, full = estimate(spec, job, o), estimate(spec, dataclasses.replace(job, checkpointing=True), o)
    sel = estimate(spec, dataclasses.replace(job, selective_checkpointing=True), o)
    assert full.activations < sel.activations < off.activations
    f_off, f_full = flops_per_microbatch(spec, job), flops_per_microbatch(spec, dataclasses.replace(job, checkpointing=True))
    f_sel = flops_per_microbatch(spec, dataclasses.replace(job, selective_checkpointing=True))
    assert f_sel[0] == f_off[0]
    assert f_off[1] < f_sel[1] < f_full[1]
    assert f_sel[1] - f_off[1] < 0.02 * (f_full[1] - f_off[1])  # no matmul is run again


def test_plan_job_reads_activation_checkpointing():
    from shardwise.plan.decide import Setup
    from shardwise.plan.inputs import job_from_config

    setup = Setup(gpus_per_node=1, nodes=1, accelerator="cuda", device_name="H200", device_mem_gib=141.0,
                  host_mem_gib=64.0, intra_gbps=0.0, intra_label="", inter_gbps=0.0, inter_label="",
                  peak_flops=989e12, mfu=None)
    j = job_from_config(Config(activation_checkpointing="selective"), setup)
    assert j.selective_checkpointing and not j.checkpointing
    assert job_from_config(Config(activation_checkpointing="full"), setup).checkpointing
    assert job_from_config(Config(gradient_checkpointing=True), setup).checkpointing


# ----------------------------------------------------------------------------- float8


class _Block(nn.Module):
    def __init__(self, h, kv, i):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(h, h, bias=False), nn.Linear(h, kv, bias=False), \
            nn.Linear(h, kv, bias=False)
        self.gate_proj, self.down_proj = nn.Linear(h, i, bias=False), nn.Linear(i, h, bias=False)
        self.odd = nn.Linear(h, 1000, bias=False)  # 1000 is no multiple of 16


class _Model(nn.Module):
    def __init__(self, h=2048, kv=1024, i=8192, vocab=32000):
        super().__init__()
        self.embed = nn.Embedding(vocab, h, device="meta")
        with torch.device("meta"):
            self.layers = nn.ModuleList([_Block(h, kv, i) for _ in range(2)])
            self.lm_head = nn.Linear(h, vocab, bias=False)


def test_float8_converts_the_wide_block_linears_only():
    names = float8.float8_targets(_Model())
    assert names == [f"layers.{b}.{n}" for b in range(2) for n in ("q_proj", "gate_proj", "down_proj")]
    # the head (vocab x hidden: wide enough) stays out: it is outside the blocks
    assert not any("lm_head" in n or "k_proj" in n or "odd" in n for n in names)
    # a wider KV projection (out 2048) is worth it
    assert "layers.0.k_proj" in float8.float8_targets(_Model(kv=2048))


def test_float8_refusal_is_one_line_on_a_machine_without_cuda():
    why = float8.refusal(torch.device("cpu"))
    assert why and "\n" not in why and "8.9" in why and "drop --float8" in why


def test_float8_step_refuses_without_cuda_before_touching_the_model():
    from shardwise.strategies.parallelize import apply_float8

    m = _Model()
    before = [type(x) for x in m.modules()]
    with pytest.raises(ShardwiseError, match=r"^--float8: float8 needs a CUDA GPU"):
        apply_float8(m, Config(float8=True), torch.device("cpu"))
    assert [type(x) for x in m.modules()] == before
    assert apply_float8(m, Config(), torch.device("cpu")) == "float8: off"


@pytest.mark.parametrize("flags, match", [
    ({"strategy": "zero3"}, "float8 linears run under single, ddp or the fsdp presets"),
    ({"tuner": "lora"}, "float8 with tuner lora is not built"),
    ({"mixed_precision": "fp16"}, "not fp16"),
    ({"compile": "off"}, "float8 without torch.compile runs torchao's scaling and casts unfused"),
])
def test_float8_config_refusals_name_the_key(flags, match):
    given = {"float8": (True, "--float8"), **{k: (v, f"--{k.replace('_', '-')}") for k, v in flags.items()}}
    with pytest.raises(ShardwiseError, match=match) as e:
        load_config(None, given)
    assert str(e.value).startswith("--float8")


def test_float8_conversion_keeps_parameter_names():
    pytest.importorskip("torchao.float8")
    m = _Model(h=64, kv=32, i=256)
    m = m.to_empty(device="cpu")
    float8.NARROW_OUT, old = 16, float8.NARROW_OUT  # tiny dims: let every multiple-of-16 block linear through
    try:
        before = [n for n, _ in m.named_parameters()]
        names = float8.convert(m)
    finally:
        float8.NARROW_OUT = old
    assert names and all("lm_head" not in n for n in names)
    assert [n for n, _ in m.named_parameters()] == before
    assert type(m.get_submodule(names[0])).__name__ == "Float8Linear"
    assert type(m.lm_head) is nn.Linear and type(m.layers[0].odd) is nn.Linear
    # the converted linear computes the same product to float8's precision, and trains (torch's CPU _scaled_mm)
    lin = m.get_submodule(names[0])
    torch.nn.init.normal_(lin.weight, std=0.05)
    x = torch.randn(32, lin.in_features, generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x)
    ref = x @ lin.weight.detach().t()
    assert y.dtype == torch.bfloat16 and ((y.float() - ref).norm() / ref.norm()).item() < 0.1
    y.float().square().sum().backward()
    assert lin.weight.grad.dtype == torch.float32 and torch.isfinite(lin.weight.grad).all()
