"""`memory_snapshot: N`: the CUDA caching allocator's history (every allocation and free, with its Python stack)
over the first N optimizer steps of a launch (a resumed run's first N after its resume), written as torch's own snapshot format to output_dir/memory/rankR.pickle, which
https://pytorch.org/memory_viz draws: what was alive at the peak and which line made it. Written after step N, or
when the loop ends before that (out of memory: what filled the device then; a stop, or fewer steps left). Recording costs host time on every
allocation, so it stops once written. CUDA only (the launch refuses it on the CPU: launch/preflight.py)."""

from __future__ import annotations

import os

import torch

MAX_ENTRIES = 1_000_000  # allocations and frees kept (torch's ring buffer): several steps of a long-context run


class MemorySnapshot:
    def __init__(self, steps: int, out: str, rank: int, device: torch.device):
        self.steps = steps if device.type == "cuda" else 0
        self.ran = 0
        from shardwise.rundir import MEMORY

        self.path = os.path.join(out, MEMORY, f"rank{rank}.pickle")  # rundir.MEMORY_FILE: cleared with the run
        if self.steps:
            torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, context="all", stacks="python")

    def after_step(self) -> str | None:
        """The snapshot's path once this launch's step N has run (written then), else None."""
        if not self.steps:
            return None
        self.ran += 1
        return self.write() if self.ran >= self.steps else None

    def close(self) -> str | None:
        """The loop ends (its steps done, a stop, an error such as running out of memory) before step N: the
        history recorded so far, written (the path), so that a launch shorter than N steps still leaves one."""
        if not self.steps:
            return None
        try:
            return self.write()
        except Exception:  # never in place of the error that ended the loop
            torch.cuda.memory._record_memory_history(enabled=None)
            self.steps = 0
            return None

    def write(self) -> str:
        from shardwise.rundir import atomic_path

        torch.cuda.synchronize()  # the frees the stream still owes are in the history
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with atomic_path(self.path, ".pickle") as tmp:
            torch.cuda.memory._dump_snapshot(tmp)
        torch.cuda.memory._record_memory_history(enabled=None)
        self.steps = 0
        return self.path
