"""Which rows each rank trains on at each step, and the padded micro-batch tensors.

A step consumes one global batch of G = micro_batch_size * grad_accum * world_size rows,
taken in order from a per-epoch permutation (seeded by seed + epoch). Rank r gets the r-th
contiguous slice of it, split into grad_accum micro-batches. The data position is
(epoch, rows of this epoch consumed), which does not depend on the world size, so a run
resumed on another number of ranks neither repeats nor skips a row within the epoch.
Every rank holds the whole (tokenized) dataset, so each can count the global batch's loss
tokens itself; no collective is needed to normalise the loss.

With sequence parallelism of degree N, `world_size` and `rank` are the data-parallel
degree and rank: the N ranks of one sequence-parallel group get the same rows, and collate
gives each its contiguous 1/N of every sequence (the width padded to a multiple of 8 N).
Targets were shifted before the split (data/encode.py), so a slice's last token predicts
the next slice's first, and positions are global, so rotary embeddings and the document
mask see the whole sequence (models/sequence_parallel.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from shardwise.data.encode import IGNORE, Encoded
from shardwise.errors import ShardwiseError


@dataclass
class DataPosition:
    epoch: int = 0
    offset: int = 0  # rows of this epoch's order already consumed

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # (B, L) int64
    targets: torch.Tensor  # (B, L) int64, IGNORE where no loss
    position_ids: torch.Tensor  # (B, L) int64


@dataclass
class StepBatch:
    micro: list[MicroBatch]
    loss_tokens: int  # over the whole global batch (all ranks, all micro-batches)
    tokens: int  # real (non-padding) input tokens over the whole global batch
    rows: list[int]  # global batch row ids, in order


class StepSampler:
    def __init__(self, data: Encoded, micro_batch_size: int, grad_accum: int, world_size: int, rank: int,
                 seed: int, pad_id: int, sp_degree: int = 1, sp_rank: int = 0):
        self.data, self.mbs, self.accum, self.world, self.rank = data, micro_batch_size, grad_accum, world_size, rank
        self.seed, self.pad_id = seed, pad_id
        self.sp_degree, self.sp_rank = sp_degree, sp_rank
        self.global_batch = micro_batch_size * grad_accum * world_size
        if len(data) < self.global_batch:
            raise ShardwiseError(
                f"the dataset has {len(data)} sequences, fewer than one global batch of {self.global_batch} "
                f"(micro_batch_size {micro_batch_size} x grad_accum {grad_accum} x {world_size} ranks); "
                "lower --micro-batch-size or --grad-accum, or add data")
        self.lengths = [len(r) for r in data.input_ids]
        self.loss_counts = [sum(t != IGNORE for t in r) for r in data.targets]
        self._orders: dict[int, list[int]] = {}

    @property
    def steps_per_epoch(self) -> int:
        return len(self.data) // self.global_batch

    def order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._orders = {epoch: torch.randperm(len(self.data), generator=g).tolist()}
        return self._orders[epoch]

    def next(self, pos: DataPosition) -> tuple[StepBatch, DataPosition]:
        """The batch for the step at `pos`, and the position after it (the last partial
        global batch of an epoch is dropped)."""
        if pos.offset + self.global_batch > len(self.data):
            pos = DataPosition(pos.epoch + 1, 0)
        rows = self.order(pos.epoch)[pos.offset: pos.offset + self.global_batch]
        per_rank = self.mbs * self.accum
        mine = rows[self.rank * per_rank: (self.rank + 1) * per_rank]
        micro = [self.collate(mine[i * self.mbs: (i + 1) * self.mbs]) for i in range(self.accum)]
        batch = StepBatch(micro, sum(self.loss_counts[r] for r in rows), sum(self.lengths[r] for r in rows), rows)
        return batch, DataPosition(pos.epoch, pos.offset + self.global_batch)

    def collate(self, rows: list[int]) -> MicroBatch:
        longest = max(self.lengths[r] for r in rows)
        unit = 8 * self.sp_degree  # a multiple of 8 keeps matmul shapes friendly, on every slice
        width = -(-longest // unit) * unit
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.int64)
        tg = torch.full((len(rows), width), IGNORE, dtype=torch.int64)
        pos = torch.arange(width, dtype=torch.int64).repeat(len(rows), 1)
        for i, r in enumerate(rows):
            n = self.lengths[r]
            ids[i, :n] = torch.tensor(self.data.input_ids[r])
            tg[i, :n] = torch.tensor(self.data.targets[r])
            p = torch.tensor(self.data.position_ids[r])
            pos[i, :n] = p
            # padding continues the last example's positions: it sits after every real
            # token, so causal attention keeps it invisible to them
            pos[i, n:] = p[-1] + 1 + torch.arange(width - n)
        if self.sp_degree > 1:
            part = slice(self.sp_rank * width // self.sp_degree, (self.sp_rank + 1) * width // self.sp_degree)
            ids, tg, pos = ids[:, part].contiguous(), tg[:, part].contiguous(), pos[:, part].contiguous()
        return MicroBatch(ids, tg, pos)
