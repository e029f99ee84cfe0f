"""Sequence parallelism (Ulysses) on 2 real gloo ranks.

First the attention function alone, in one spawned pair of processes: a Llama model whose
attention runs Ulysses over 2 ranks, each holding half of every sequence, gives the same
logits and (summed over ranks) the same gradients as the unsplit model in one process, for
plain rows, packed rows (positions restarting per document), GQA with KV heads divisible
by the degree and fewer KV heads than ranks (replicated). Then the whole path through the
real CLI: SP = 2 trains like one process on the same global batch, step for step.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.dist.shared import MAX_GRAD_NORM, RTOL, SINGLE, STEPS, TWO, Run, train_args
from tests.dist.test_parity import assert_same_run
from tests.helpers import ConcurrentRuns, forked_ranks, run_cli
from tests.inproc.trainer import train




def _model(kv_heads: int, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=256,
                      attn_implementation="sdpa", use_cache=False)  # as models/load.py: no cache in training
    return LlamaForCausalLM(cfg).float()


def _batch(packed: bool):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (2, 32), generator=g)
    if packed:  # row 0: documents of 5, 19 and 8 tokens; row 1: 13 and 19
        pos = torch.cat([torch.cat([torch.arange(5), torch.arange(19), torch.arange(8)]),
                         torch.cat([torch.arange(13), torch.arange(19)])]).view(2, 32)
    else:
        pos = torch.arange(32).repeat(2, 1)
    targets = torch.randint(0, 64, (2, 32), generator=g)
    return ids, pos, targets


def _loss(model, ids, pos, targets):
    logits = model(input_ids=ids, position_ids=pos).logits
    return torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), reduction="sum"), logits


def _attention_worker(rank: int, init_file: str, q) -> None:
    from shardwise.models.sequence_parallel import apply_sequence_parallel
    from shardwise.strategies.parallel import ParallelDims

    # a file rendezvous: no port to pick, so nothing another test's processes could take first
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    dims = ParallelDims(1, 1, 2, 1, world_size=2, rank=rank)  # one sequence group of both ranks
    results = {}
    for kv in (2, 1):
        for packed in (False, True):
            ids, pos, targets = _batch(packed)
            ref = _model(kv)
            ref_loss, ref_logits = _loss(ref, ids, pos, targets)
            ref_loss.backward()
            sp = _model(kv)
            apply_sequence_parallel(sp, dims, "ulysses")
            half = slice(rank * 16, (rank + 1) * 16)
            loss, logits = _loss(sp, ids[:, half], pos[:, half], targets[:, half])
            loss.backward()
            total = loss.detach().clone()
            dist.all_reduce(total)
            grads_close = True
            for (name, p), (_, r) in zip(sp.named_parameters(), ref.named_parameters()):
                g = p.grad.clone()
                dist.all_reduce(g)  # what DDP/FSDP do (as a mean, with the loss scaled by the world)
                grads_close &= torch.allclose(g, r.grad, rtol=1e-4, atol=1e-6)
            results[(kv, packed)] = (torch.allclose(logits, ref_logits[:, half], rtol=1e-4, atol=1e-5),
                                     torch.allclose(total, ref_loss, rtol=1e-5), grads_close)
    q.put((rank, results))
    dist.destroy_process_group()


def test_ulysses_attention_matches_the_unsplit_model(tmp_path):
    with forked_ranks("tests.dist.test_sequence_parallel", "shardwise.models.sequence_parallel") as ctx:
        q = ctx.Queue()
        mp.start_processes(_attention_worker, args=(str(tmp_path / "init"), q), nprocs=2, start_method="forkserver")
    for _ in range(2):
        rank, results = q.get(timeout=60)
        for case, (logits_ok, loss_ok, grads_ok) in results.items():
            assert logits_ok and loss_ok and grads_ok, (rank, case, logits_ok, loss_ok, grads_ok)


def test_one_rank_document_mask_matches_transformers_packing():
    """At degree 1 (long packed sequences on one GPU take this path) the attention function
    gives what transformers' own packed-sequence SDPA mask gives, and that differs from
    plain causal attention, so the packed cases above are sharp."""
    from shardwise.models.sequence_parallel import apply_sequence_parallel

    ids, pos, _ = _batch(True)
    hf, ours = _model(2), _model(2)
    apply_sequence_parallel(ours, None, 1)
    with torch.no_grad():
        want = hf(input_ids=ids, position_ids=pos).logits
        got = ours(input_ids=ids, position_ids=pos).logits
        plain = hf(input_ids=ids, position_ids=torch.arange(32).repeat(2, 1)).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(want[0, 5:], plain[0, 5:], atol=1e-3)


# -- the whole path through the CLI ---------------------------------------------------------
# SP = 2 on 2 ranks is data-parallel degree 1: the global batch of 8 is 2 x 4 accumulation,
# the same rows as the session's one-process runs (SINGLE). Each case also exercises
# something else: packing with gradient checkpointing (recomputed exchanges), ZeRO-3, and
# checkpoints that cross SP degrees both ways (the data position is counted in rows).
SP2 = ("--nproc-per-node", "2", "--micro-batch-size", "2", "--grad-accum", "4", "--sequence-parallel", "2")
PACKED = ("--packing",)


@pytest.fixture(scope="module")
def sp_runs(tmp_path_factory, chat_data, single_ref):
    batch, outs = ConcurrentRuns(), {}
    cases = {
        "ddp": (*SP2, "--strategy", "ddp", "--save-every", "6", "--no-save-final"),
        "single-packed": (*SINGLE, *PACKED, "--no-save-final"),
        "fsdp-packed": (*SP2, *PACKED, "--strategy", "fsdp", "--gradient-checkpointing", "--no-save-final"),
        "ring-packed": (*SP2, *PACKED, "--strategy", "ddp", "--sp-mode", "ring", "--no-save-final"),
        # SP = 1 (one process) -> SP = 2 under ZeRO-3
        "zero3-from-single": (*SP2, "--strategy", "zero3", "--resume", str(single_ref.ckpt(4)), "--no-save-final"),
    }
    for name, extra in cases.items():
        outs[name] = tmp_path_factory.mktemp(name)
        if name != "single-packed":
            batch.add(name, *train_args(outs[name], chat_data, *extra))
    # SP = 2 -> SP = 1 (data-parallel degree 2)
    outs["ddp-from-sp"] = tmp_path_factory.mktemp("ddp-from-sp")
    batch.add("ddp-from-sp", *train_args(outs["ddp-from-sp"], chat_data, *TWO, "--strategy", "ddp", "--resume",
                                         str(outs["ddp"] / "checkpoints" / "step_00000006"), "--no-save-final"),
              after="ddp")
    # the one-process reference trains in this process (tests/inproc/trainer.py); its 2-rank partners stay real
    single_packed = train(*train_args(outs["single-packed"], chat_data, *cases["single-packed"])[1:])
    return lambda name: single_packed if name == "single-packed" else Run(outs[name], batch.get(name).stdout)


def test_sp2_ddp_trains_like_one_process(sp_runs, single_ref):
    run = sp_runs("ddp")
    assert "Ulysses sequence parallel over groups of 2" in run.stdout
    assert "data-parallel degree 1" in run.stdout
    assert_same_run(run.metrics, single_ref.metrics)


def test_sp2_fsdp_packed_trains_like_one_process_packed(sp_runs):
    """Packed rows keep their document boundaries across the split (the mask comes from the
    gathered global positions); gradient checkpointing recomputes the exchanges. Sharp: with
    the document mask removed on purpose, the first 4 losses differ from the reference by
    1e-3 relative (50x the tolerance) and the gradient norms by 3%."""
    ref = sp_runs("single-packed").metrics
    assert max(r["grad_norm"] for r in ref) > MAX_GRAD_NORM
    assert_same_run(sp_runs("fsdp-packed").metrics, ref)


def test_sp2_ring_packed_trains_like_one_process_packed(sp_runs):
    """Ring attention (P2P key/value exchange, its own backward ring pass) with documents that
    straddle the two ranks' halves: same losses and gradient norms as one process."""
    run = sp_runs("ring-packed")
    assert "ring attention (by --sp-mode ring" in run.stdout and "ring sequence parallel over groups of 2" in run.stdout
    assert_same_run(run.metrics, sp_runs("single-packed").metrics)


def test_checkpoints_cross_sequence_parallel_degrees(sp_runs, single_ref):
    single = single_ref.metrics
    down = sp_runs("ddp-from-sp")
    assert [r["step"] for r in down.metrics] == list(range(7, STEPS + 1))
    torch.testing.assert_close(torch.tensor(down.losses), torch.tensor([r["loss"] for r in single[6:]]),
                               rtol=RTOL, atol=0)
    up = sp_runs("zero3-from-single")
    assert [r["step"] for r in up.metrics] == list(range(5, STEPS + 1))
    torch.testing.assert_close(torch.tensor(up.losses), torch.tensor([r["loss"] for r in single[4:]]),
                               rtol=RTOL, atol=0)


def test_bad_degrees_are_refused_before_launch(tmp_path, chat_data):
    """One line naming the flag and the model's numbers; nothing written."""
    out = tmp_path / "run"
    p = run_cli(*train_args(out, chat_data, "--strategy", "ddp", "--nproc-per-node", "2",
                            "--sequence-parallel", "3"), check=False, timeout=300)
    assert p.returncode != 0 and "sequence_parallel 3 must divide the 2 ranks" in p.stderr + p.stdout
    p = run_cli(*train_args(out, chat_data, "--strategy", "ddp", "--nproc-per-node", "8",
                            "--sequence-parallel", "8", "--sp-mode", "ulysses"), check=False, timeout=300)
    text = p.stderr + p.stdout
    assert p.returncode != 0 and "4 attention heads" in text and "--sequence-parallel 4" in text, text
    assert not out.exists()
