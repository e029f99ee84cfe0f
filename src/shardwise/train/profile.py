"""Profiled steps: how long a step spends communicating, and how much of that no compute hides.

`profile_steps: N` profiles N optimizer steps with torch.profiler, one profiler session per
step (a device sync before and after, so the step's work lies inside its session). From the
session's events it computes, per step:

- `comm_total_s`: the measure (length of the union) of the communication intervals;
- `comm_exposed_s`: the part of it that no compute interval overlaps, i.e.
  |union(comm)| - |union(comm) ∩ union(compute)|.

Which intervals are communication and which are compute depends on the device
(`comm_method` in the step record says which was used):

- CUDA: kernels on this rank's GPU. Communication = kernels whose name contains "nccl"
  (ncclDevKernel_*, ncclKernel_*); compute = every other kernel (memcpy/memset activity is
  neither). This is the usual "NCCL kernel time not overlapped by a compute kernel".
- CPU (gloo): gloo runs each collective on one of its own worker threads, which the profiler
  records as `gloo:<collective>` events. Communication = those events; compute = the aten
  operators the training thread runs (the thread that runs the step; operators inside a c10d
  call are not compute). A collective's time that no training-thread operator overlaps is
  time the training thread spends waiting for it, or running Python between operators: on
  the CPU `comm_exposed_s` is therefore an upper bound on the wait, tight when operators
  dominate the step.

Each profiled step also leaves what it measured in the run directory, for a person to read:
`profile/step-<N>-rank<R>.txt`, the operators by their own time (on the GPU and on the host,
or on the host alone), and `profile/step-<N>-rank<R>.json.gz`, the whole timeline as a Chrome
trace (chrome://tracing, https://ui.perfetto.dev). Both are written to a temporary name and
renamed, so a file there is whole.

The loop reads nothing of this unless a step is profiled: `StepProfiler.step` is a shared
null context for every other step.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

MARK = "shardwise/profiled_step"
METHOD_CUDA = "cuda: nccl kernels not overlapped by other kernels on the GPU"
METHOD_CPU = "cpu: gloo collectives (gloo threads) not overlapped by training-thread aten ops; an upper bound on the wait"
CPU_COMM_PREFIX = ("gloo:",)
CPU_COMM_CALLS = ("c10d::", "_c10d_functional::", "record_param_comms", "nccl:", "gloo:")

Interval = tuple[float, float]


# ----------------------------------------------------------------------------- interval arithmetic


def union(intervals) -> list[Interval]:
    """Sorted, disjoint intervals covering the same points (empty and reversed ones dropped)."""
    out: list[list[float]] = []
    for s, e in sorted((s, e) for s, e in intervals if e > s):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def measure(intervals) -> float:
    """Total length of the union."""
    return sum(e - s for s, e in union(intervals))


def intersect(a, b) -> list[Interval]:
    """union(a) ∩ union(b), as sorted disjoint intervals."""
    a, b = union(a), union(b)
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if e > s:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def clip(intervals, lo: float, hi: float) -> list[Interval]:
    return [(max(s, lo), min(e, hi)) for s, e in intervals if min(e, hi) > max(s, lo)]


def exposed(comm, compute) -> tuple[float, float]:
    """(|union(comm)|, |union(comm)| - |union(comm) ∩ union(compute)|)."""
    total = measure(comm)
    return total, max(total - measure(intersect(comm, compute)), 0.0)


# ----------------------------------------------------------------------------- events -> intervals


def _span(e) -> Interval:
    return (float(e.time_range.start), float(e.time_range.end))  # microseconds


def _inside_comm_call(e) -> bool:
    p = e.cpu_parent
    while p is not None:
        if p.name.startswith(CPU_COMM_CALLS):
            return True
        p = p.cpu_parent
    return False


def split_cuda(events, device_index: int) -> tuple[list[Interval], list[Interval]]:
    """(nccl kernel intervals, other kernel intervals) on one GPU. Annotations that the
    profiler mirrors onto the GPU timeline (a record_function's range, named like its CPU
    event) are not kernels; memcpy/memset activity is neither."""
    cpu = torch.autograd.DeviceType.CPU
    annotations = {e.name for e in events if e.device_type == cpu}
    comm, compute = [], []
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CUDA or e.device_index != device_index:
            continue
        name = e.name
        if name in annotations or name.startswith(("Memcpy", "Memset")):
            continue
        (comm if "nccl" in name.lower() else compute).append(_span(e))
    return comm, compute


def split_cpu(events, main_thread: int) -> tuple[list[Interval], list[Interval]]:
    """(gloo collective intervals, training-thread operator intervals)."""
    comm, compute = [], []
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CPU:
            continue
        if e.name.startswith(CPU_COMM_PREFIX):
            comm.append(_span(e))
        elif e.thread == main_thread and e.name.startswith("aten::") and not _inside_comm_call(e):
            compute.append(_span(e))
    return comm, compute


def comm_times(events, device: torch.device) -> dict:
    """{comm_total_s, comm_exposed_s, comm_method} for one profiled step's events."""
    mark = next((e for e in events if e.name == MARK), None)
    if mark is None:
        raise RuntimeError(f"profiler events lack the step marker {MARK!r}")
    if device.type == "cuda":
        # GPU timestamps are not clipped to the CPU marker's range (clock skew); the session
        # holds this step's kernels only (synced before and after)
        comm, compute = split_cuda(events, device.index if device.index is not None else torch.cuda.current_device())
        method = METHOD_CUDA
    else:
        lo, hi = _span(mark)
        comm, compute = (clip(x, lo, hi) for x in split_cpu(events, mark.thread))
        method = METHOD_CPU
    total, exp = exposed(comm, compute)
    return {"comm_total_s": total * 1e-6, "comm_exposed_s": exp * 1e-6, "comm_method": method}


# ----------------------------------------------------------------------------- the loop's hook


def profiled_range(profile_steps: int, profile_start: int, total: int) -> tuple[int, int]:
    """(first, last) profiled step, 1-based and inclusive; (0, -1) when none.
    profile_start 0 means the last `profile_steps` steps of the run."""
    if profile_steps <= 0 or total <= 0:
        return 0, -1
    first = profile_start if profile_start > 0 else max(total - profile_steps + 1, 1)
    return first, min(first + profile_steps - 1, total)


@dataclass
class StepProfiler:
    """`with prof.step(n): ...` around step n's forward/backward/optimizer step; after it,
    `prof.take()` gives that step's communication times (None for an unprofiled step)."""

    first: int
    last: int
    device: torch.device
    out_dir: Path | None = None  # where each profiled step's table and trace go (none: not written)
    rank: int = 0
    _result: dict | None = None

    @classmethod
    def from_config(cls, cfg, device: torch.device, total: int, out_dir: Path | None = None,
                    rank: int = 0) -> "StepProfiler":
        first, last = profiled_range(cfg.profile_steps, cfg.profile_start, total)
        return cls(first, last, device, Path(out_dir) / "profile" if out_dir is not None else None, rank)

    def wants(self, step: int) -> bool:
        return self.first <= step <= self.last

    def step(self, step: int):
        return self._profile(step) if self.wants(step) else contextlib.nullcontext()

    @contextlib.contextmanager
    def _profile(self, step: int):
        from torch.profiler import ProfilerActivity, profile, record_function

        cuda = self.device.type == "cuda"
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        sync = (lambda: torch.cuda.synchronize(self.device)) if cuda else (lambda: None)
        sync()  # the previous step's kernels end before this session starts
        prof = profile(activities=acts)
        with warnings.catch_warnings():  # one session per step is what we want, not a mistake
            warnings.filterwarnings("ignore", message=".*Profiler clears events.*")
            prof.start()
        try:
            with record_function(MARK):
                yield
                sync()  # this step's kernels end inside the marker
        finally:
            prof.stop()
        try:
            self._result = comm_times(prof.events(), self.device)
        except Exception as e:  # a measurement must not end the run, nor leave the ranks' records unlike
            nan = float("nan")
            self._result = {"comm_total_s": nan, "comm_exposed_s": nan,
                            "comm_method": f"failed: {type(e).__name__}: {str(e)[:120]}"}
        if self.out_dir is not None:
            try:
                self._result["profile_files"] = write_profile(prof, self.out_dir, step, self.rank, cuda)
            except Exception as e:  # a full disk or a profiler that cannot export must not end the run either
                self._result["profile_files"] = f"failed: {type(e).__name__}: {str(e)[:120]}"

    def take(self) -> dict | None:
        r, self._result = self._result, None
        return r


def operator_table(prof, cuda: bool, rows: int = 40) -> str:
    """The step's operators by their own time: on the GPU first when there is one, then on the host."""
    avg = prof.key_averages()
    parts = []
    if cuda:
        parts.append(f"# operators by their own time on the GPU (top {rows})\n"
                     + avg.table(sort_by="self_device_time_total", row_limit=rows))
    parts.append(f"# operators by their own time on the host (top {rows})\n"
                 + avg.table(sort_by="self_cpu_time_total", row_limit=rows))
    return "\n\n".join(parts) + "\n"


def write_profile(prof, out_dir: Path, step: int, rank: int, cuda: bool) -> list[str]:
    """Write one profiled step's operator table and Chrome trace under out_dir (rundir's atomic writes: a file
    there is whole); their paths."""
    from shardwise.rundir import atomic_path, atomic_write

    out_dir.mkdir(parents=True, exist_ok=True)
    table, trace = out_dir / f"step-{step}-rank{rank}.txt", out_dir / f"step-{step}-rank{rank}.json.gz"
    atomic_write(str(table), operator_table(prof, cuda))
    with atomic_path(str(trace), suffix=".json.gz") as tmp:  # export_chrome_trace compresses by the suffix
        prof.export_chrome_trace(tmp)
    return [str(table), str(trace)]
