"""`shardwise export CHECKPOINT --out DIR [--merge-lora]`: a Hugging Face safetensors
directory from any shardwise checkpoint, on the CPU, without the GPUs or the number of
ranks it was trained on (DCP reshards to one process on load)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

from shardwise import rundir
from shardwise.errors import ShardwiseError
from shardwise.models.save import save_pretrained


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="Write a Hugging Face model directory from a checkpoint.",
                       description="Write a Hugging Face safetensors directory from a shardwise checkpoint.")
    p.add_argument("checkpoint", help="A checkpoints/step_N directory, or a run directory (its newest checkpoint).")
    p.add_argument("--out", required=True, help="Directory to write (must not exist or be empty).")
    p.add_argument("--merge-lora", action="store_true", help="Merge LoRA adapters into the base weights.")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="Allow custom modelling code recorded in the checkpoint's hf/ directory (off: never run its "
                        "code, whatever the checkpoint's own config says).")
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
    if os.path.isdir(path) and rundir.run_id(path) is not None:  # a run directory, without checkpoints
        final = os.path.join(path, "final")
        if any(os.path.isfile(os.path.join(final, f)) for f in ("config.json", "adapter_config.json")):
            raise ShardwiseError(f"{path}: this run saved no checkpoint (it ran without --save-every); its final/ is "
                                 f"already a Hugging Face directory: use {final} as it is (shardwise chat {final})")
        raise ShardwiseError(f"{path}: this run saved no checkpoint (it ran without --save-every) and no final "
                             "model; nothing to export: train with --save-every N (or without --no-save-final)")
    if not os.path.lexists(path):
        raise ShardwiseError(f"{path} does not exist; give a checkpoints/step_N directory or a run directory")
    raise ShardwiseError(f"{path}: not a shardwise checkpoint (no meta.json) nor a run directory holding one")


def _adapter_base(cfg) -> str:
    """The base model a LoRA checkpoint was trained on, as an absolute directory when it is one here (the tiny
    model is rebuilt from its seed), else as the run named it: what an exported adapter records for `chat`."""
    if cfg.model == "tiny":
        from shardwise.models.tiny import tiny_dir

        return tiny_dir(cfg.seed)
    path = os.path.abspath(os.path.expanduser(cfg.model))
    return path if os.path.isfile(os.path.join(path, "config.json")) else cfg.model


def check_out(out: str) -> str:
    """--out as an absolute path, refused in one line before anything is loaded: empty, a symbolic link, a file, a
    non-empty directory, inside a run directory's own entries, or not creatable."""
    if not out.strip():
        raise ShardwiseError("--out: empty; give the directory to write, e.g. --out exported/")
    out = os.path.abspath(os.path.expanduser(out))
    if os.path.islink(out):  # export replaces --out with a directory of its own: never written through a link
        raise ShardwiseError(f"--out {out}: a symbolic link (to {os.readlink(out)}), which export does not write "
                             "through; give the directory itself or a new path")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):  # before the heavy imports
        raise ShardwiseError(f"--out {out}: exists and is not empty; choose a new directory")
    inside = rundir.enclosing_run(out)
    if inside:  # e.g. RUN/checkpoints/step_N/merged: rotating that step away (or --overwrite) would delete the export
        raise ShardwiseError(f"--out {out}: lies in {inside[1]}/ of the run directory {inside[0]}, which that run "
                             "deletes whole when it is overwritten (or rotates its checkpoints); choose a directory "
                             "outside it")
    rundir.check_creatable(out, "--out", "--out")
    return out


def _read_checkpoint(path: str, merge_lora: bool, trust_remote_code: bool) -> tuple[dict, object, str]:
    """(meta.json, the run's Config, hf/) of a verified checkpoint, refused in one line where it cannot export."""
    from shardwise.config import from_dict
    from shardwise.train import checkpoint as ckpt

    ckpt.verify(path, rng=False)  # before anything of it is read: complete, and nothing in it can run code
    meta = ckpt.read_meta(path)
    try:
        cfg = from_dict(meta["config"])
    except (TypeError, ValueError) as e:
        raise ShardwiseError(f"checkpoint {path}: meta.json key 'config' is not a shardwise run's config ({e}); the "
                             "checkpoint is damaged, use an older one") from None
    if merge_lora and cfg.tuner == "full":  # as train refuses --merge-lora without --tuner lora
        raise ShardwiseError(f"--merge-lora: {path} is a full fine-tune (tuner full), with no LoRA adapter to "
                             "merge; export it without --merge-lora (it is already a full model)")
    hf_dir = os.path.join(path, "hf")
    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        raise ShardwiseError(f"{path}: the checkpoint has no hf/config.json (written by an older shardwise?)")
    # trust_remote_code is the user's flag only: the checkpoint's meta.json is not the user's word
    with open(os.path.join(hf_dir, "config.json"), "rb") as fh:
        try:
            custom = "auto_map" in json.load(fh)
        except ValueError:
            custom = False
    if custom and not trust_remote_code:
        raise ShardwiseError(f"{path}: its hf/config.json names custom code (auto_map), which export runs only "
                             "with --trust-remote-code; pass it if you trust this checkpoint")
    return meta, cfg, hf_dir


def _load_model(path: str, cfg, hf_dir: str, merge_lora: bool, trust_remote_code: bool):
    """The model built from hf/config.json with the checkpoint's weights, and its tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from shardwise.train import checkpoint as ckpt

    try:
        config = AutoConfig.from_pretrained(hf_dir, local_files_only=True, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=trust_remote_code)
    except Exception as e:  # transformers raises many types here
        msg = str(e).splitlines()[0][:200] if str(e) else ""
        raise ShardwiseError(f"{path}: cannot build the model from hf/config.json ({type(e).__name__}: {msg})") from None
    if cfg.tuner != "full":
        from shardwise.models.lora import apply_lora

        model = apply_lora(model, cfg)
        if not merge_lora:  # the adapter's base: the model it was trained on, not the weightless hf/ config
            model.peft_config["default"].base_model_name_or_path = _adapter_base(cfg)
    state = {"model": model.state_dict()}
    ckpt.load(path, state, no_dist=True)
    model.load_state_dict(state["model"])
    try:
        tok = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as e:  # transformers raises many types here
        msg = str(e).splitlines()[0][:200] if str(e) else ""
        raise ShardwiseError(f"{path}: cannot load the tokenizer in hf/ ({type(e).__name__}: {msg})") from None
    return model, tok


def _write(model, tok, out: str, record: dict) -> None:
    """The model, its tokenizer and shardwise_export.json into a fresh temporary directory beside `out`, renamed
    to `out` once whole (an empty `out` is replaced; nothing else is)."""
    from shardwise.train import checkpoint as ckpt

    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.", suffix=".tmp", dir=parent)  # ours alone
    try:
        save_pretrained(model, tmp)
        tok.save_pretrained(tmp)
        with open(os.path.join(tmp, "shardwise_export.json"), "w") as fh:
            json.dump(record, fh, indent=1)
        ckpt.apply_umask(tmp)
        if os.path.isdir(out):
            os.rmdir(out)  # empty (checked above); fails rather than delete anything that appeared since
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def export(checkpoint: str, out: str, merge_lora: bool = False, trust_remote_code: bool = False) -> str:
    out = check_out(out)
    path = resolve_checkpoint(os.path.expanduser(checkpoint))
    meta, cfg, hf_dir = _read_checkpoint(path, merge_lora, trust_remote_code)
    model, tok = _load_model(path, cfg, hf_dir, merge_lora, trust_remote_code)
    merged = bool(merge_lora and cfg.tuner != "full")
    if merged:
        model = model.merge_and_unload()
    _write(model, tok, out, {"checkpoint": os.path.abspath(path), "step": meta["step"],
                             "strategy": meta.get("strategy"), "world_size": meta.get("world_size"),
                             "merged_lora": merged})
    return out


def run(args) -> int:
    from shardwise.rundir import quiet_libraries

    quiet_libraries()
    out = export(args.checkpoint, args.out, args.merge_lora, args.trust_remote_code)
    print(f"shardwise: exported {resolve_checkpoint(os.path.expanduser(args.checkpoint))} to {out}")
    return 0
