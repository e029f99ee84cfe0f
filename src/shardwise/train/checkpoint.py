"""Sharded, atomic checkpoints through torch.distributed.checkpoint (DCP).

Layout: OUTPUT_DIR/checkpoints/step_00000100/ holding DCP shards (each rank writes its
own; nothing is gathered on rank 0), meta.json (step, data position, world size, strategy)
and rng/rank{R}.pt. A checkpoint is written to step_N.tmp and renamed only after every
rank has finished, so a crash mid-save leaves the previous checkpoint intact; leftover
.tmp directories are ignored and removed by the next save. Because DCP stores tensors by
parameter name and reshards on load, a checkpoint saved on N ranks loads on M ranks, and
one saved under ddp loads under fsdp and back.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import torch
import torch.distributed.checkpoint as dcp

from shardwise.errors import ShardwiseError
from shardwise.train import dist as sdist

STEP_RE = re.compile(r"^step_(\d{8})$")
META = "meta.json"


def ckpt_root(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def complete_checkpoints(output_dir: str) -> list[str]:
    root = ckpt_root(output_dir)
    if not os.path.isdir(root):
        return []
    found = [d for d in os.listdir(root) if STEP_RE.match(d) and os.path.isfile(os.path.join(root, d, META))]
    return [os.path.join(root, d) for d in sorted(found)]


def latest(output_dir: str) -> str | None:
    ckpts = complete_checkpoints(output_dir)
    return ckpts[-1] if ckpts else None


def read_meta(path: str) -> dict:
    try:
        with open(os.path.join(path, META)) as fh:
            return json.load(fh)
    except (OSError, json.JSONDecodeError) as e:
        raise ShardwiseError(f"--resume {path}: not a complete shardwise checkpoint ({e}); "
                             "give a checkpoints/step_N directory or use --resume auto")


def save(output_dir: str, step: int, state: dict, meta: dict, rank: int, keep: int) -> str:
    """Collective: every rank calls it with its own (sharded) state."""
    root = ckpt_root(output_dir)
    final = os.path.join(root, f"step_{step:08d}")
    tmp = final + ".tmp"
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        for d in os.listdir(root):  # debris of interrupted saves
            if d.endswith(".tmp"):
                shutil.rmtree(os.path.join(root, d), ignore_errors=True)
    sdist.barrier()
    dcp.save(state, checkpoint_id=tmp)
    os.makedirs(os.path.join(tmp, "rng"), exist_ok=True)
    torch.save(rng_state(), os.path.join(tmp, "rng", f"rank{rank}.pt"))
    sdist.barrier()
    if rank == 0:
        with open(os.path.join(tmp, META), "w") as fh:
            json.dump(meta, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        if os.path.exists(final):
            shutil.rmtree(final)
        os.rename(tmp, final)
        for old in complete_checkpoints(output_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    sdist.barrier()
    return final


def load(path: str, state: dict) -> None:
    """Fill `state` (from strategy.state_dict) in place from a checkpoint, resharding."""
    dcp.load(state, checkpoint_id=path)


def rng_state() -> dict:
    out = {"cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def restore_rng(path: str, rank: int) -> bool:
    f = os.path.join(path, "rng", f"rank{rank}.pt")
    if not os.path.isfile(f):
        return False
    st = torch.load(f, weights_only=True)
    torch.random.set_rng_state(st["cpu"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state(st["cuda"])
    return True
