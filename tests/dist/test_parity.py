"""Every strategy trains identically: on 2 gloo ranks (through the real CLI and torchrun's
elastic agent), the same seed, data and global batch give the same per-step loss and
pre-clip gradient norm as one process, with gradient accumulation and clipping on.

fp32 on the CPU: only the order of floating-point reductions differs, so the tolerance is
tight (tests/dist/shared.py's RTOL = 2e-5). Its sharpness was checked by breaking the
strategies on purpose (same flags, lr 3e-3), each of which fails here:
  fsdp, gradient sync on the first micro-batch instead of the last  loss off by 10%, norm by 36%
  zero2, loss divided by grad accumulation once more (wrong scale)  loss off by 1e-7 (!), norm by 50%
  zero2, clipping skipped (gradient_clipping 0 via deepspeed.config) loss off by 2.4%, norm by 8%
A wrong gradient scale leaves the losses unchanged once clipping fires (clip + Adam undo
any constant factor), which is why the pre-clip gradient norm is compared too.
"""

import pytest
import torch

from tests.dist.shared import LORA, MAX_GRAD_NORM, RTOL, STEPS, TWO, Run, train_args
from tests.helpers import ConcurrentRuns



def assert_same_run(got: list[dict], ref: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in ref] == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor([r[key] for r in got]), torch.tensor([r[key] for r in ref]),
                                   rtol=RTOL, atol=0, msg=lambda m, key=key: f"{key}: {m}")


@pytest.fixture(scope="module")
def single(single_ref):
    """The session's one-process run (tests/dist/shared.py)."""
    ref = single_ref.metrics
    # the comparison is sharp: clipping fires, and the loss moves far beyond the tolerance
    assert max(r["grad_norm"] for r in ref) > MAX_GRAD_NORM
    assert abs(ref[0]["loss"] - ref[-1]["loss"]) > 1e4 * RTOL * ref[0]["loss"]
    return ref


# Each case also exercises something else on the way, at no extra launch: gradient
# checkpointing (fsdp-grad-op, zero3) and a mid-run checkpoint that other strategies resume.
CASES = {
    "fsdp": ("--strategy", "fsdp", "--no-save-final"),
    "fsdp-grad-op": ("--strategy", "fsdp-grad-op", "--gradient-checkpointing", "--save-every", "6",
                     "--no-save-final"),
    "zero1": ("--strategy", "zero1", "--no-save-final"),
    "zero2": ("--strategy", "zero2", "--no-save-final"),
    "zero3": ("--strategy", "zero3", "--gradient-checkpointing", "--save-every", "6", "--save-final"),
    # the optimizer step on the host's fp32 state (the fused AdamW there too, strategies/base.py optimizer_kernel)
    "fsdp-offload": ("--strategy", "fsdp-offload", "--no-save-final"),
    "zero2-offload": ("--strategy", "zero2-offload", "--no-save-final"),
}
# zero3 under LoRA: its frozen embedding once let DeepSpeed free the first block's gradients before that block's
# backward (strategies/deepspeed.py apply_leaves)
LORA_CASES = {s: ("--strategy", s, *LORA, "--merge-lora") for s in ("ddp", "fsdp", "zero3")}


# (saved by, resumed by, the resume's own flags): the zero3 resume runs DeepSpeed's per-submodule fetch
RESUMES = [("zero3", "fsdp", ()), ("fsdp-grad-op", "zero3", ("--deepspeed-fetch", "module"))]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, chat_data):
    """Every 2-rank run of this module, launched together (two at a time) on first use: the
    runs from scratch (the ones whose checkpoints are resumed first), then the resumes."""
    batch, outs = ConcurrentRuns(), {}
    scratch = {**{n: CASES[n] for n in ("zero3", "fsdp-grad-op")}, **CASES,
               **{f"lora-{s}": e for s, e in LORA_CASES.items()}}
    for name, extra in scratch.items():
        outs[name] = tmp_path_factory.mktemp(name)
        batch.add(name, *train_args(outs[name], chat_data, *TWO, *extra))
    for saved_by, resumed_by, flags in RESUMES:
        name = f"{resumed_by}-from-{saved_by}"
        outs[name] = tmp_path_factory.mktemp(name)
        batch.add(name, *train_args(outs[name], chat_data, *TWO, "--strategy", resumed_by, "--resume",
                                    str(outs[saved_by] / "checkpoints" / "step_00000006"), "--no-save-final",
                                    *flags),
                  after=saved_by)

    def get(name) -> Run:
        p = batch.get(name)
        return Run(outs[name], p.stdout, p.stderr)

    return get


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_match_one_process(name, single, runs):
    assert_same_run(runs(name).metrics, single)


@pytest.mark.parametrize("saved_by,resumed_by,flags", RESUMES)
def test_checkpoint_resumes_under_another_strategy(saved_by, resumed_by, flags, single, runs):
    """DeepSpeed state is saved in the same name-keyed DCP form as FSDP's: a ZeRO-3
    checkpoint resumes under FSDP and an FSDP one under ZeRO-3, on the same trajectory."""
    assert runs(saved_by).ckpt(6).is_dir()
    run = runs(f"{resumed_by}-from-{saved_by}")
    assert f"saved by {saved_by} on 2 ranks; now {resumed_by} on 2" in run.stdout
    got = run.metrics
    assert [r["step"] for r in got] == list(range(7, STEPS + 1))
    torch.testing.assert_close(torch.tensor([r["loss"] for r in got]),
                               torch.tensor([r["loss"] for r in single[6:]]), rtol=RTOL, atol=0)


def test_zero3_final_model_is_the_trained_full_model(runs, tiny_dir):
    """full_model_state_dict gathers ZeRO-3's partitions: final/ loads with transformers,
    equals the last step's checkpoint (fp32 master weights) and differs from the initial model."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    run = runs("zero3")
    final = AutoModelForCausalLM.from_pretrained(str(run.out / "final"), local_files_only=True).state_dict()
    fresh = AutoModelForCausalLM.from_pretrained(tiny_dir, local_files_only=True)
    initial = {k: v.clone() for k, v in fresh.state_dict().items()}
    state = {"model": fresh.state_dict()}
    dcp.load(state, checkpoint_id=str(run.ckpt(STEPS)))
    for k, v in state["model"].items():
        torch.testing.assert_close(final[k], v, rtol=0, atol=0)
    assert any(not torch.equal(final[k], initial[k]) for k in initial)


def test_zero3_log_stays_one_line_per_step_with_each_library_warning_once(runs):
    """DeepSpeed's ZeRO-3 collectives raise the same deprecation warnings in every step on
    every rank; the worker prints each distinct one once, from rank 0."""
    run = runs("zero3")
    lines = [ln for ln in (run.stdout + run.stderr).splitlines() if ln.strip()]
    steps = [ln for ln in lines if ln.startswith("step ")]
    assert len(steps) == STEPS
    warned = [ln for ln in lines if "Warning:" in ln]
    assert len(warned) == len(set(warned)), "a library warning was printed more than once"
    assert len(lines) - len(steps) <= 20, "\n".join(lines)  # start-up, checkpoints and the end message


# -- LoRA ---------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", list(LORA_CASES))
def test_lora_two_ranks_match_one_process(strategy, lora_single_ref, runs):
    run = runs(f"lora-{strategy}")
    lora_single = lora_single_ref.metrics
    assert max(r["grad_norm"] for r in lora_single) > MAX_GRAD_NORM
    assert_same_run(run.metrics, lora_single)
    if strategy in ("fsdp", "zero3"):
        check_lora_outputs(run.out)


def check_lora_outputs(out):
    """final/ is a PEFT adapter (only adapter tensors); final/merged is the same function."""
    import json

    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    summary = json.loads((out / "summary.json").read_text())
    assert 0 < summary["trainable_params"] < summary["params"] / 10
    adapter = load_file(str(out / "final" / "adapter_model.safetensors"))
    assert adapter and all("lora_" in k for k in adapter)
    base_dir = json.loads((out / "final" / "adapter_config.json").read_text())["base_model_name_or_path"]
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), str(out / "final"))
    merged = AutoModelForCausalLM.from_pretrained(str(out / "final" / "merged"), local_files_only=True)
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    ids = torch.randint(0, 400, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got, before = (m(input_ids=ids).logits for m in (peft_model, merged, base))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert (want - before).abs().max() > 1e-2  # the adapter learned something
