"""Checkpointed block inputs kept in host memory (`--activation-checkpointing offload`).

Under full checkpointing a block keeps only its input for backward; at long lengths those inputs, one residual
stream per block, are most of what the device holds at the end of forward (32 x S x h x 2 bytes: 32 GiB for the
Llama-3.1-8B shape at 128K tokens). Here each block runs under torch's non-reentrant `checkpoint`, and the one tensor
that checkpoint saves outside its own recompute machinery (the block input, through `saved_tensors_hooks`: checkpoint
saves its inputs before it installs its own hooks) is packed into host memory instead:

- forward: the copy out runs on a side stream (pinned host memory on CUDA), after the main stream's work that made the
  input; the device tensor is marked as used by the side stream (`record_stream`) and let go at once, so the caching
  allocator reuses its memory as soon as the copy has run on the GPU, however far ahead the host has queued work;
- backward: blocks run backward last to first, so when block k unpacks its input (its recompute starts), the copy
  back of block k-1's input starts on the side stream, and runs under block k's recompute and backward: one block
  ahead, two block inputs on the device at a time.

Everything else the block saves stays in checkpoint's own hands (recomputed in backward), so the numerics are the
ones of plain full checkpointing: the same forward, the same recompute, the same gradients. On the CPU the host copy
is a second CPU tensor (the same code path without streams), which is what the parity tests run.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch
from torch import nn


class _Packed:
    """One block input in host memory; `back` is its prefetched device copy once the prefetch started."""

    __slots__ = ("host", "device", "out_done", "back", "back_done", "index", "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.device, out_done, index: int):
        self.host, self.device, self.out_done, self.index = host, device, out_done, index
        self.back = None
        self.back_done = None


class HostCheckpoints:
    """The host store of one model's checkpointed block inputs, shared by its blocks (in forward order)."""

    def __init__(self):
        self.entries: list[weakref.ref] = []  # this forward's packed inputs, in block order
        self.stream = None
        self.target: torch.Tensor | None = None  # the input the running block's checkpoint is about to save
        self.copies_out = 0
        self.copies_in = 0
        self.prefetched = 0
        self.host_bytes = 0  # host bytes alive now, and the most at once
        self.peak_host_bytes = 0

    # ------------------------------------------------------------------ forward: device -> host
    def _side(self, device: torch.device):
        if self.stream is None:
            self.stream = torch.cuda.Stream(device)
        return self.stream

    def pack(self, t: torch.Tensor):
        if t is not self.target:  # anything else checkpoint saves outside its recompute stays where it is
            return t
        self.target = None
        if not any(r() is not None for r in self.entries):  # a new forward: the last one's inputs are all used
            self.entries = []
        if t.device.type == "cuda":
            side = self._side(t.device)
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            side.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(side):
                host.copy_(t.detach(), non_blocking=True)
                done = torch.cuda.Event()
                done.record(side)
            t.record_stream(side)  # its memory waits for the copy, not for this reference
        else:
            host, done = t.detach().clone(), None
        packed = _Packed(host, t.device, done, len(self.entries))
        nbytes = host.numel() * host.element_size()
        self.host_bytes += nbytes
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
        weakref.finalize(packed, self._freed, nbytes)
        self.entries.append(weakref.ref(packed))
        self.copies_out += 1
        return packed

    def _freed(self, nbytes: int) -> None:
        self.host_bytes -= nbytes

    # ------------------------------------------------------------------ backward: host -> device, one block ahead
    def _fetch(self, p: _Packed) -> None:
        """Start the copy back of `p` on the side stream (CUDA), into memory of the main stream's pool."""
        main = torch.cuda.current_stream(p.device)
        side = self._side(p.device)
        p.back = torch.empty(p.host.shape, dtype=p.host.dtype, device=p.device)
        side.wait_stream(main)  # the memory p.back reuses may still be read by queued main-stream work
        if p.out_done is not None:
            side.wait_event(p.out_done)
        with torch.cuda.stream(side):
            p.back.copy_(p.host, non_blocking=True)
            p.back_done = torch.cuda.Event()
            p.back_done.record(side)

    def unpack(self, p):
        if not isinstance(p, _Packed):
            return p
        self.copies_in += 1
        if p.device.type != "cuda":
            out = p.host.clone()
        else:
            if p.back is None:
                self._fetch(p)
            else:
                self.prefetched += 1
            torch.cuda.current_stream(p.device).wait_event(p.back_done)
            out, p.back, p.back_done = p.back, None, None
        if p.index > 0 and p.index <= len(self.entries):
            prev = self.entries[p.index - 1]()
            if prev is not None and prev.device.type == "cuda" and prev.back is None:
                self._fetch(prev)
        return out

    @contextmanager
    def saving(self, block_input: torch.Tensor):
        """The hooks around one block's checkpoint call, packing `block_input` when checkpoint saves it."""
        self.target = block_input
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield
        finally:
            self.target = None


def offload_block(block: nn.Module, store: HostCheckpoints) -> None:
    """Make `block.forward` a full non-reentrant checkpoint whose saved input lives in `store` (parameters and their
    names untouched). The checkpointed function is `block.checkpointed_forward`, which compile replaces by its
    compiled form (models/speed.py compile_blocks): the hooks stay outside the traced graph."""
    from torch.utils.checkpoint import checkpoint

    block.checkpointed_forward = block.forward

    @torch.compiler.disable
    def offloaded_forward(*args, **kwargs):
        if "hidden_states" in kwargs and not args:  # checkpoint keeps keyword arguments in its closure, not saved
            args = (kwargs.pop("hidden_states"),)
        if not torch.is_grad_enabled() or not args or not isinstance(args[0], torch.Tensor):
            return block.checkpointed_forward(*args, **kwargs)
        with store.saving(args[0]):
            return checkpoint(block.checkpointed_forward, *args, use_reentrant=False, **kwargs)

    block.forward = offloaded_forward
    block.host_checkpoints = store


def offload_blocks(blocks: list[nn.Module]) -> HostCheckpoints:
    store = HostCheckpoints()
    for block in blocks:
        offload_block(block, store)
    return store
