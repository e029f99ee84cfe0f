"""`memory_snapshot: N`: the CUDA caching allocator's history (every allocation and free, with its Python stack)
over the first N optimizer steps of a launch (a resumed run's first N after its resume), written as torch's own snapshot format to output_dir/memory/rankR.pickle, which
https://pytorch.org/memory_viz draws: what was alive at the peak and which line made it. Written after step N, or
when the loop ends before that (out of memory: what filled the device then; a stop, or fewer steps left). Recording costs host time on every
allocation, so it stops once written. CUDA only (the launch refuses it on the CPU: launch/preflight.py)."""

from __future__ import annotations

import os
import sys

import torch

MAX_ENTRIES = 1_000_000  # allocations and frees kept (torch's ring buffer): several steps of a long-context run
# torch releases whose compiled autograd functions fail inside an activation-checkpointed region while the allocator
# records its history (pytorch/pytorch#179536: "apply of FunctionMeta returned NULL without setting an exception")
BROKEN_UNDER_CHECKPOINTED_COMPILE = (2, 11)


def refusal(compiled: bool, checkpointing: str, torch_version: str = torch.__version__) -> str | None:
    """Why this run cannot record its allocator history, or None: on the torch releases of
    BROKEN_UNDER_CHECKPOINTED_COMPILE onwards, compiled blocks under activation checkpointing (any mode) fail their
    first backward while the history is recorded, so the run would end at its first step."""
    from torch.torch_version import TorchVersion

    if not compiled or checkpointing == "off" or TorchVersion(torch_version) < BROKEN_UNDER_CHECKPOINTED_COMPILE:
        return None
    return (f"torch {torch_version} fails the first backward of compiled blocks under activation checkpointing "
            f"({checkpointing}) while the allocator's history is recorded (pytorch/pytorch#179536); record the "
            "snapshot with --compile off (the eager step's memory), or without checkpointing")


class MemorySnapshot:
    def __init__(self, steps: int, out: str, rank: int, device: torch.device):
        from shardwise.rundir import MEMORY

        self.steps = steps if device.type == "cuda" else 0
        self.ran, self.rank = 0, rank
        self.path = os.path.join(out, MEMORY, f"rank{rank}.pickle")  # rundir.MEMORY_FILE: cleared with the run
        if self.steps:
            torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, context="all", stacks="python")

    def after_step(self) -> None:
        """Once this launch's step N has run: the history written, and said."""
        if self.steps:
            self.ran += 1
            if self.ran >= self.steps:
                self.write(f"of this launch's first {self.steps} step(s)")

    def close(self) -> None:
        """The loop ends (its steps done, a stop, an error such as running out of memory) before step N: the
        history recorded so far, written, so that a launch shorter than N steps still leaves one."""
        if not self.steps:
            return
        try:
            self.write(f"of this launch up to where its loop ended ({self.ran} step(s) done)")
        except Exception:  # never in place of the error that ended the loop
            torch.cuda.memory._record_memory_history(enabled=None)
            self.steps = 0

    def write(self, what: str) -> None:
        """Write the history and stop recording; every rank says where its own went, on stderr (the run's
        reporter speaks for rank 0 only)."""
        from shardwise.rundir import atomic_path

        torch.cuda.synchronize()  # the frees the stream still owes are in the history
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with atomic_path(self.path, ".pickle") as tmp:
            torch.cuda.memory._dump_snapshot(tmp)
        torch.cuda.memory._record_memory_history(enabled=None)
        self.steps = 0
        print(f"shardwise: rank {self.rank}: the CUDA allocator's history {what} is in {self.path} "
              "(pytorch.org/memory_viz)", file=sys.stderr, flush=True)
