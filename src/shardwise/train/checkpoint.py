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

import errno
import json
import os
import re
import shutil

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from shardwise.errors import ShardwiseError
from shardwise.train import dist as sdist
from shardwise.train.faults import Faults

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


def save(output_dir: str, step: int, state: dict, meta: dict, rank: int, keep: int, model_dir: str = "") -> str:
    """Collective: every rank calls it with its own (sharded) state. The model's config
    and tokenizer files travel with the checkpoint (hf/), so `shardwise export` needs
    nothing else. A failed save (disk full, ...) leaves the previous checkpoint intact."""
    root = ckpt_root(output_dir)
    final = os.path.join(root, f"step_{step:08d}")
    tmp = final + ".tmp"
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        remove_partial(output_dir)
    sdist.barrier()
    try:
        dcp.save(state, checkpoint_id=tmp)
        os.makedirs(os.path.join(tmp, "rng"), exist_ok=True)
        torch.save(rng_state(), os.path.join(tmp, "rng", f"rank{rank}.pt"))
        if rank == 0 and model_dir:
            copy_hf_files(model_dir, os.path.join(tmp, "hf"))
        Faults(rank).during_save(step)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's exception is a BaseException
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        full = _is_disk_full(e) or _free_bytes(root) < 64 * 2**20
        prev = latest(output_dir) or "none"
        raise ShardwiseError(
            f"{'disk full' if full else 'failed'} while saving checkpoint {final} ({_first_line(e)}); "
            f"the previous checkpoint is intact: {prev}; "
            + ("free space, then resume with --resume auto" if full else "fix the cause, then resume with --resume auto")
        ) from e
    sdist.barrier()
    if rank == 0:
        with open(os.path.join(tmp, META), "w") as fh:
            json.dump(meta, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        apply_umask(tmp)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.rename(tmp, final)
        for old in complete_checkpoints(output_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    sdist.barrier()
    return final


def remove_partial(output_dir: str) -> None:
    """Delete the debris of interrupted saves (step_N.tmp); complete ones are untouched."""
    root = ckpt_root(output_dir)
    if os.path.isdir(root):
        for d in os.listdir(root):
            if d.endswith(".tmp"):
                shutil.rmtree(os.path.join(root, d), ignore_errors=True)


HF_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "chat_template.jinja", "tokenizer.model", "vocab.json", "merges.txt")


def copy_hf_files(model_dir: str, dest: str) -> None:
    os.makedirs(dest, exist_ok=True)
    for f in HF_FILES:
        src = os.path.join(model_dir, f)
        if os.path.isfile(src):
            shutil.copy2(src, os.path.join(dest, f))


def apply_umask(path: str) -> None:
    """Some writers create files 0600; give everything the user's umask like any other file."""
    mask = os.umask(0)
    os.umask(mask)
    for base, dirs, files in os.walk(path):
        for f in files:
            os.chmod(os.path.join(base, f), 0o666 & ~mask)
        for d in dirs:
            os.chmod(os.path.join(base, d), 0o777 & ~mask)


def _is_disk_full(e: BaseException) -> bool:
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def _free_bytes(path: str) -> int:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 0


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:200]


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
