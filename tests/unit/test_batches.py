import pytest
import torch

from shardwise.data.batches import DataPosition, StepSampler
from shardwise.data.encode import IGNORE, Encoded
from shardwise.errors import ShardwiseError


def dataset(n=40):
    ids = [[5] * (3 + i % 7) for i in range(n)]
    tg = [[IGNORE] * (len(r) - 1 - i % 2) + [7] * (1 + i % 2) for i, r in enumerate(ids)]
    return Encoded(ids, tg, [list(range(len(r))) for r in ids], [""] * n)


def rows_of_step(data, world, mbs, accum, pos):
    """Rows each rank gets, via the padded tensors' lengths (so collate is exercised)."""
    out = []
    for rank in range(world):
        s = StepSampler(data, mbs, accum, world, rank, seed=3, pad_id=0)
        batch, nxt = s.next(pos)
        assert len(batch.micro) == accum and all(mb.input_ids.shape[0] == mbs for mb in batch.micro)
        out.append(batch)
    return out, nxt


def test_ranks_split_the_global_batch_disjointly_and_agree_on_counts():
    data = dataset()
    batches, nxt = rows_of_step(data, world=2, mbs=2, accum=3, pos=DataPosition())
    assert batches[0].rows == batches[1].rows and len(set(batches[0].rows)) == 12
    assert batches[0].loss_tokens == sum(sum(t != IGNORE for t in data.targets[r]) for r in batches[0].rows)
    # the global batch of 2 ranks is the same rows as one process with twice the accumulation
    single, _ = rows_of_step(data, world=1, mbs=2, accum=6, pos=DataPosition())
    assert single[0].rows == batches[0].rows and single[0].loss_tokens == batches[0].loss_tokens
    assert nxt == DataPosition(0, 12)


def test_padding_is_ignored_and_positions_continue():
    data = dataset()
    s = StepSampler(data, 4, 1, 1, 0, seed=0, pad_id=0)
    mb = s.collate([0, 6])
    assert mb.input_ids.shape[1] % 8 == 0
    assert (mb.targets[0, len(data.input_ids[0]):] == IGNORE).all()
    assert mb.position_ids[0].tolist() == list(range(mb.input_ids.shape[1]))


def test_epochs_roll_over_with_a_new_order_and_drop_the_partial_batch():
    data = dataset(40)
    s = StepSampler(data, 4, 1, 2, 0, seed=1, pad_id=0)
    assert s.steps_per_epoch == 5
    pos, seen = DataPosition(), []
    for _ in range(5):
        b, pos = s.next(pos)
        seen += b.rows
    assert sorted(seen) == list(range(40)) and pos == DataPosition(0, 40)
    b, pos = s.next(pos)
    assert pos == DataPosition(1, 8) and b.rows != seen[:8]


def test_position_is_world_size_independent():
    """Resuming on another world size continues at the same row of the same epoch."""
    data = dataset(48)
    two = StepSampler(data, 2, 1, 2, 0, seed=5, pad_id=0)
    one = StepSampler(data, 2, 1, 1, 0, seed=5, pad_id=0)
    pos, rows = DataPosition(), []
    for _ in range(3):
        b, pos = two.next(pos)
        rows += b.rows
    for _ in range(3):
        b, pos = one.next(pos)
        rows += b.rows
    assert len(rows) == len(set(rows)) == 18 and rows == two.order(0)[:18]


def test_too_little_data_for_one_global_batch():
    with pytest.raises(ShardwiseError, match="fewer than one global batch of 64"):
        StepSampler(dataset(10), 8, 4, 2, 0, seed=0, pad_id=0)


def test_sequence_parallel_ranks_share_rows_and_split_each_sequence():
    """SP degree 2 on 4 ranks: data-parallel degree 2; the two SP ranks of a group get the
    same rows and, side by side, exactly the unsplit micro-batch (targets shifted before
    the split, positions global), padded to a multiple of 16."""
    data = dataset()
    whole = StepSampler(data, 2, 1, 2, 1, seed=3, pad_id=0)
    parts = [StepSampler(data, 2, 1, 2, 1, seed=3, pad_id=0, sp_degree=2, sp_rank=r) for r in range(2)]
    (ref, _), (a, _), (b, _) = (s.next(DataPosition()) for s in (whole, *parts))
    assert a.rows == b.rows == ref.rows and a.loss_tokens == ref.loss_tokens
    for key in ("input_ids", "targets", "position_ids"):
        left, right = getattr(a.micro[0], key), getattr(b.micro[0], key)
        assert left.shape == right.shape and left.shape[1] * 2 % 16 == 0
        joined = torch.cat([left, right], dim=1)
        want = getattr(ref.micro[0], key)
        assert torch.equal(joined[:, :want.shape[1]], want), key
        if key == "targets":
            assert (joined[:, want.shape[1]:] == IGNORE).all()


def test_micro_batches_get_about_the_same_tokens_every_row_once_longest_first():
    """The global batch is dealt by length into world x accum micro-batches: each within one row's length of the
    others' tokens, so each rank's total within accum rows' lengths, where the contiguous slices of the same rows
    were far apart; each micro-batch's rows longest first. The micro-batches depend only on how many there are."""
    lengths = [90, 88, 85, 80, 12, 10, 9, 8, 60, 5, 40, 30]  # a batch of 12: halves of 463 and 148 tokens in order
    ids = [[5] * n for n in lengths]
    data = Encoded(ids, [[7] * n for n in lengths], [list(range(n)) for n in lengths], [""] * len(lengths))
    rows = list(range(12))
    for world, mbs, accum in ((2, 3, 2), (3, 2, 2), (4, 3, 1), (1, 2, 6)):
        dealt = StepSampler(data, mbs, accum, world, 0, seed=0, pad_id=0).deal(rows)
        assert sorted(sum(dealt, [])) == rows and len(dealt) == world * accum and all(len(d) == mbs for d in dealt)
        slot = [sum(lengths[r] for r in d) for d in dealt]
        assert max(slot) - min(slot) <= max(lengths), slot
        per_rank = [sum(slot[k * accum:(k + 1) * accum]) for k in range(world)]
        contiguous = [sum(lengths[r] for r in rows[k * mbs * accum:(k + 1) * mbs * accum]) for k in range(world)]
        if world > 1:
            assert max(per_rank) - min(per_rank) <= accum * max(lengths) and max(per_rank) < max(contiguous)
        for d in dealt:
            assert [lengths[r] for r in d] == sorted((lengths[r] for r in d), reverse=True)
    # 2 ranks x 2 micro-batches and 1 rank x 4: the same micro-batches
    two = StepSampler(data, 3, 2, 2, 0, seed=0, pad_id=0).deal(rows)
    assert StepSampler(data, 3, 4, 1, 0, seed=0, pad_id=0).deal(rows) == two
    # what each rank trains on at a step is its micro-batches, in order
    for rank in range(2):
        s = StepSampler(data, 3, 2, 2, rank, seed=0, pad_id=0)
        got = [[int((row != 0).sum()) for row in mb.input_ids] for mb in s.next(DataPosition())[0].micro]
        mine = s.deal(s.order(0)[:12])[rank * 2:rank * 2 + 2]
        assert got == [[lengths[r] for r in m] for m in mine]


def test_the_dealt_batch_trains_as_one_process_on_the_whole_batch():
    """Dealing changes which rank computes a row, not the update: the gradient summed over ranks (each micro-batch's
    summed loss over the global batch's loss tokens, as loop.forward_backward_step) equals one process's over the
    whole global batch, for a real (tiny, Llama-shaped) model. A control shows the comparison can fail."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardwise.models.tiny import TINY_CONFIG

    lengths = [30, 7, 25, 9, 18, 11, 4, 28]
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(3, 200, (n,), generator=g).tolist() for n in lengths]
    data = Encoded(ids, [r[1:] + [IGNORE] for r in ids], [list(range(n)) for n in lengths], [""] * len(lengths))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY_CONFIG))

    def grads(world):
        model.zero_grad()
        for rank in range(world):
            batch, _ = StepSampler(data, 4 // world, 2, world, rank, seed=1, pad_id=0).next(DataPosition())
            for mb in batch.micro:
                logits = model(input_ids=mb.input_ids, position_ids=mb.position_ids).logits.float()
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), mb.targets.flatten(),
                                                         ignore_index=IGNORE, reduction="sum")
                (loss / batch.loss_tokens).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    one, two = grads(1), grads(2)
    torch.testing.assert_close(two, one, rtol=1e-4, atol=1e-6)
    assert not torch.allclose(two * 1.01, one, rtol=1e-4, atol=1e-6)  # control: a 1% change is seen
