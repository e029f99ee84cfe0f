"""Validation loss during training, and keeping the best checkpoint.

The validation rows are split over the data-parallel ranks (rank r of W takes rows r, r + W,
...); every rank runs the same number of forward passes (a rank out of rows runs a batch
without loss tokens), because under FSDP and ZeRO-3 each forward is a collective. Each forward runs
through the strategy's wrapped model, under its autocast, with no_grad and in eval mode
(no dropout). The summed token losses and the loss-token counts are added over the ranks
with one all_reduce, so the result is the loss per loss token of the whole validation set,
whatever the number of ranks or the strategy: the same normalisation as training.

`--keep-best` writes checkpoints/best.json naming the checkpoint saved at the step with
the lowest validation loss so far; checkpoint rotation (keep_checkpoints) never deletes it.
"""

from __future__ import annotations

import json
import math
import os

import torch

from shardwise.data.batches import StepSampler
from shardwise.data.encode import IGNORE, Encoded
from shardwise.models.speed import token_loss_sum
from shardwise.train import checkpoint as ckpt
from shardwise.train import dist as sdist


class Evaluator:
    """`due(step)`, `run(...)` -> {'val_loss', 'val_tokens'} or {}; a no-op without a validation set."""

    def __init__(self, cfg, env, val_file: str, pad_id: int, total: int, out: str):
        self.cfg, self.env, self.total, self.out = cfg, env, total, out
        self.data = None
        self.last: tuple[int, float] | None = None  # (step, val_loss) of the newest evaluation
        self.best: tuple[int, float] | None = None
        if not val_file:
            return
        from safetensors.torch import load_file

        self.data = Encoded.from_tensors(load_file(val_file))
        # with sequence parallelism each rank of a group takes its slice of every row, as in training: the
        # attention expects one, and the summed loss and token count then add up over the group exactly once
        dims = getattr(env, "dims", None)
        sp, sp_rank = (dims.sp, dims.sp_rank) if dims is not None else (1, 0)
        self.collate = StepSampler(self.data, 1, 1, 1, 0, cfg.seed, pad_id, sp_degree=sp, sp_rank=sp_rank).collate
        best = ckpt.read_best(out)
        if best:  # a resumed run keeps the best so far
            self.best = (best["step"], best["val_loss"])

    def due(self, step: int) -> bool:
        if self.data is None:
            return False
        every = self.cfg.eval_every
        return step == self.total or (every > 0 and step % every == 0)

    @torch.no_grad()
    def run(self, model, strategy, step: int, fused_head=None) -> dict:
        if not self.due(step):
            return {}
        env, mbs = self.env, self.cfg.micro_batch_size
        dims = getattr(env, "dims", None)  # the data-parallel split (sequence/tensor peers read the same rows)
        dp_rank, dp_size = (dims.dp_rank, dims.dp_size) if dims is not None else (env.rank, env.world_size)
        rows = list(range(dp_rank, len(self.data), dp_size))
        per_rank = math.ceil(len(self.data) / dp_size)
        acc = torch.zeros(2, dtype=torch.float64, device=env.device)  # summed loss, loss tokens
        was_training = model.training
        model.eval()
        for i in range(0, per_rank, mbs):
            mine = rows[i:i + mbs]
            mb = self.collate(mine or [0])
            targets = mb.targets if mine else torch.full_like(mb.targets, IGNORE)
            ids, pos, tg = (t.to(env.device, non_blocking=True) for t in (mb.input_ids, mb.position_ids, targets))
            with strategy.autocast(), strategy.loss_parallel():
                if fused_head is not None:  # the head returns the summed loss (models/speed.py)
                    fused_head.loss_targets = tg
                    summed = model(input_ids=ids, position_ids=pos).logits
                    fused_head.loss_targets = None
                else:
                    summed = token_loss_sum(model(input_ids=ids, position_ids=pos).logits, tg)
            acc[0] += summed.double()
            acc[1] += (tg != IGNORE).sum()
        model.train(was_training)
        sdist.all_reduce(acc)
        if dims is not None:
            acc /= dims.tp  # the tensor-parallel ranks of a data-parallel rank compute the same loss: count it once
        loss, n = acc[0].item() / max(acc[1].item(), 1), int(acc[1].item())
        self.last = (step, loss)
        return {"val_loss": loss, "val_tokens": n}

    def keeping_best(self, save):
        """`save` (the loop's checkpoint writer) that also records the best checkpoint."""
        if self.data is None or not self.cfg.keep_best:
            return save

        def save_and_mark() -> str:
            path = save()
            if self.last and path.endswith(f"step_{self.last[0]:08d}") and \
                    (self.best is None or self.last[1] <= self.best[1]):
                self.best = self.last
                if self.env.is_main:
                    _write_json(os.path.join(ckpt.ckpt_root(self.out), ckpt.BEST),
                                {"step": self.last[0], "val_loss": self.last[1], "checkpoint": path})
                    ckpt.rotate(self.out, self.cfg.keep_checkpoints)  # the previous best is no longer kept for it
            return path

        return save_and_mark

    def summary(self) -> dict:
        if self.data is None:
            return {}
        out = {"final_val_loss": self.last[1] if self.last else None}
        if self.cfg.keep_best:
            best = ckpt.read_best(self.out)
            out.update(best_val_loss=best and best["val_loss"], best_checkpoint=best and best["checkpoint"])
        return out


def _write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=1)
    os.replace(tmp, path)
