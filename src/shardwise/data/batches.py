"""Which rows each rank trains on at each step, and the padded micro-batch tensors.

A step consumes one global batch of G = micro_batch_size * grad_accum * world_size rows,
taken in order from a per-epoch permutation (seeded by seed + epoch). The rows are dealt by
length (`deal`) into world_size * grad_accum micro-batches of micro_batch_size rows with about
the same number of tokens each; rank r trains on micro-batches r * grad_accum and on. The data position is
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

Padding-free (--padding-free; `padding_free` below decides it): collate lays a micro-batch's rows one
after another in one row of shape (1, sum of lengths rounded up to a multiple of 8) instead of padding
each to the longest. Positions restart at each row's start, so the model's mask is block-diagonal
(transformers' find_packed_sequence_indices): the same rows, loss and gradients, no compute on padding.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from shardwise.config import Config
from shardwise.data.encode import IGNORE, Encoded
from shardwise.errors import ShardwiseError

# The transformers families (config.json's model_type) whose decoder builds its mask with create_causal_mask or
# create_sliding_window_causal_mask(..., position_ids=...) (transformers 5.x), which is block-diagonal where the
# positions restart, and which load with SDPA and no dropout by default: a flattened micro-batch trains as the
# padded one (tests/unit/test_padding_free.py builds each and compares the loss and gradients). Not hybrid,
# recurrent or linear-attention families (jamba, mamba, qwen3_next, ...): their state would run from one row into
# the next. gemma2 does not load with SDPA here; seed_oss has dropout by default (not compared).
PADDING_FREE_FAMILIES = ("llama", "mistral", "ministral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe",
                         "gemma", "gemma3_text", "phi", "phi3", "olmo", "olmo2", "olmo3", "granite", "cohere",
                         "cohere2", "starcoder2", "glm", "glm4", "smollm3", "helium", "arcee", "apertus", "exaone4",
                         "ernie4_5", "hunyuan_v1_dense")
PADDING_FREE_WHERE = "--padding-free on (key padding_free)"

# Under --padding-free auto a micro-batch is flattened only where that was measured to pay on the CPU
# (benchmarks/padding_free_step.py, one thread, the 3.9M Qwen2 shape; docs/data.md): the flattened row's
# dense mask costs (sum of lengths)^2 where the padded batch's causal kernel costs rows x width^2, so flattening
# won at up to ~1,000 tokens (0.74-0.80 of the padded step) and lost from ~1,500 (up to 2.8x, long rows with little
# padding). So: at most AUTO_FLAT_MAX tokens, and only when it drops at least AUTO_FLAT_SAVING of the token slots.
AUTO_FLAT_MAX = 1024
AUTO_FLAT_SAVING = 0.1


def check_padding_free_family(cfg: Config, model_type, where: str = PADDING_FREE_WHERE) -> None:
    """Refuse --padding-free on for a model family not in PADDING_FREE_FAMILIES (`model_type` from its
    config.json; the built-in tiny model is llama)."""
    if cfg.padding_free == "on" and model_type not in PADDING_FREE_FAMILIES:
        raise ShardwiseError(f"{where}: a flattened micro-batch keeps its rows apart only in model families whose "
                             f"attention mask restarts with the positions ({', '.join(PADDING_FREE_FAMILIES)}), not "
                             f"the model's '{model_type}' (model_type in its config.json); use --padding-free auto "
                             "or off")


def padding_free(cfg: Config, model_type, sp: int = 1, tp: int = 1, cuda: bool = False) -> bool:
    """Whether collate flattens each micro-batch (--padding-free), for this run's model family (`model_type`), its
    sequence- and tensor-parallel degrees (those --strategy auto may have chosen) and whether it trains on CUDA.
    off: never. on: every micro-batch, wherever it is correct, else a ShardwiseError. auto: on the CPU (on a GPU,
    SDPA with a dense mask leaves the flash kernel; not measured) with more than one row per micro-batch, and then
    only the micro-batches where it pays (flattening_pays: the sampler's flat_when_it_pays)."""
    if cfg.padding_free == "off":
        return False
    # task dpo sums each row's log-probabilities over the padded (B, L) layout (train/objective.py)
    correct = not cfg.packing and sp == 1 and tp == 1 and getattr(cfg, "task", "sft") == "sft"
    if cfg.padding_free == "on":
        if not correct:
            raise ShardwiseError(f"{PADDING_FREE_WHERE}: a flattened micro-batch is not built with packing, sequence "
                                 f"or tensor parallelism (this run: packing {cfg.packing}, sequence parallel {sp}, "
                                 f"tensor parallel {tp}); use --padding-free auto or off")
        check_padding_free_family(cfg, model_type)
        return True
    return correct and model_type in PADDING_FREE_FAMILIES and not cuda and cfg.micro_batch_size > 1


def flattening_pays(lengths: list[int], width: int) -> bool:
    """Whether one flattened row beats rows padded to `width` on the CPU (AUTO_FLAT_MAX, AUTO_FLAT_SAVING)."""
    flat = -(-sum(lengths) // 8) * 8
    return flat <= AUTO_FLAT_MAX and flat <= (1 - AUTO_FLAT_SAVING) * len(lengths) * width


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
    rows: list[int] | None = None  # the dataset rows, in the batch's order (task dpo: chosen rows, then rejected)


@dataclass
class StepBatch:
    micro: list[MicroBatch]
    loss_tokens: int  # over the whole global batch (all ranks, all micro-batches)
    tokens: int  # real (non-padding) input tokens over the whole global batch
    rows: list[int]  # global batch row ids, in order
    units: int = 0  # examples in the global batch: rows, or with pairs (task dpo) preference pairs


class StepSampler:
    def __init__(self, data: Encoded, micro_batch_size: int, grad_accum: int, world_size: int, rank: int,
                 seed: int, pad_id: int, sp_degree: int = 1, sp_rank: int = 0, padding_free: bool = False,
                 flat_when_it_pays: bool = False, pairs: bool = False):
        self.data, self.mbs, self.accum, self.world, self.rank = data, micro_batch_size, grad_accum, world_size, rank
        self.seed, self.pad_id = seed, pad_id
        self.sp_degree, self.sp_rank = sp_degree, sp_rank
        if padding_free and sp_degree > 1:
            raise ShardwiseError("padding-free micro-batches are not built with sequence parallelism")
        self.padding_free = padding_free
        self.flat_when_it_pays = flat_when_it_pays  # --padding-free auto: only micro-batches that gain (flattens)
        # the unit of shuffling, dealing and batch sizes: one row, or with `pairs` (task dpo) rows 2u and 2u + 1, a
        # prompt's chosen and rejected answer, which always share a micro-batch
        self.group = 2 if pairs else 1
        self.units = len(data) // self.group
        self.global_batch = micro_batch_size * grad_accum * world_size
        what = "preference pairs" if pairs else "sequences"
        if self.units < self.global_batch:
            raise ShardwiseError(
                f"the dataset has {self.units} {what}, fewer than one global batch of {self.global_batch} "
                f"(micro_batch_size {micro_batch_size} x grad_accum {grad_accum} x {world_size} ranks); "
                "lower --micro-batch-size or --grad-accum, or add data")
        self.lengths = [len(r) for r in data.input_ids]
        self.unit_len = [sum(self.lengths[u * self.group: (u + 1) * self.group]) for u in range(self.units)]
        self.loss_counts = [sum(t != IGNORE for t in r) for r in data.targets]
        self._orders: dict[int, list[int]] = {}

    @property
    def steps_per_epoch(self) -> int:
        return self.units // self.global_batch

    def order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._orders = {epoch: torch.randperm(self.units, generator=g).tolist()}
        return self._orders[epoch]

    def next(self, pos: DataPosition) -> tuple[StepBatch, DataPosition]:
        """The batch for the step at `pos`, and the position after it (the last partial
        global batch of an epoch is dropped)."""
        if pos.offset + self.global_batch > self.units:
            pos = DataPosition(pos.epoch + 1, 0)
        units = self.order(pos.epoch)[pos.offset: pos.offset + self.global_batch]
        micro = [self.collate(self.rows_of(m))
                 for m in self.deal(units)[self.rank * self.accum:(self.rank + 1) * self.accum]]
        rows = self.rows_of(units)
        batch = StepBatch(micro, sum(self.loss_counts[r] for r in rows), sum(self.lengths[r] for r in rows), rows,
                          len(units))
        return batch, DataPosition(pos.epoch, pos.offset + self.global_batch)

    def rows_of(self, units: list[int]) -> list[int]:
        """The rows of `units`: the units themselves, or with pairs every chosen row, then every rejected row."""
        return [u * self.group + k for k in range(self.group) for u in units]

    def deal(self, rows: list[int]) -> list[list[int]]:
        """The global batch `rows` dealt into world_size * grad_accum micro-batches of micro_batch_size rows with
        about the same number of tokens each: longest first, each row to the micro-batch with the fewest tokens so
        far that still has room (ties to the lower index); each micro-batch's rows longest first. Rank r trains on
        micro-batches r * grad_accum to (r + 1) * grad_accum - 1.

        Why: a data-parallel step ends with the gradient all-reduce, which waits for the rank with the most work.
        Contiguous slices of a shuffled batch of rows of uneven length leave one rank idle for part of every step
        (the tiny CPU job, rows of 20-98 tokens: the busier of two ranks had 9% more tokens than the mean on
        average, 1.4% dealt like this). The update is the same: each micro-batch's summed loss is divided by the
        whole global batch's loss tokens (loop.forward_backward_step), so which rank computes a row changes only the
        order of a sum. The micro-batches depend only on how many there are, so 2 ranks train on exactly the
        micro-batches of one process with twice the accumulation, even where a micro-batch adds a term of its own
        (a mixture-of-experts router's load-balancing loss). Every rank deals the same rows from the same lengths,
        so no collective is needed, and a run resumed on another number of ranks reads the same global batches."""
        slots = self.world * self.accum
        dealt, tokens = [[] for _ in range(slots)], [0] * slots
        for r in sorted(rows, key=lambda r: -self.unit_len[r]):  # stable: equal lengths keep the batch's order
            k = min((k for k in range(slots) if len(dealt[k]) < self.mbs), key=lambda k: tokens[k])
            dealt[k].append(r)
            tokens[k] += self.unit_len[r]
        return dealt

    def collate(self, rows: list[int]) -> MicroBatch:
        longest = max(self.lengths[r] for r in rows)
        unit = 8 * self.sp_degree  # a multiple of 8 keeps matmul shapes friendly, on every slice
        width = -(-longest // unit) * unit
        if self.padding_free and (not self.flat_when_it_pays or flattening_pays(
                [self.lengths[r] for r in rows], width)):
            return self.flat(rows)
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
        return MicroBatch(ids, tg, pos, rows)

    def flat(self, rows: list[int]) -> MicroBatch:
        """The rows one after another in one row (1, W), W their total length rounded up to a multiple of 8; each
        row's positions start where its own do, so the model's mask keeps the rows apart."""
        total = sum(self.lengths[r] for r in rows)
        width = -(-total // 8) * 8
        ids = torch.full((1, width), self.pad_id, dtype=torch.int64)
        tg = torch.full((1, width), IGNORE, dtype=torch.int64)
        pos = torch.empty((1, width), dtype=torch.int64)
        at = 0
        for r in rows:
            n = self.lengths[r]
            ids[0, at:at + n] = torch.tensor(self.data.input_ids[r])
            tg[0, at:at + n] = torch.tensor(self.data.targets[r])
            pos[0, at:at + n] = torch.tensor(self.data.position_ids[r])
            at += n
        # the padding continues the last row's positions, as in collate: after all its tokens, seen by none
        pos[0, at:] = pos[0, at - 1] + 1 + torch.arange(width - at)
        return MicroBatch(ids, tg, pos)
