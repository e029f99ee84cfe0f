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
    if preset.startswith("zero"):
        pytest.importorskip("deepspeed")
    assert _kernel(preset, device, mixed_precision="bf16") == {"fused": True}


def test_fp16_with_fsdp_offloaded_from_a_gpu_keeps_foreach():
    """fp16's grad scaler hands a fused optimizer its found-inf flag on the GPU; the fused CPU kernel would copy
    it to the host without waiting for it. foreach lets the scaler read the flag first. Only that case."""
    assert _kernel("fsdp-offload", "cuda", mixed_precision="fp16") == {"foreach": True}
    assert _kernel("fsdp", "cuda", mixed_precision="fp16") == {"fused": True}
    assert _kernel("fsdp-offload", "cpu", mixed_precision="fp16") == {"fused": True}


@pytest.mark.parametrize("max_norm", [0.05, 100.0, 0.0], ids=["clipping", "under-the-norm", "no-clipping"])
def test_the_clip_folded_into_the_fused_step_equals_clipping_first(max_norm):
    """Strategy.step hands the clip to the fused AdamW (grad_scale = 1 / torch's clamped clip coefficient) instead of
    scaling the gradients first: the updates equal clip_grad_norm_ then the step, and the norm returned is the
    pre-clip one; no grad_scale is left on the optimizer."""
    cfg = config.load_config(None, {"mixed_precision": ("no", "test"), "max_grad_norm": (max_norm, "test")}).cfg
    strategy = Strategy(cfg, DistEnv(0, 1, 0, 1, torch.device("cpu"), "gloo"))
    torch.manual_seed(0)
    folded, reference = torch.nn.Linear(8, 5), torch.nn.Linear(8, 5)
    reference.load_state_dict(folded.state_dict())
    opts = [torch.optim.AdamW(m.parameters(), lr=0.1, fused=True) for m in (folded, reference)]
    x = torch.randn(4, 8)
    for step in range(3):
        for m in (folded, reference):
            (m(x * (step + 1)) ** 2).sum().backward()
        norm = strategy.step(folded, opts[0])
        expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm if max_norm > 0 else float("inf"))
        opts[1].step()
        opts[1].zero_grad(set_to_none=True)
        torch.testing.assert_close(norm, expected)
        for a, b in zip(folded.parameters(), reference.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        assert not hasattr(opts[0], "grad_scale")
    if max_norm == 0.05:
        assert float(norm) > 10 * max_norm  # the clip did fire, so the comparison is sharp


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_the_folded_clip_on_fsdp2_dtensors_equals_clipping_first(device, tmp_path):
    """The same on FSDP2's DTensor parameters (one rank, gloo on the CPU, NCCL on a GPU): the fused AdamW takes the
    plain-tensor divisor beside its DTensor lists, as it takes found_inf."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                            rank=0, world_size=1)
    try:
        mesh = init_device_mesh(device, (1,))
        cfg = config.load_config(None, {"mixed_precision": ("no", "test"), "max_grad_norm": (0.05, "test")}).cfg
        strategy = Strategy(cfg, DistEnv(0, 1, 0, 1, torch.device(device), "gloo"))
        torch.manual_seed(0)
        models = [torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)).to(device) for _ in range(2)]
        models[1].load_state_dict(models[0].state_dict())
        for m in models:
            fully_shard(m, mesh=mesh)
        opts = [torch.optim.AdamW(m.parameters(), lr=0.1, fused=True) for m in models]
        x = torch.randn(4, 8, device=device)
        for step in range(3):
            for m in models:
                (m(x * (step + 1)) ** 2).sum().backward()
            norm = strategy.step(models[0], opts[0])
            expected = torch.nn.utils.clip_grad_norm_(list(models[1].parameters()), 0.05, foreach=True)
            opts[1].step()
            opts[1].zero_grad(set_to_none=True)
            torch.testing.assert_close(norm, expected.full_tensor())
            assert float(norm) > 0.5  # the clip fires
            for a, b in zip(models[0].parameters(), models[1].parameters()):
                torch.testing.assert_close(a.full_tensor(), b.full_tensor(), rtol=1e-6, atol=1e-7)
    finally:
        dist.destroy_process_group()


def test_only_fsdp_cpu_offload_asks_for_host_collectives():
    """The loop asks the strategy whether its group needs gloo beside NCCL (train/dist.py): FSDP's CPU offload only."""
    from shardwise import strategies

    for name, want in (("fsdp-offload", True), ("fsdp", False), ("ddp", False), ("zero2-offload", False),
                       ("zero3-offload", False), ("single", False)):
        cfg = config.load_config(None, {"strategy": (name, "test")}).cfg
        assert strategies.get(cfg.strategy).host_collectives(cfg) is want, name
