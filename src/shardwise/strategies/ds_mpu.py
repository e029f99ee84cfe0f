"""DeepSpeed's process groups, taken from the run's one device mesh (strategies/parallel.py).

`deepspeed.initialize(mpu=...)` is how DeepSpeed receives a framework's groups: it asks this object
for them instead of making its own (without one it clones the world group for data parallelism).
What DeepSpeed asks, and what changes with the answer:

- data parallel (`get_data_parallel_group`, `_world_size`, `_rank`): the group it broadcasts the
  initial weights over, reduces (ZeRO-2: reduce-scatters) gradients over and averages them by, ZeRO's
  partitioning group (optimizer states, gradients, and at stage 3 the parameters), the group the
  gradient norm and the overflow check are all-reduced over, and the world size the batch size is
  checked against. Ours is `grad_group`: the data-parallel ranks and the sequence-parallel ones
  (each holds other tokens of the same rows), `grad_size` ranks, the count `ds_config` writes into
  `train_batch_size`.
- model parallel (`get_model_parallel_group`, `_world_size`, `_rank`, and the `tensor_model_parallel`
  names, which DeepSpeed prefers where both exist): the tensor-parallel group. ZeRO sums the squared
  gradient norm over it too, counting a parameter that is not split over it on its rank 0 only; with
  tp = 1 (DeepSpeed composes with no tensor parallelism) it is this rank alone, so no all-reduce runs
  and every parameter counts, as without an mpu. Checkpoint file names would read its rank (0).

No sequence-parallel methods: DeepSpeed reads `get_sequence_parallel_world_size` as its own Ulysses
layout and then divides the summed gradients by dp instead of dp x sp (runtime/zero/stage_1_and_2.py
and stage3.py, `/ float(self.sequence_parallel_size)`), and sizes the batch by dp alone. The loop
scales each rank's loss by grad_size and expects a mean over those ranks (train/loop.py
forward_backward_step), so to DeepSpeed every gradient rank is a data-parallel rank. No pipeline
methods: DeepSpeed takes a missing one as degree 1.
"""

from __future__ import annotations

import torch.distributed as dist


class MeshGroups:
    """The `mpu` handed to DeepSpeed: every group is one the mesh already holds (dims), none new."""

    def __init__(self, dims):
        self.dims = dims

    # -- data parallel: every rank gradients are averaged over --------------------------------
    def get_data_parallel_group(self):
        return self.dims.grad_group

    def get_data_parallel_world_size(self) -> int:
        return self.dims.grad_size

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank(group=self.dims.grad_group)

    # -- model parallel: the tensor-parallel ranks (no pipeline) ------------------------------
    def get_model_parallel_group(self):
        return self.dims.tp_group

    def get_model_parallel_world_size(self) -> int:
        return self.dims.tp

    def get_model_parallel_rank(self) -> int:
        return self.dims.tp_rank

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_rank = get_model_parallel_rank
