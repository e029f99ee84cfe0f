"""`shardwise export CHECKPOINT --out DIR [--merge-lora]`: a Hugging Face safetensors
directory from any shardwise checkpoint, on the CPU, without the GPUs or the number of
ranks it was trained on (DCP reshards to one process on load)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

from shardwise.errors import ShardwiseError
from shardwise.models.save import save_pretrained


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="Write a Hugging Face model directory from a checkpoint.",
                       description="Write a Hugging Face safetensors directory from a shardwise checkpoint.")
    p.add_argument("checkpoint", help="A checkpoints/step_N directory, or a run directory (its newest checkpoint).")
    p.add_argument("--out", required=True, help="Directory to write (must not exist or be empty).")
    p.add_argument("--merge-lora", action="store_true", help="Merge LoRA adapters into the base weights.")
    p.set_defaults(func=run)


def resolve_checkpoint(path: str) -> str:
    from shardwise.train import checkpoint as ckpt

    if os.path.isfile(os.path.join(path, ckpt.META)):
        return path
    newest = ckpt.latest(path) if os.path.isdir(path) else None
    if newest:
        return newest
    if os.path.isdir(path) and ckpt.complete_checkpoints(path):
        bad, why = ckpt.skipped_newer(path)[0]
        raise ShardwiseError(f"{path}: no complete checkpoint (the newest, {bad}, is incomplete or corrupt: {why})")
    raise ShardwiseError(f"{path}: not a shardwise checkpoint (no meta.json) nor a run directory holding one")


def export(checkpoint: str, out: str, merge_lora: bool = False) -> str:
    if not out.strip():
        raise ShardwiseError("--out: empty; give the directory to write, e.g. --out exported/")
    out = os.path.abspath(out)
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):  # before the heavy imports
        raise ShardwiseError(f"--out {out}: exists and is not empty; choose a new directory")
    path = resolve_checkpoint(checkpoint)

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from shardwise.config import from_dict
    from shardwise.train import checkpoint as ckpt
    ckpt.verify(path)  # before anything of it is read: complete, and nothing in it can run code
    meta = ckpt.read_meta(path)
    cfg = from_dict(meta["config"])
    hf_dir = os.path.join(path, "hf")
    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        raise ShardwiseError(f"{path}: the checkpoint has no hf/config.json (written by an older shardwise?)")
    config = AutoConfig.from_pretrained(hf_dir, local_files_only=True, trust_remote_code=cfg.trust_remote_code)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=cfg.trust_remote_code)
    if cfg.tuner != "full":
        from shardwise.models.lora import apply_lora

        model = apply_lora(model, cfg)
    state = {"model": model.state_dict()}
    ckpt.load(path, state, no_dist=True)
    model.load_state_dict(state["model"])
    tok = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.", suffix=".tmp", dir=parent)  # ours alone
    try:
        if cfg.tuner != "full" and merge_lora:
            model = model.merge_and_unload()
        save_pretrained(model, tmp)
        tok.save_pretrained(tmp)
        with open(os.path.join(tmp, "shardwise_export.json"), "w") as fh:
            json.dump({"checkpoint": os.path.abspath(path), "step": meta["step"], "strategy": meta.get("strategy"),
                       "world_size": meta.get("world_size"), "merged_lora": bool(merge_lora and cfg.tuner != "full")},
                      fh, indent=1)
        ckpt.apply_umask(tmp)
        if os.path.isdir(out):
            os.rmdir(out)  # empty (checked above); fails rather than delete anything that appeared since
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def run(args) -> int:
    from shardwise.rundir import quiet_libraries

    quiet_libraries()
    out = export(args.checkpoint, args.out, args.merge_lora)
    print(f"shardwise: exported {resolve_checkpoint(args.checkpoint)} to {out}")
    return 0
