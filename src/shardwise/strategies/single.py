"""`single`: one process, no wrapping; or, with --tensor-parallel N, the N processes of one replica
(pure TP), times --sequence-parallel M when both are set: then the M sequence ranks hold other
tokens of the same rows, and their gradients are averaged before the step (the loop scales each
rank's loss by grad_size = M, as for the data-parallel strategies, which average by themselves)."""

import torch
import torch.distributed as dist

from shardwise.strategies.base import Strategy


class SingleStrategy(Strategy):
    name = "single"

    def step(self, model: torch.nn.Module, optimizer) -> torch.Tensor:
        if self.dims.grad_size > 1:
            average_gradients(model, self.dims.grad_group, self.dims.grad_size)
        return super().step(model, optimizer)


def average_gradients(model: torch.nn.Module, group, n: int) -> None:
    """Average every gradient over `group` (n ranks) in place; a DTensor's local shard, which the ranks of
    the group hold at the same place of the tensor-parallel mesh (gloo has no AVG: sum, then divide)."""
    for p in model.parameters():
        if p.grad is not None:
            local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            dist.all_reduce(local, group=group)
            local.div_(n)
