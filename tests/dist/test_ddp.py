"""DDP on real 2-rank gloo groups through torchrun's elastic agent, against one process."""

import os
import socket
import subprocess
import sys

import pytest
import torch

from tests.helpers import chat_records, losses, read_metrics, run_cli, write_jsonl

COMMON = ("--model", "tiny", "--seq-len", "64", "--log-every", "1", "--lr", "1e-3", "--warmup-steps", "2",
          "--max-grad-norm", "0.5", "--mixed-precision", "no", "--seed", "0")
RTOL = 2e-5  # fp32: only the order of floating-point reductions differs


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(str(tmp_path_factory.mktemp("data") / "chat.jsonl"), chat_records(96))


def train(out, data, *extra):
    run_cli("train", *COMMON, "--data", data, "--output-dir", str(out), *extra)
    return losses(str(out))


@pytest.fixture(scope="module")
def single_run(tmp_path_factory, data):
    out = tmp_path_factory.mktemp("single")
    return train(out, data, "--strategy", "single", "--nproc-per-node", "1", "--micro-batch-size", "2",
                 "--grad-accum", "4", "--max-steps", "10", "--no-save-final"), out


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory, data):
    out = tmp_path_factory.mktemp("ddp")
    return train(out, data, "--strategy", "ddp", "--nproc-per-node", "2", "--micro-batch-size", "2",
                 "--grad-accum", "2", "--max-steps", "12", "--save-every", "6"), out


def test_ddp_two_ranks_match_one_process_on_the_same_global_batch(single_run, ddp_run, data, tmp_path):
    ref, single_out = single_run
    got, _ = ddp_run
    # same global batch, but ddp runs 12 steps: the cosine schedule differs after step 1,
    # so compare a ddp run of 10 steps
    got = train(tmp_path / "ddp10", data, "--strategy", "ddp", "--nproc-per-node", "2", "--micro-batch-size", "2",
                "--grad-accum", "2", "--max-steps", "10", "--no-save-final")
    assert len(ref) == len(got) == 10
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=RTOL, atol=0)
    # the pre-clip gradient norm too: clipping + Adam would hide a constant scaling error in the loss
    norm = lambda d: torch.tensor([r["grad_norm"] for r in read_metrics(str(d))])  # noqa: E731
    torch.testing.assert_close(norm(tmp_path / "ddp10"), norm(single_out), rtol=1e-4, atol=0)
    # the comparison is sharp enough: clipping fired, and the loss moved far more than the tolerance
    norms = [r["grad_norm"] for r in read_metrics(str(single_out))]
    assert max(norms) > 0.5
    assert abs(ref[0] - ref[-1]) > 1e4 * RTOL * abs(ref[0])


def test_unclipped_run_differs_beyond_tolerance(single_run, data, tmp_path):
    """Negative control: the tolerance above would catch a skipped clip."""
    ref, _ = single_run
    unclipped = train(tmp_path / "noclip", data, "--strategy", "single", "--nproc-per-node", "1",
                      "--micro-batch-size", "2", "--grad-accum", "4", "--max-steps", "10", "--no-save-final",
                      "--max-grad-norm", "0")
    diff = max(abs(a - b) / abs(b) for a, b in zip(unclipped, ref))
    assert diff > 100 * RTOL


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_over_loopback_match_one_node(ddp_run, data, tmp_path):
    """Two launcher processes ("nodes", 1 rank each) rendezvous through c10d on loopback."""
    out = tmp_path / "twonode"
    endpoint = f"127.0.0.1:{_free_port()}"
    args = ["train", *COMMON, "--data", data, "--output-dir", str(out), "--strategy", "ddp", "--nnodes", "2",
            "--nproc-per-node", "1", "--rdzv-endpoint", endpoint, "--micro-batch-size", "2", "--grad-accum", "2",
            "--max-steps", "12", "--save-every", "6", "--no-save-final"]
    env = {**os.environ}
    procs = [subprocess.Popen([sys.executable, "-m", "shardwise", *args, "--node-rank", str(i)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in (0, 1)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outs)
    ref, _ = ddp_run
    torch.testing.assert_close(torch.tensor(losses(str(out))), torch.tensor(ref), rtol=RTOL, atol=0)


def test_resume_continues_the_same_loss_trajectory(ddp_run, data, tmp_path):
    ref, out = ddp_run
    ckpt = out / "checkpoints" / "step_00000006"
    assert (ckpt / "meta.json").is_file()
    resumed = train(tmp_path / "resumed", data, "--strategy", "ddp", "--nproc-per-node", "2", "--micro-batch-size",
                    "2", "--grad-accum", "2", "--max-steps", "12", "--resume", str(ckpt), "--no-save-final")
    assert len(resumed) == 6
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(ref[6:]), rtol=RTOL, atol=0)


def test_resume_on_one_rank_from_a_two_rank_checkpoint(ddp_run, data, tmp_path):
    ref, out = ddp_run
    p = run_cli("train", *COMMON, "--data", data, "--output-dir", str(tmp_path / "r1"), "--strategy", "single",
                "--nproc-per-node", "1", "--micro-batch-size", "2", "--grad-accum", "4", "--max-steps", "12",
                "--resume", str(out / "checkpoints" / "step_00000006"), "--no-save-final")
    assert "saved by ddp on 2 ranks; now single on 1" in p.stdout
    torch.testing.assert_close(torch.tensor(losses(str(tmp_path / "r1"))), torch.tensor(ref[6:]), rtol=RTOL, atol=0)


def test_final_hf_directory_holds_the_trained_weights(ddp_run, tiny_dir):
    """save -> load: final/ loads with transformers and equals the last checkpoint's model."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, out = ddp_run
    final = AutoModelForCausalLM.from_pretrained(str(out / "final"), local_files_only=True)
    AutoTokenizer.from_pretrained(str(out / "final"), local_files_only=True)
    fresh = AutoModelForCausalLM.from_pretrained(tiny_dir, local_files_only=True)
    state = {"model": fresh.state_dict()}
    dcp.load(state, checkpoint_id=str(out / "checkpoints" / "step_00000012"))
    trained = final.state_dict()
    initial = AutoModelForCausalLM.from_pretrained(tiny_dir, local_files_only=True).state_dict()
    for k, v in state["model"].items():
        assert torch.equal(trained[k], v), k
    assert not torch.equal(trained["lm_head.weight"], initial["lm_head.weight"])


def test_gradient_checkpointing_under_ddp_trains_identically(single_run, data, tmp_path):
    """Non-reentrant checkpointing recomputes the same activations: same losses, under DDP."""
    ref, _ = single_run
    got = train(tmp_path / "gc", data, "--strategy", "ddp", "--nproc-per-node", "2", "--micro-batch-size", "2",
                "--grad-accum", "2", "--max-steps", "10", "--no-save-final", "--gradient-checkpointing")
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=RTOL, atol=0)
