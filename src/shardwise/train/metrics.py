"""Rank-0 reporting: terminal (progress bar on a TTY, plain lines otherwise),
metrics.jsonl (one object per logged step), TensorBoard events, summary.json."""

from __future__ import annotations

import json
import os
import resource
import sys
import time

import torch


def peak_memory_gib(device: torch.device) -> float:
    """CUDA peak allocated on a GPU; the process's own peak RSS on the CPU (VmHWM: unlike
    ru_maxrss it does not inherit the parent's peak across fork+exec)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**20  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def flops_per_token(n_params: int, n_layers: int, hidden: int, seq_len: float) -> float:
    """Training FLOPs per token: 6N for the matmuls + 12*L*H*T for attention (PaLM, App. B)."""
    return 6 * n_params + 12 * n_layers * hidden * seq_len


def keep_steps_up_to(path: str, step: int) -> None:
    """Drop the records of steps after `step` (a resume from an older checkpoint runs them
    again), so metrics.jsonl holds each step once. Rewritten atomically."""
    from shardwise.rundir import atomic_write

    try:
        with open(path) as fh:
            lines = fh.readlines()
    except FileNotFoundError:
        return
    kept = []
    for line in lines:
        try:
            if json.loads(line).get("step", 0) > step:
                continue
        except (ValueError, AttributeError):
            continue  # a line torn by a kill mid-write
        kept.append(line if line.endswith("\n") else line + "\n")
    if len(kept) != len(lines):
        atomic_write(path, "".join(kept))


class Reporter:
    def __init__(self, output_dir: str, is_main: bool, total_steps: int, start_step: int, append: bool):
        self.is_main, self.total = is_main, total_steps
        self.bar = None
        self.tb = None
        self.fh = None
        if not is_main:
            return
        path = os.path.join(output_dir, "metrics.jsonl")
        if append:
            keep_steps_up_to(path, start_step)
        self.fh = open(path, "a" if append else "w")
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(output_dir, "tensorboard"))
        except ImportError:  # tensorboard is a dependency; tolerate its absence
            self.tb = None
        if sys.stdout.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)

    def log(self, rec: dict) -> None:
        if not self.is_main:
            return
        self.fh.write(json.dumps(rec) + "\n")
        self.fh.flush()
        if self.tb:
            for k, v in rec.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(f"train/{k}", v, rec["step"])
        line = (f"loss {rec['loss']:.4f} | lr {rec['lr']:.2e} | {rec['tokens_per_s']:,.0f} tok/s | "
                f"{rec['peak_mem_gib']:.2f} GiB" + (f" | mfu {rec['mfu']:.1%}" if "mfu" in rec else ""))
        if self.bar:
            self.bar.n = rec["step"]
            self.bar.set_postfix_str(line, refresh=True)
        else:
            print(f"step {rec['step']}/{self.total} | {line}", flush=True)

    def say(self, msg: str) -> None:
        if not self.is_main:
            return
        if self.bar:
            self.bar.write(msg)
        else:
            print(msg, flush=True)

    def close(self) -> None:
        if self.bar:
            self.bar.close()
        if self.fh:
            self.fh.close()
        if self.tb:
            self.tb.close()


class Window:
    """Throughput over the steps since the last log (the log's .item() is the sync point)."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.steps = 0
        self.tokens = 0

    def add(self, tokens: int) -> None:
        self.steps += 1
        self.tokens += tokens

    def read(self) -> tuple[float, float]:
        dt = time.perf_counter() - self.t0
        return dt / max(self.steps, 1), self.tokens / dt if dt > 0 else 0.0
