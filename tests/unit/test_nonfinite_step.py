"""Strategy.step skips a non-finite update and reports it through take_nonfinite, on both optimizer kernels:
the fused AdamW (every preset's, on the GPU and the CPU: skipped by the kernel through found_inf, no host sync in
step) and foreach (fp16 with an FSDP step offloaded from a GPU: the norm is read in step). Both kernels run on the
CPU, so both paths are tested here."""

import pytest
import torch

from shardwise import config
from shardwise.strategies.base import DistEnv, Strategy


def _setup(kernel: dict, sync_step: bool = False):
    cfg = config.load_config(None, {"mixed_precision": ("no", "test"), "sync_step": (sync_step, "test")}).cfg
    strategy = Strategy(cfg, DistEnv(0, 1, 0, 1, torch.device("cpu"), "gloo"))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, **kernel)
    return strategy, model, opt


def _backward(model, poison: bool):
    loss = model(torch.ones(2, 4)).sum()
    (loss * float("nan") if poison else loss).backward()


@pytest.mark.parametrize("kernel", [{"fused": True}, {"foreach": True}], ids=["fused", "foreach"])
def test_a_non_finite_step_is_skipped_and_reported_in_order(kernel):
    strategy, model, opt = _setup(kernel)
    before = [p.detach().clone() for p in model.parameters()]
    _backward(model, poison=True)
    norm = strategy.step(model, opt)
    assert not torch.isfinite(norm)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the update was not applied
    assert all(p.grad is None for p in model.parameters())
    if kernel.get("fused"):  # the flag stays on the device until read; the skipped step is not counted in Adam
        assert isinstance(strategy._nonfinite[0], torch.Tensor)
        assert float(opt.state[model.weight]["step"]) == 0.0
        assert not hasattr(opt, "found_inf")  # removed after the step, as GradScaler does
    _backward(model, poison=False)
    strategy.step(model, opt)
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # this one was
    assert strategy.take_nonfinite() == [True, False]
    assert strategy.take_nonfinite() == []  # read once


def test_fused_and_foreach_agree_on_the_updates_around_a_skipped_step():
    runs = []
    for kernel in ({"fused": True}, {"foreach": True}):
        strategy, model, opt = _setup(kernel)
        for poison in (False, True, False):
            _backward(model, poison)
            strategy.step(model, opt)
        assert strategy.take_nonfinite() == [False, True, False]
        runs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_sync_step_reads_the_check_on_the_host_even_with_the_fused_kernel():
    strategy, model, opt = _setup({"fused": True}, sync_step=True)
    _backward(model, poison=True)
    strategy.step(model, opt)
    assert strategy._nonfinite == [True]  # a host bool, decided in the step
    assert not hasattr(opt, "found_inf")
    assert strategy.take_nonfinite() == [True]


def test_resuming_a_foreach_checkpoint_keeps_this_runs_fused_kernel():
    """A checkpoint of a foreach run (every CPU and offload run before 2026-12-02) resumed where the strategy uses the
    fused kernel: the loaded
    param groups must not switch the kernel back (found_inf would then reach the foreach AdamW, which refuses it)."""
    saver, model, opt = _setup({"foreach": True})
    _backward(model, poison=False)
    saver.step(model, opt)
    state = saver.state_dict(model, opt)
    strategy, _, _ = _setup({"fused": True})
    fused = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    strategy.load_state_dict(model, fused, state)
    assert all(g["fused"] is True and not g["foreach"] for g in fused.param_groups)
    assert float(fused.state[model.weight]["step"]) == 1.0  # the state did load
    before = [p.detach().clone() for p in model.parameters()]
    _backward(model, poison=True)
    strategy.step(model, fused)  # the device path, no AssertionError
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert strategy.take_nonfinite() == [True]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_fused_cpu_kernel_skips_a_flagged_step_in_every_parameter_dtype(dtype):
    """The CPU's fused AdamW honours found_inf for the parameter dtypes a run can store (fp32, bf16 with
    --param-dtype bf16, fp16): the weights and Adam's step count stay as they were, and the next step applies."""
    strategy, _, _ = _setup({"fused": True})
    model = torch.nn.Linear(4, 3).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.full_like(p, float("nan"))
    strategy.step(model, opt)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert float(opt.state[model.weight]["step"]) == 0.0
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    strategy.step(model, opt)
    assert not any(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert strategy.take_nonfinite() == [True, False]


def _kernel(strategy: str, device: str, **keys) -> dict:
    from shardwise import strategies

    cfg = config.load_config(None, {"strategy": (strategy, "test"), **{k: (v, "test") for k, v in keys.items()}}).cfg
    env = DistEnv(0, 1, 0, 1, torch.device(device), "nccl" if device == "cuda" else "gloo")
    return strategies.get(cfg.strategy)(cfg, env).optimizer_kernel()


@pytest.mark.parametrize("preset", ["single", "ddp", "fsdp", "fsdp-offload", "zero2", "zero2-offload",
                                    "zero3-offload"])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_every_preset_steps_with_the_fused_adamw(preset, device):
    """The fused AdamW wherever the step runs, the host of an offload preset included (4.1x foreach there on a
    16-core H200 host: benchmarks/results/offload_fused_adamw_h200_2026-12-02.md). Building the strategy touches
    no GPU, so the CUDA choice is checked here too."""
    assert _kernel(preset, device, mixed_precision="bf16") == {"fused": True}


def test_fp16_with_fsdp_offloaded_from_a_gpu_keeps_foreach():
    """fp16's grad scaler hands a fused optimizer its found-inf flag on the GPU; the fused CPU kernel would copy
    it to the host without waiting for it. foreach lets the scaler read the flag first. Only that case."""
    assert _kernel("fsdp-offload", "cuda", mixed_precision="fp16") == {"foreach": True}
    assert _kernel("fsdp", "cuda", mixed_precision="fp16") == {"fused": True}
    assert _kernel("fsdp-offload", "cpu", mixed_precision="fp16") == {"fused": True}
