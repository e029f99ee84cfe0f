"""Devices, memory, interconnect and peak FLOP/s.

Importing this module never initialises CUDA or a process group; `detect()` only reads.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass

# Dense peak TFLOP/s by (device name substring, dtype), from the vendors' datasheets
# (NVIDIA A100/H100/H200/L40S/A10/4090 datasheets; the "without sparsity" figures).
# fp8: the float8 tensor cores of Hopper and Ada (float8 matmuls with fp32 accumulation, as torch._scaled_mm runs
# them); a listed GPU without the key has none (`plan --float8` refuses it).
PEAK_TFLOPS = {
    "H200": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0, "fp8": 1979.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0, "fp8": 1979.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "fp32": 91.6, "fp8": 733.0},
    "A10": {"bf16": 125.0, "fp16": 125.0, "fp32": 31.2},
    "4090": {"bf16": 165.2, "fp16": 165.2, "fp32": 82.6, "fp8": 330.3},
}

# Device memory bandwidth in TB/s, from the same datasheets and parts (H100: SXM, HBM3; A100: 80 GB SXM, HBM2e): what
# the planner's memory-bound passes scale with (plan/comm.py device_mem_bw).
MEMORY_TBPS = {"H200": 4.8, "H100": 3.35, "A100": 2.039, "L40S": 0.864, "A10": 0.6, "4090": 1.008}


@dataclass
class Hardware:
    """What one node has."""

    accelerator: str  # "cuda" or "cpu"
    device_name: str
    device_count: int  # GPUs per node (0 on CPU)
    memory_gib: float  # per device (GPU memory, or host RAM on CPU)
    host_memory_gib: float
    nvlink: bool | None = None  # GPUs of a node linked by NVLink (None: not known)


def _datasheet(table: dict, device_name: str):
    """The entry of the first key `device_name` contains (the tables list an A100 before an A10), or None."""
    return next((row for key, row in table.items() if key in device_name), None)


def peak_flops(device_name: str, dtype: str = "bf16") -> float | None:
    """Dense peak FLOP/s of one device for a compute dtype, or None when unknown (CPU)."""
    table = _datasheet(PEAK_TFLOPS, device_name)
    return None if table is None else table.get(dtype, table["bf16"]) * 1e12


def fp8_peak_flops(device_name: str) -> float | None:
    """Dense float8 peak FLOP/s of one device: 0.0 for a known GPU without float8 tensor cores, None when the
    device is not in the table (as peak_flops)."""
    table = _datasheet(PEAK_TFLOPS, device_name)
    return None if table is None else table.get("fp8", 0.0) * 1e12


def memory_bandwidth(device_name: str) -> float | None:
    """Datasheet device memory bandwidth of one GPU in bytes/s, or None when the device is not in the table (as
    peak_flops)."""
    tbps = _datasheet(MEMORY_TBPS, device_name)
    return None if tbps is None else tbps * 1e12


def host_memory_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        return 0.0


def host_available_gib() -> float:
    """RAM this machine can give a new process now (Linux's MemAvailable), else its total."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return host_memory_gib()


def detect() -> Hardware:
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return Hardware("cuda", props.name, torch.cuda.device_count(), props.total_memory / 2**30, host_memory_gib())
    return Hardware("cpu", "cpu", 0, host_memory_gib(), host_memory_gib())


def bf16_supported() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


# ----------------------------------------------------------------------------- links

# Nominal per-GPU (or per-node, for the network) bandwidths in Gb/s, used when nothing is
# measured or given. nccl-tests bus bandwidth reaches ~80% of these on large messages.
LINKS_GBPS = {
    "nvlink4": (3600.0, "NVLink 4 (H100/H200 SXM, 450 GB/s per direction)"),
    "nvlink3": (2400.0, "NVLink 3 (A100 SXM, 300 GB/s per direction)"),
    "pcie4": (256.0, "PCIe Gen4 x16 (32 GB/s)"),
    "pcie5": (512.0, "PCIe Gen5 x16 (64 GB/s)"),
    "eth25": (25.0, "25 Gb/s Ethernet"),
    "net100": (100.0, "100 Gb/s Ethernet/InfiniBand per node"),
    "ib400": (400.0, "400 Gb/s InfiniBand per node"),
    "gloo": (40.0, "gloo on one host (shared memory / loopback TCP)"),
}
LINK_EFFICIENCY = 0.8  # achieved bus bandwidth / nominal, large messages


def default_intra_link(device_name: str, nvlink: bool | None = None) -> str:
    """The link assumed between GPUs of one node when nothing is measured or given."""
    if device_name == "cpu":
        return "gloo"
    if nvlink is False:
        return "pcie5" if any(k in device_name for k in ("H100", "H200", "L40S")) else "pcie4"
    if any(k in device_name for k in ("H100", "H200", "B200", "GH200")):
        return "nvlink4"
    if "A100" in device_name or nvlink:
        return "nvlink3"
    return "pcie4"


def cache_dir() -> str:
    """Where measurements are kept: $SHARDWISE_CACHE_DIR, else ~/.cache/shardwise."""
    return os.environ.get("SHARDWISE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "shardwise")


def folder_problem(path: str, tighten: bool = False) -> str | None:
    """Why the existing folder `path` cannot hold what this user's processes load (a cache: compiled code,
    tokenized data, the tiny model), or None: it must be a directory, not a link, owned by this user, and nobody
    else may write it. With `tighten`, a folder of ours that a umask left group- or other-writable is made
    private instead. Raises OSError where it cannot be read or tightened."""
    import stat

    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        return f"{path} is a link or not a directory"
    if st.st_uid != os.getuid():
        return f"{path} belongs to another user (uid {st.st_uid})"
    if st.st_mode & 0o022:
        if not tighten:
            return f"{path} can be written by other users"
        os.chmod(path, stat.S_IMODE(st.st_mode) & ~0o022)
    return None


def use_compile_cache() -> str | None:
    """Keep torch.compile's caches (inductor's FX graph and AOTAutograd caches, its generated kernels) under
    $SHARDWISE_CACHE_DIR/compile/<host>, where they outlive a reboot that empties torch's default
    ($TMPDIR/torchinductor_$USER): a re-run then loads its compiled blocks instead of compiling them again (9.8 s
    of the anchor job's first step on an H200). Sets TORCHINDUCTOR_CACHE_DIR in this process's
    environment, which torch reads when it first compiles and the workers inherit; a user's own
    TORCHINDUCTOR_CACHE_DIR is kept.

    What inductor caches is code the training process loads (pickled graphs, generated modules, built kernels), so
    the folder is used only when this user owns it and nobody else can write it (made with mode 0700; a link is
    not followed), and it is per host: nodes sharing a home directory over NFS do not share one cache, as
    torch's /tmp default never did. Returns the directory in use, or None where the folder is not safe or cannot
    be made (torch's default then stays)."""
    import socket

    own = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if own:
        return own
    root = os.path.join(os.path.abspath(cache_dir()), "compile")
    path = os.path.join(root, socket.gethostname() or "host")
    try:
        os.makedirs(os.path.dirname(root), exist_ok=True)
        for d in (root, path):
            try:
                os.mkdir(d, 0o700)
            except FileExistsError:  # made before (or by a concurrent launcher): judged below like any other
                pass
            if folder_problem(d):
                return None
    except OSError:  # the cache directory cannot be made or written: torch's default
        return None
    if not os.access(path, os.W_OK | os.X_OK):
        return None
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    return path


def doctor_path() -> str:
    return os.path.join(cache_dir(), "doctor.json")


def load_doctor() -> dict | None:
    """The last `shardwise doctor` report, or None."""
    try:
        with open(doctor_path(), encoding="utf-8") as fh:
            d = json.load(fh)
        return d if isinstance(d, dict) else None
    except (OSError, ValueError):
        return None


def detect_light() -> Hardware:
    """Like detect(), without importing torch: nvidia-smi when present, else the host."""
    host = host_memory_gib()
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=5).stdout
            rows = [r.split(",") for r in out.strip().splitlines() if r.strip()]
            if rows:
                topo = subprocess.run([smi, "topo", "-m"], capture_output=True, text=True, timeout=5).stdout
                nvlink = any(tok.startswith("NV") and tok[2:].isdigit() for tok in topo.split()) if len(rows) > 1 else None
                return Hardware("cuda", rows[0][0].strip(), len(rows), float(rows[0][1]) / 1024, host, nvlink)
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            pass
    return Hardware("cpu", "cpu", 0, host, host)
