"""The global gradient norm when gradients live on the host: a CPU run, or FSDP's CPU offload.

torch's `get_total_norm` is right for gradients on a GPU: one fused foreach kernel per device, and for DTensors a
partial-norm reduction over each mesh. On the host it costs more than the optimizer step it guards, and on a GPU
job it can fail:

- torch's CPU 2-norm of one tensor runs on one thread (torch 2.11 and 2.13): on the anchor job's fsdp-offload step
  the norm over the 1.14B host gradients took 455 ms of a 1.2 s step, longer than the fused AdamW that reads and
  writes four times as much (315 ms; the profiled step's operator table, docs/speed.md, "The levers"). The norms
  of a 2-D view's rows of 4,096 are spread over
  the threads, and each row is a short sum, so the result is also closer to a float64 reference: 7.6M values of
  mean 0.5, 8e-8 relative error of the square sum, against 5e-4 for torch's single reduction. Tensors under 1M
  values keep torch's foreach norm (SMALL, below).
- A DTensor whose shard lies on the host reduces its partial norm with a collective on a CPU tensor. Over an
  NCCL-only process group that is "No backend type associated with device type cpu" at the first clip, on every
  job of two or more GPUs (pytorch/pytorch#148532, meta-pytorch/torchtune#1977). Here the partial sums of squares
  are reduced as one scalar per mesh and shard layout, on the mesh's own device, and come back.

The semantics are DTensor's: a sharded gradient's pieces are summed over the mesh dimensions it is sharded on,
a replicated one is counted once. `host_grad_norm` returns None when no gradient is on the host, or one is a
DTensor with a pending (partial) reduction: the caller keeps torch's path there.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# Rows of this many elements: each row's norm is one thread's short sum, the rows spread over the threads.
ROW = 4096
# Smaller tensors go through torch's foreach norm in one call, one reduction each: the rows' few operators per
# tensor cost more than the threads save there (a 3.9M-parameter model: 0.6 ms a step more on one thread), and a
# reduction of up to 1M float32 values is off by about 1e-6 relative (the anchor's 65M-value embedding: 1e-3).
SMALL = 1 << 20


def _local(g: torch.Tensor) -> torch.Tensor:
    return g._local_tensor if hasattr(g, "device_mesh") else g


def square_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum of squares of one host tensor in float32, over the threads: the norms of the ROW-element rows of a 2-D
    view (plus the elements left over), then their squares summed (torch's sum is pairwise)."""
    if not t.is_contiguous():  # no copy of a strided gradient (FSDP2's shards are contiguous): its last dim's rows
        return torch.linalg.vector_norm(t, dim=-1 if t.dim() > 1 else None, dtype=torch.float32).square().sum()
    flat = t.view(-1)
    n = flat.numel()
    r = n // ROW
    if r < 2:
        return torch.linalg.vector_norm(flat, dtype=torch.float32).square()
    total = torch.linalg.vector_norm(flat[:r * ROW].view(r, ROW), dim=1, dtype=torch.float32).square().sum()
    if n > r * ROW:
        total = total + torch.linalg.vector_norm(flat[r * ROW:], dtype=torch.float32).square()
    return total


def _group_square_sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Sum of squares of local tensors (any devices) in float32, on the first tensor's device."""
    device = tensors[0].device
    parts = []
    by_device: dict = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    for dev, ts in by_device.items():
        if dev.type == "cpu":
            small = [t for t in ts if t.numel() < SMALL]
            if small:
                parts.append(torch.stack(torch._foreach_norm(small, dtype=torch.float32)).square().sum())
            parts.extend(square_sum(t) for t in ts if t.numel() >= SMALL)
        else:  # a GPU's share: torch's fused foreach norms
            parts.append(torch.stack(torch._foreach_norm(ts, dtype=torch.float32)).square().sum().to(device))
    return torch.stack([p.to(device) for p in parts]).sum()


def _layout(g: torch.Tensor):
    """(mesh, mesh dims the gradient is sharded on) for a DTensor, None for a plain tensor. Every placement but
    Replicate shards (partial ones never come here): Shard, and the _StridedShard FSDP2 puts on the data-parallel
    dimension of a weight tensor parallelism already split on the same dimension, whose is_shard() is False."""
    mesh = getattr(g, "device_mesh", None)
    if mesh is None:
        return None
    return mesh, tuple(i for i, p in enumerate(g.placements) if not p.is_replicate())


def host_grad_norm(grads: list[torch.Tensor]) -> torch.Tensor | None:
    """The global 2-norm of `grads` (plain tensors and DTensors) as a float32 scalar on the host, when any of them
    (or its local shard) is on the host; None when all are on accelerators. Every rank of each gradient's mesh must
    call it with the same layouts (it runs one all-reduce per mesh and layout, in the order the gradients first
    show them, which is the parameters' order)."""
    if not any(_local(g).device.type == "cpu" for g in grads):
        return None
    if any(p.is_partial() for g in grads for p in getattr(g, "placements", ())):
        return None  # a pending reduction: torch's DTensor path does it
    groups: dict = {}
    for g in grads:
        groups.setdefault(_layout(g), []).append(_local(g))
    total = torch.zeros((), dtype=torch.float32)
    for layout, tensors in groups.items():
        s = _group_square_sum(tensors)
        if layout is not None and layout[1]:
            mesh, dims = layout
            s = s.to(mesh.device_type)  # the collective on the mesh's device: NCCL takes no host tensor
            for d in dims:
                dist.all_reduce(s, group=mesh.get_group(d))
        total += s.to("cpu")
    return total.sqrt()


def scale_grads_(grads: list[torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    """Clip in place: every gradient times min(1, max_norm / (norm + 1e-6)), as torch's clip_grads_with_norm_, on
    the local tensors (a DTensor's shard shares its storage)."""
    coef = torch.clamp(max_norm / (norm.float() + 1e-6), max=1.0)
    by_device: dict = {}
    for g in grads:
        loc = _local(g)
        by_device.setdefault((loc.device, loc.dtype), []).append(loc)
    for (dev, _), ts in by_device.items():
        torch._foreach_mul_(ts, coef.to(dev))
