"""Every strategy trains identically: on 2 gloo ranks (through the real CLI and torchrun's
elastic agent), the same seed, data and global batch give the same per-step loss and
pre-clip gradient norm as one process, with gradient accumulation and clipping on.

fp32 on the CPU: only the order of floating-point reductions differs, so the tolerance is
tight (tests/dist/test_ddp.py's RTOL = 2e-5). Its sharpness was checked by breaking the
strategies on purpose (same flags, lr 3e-3), each of which fails here:
  fsdp, gradient sync on the first micro-batch instead of the last  loss off by 10%, norm by 36%
  zero2, loss divided by grad accumulation once more (wrong scale)  loss off by 1e-7 (!), norm by 50%
  zero2, clipping skipped (gradient_clipping 0 via deepspeed.config) loss off by 2.4%, norm by 8%
A wrong gradient scale leaves the losses unchanged once clipping fires (clip + Adam undo
any constant factor), which is why the pre-clip gradient norm is compared too.
"""

import pytest
import torch

from tests.dist.test_ddp import COMMON, RTOL
from tests.helpers import chat_records, read_metrics, run_cli, write_jsonl

MAX_GRAD_NORM = 0.5  # COMMON's --max-grad-norm; the reference run's norms exceed it
STEPS = 10
SINGLE = ("--strategy", "single", "--nproc-per-node", "1", "--micro-batch-size", "2", "--grad-accum", "4")
TWO = ("--nproc-per-node", "2", "--micro-batch-size", "2", "--grad-accum", "2")
LORA = ("--tuner", "lora", "--lora-r", "4", "--lora-dropout", "0", "--lr", "3e-3")  # no dropout: RNG per rank


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(str(tmp_path_factory.mktemp("data") / "chat.jsonl"), chat_records(96))


def train(out, data, *extra) -> list[dict]:
    run_cli("train", *COMMON, "--data", data, "--output-dir", str(out), "--max-steps", str(STEPS), *extra)
    return read_metrics(str(out))


def assert_same_run(got: list[dict], ref: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in ref] == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor([r[key] for r in got]), torch.tensor([r[key] for r in ref]),
                                   rtol=RTOL, atol=0, msg=lambda m, key=key: f"{key}: {m}")


@pytest.fixture(scope="module")
def single(tmp_path_factory, data):
    ref = train(tmp_path_factory.mktemp("single"), data, *SINGLE, "--no-save-final")
    # the comparison is sharp: clipping fires, and the loss moves far beyond the tolerance
    assert max(r["grad_norm"] for r in ref) > MAX_GRAD_NORM
    assert abs(ref[0]["loss"] - ref[-1]["loss"]) > 1e4 * RTOL * ref[0]["loss"]
    return ref


# Each case also exercises something else on the way, at no extra launch: gradient
# checkpointing (fsdp-grad-op, zero3) and a mid-run checkpoint that other strategies resume.
CASES = {
    "fsdp": ("--strategy", "fsdp", "--no-save-final"),
    "fsdp-grad-op": ("--strategy", "fsdp-grad-op", "--gradient-checkpointing", "--save-every", "5",
                     "--no-save-final"),
    "zero1": ("--strategy", "zero1", "--no-save-final"),
    "zero2": ("--strategy", "zero2", "--no-save-final"),
    "zero3": ("--strategy", "zero3", "--gradient-checkpointing", "--save-every", "5", "--save-final"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data):
    cache = {}

    def get(name):
        if name not in cache:
            out = tmp_path_factory.mktemp(name)
            cache[name] = (train(out, data, *TWO, *CASES[name]), out)
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_match_one_process(name, single, runs):
    got, _ = runs(name)
    assert_same_run(got, single)


@pytest.mark.parametrize("saved_by,resumed_by", [("zero3", "fsdp"), ("fsdp-grad-op", "zero3")])
def test_checkpoint_resumes_under_another_strategy(saved_by, resumed_by, single, runs, data, tmp_path):
    """DeepSpeed state is saved in the same name-keyed DCP form as FSDP's: a ZeRO-3
    checkpoint resumes under FSDP and an FSDP one under ZeRO-3, on the same trajectory."""
    _, out = runs(saved_by)
    ckpt = out / "checkpoints" / "step_00000005"
    p = run_cli("train", *COMMON, "--data", data, "--output-dir", str(tmp_path / "resumed"), "--max-steps",
                str(STEPS), *TWO, "--strategy", resumed_by, "--resume", str(ckpt), "--no-save-final")
    assert f"saved by {saved_by} on 2 ranks; now {resumed_by} on 2" in p.stdout
    got = read_metrics(str(tmp_path / "resumed"))
    assert [r["step"] for r in got] == list(range(6, STEPS + 1))
    torch.testing.assert_close(torch.tensor([r["loss"] for r in got]),
                               torch.tensor([r["loss"] for r in single[5:]]), rtol=RTOL, atol=0)


def test_zero3_final_model_is_the_trained_full_model(runs, tiny_dir):
    """full_model_state_dict gathers ZeRO-3's partitions: final/ loads with transformers,
    equals the step-10 checkpoint (fp32 master weights) and differs from the initial model."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    _, out = runs("zero3")
    final = AutoModelForCausalLM.from_pretrained(str(out / "final"), local_files_only=True).state_dict()
    fresh = AutoModelForCausalLM.from_pretrained(tiny_dir, local_files_only=True)
    initial = {k: v.clone() for k, v in fresh.state_dict().items()}
    state = {"model": fresh.state_dict()}
    dcp.load(state, checkpoint_id=str(out / "checkpoints" / "step_00000010"))
    for k, v in state["model"].items():
        torch.testing.assert_close(final[k], v, rtol=0, atol=0)
    assert any(not torch.equal(final[k], initial[k]) for k in initial)


# -- LoRA ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lora_single(tmp_path_factory, data):
    return train(tmp_path_factory.mktemp("lora-single"), data, *SINGLE, *LORA, "--no-save-final")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_lora_two_ranks_match_one_process(strategy, lora_single, data, tmp_path):
    out = tmp_path / strategy
    got = train(out, data, *TWO, *LORA, "--strategy", strategy, "--merge-lora")
    assert max(r["grad_norm"] for r in lora_single) > MAX_GRAD_NORM
    assert_same_run(got, lora_single)
    if strategy == "fsdp":
        check_lora_outputs(out)


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
