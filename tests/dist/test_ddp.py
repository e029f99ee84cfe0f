"""DDP on real 2-rank gloo groups through torchrun's elastic agent, against one process.

The 12-step one-process and 2-rank DDP runs compared here are the session's reference runs
(tests/dist/shared.py), shared with test_parity.py and test_reliability.py."""

import os
import socket
import subprocess
import sys

import pytest
import torch

from tests.dist.shared import DDP, RTOL, SINGLE, STEPS, train_args
from tests.helpers import ConcurrentRuns, free_port, losses
from tests.inproc.trainer import train



def norms(run) -> torch.Tensor:
    return torch.tensor([r["grad_norm"] for r in run.metrics])


@pytest.fixture(scope="module")
def runs(tmp_path_factory, chat_data, ddp_ref):
    """This module's independent multi-rank runs, started together on first use. (Its one-rank runs train in this
    process: tests/inproc/trainer.py.)"""
    r = ConcurrentRuns()
    out = tmp_path_factory.mktemp("ddp-module")
    r.add("resumed", *train_args(out / "resumed", chat_data, *DDP, "--resume", str(ddp_ref.ckpt(4)), "--no-save-final"))
    return r, out


def test_ddp_two_ranks_match_one_process_on_the_same_global_batch(single_ref, ddp_ref):
    ref, got = single_ref.losses, ddp_ref.losses
    assert len(ref) == len(got) == STEPS
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=RTOL, atol=0)
    # the pre-clip gradient norm too: clipping + Adam would hide a constant scaling error in the loss
    torch.testing.assert_close(norms(ddp_ref), norms(single_ref), rtol=1e-4, atol=0)
    # the comparison is sharp enough: clipping fired, and the loss moved far more than the tolerance
    assert max(norms(single_ref)) > 0.5
    assert abs(ref[0] - ref[-1]) > 1e4 * RTOL * abs(ref[0])


def test_unclipped_run_differs_beyond_tolerance(single_ref, chat_data, tmp_path):
    """Negative control: the tolerance above would catch a skipped clip."""
    unclipped = train(*train_args(tmp_path / "noclip", chat_data, *SINGLE, "--no-save-final", "--max-grad-norm",
                                  "0")[1:]).losses
    diff = max(abs(a - b) / abs(b) for a, b in zip(unclipped, single_ref.losses))
    assert diff > 100 * RTOL



def test_two_nodes_over_loopback_match_one_node(ddp_ref, chat_data, tmp_path):
    """Two launcher processes ("nodes", 1 rank each) rendezvous through c10d on loopback."""
    out = tmp_path / "twonode"
    endpoint = f"127.0.0.1:{free_port()}"
    args = [*train_args(out, chat_data, "--strategy", "ddp", "--nnodes", "2", "--nproc-per-node", "1",
                        "--rdzv-endpoint", endpoint, "--micro-batch-size", "2", "--grad-accum", "2",
                        "--save-every", "4", "--no-save-final")]
    env = {**os.environ}
    procs = [subprocess.Popen([sys.executable, "-m", "shardwise", *args, "--node-rank", str(i)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in (0, 1)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outs)
    torch.testing.assert_close(torch.tensor(losses(str(out))), torch.tensor(ddp_ref.losses), rtol=RTOL, atol=0)


def test_resume_continues_the_same_loss_trajectory(ddp_ref, runs):
    ckpt = ddp_ref.ckpt(4)
    assert (ckpt / "meta.json").is_file()
    r, out = runs
    r.get("resumed")
    resumed = losses(str(out / "resumed"))
    assert len(resumed) == STEPS - 4
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(ddp_ref.losses[4:]), rtol=RTOL, atol=0)


def test_resume_on_one_rank_from_a_two_rank_checkpoint(ddp_ref, chat_data, tmp_path):
    """One rank, in this process (tests/inproc/trainer.py), from the 2-rank reference's step-4 checkpoint."""
    r1 = train(*train_args(tmp_path / "r1", chat_data, *SINGLE, "--resume", ddp_ref.ckpt(4), "--no-save-final")[1:])
    assert "saved by ddp on 2 ranks; now single on 1" in r1.stdout
    torch.testing.assert_close(torch.tensor(r1.losses), torch.tensor(ddp_ref.losses[4:]), rtol=RTOL, atol=0)


def test_resume_on_one_rank_with_the_saved_accumulation_keeps_the_global_batch(ddp_ref, chat_data, tmp_path):
    """The 2-rank checkpoint resumed on one process with the run's own micro-batch and accumulation (as a user
    resumes with config.yaml on fewer GPUs): the accumulation is raised to keep the global batch, so the steps left
    and the per-step losses are the uninterrupted run's; it halved the batch and doubled the epoch's steps."""
    one = ("--strategy", "single", "--nproc-per-node", "1", "--micro-batch-size", "2", "--grad-accum", "2")
    r1 = train(*train_args(tmp_path / "r1", chat_data, *one, "--resume", ddp_ref.ckpt(4), "--no-save-final")[1:])
    assert ("resuming on 1 data-parallel rank(s) (the checkpoint ran 2): --grad-accum 2 -> 4 keeps its global batch "
            "of 8 sequences, so its schedule and epoch hold") in r1.stdout
    torch.testing.assert_close(torch.tensor(r1.losses), torch.tensor(ddp_ref.losses[4:]), rtol=RTOL, atol=0)


def test_final_hf_directory_holds_the_trained_weights(ddp_ref, tiny_dir):
    """save -> load: final/ loads with transformers and equals the last checkpoint's model."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = ddp_ref.out
    final = AutoModelForCausalLM.from_pretrained(str(out / "final"), local_files_only=True)
    AutoTokenizer.from_pretrained(str(out / "final"), local_files_only=True)
    fresh = AutoModelForCausalLM.from_pretrained(tiny_dir, local_files_only=True)
    state = {"model": fresh.state_dict()}
    dcp.load(state, checkpoint_id=str(ddp_ref.ckpt(STEPS)))
    trained = final.state_dict()
    initial = AutoModelForCausalLM.from_pretrained(tiny_dir, local_files_only=True).state_dict()
    for k, v in state["model"].items():
        assert torch.equal(trained[k], v), k
    assert not torch.equal(trained["lm_head.weight"], initial["lm_head.weight"])


def test_gradient_checkpointing_under_ddp_trains_identically(single_ref, ddp_gc_timed):
    """Non-reentrant checkpointing recomputes the same activations: same losses, under DDP.
    (The run also saves on a time interval, which test_reliability.py checks; saving must not
    change the losses either.)"""
    got = ddp_gc_timed.losses
    assert len(got) == STEPS
    # the run's header says what the strategy's parallelize steps turned on (and only those)
    head = [ln for ln in ddp_gc_timed.stdout.splitlines() if ln.startswith("shardwise: activation checkpointing:")]
    assert head == ["shardwise: activation checkpointing: every block (full); padding-free: a micro-batch's rows in "
                    "one sequence where that saves compute"], ddp_gc_timed.stdout
    assert "compile:" not in ddp_gc_timed.stdout and "float8:" not in ddp_gc_timed.stdout
    torch.testing.assert_close(torch.tensor(got), torch.tensor(single_ref.losses), rtol=RTOL, atol=0)
