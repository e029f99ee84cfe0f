"""Tensor parallelism (DTensor, strategies/parallelize.py) through the real CLI on 2 gloo ranks.

One launch: fsdp with --tensor-parallel 2 on 2 ranks (one data-parallel rank: each block's
q/k/v/gate/up split column-wise and o/down row-wise, the norms sequence-parallel, embedding and
head split over the vocabulary with the fused vocabulary-parallel loss, FSDP wrapped around the
DTensor weights on the size-1 shard dimension) trains like the session's one process on the
same global batch of 8, step for step: loss and pre-clip gradient norm at the parity tests'
fp32 tolerance (clipping fires, so a gradient norm that counted replicated weights once per tp
rank, or missed sharded ones, would show: leaving one mesh's group out of the norm in
Strategy.clip_grad_norm, on purpose, moved the losses by 1.6% and the norms by 17%). Its final/
directory is a plain Hugging Face model with full (gathered) weights equal to the reference's
after the same 12 steps, and its checkpoint exports to the same model in one process.

Two resumes across degrees (launched together): its step-8 checkpoint as TP 1 x DP 2, and the
one-process step-8 checkpoint as TP 2 with gradient checkpointing and the unfused loss
(vocabulary-sharded logits under loss_parallel); both continue on the one-process trajectory.

The 2-D mesh (FSDP 2 x TP 2 on 4 ranks) and pure TP (`--strategy single --tensor-parallel 2`)
are compared the same way by the last test, which runs only with SHARDWISE_SLOW_TESTS=1: 4 CPU
ranks cost too much of the suite's time to run on every change (docs/tensor-parallel.md says
when it was last run and what it gave).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.dist.shared import MAX_GRAD_NORM, RTOL, STEPS, TWO, Run, train_args
from tests.dist.test_parity import assert_same_run
from tests.helpers import ConcurrentRuns, run_cli

# SINGLE's global batch (1 rank x 2 x 4) on one data-parallel rank of 2 tensor-parallel ranks
TP2 = ("--strategy", "fsdp", "--nproc-per-node", "2", "--tensor-parallel", "2", "--micro-batch-size", "2",
       "--grad-accum", "4")


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory, chat_data) -> Run:
    out = tmp_path_factory.mktemp("tp2")
    p = run_cli(*train_args(out, chat_data, *TP2, "--save-every", "4", "--keep-checkpoints", "3"))
    return Run(out, p.stdout, p.stderr)


@pytest.fixture(scope="module")
def resumes(tmp_path_factory, chat_data, tp_run, single_ref):
    """The cross-degree resumes, launched together: the TP 2 x DP 1 run's step-8 checkpoint resumed
    as TP 1 x DP 2 (fsdp on 2 ranks), and the one-process run's step-8 checkpoint resumed as
    TP 2 x DP 1 with gradient checkpointing and the plain (unfused) loss: the vocabulary-sharded
    logits' cross-entropy under torch's loss_parallel (the module's other runs use the fused
    vocabulary-parallel loss of models/speed.py). Both measure a validation loss at the end. They resume
    from step 8, not 4: a TP step is the suite's costliest, and 4 steps after a resume show a wrong
    optimizer state or data position as well as 8 do."""
    batch, outs = ConcurrentRuns(), {}
    for name, ckpt, extra in (("tp1-from-tp2", tp_run.ckpt(8), ("--strategy", "fsdp", *TWO)),
                              ("tp2-from-tp1", single_ref.ckpt(8), (*TP2, "--gradient-checkpointing",
                                                                         "--no-fused-loss"))):
        outs[name] = tmp_path_factory.mktemp(name)
        batch.add(name, *train_args(outs[name], chat_data, *extra, "--resume", str(ckpt), "--no-save-final",
                                    "--val-data", str(chat_data)))

    def get(name) -> Run:
        p = batch.get(name)
        return Run(outs[name], p.stdout, p.stderr)

    return get


def test_tp2_trains_like_one_process_step_for_step(tp_run, single_ref):
    ref = single_ref.metrics
    assert max(r["grad_norm"] for r in ref) > MAX_GRAD_NORM  # clipping fires: the norm is compared sharply
    text = tp_run.stdout + tp_run.stderr
    assert "tensor parallel: attention and MLP linears split over groups of 2 ranks" in text, text[-3000:]
    assert "+ tensor parallel over groups of 2 on 2 rank(s)" in text, text[-3000:]
    assert_same_run(tp_run.metrics, ref)


def test_tp2_final_and_checkpoint_are_full_hugging_face_models_equal_to_one_process(tp_run, single_ref, tmp_path):
    """final/ holds the gathered (full) weights, and `shardwise export` turns the TP checkpoint (DTensor
    shards in DCP) into the same model in one process; both equal the one-process run's step-12
    checkpoint, exported the same way. atol 5e-5: Adam divides by sqrt(v), so reduction-order
    differences in tiny gradients move weights by more than the losses' 2e-5 relative (observed 3.5e-6)."""
    from transformers import AutoModelForCausalLM

    from shardwise.export import export

    final = AutoModelForCausalLM.from_pretrained(str(tp_run.out / "final")).state_dict()
    exported = AutoModelForCausalLM.from_pretrained(export(str(tp_run.ckpt(STEPS)), str(tmp_path / "tp"))).state_dict()
    ref = AutoModelForCausalLM.from_pretrained(export(str(single_ref.ckpt(STEPS)), str(tmp_path / "one"))).state_dict()
    assert ref.keys() == final.keys() == exported.keys()
    for name, t in ref.items():
        assert final[name].shape == exported[name].shape == t.shape, name  # e.g. q_proj (heads x head_dim, hidden)
        torch.testing.assert_close(final[name], t, rtol=0, atol=5e-5, msg=lambda m, n=name: f"final {n}: {m}")
        torch.testing.assert_close(exported[name], final[name], rtol=0, atol=0, msg=lambda m, n=name: f"export {n}: {m}")


@pytest.mark.parametrize("name,saved_by,resumed_by", [("tp1-from-tp2", "fsdp on 2", "fsdp on 2"),
                                                      ("tp2-from-tp1", "single on 1", "fsdp on 2")])
def test_a_checkpoint_resumes_with_another_tensor_parallel_degree_on_the_same_trajectory(
        name, saved_by, resumed_by, resumes, single_ref):
    """The optimizer's state is saved keyed by parameter name (not by parameter group, which differ per
    mesh), so TP 2 x DP 1 resumes as TP 1 x DP 2 and a TP 1 checkpoint as TP 2 (with gradient
    checkpointing); steps 9-12 equal the uninterrupted one-process run's, loss and gradient norm."""
    run = resumes(name)
    assert f"saved by {saved_by} ranks; now {resumed_by}" in run.stdout, run.stdout[-3000:]
    got, ref = run.metrics, single_ref.metrics[8:]
    assert [r["step"] for r in got] == list(range(9, STEPS + 1))
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor([r[key] for r in got]), torch.tensor([r[key] for r in ref]),
                                   rtol=RTOL, atol=0, msg=lambda m, key=key: f"{name} {key}: {m}")


def test_the_validation_loss_under_tp_equals_the_one_without(resumes):
    """The evaluator's loss (train/evaluate.py) with TP 2's vocabulary-sharded logits under loss_parallel equals
    the TP 1 run's on the same weights (both resumes end on the one-process trajectory)."""
    tp1, tp2 = (resumes(n).metrics[-1] for n in ("tp1-from-tp2", "tp2-from-tp1"))
    assert tp1["step"] == tp2["step"] == STEPS and tp1["val_tokens"] == tp2["val_tokens"] > 0
    torch.testing.assert_close(torch.tensor(tp2["val_loss"]), torch.tensor(tp1["val_loss"]), rtol=RTOL, atol=0)


def test_a_degree_the_heads_do_not_divide_is_refused_before_launch_with_the_models_numbers(chat_data, tmp_path):
    p = run_cli(*train_args(tmp_path / "tp4", chat_data, "--strategy", "fsdp", "--nproc-per-node", "4",
                            "--tensor-parallel", "4"), check=False)
    text = p.stdout + p.stderr
    assert p.returncode != 0, text
    assert ("flag --tensor-parallel: tensor parallelism gives each of the 4 ranks whole attention heads, and 4 does "
            "not divide the model's 4 attention heads and 2 KV heads; use --tensor-parallel 2") in text, text
    assert "Traceback" not in text and not (tmp_path / "tp4").exists()


@pytest.mark.skipif(os.environ.get("SHARDWISE_SLOW_TESTS") != "1",
                    reason="4 gloo ranks cost minutes of the suite's CPU time: run with SHARDWISE_SLOW_TESTS=1")
@pytest.mark.parametrize("name,flags", [
    ("fsdp2-x-tp2", ("--strategy", "fsdp", "--nproc-per-node", "4", "--tensor-parallel", "2", "--micro-batch-size",
                     "2", "--grad-accum", "2")),
    ("pure-tp2", ("--strategy", "single", "--nproc-per-node", "2", "--tensor-parallel", "2", "--micro-batch-size",
                  "2", "--grad-accum", "4", "--no-fused-loss"))])
def test_slow_2d_mesh_and_pure_tp_train_like_one_process(name, flags, single_ref, chat_data, tmp_path):
    """FSDP 2 x TP 2 on 4 ranks (the 2-D mesh: FSDP over dp_shard around the tp DTensors) and pure TP 2
    (one replica, no data-parallel wrap, the unfused loss under loss_parallel), same global batch of 8:
    the one-process run's losses and gradient norms, step for step."""
    p = run_cli(*train_args(tmp_path / name, chat_data, *flags, "--no-save-final"), timeout=1500)
    assert "+ tensor parallel over groups of 2" in p.stdout + p.stderr
    assert_same_run(Run(tmp_path / name).metrics, single_ref.metrics)


@pytest.mark.skipif(os.environ.get("SHARDWISE_SLOW_TESTS") != "1",
                    reason="4 gloo ranks cost minutes of the suite's CPU time: run with SHARDWISE_SLOW_TESTS=1")
@pytest.mark.parametrize("name,flags", [
    ("tp2-x-sp2", ("--strategy", "fsdp", "--sp-mode", "ulysses")),
    ("tp2-x-sp2-unfused-ckpt", ("--strategy", "fsdp", "--sp-mode", "ulysses", "--no-fused-loss",
                                "--gradient-checkpointing", "--packing")),
    ("tp2-x-sp2-ring", ("--strategy", "fsdp", "--sp-mode", "ring", "--packing")),
    ("single-tp2-x-sp2", ("--strategy", "single", "--sp-mode", "ulysses"))])
def test_slow_tensor_times_sequence_parallel_trains_like_one_process(name, flags, single_ref, chat_data, tmp_path,
                                                                     tmp_path_factory):
    """TP 2 x SP 2 on 4 ranks (fsdp, and single: one replica whose sp ranks average their gradients; data-parallel
    degree 1, the global batch of 8): each sequence split over the
    2 sp ranks, each half split again over the 2 tp ranks between blocks; Ulysses exchanges each tp rank's 2 of
    the 4 heads (its 1 KV head replicated to 2) over the sp pair. Same losses and gradient norms as one process,
    step for step: the fused vocabulary-parallel loss, and the unfused loss under loss_parallel with gradient
    checkpointing and packed rows (against the one-process packed run); and ring attention instead of Ulysses
    (each tp rank's ring over the sp pair, packed rows whose documents straddle the halves)."""
    base = ("--nproc-per-node", "4", "--tensor-parallel", "2", "--sequence-parallel", "2",
            "--micro-batch-size", "2", "--grad-accum", "4", "--no-save-final")
    p = run_cli(*train_args(tmp_path / name, chat_data, *base, *flags), timeout=1500)
    text = p.stdout + p.stderr
    how = "ring" if "ring" in flags else "Ulysses"
    assert f"{how} sequence parallel over groups of 2 + tensor parallel over groups of 2" in text, text[-3000:]
    ref = single_ref.metrics
    if "--packing" in flags:
        one = tmp_path_factory.mktemp("single-packed")
        run_cli(*train_args(one, chat_data, "--strategy", "single", "--nproc-per-node", "1", "--micro-batch-size", "2",
                            "--grad-accum", "4", "--packing", "--no-save-final"), timeout=1500)
        ref = Run(one).metrics
    assert_same_run(Run(tmp_path / name).metrics, ref)
