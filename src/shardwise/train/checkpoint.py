"""Sharded, atomic checkpoints through torch.distributed.checkpoint (DCP).

Layout: OUTPUT_DIR/checkpoints/step_00000100/ holding DCP shards (each rank writes its
own; nothing is gathered on rank 0), meta.json (step, data position, world size, strategy)
and rng/rank{R}.pt. A checkpoint is written to step_N.tmp and renamed only after every
rank has finished, so a crash mid-save leaves the previous checkpoint intact; a leftover
step_N.tmp is removed by the next save only if it holds the marker this module writes into
every temporary directory it creates (nothing else is ever deleted). Because DCP stores
tensors by parameter name and reshards on load, a checkpoint saved on N ranks loads on M
ranks, and one saved under ddp loads under fsdp and back.

Loading never runs code from a checkpoint: DCP unpickles `.metadata` and the non-tensor
items of the shards; here `.metadata` goes through an unpickler that admits only DCP's own
metadata classes and plain values, and non-tensor items through `torch.load(weights_only=True)`.
meta.json records every file's size and the sha256 of `.metadata`, so a truncated or
missing file is found before anything is loaded (shards are not hashed: that would read
every byte of a large checkpoint); the same cheap check refuses a meta.json whose keys have
the wrong type or range and an unreadable RNG file. A shard with garbage inside is named
when it is loaded, never with torch's advice to load it with weights_only=False.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import json
import os
import pickle
import re
import shutil
import warnings
from typing import TYPE_CHECKING

import torch

from shardwise import rundir
from shardwise.errors import ShardwiseError
from shardwise.train import dist as sdist
from shardwise.train.faults import Faults

if TYPE_CHECKING:
    from torch.distributed.checkpoint import metadata as dcp_metadata

STEP_RE = re.compile(r"^step_(\d{8})$")
TMP_RE = re.compile(r"^step_\d{8}\.tmp$")
META = "meta.json"
DCP_METADATA = ".metadata"
PARTIAL_MARKER = ".shardwise-partial"  # in a temporary checkpoint directory this module created
BEST = "best.json"  # {"step", "val_loss", "checkpoint"}: kept by --keep-best (train/evaluate.py)


def ckpt_root(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def complete_checkpoints(output_dir: str) -> list[str]:
    root = ckpt_root(output_dir)
    if not os.path.isdir(root):
        return []
    found = [d for d in os.listdir(root) if STEP_RE.match(d) and os.path.isfile(os.path.join(root, d, META))]
    return [os.path.join(root, d) for d in sorted(found)]


def latest(output_dir: str) -> str | None:
    """The newest checkpoint that passes the cheap completeness check (`problem`)."""
    for path in reversed(complete_checkpoints(output_dir)):
        if problem(path) is None:
            return path
    return None


def skipped_newer(output_dir: str) -> list[tuple[str, str]]:
    """(path, what is wrong) of every checkpoint newer than `latest` (incomplete or corrupt)."""
    out = []
    for path in reversed(complete_checkpoints(output_dir)):
        why = problem(path)
        if why is None:
            break
        out.append((path, why))
    return out


def read_meta(path: str) -> dict:
    """meta.json, its keys' types and ranges checked (`meta_problem`): a damaged one is refused in one line."""
    try:
        with open(os.path.join(path, META)) as fh:
            meta = json.load(fh)
    except (OSError, ValueError) as e:
        raise ShardwiseError(f"--resume {path}: not a complete shardwise checkpoint ({e}); "
                             "give a checkpoints/step_N directory or use --resume auto")
    why = meta_problem(meta, path, required=("step", "data_position", "config"))
    if why is not None:
        raise CorruptCheckpoint(f"checkpoint {path}: {why}; the checkpoint is damaged, use an older one")
    return meta


def save(output_dir: str, step: int, state: dict, meta: dict, rank: int, keep: int, model_dir: str = "",
         chat_template: str = "") -> str:
    """Collective: every rank calls it with its own (sharded) state. The model's config
    and tokenizer files travel with the checkpoint (hf/), so `shardwise export` needs
    nothing else; `chat_template` (the run's own, when --chat-template replaced the
    tokenizer's) is written as hf/chat_template.jinja, which the tokenizer loads in place of
    its files' template. A failed save (disk full, ...) leaves the previous checkpoint intact."""
    root = ckpt_root(output_dir)
    final = os.path.join(root, f"step_{step:08d}")
    tmp = final + ".tmp"
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        remove_partial(output_dir)
        if os.path.lexists(tmp):
            raise ShardwiseError(f"{tmp} exists and was not made by shardwise (no {PARTIAL_MARKER}); "
                                 "move it away, then resume with --resume auto")
        os.mkdir(tmp)
        open(os.path.join(tmp, PARTIAL_MARKER), "w").close()
    sdist.barrier()
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.save(state, checkpoint_id=tmp)
        os.makedirs(os.path.join(tmp, "rng"), exist_ok=True)
        torch.save(rng_state(), os.path.join(tmp, "rng", f"rank{rank}.pt"))
        if rank == 0 and model_dir:
            copy_hf_files(model_dir, os.path.join(tmp, "hf"))
            if chat_template:
                with open(os.path.join(tmp, "hf", "chat_template.jinja"), "w") as fh:
                    fh.write(chat_template)
        Faults(rank).during_save(step)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's exception is a BaseException
        if rank == 0:
            _remove_own_tmp(tmp)
        full = disk_full(e, root)
        prev = latest(output_dir) or "none"
        raise ShardwiseError(
            f"{'disk full' if full else 'failed'} while saving checkpoint {final} ({first_line(e)}); "
            f"the previous checkpoint is intact: {prev}; "
            + ("free space, then resume with --resume auto" if full else "fix the cause, then resume with --resume auto")
        ) from e
    sdist.barrier()
    if rank == 0:
        os.remove(os.path.join(tmp, PARTIAL_MARKER))
        meta = {**meta, **file_record(tmp)}
        if model_dir:
            meta["model_arch"] = model_arch(model_dir)
        with open(os.path.join(tmp, META), "w") as fh:
            json.dump(meta, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        apply_umask(tmp)
        if os.path.exists(final):  # an older run of this directory saved this step (resumed from before it)
            if not os.path.isfile(os.path.join(final, META)):
                raise ShardwiseError(f"{final} exists and is not a shardwise checkpoint; move it away, then resume "
                                     "with --resume auto")
            shutil.rmtree(final)
        os.rename(tmp, final)
        rotate(output_dir, keep)
    sdist.barrier()
    return final


def rotate(output_dir: str, keep: int) -> None:
    """Remove the complete checkpoints older than the newest `keep`, except the one best.json names (--keep-best's
    is never rotated out). Called after each save, and again once best.json names the checkpoint just saved (the
    previous best, kept at the save, may then go)."""
    best = read_best(output_dir)
    for old in complete_checkpoints(output_dir)[:-keep]:
        if not (best and os.path.samefile(old, best["checkpoint"])):
            shutil.rmtree(old, ignore_errors=True)


def read_best(output_dir: str) -> dict | None:
    """checkpoints/best.json when it names a complete checkpoint."""
    try:
        with open(os.path.join(ckpt_root(output_dir), BEST)) as fh:
            best = json.load(fh)
    except (OSError, ValueError):
        return None
    ok = isinstance(best, dict) and os.path.isfile(os.path.join(str(best.get("checkpoint", "")), META))
    return best if ok else None


def remove_partial(output_dir: str) -> None:
    """Delete the debris of interrupted saves: step_N.tmp directories holding our marker.
    Complete checkpoints and anything without the marker are untouched."""
    root = ckpt_root(output_dir)
    if os.path.isdir(root):
        for d in os.listdir(root):
            if TMP_RE.match(d):
                _remove_own_tmp(os.path.join(root, d))


def _remove_own_tmp(path: str) -> None:
    if not os.path.islink(path) and os.path.isfile(os.path.join(path, PARTIAL_MARKER)):
        shutil.rmtree(path, ignore_errors=True)


# -- what a checkpoint records about itself, and its verification ---------------------------

ARCH_FIELDS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "vocab_size", "intermediate_size")


def model_arch(model_dir: str) -> dict:
    """The architecture-defining fields of a Hugging Face config.json (absent ones are None)."""
    with open(os.path.join(model_dir, "config.json")) as fh:
        c = json.load(fh)
    arch = {k: c.get(k) for k in ARCH_FIELDS}
    if arch["num_key_value_heads"] is None:
        arch["num_key_value_heads"] = arch["num_attention_heads"]
    return arch


def file_record(path: str) -> dict:
    """Sizes of every file of a checkpoint directory and the sha256 of DCP's .metadata."""
    sizes = {}
    for base, _dirs, files in os.walk(path):
        for f in files:
            full = os.path.join(base, f)
            sizes[os.path.relpath(full, path)] = os.path.getsize(full)
    return {"files": sizes, "metadata_sha256": _sha256(os.path.join(path, DCP_METADATA))}


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


RNG_FILE_RE = re.compile(r"rank\d+\.pt")


def problem(path: str, rng: bool = True) -> str | None:
    """What makes this checkpoint unusable (a damaged meta.json, missing/truncated files, a changed .metadata,
    with `rng` an unreadable rng/rankR.pt), or None. Cheap: sizes, one hash of the small .metadata file, and a
    read of the small RNG files (the shards are not read: garbage in them is found when they are loaded)."""
    try:
        with open(os.path.join(path, META)) as fh:
            meta = json.load(fh)
    except (OSError, ValueError) as e:
        return f"{META} unreadable ({first_line(e)})"
    why = meta_problem(meta, path)
    if why is not None:
        return why
    md = os.path.join(path, DCP_METADATA)
    if not os.path.isfile(md):
        return f"{DCP_METADATA} is missing"
    for rel, size in (meta.get("files") or {}).items():
        f = os.path.join(path, rel)
        if not os.path.isfile(f):
            return f"{rel} is missing"
        if os.path.getsize(f) != size:
            return f"{rel} has {os.path.getsize(f)} bytes, {size} were written"
    if meta.get("metadata_sha256") and _sha256(md) != meta["metadata_sha256"]:
        return f"{DCP_METADATA} differs from the one written (sha256)"
    rng_dir = os.path.join(path, "rng")
    if rng and os.path.isdir(rng_dir):
        for f in sorted(os.listdir(rng_dir)):
            if not RNG_FILE_RE.fullmatch(f):  # only what a save writes and a resume reads (a .DS_Store is no damage)
                continue
            why = _rng_problem(os.path.join(rng_dir, f))
            if why is not None:
                return f"rng/{f} is corrupt ({why})"
    return None


def _json_type(v) -> str:
    if v is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object"}.get(type(v), type(v).__name__)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def meta_problem(meta, path: str, required: tuple[str, ...] = ("step",)) -> str | None:
    """What is wrong with a checkpoint's meta.json (already parsed): a missing `required` key, a key of the wrong
    type, a value out of range; or None. Every reader of meta.json goes through this, so a damaged one is one
    line naming the key, not a traceback wherever the value is first used."""
    if not isinstance(meta, dict):
        return f"{META} is not a JSON object (it is {_json_type(meta)})"
    for key in required:
        if key not in meta:
            return f"{META} has no key '{key}'"

    def bad(key: str, want: str) -> str:
        v = meta
        for part in key.split("."):
            v = v[part]
        return f"{META} key '{key}' must be {want} (it is {_json_type(v)})"

    files = meta.get("files")
    if files is not None:
        if not isinstance(files, dict):
            return bad("files", "an object mapping each file to its size")
        for rel, size in files.items():
            if not _is_int(size) or size < 0:
                return f"{META} key 'files' gives {rel} the size {size!r}, not a byte count"
    if "metadata_sha256" in meta and not isinstance(meta["metadata_sha256"], str):
        return bad("metadata_sha256", "a string")
    step = meta.get("step")
    if "step" in meta:
        if not _is_int(step):
            return bad("step", "an integer")
        m = STEP_RE.match(os.path.basename(os.path.normpath(path)))
        if step < 0:
            return f"{META} key 'step' is {step}, less than 0"
        if m and int(m.group(1)) != step:
            return f"{META} key 'step' is {step}, but the checkpoint's directory is {m.group(0)}"
    for key, least in (("tokens_seen", 0), ("world_size", 1)):
        if key in meta and not _is_int(meta[key]):
            return bad(key, "an integer")
        if meta.get(key, least) < least:
            return f"{META} key '{key}' is {meta[key]}, less than {least}"
    if "strategy" in meta and not isinstance(meta["strategy"], str):
        return bad("strategy", "a string")
    for key in ("config", "model_arch"):
        if key in meta and not isinstance(meta[key], dict):
            return bad(key, "an object")
    config = meta.get("config") or {}
    for key in ("lora",):
        if key in config and not isinstance(config[key], dict):
            return bad(f"config.{key}", "an object")
    for key in ("first_loss", "wall_time_s"):
        if meta.get(key) is not None and (isinstance(meta[key], bool) or not isinstance(meta[key], (int, float))):
            return bad(key, "a number")
    if "data_position" in meta:
        pos = meta["data_position"]
        if not isinstance(pos, dict):
            return bad("data_position", "an object with the keys epoch and offset")
        if set(pos) - {"epoch", "offset"}:
            return f"{META} key 'data_position' has unknown keys {sorted(set(pos) - {'epoch', 'offset'})}"
        for key in ("epoch", "offset"):
            if key in pos and not _is_int(pos[key]):
                return bad(f"data_position.{key}", "an integer")
            if pos.get(key, 0) < 0:
                return f"{META} key 'data_position.{key}' is {pos[key]}, less than 0"
        # a step reads at most one new epoch; every row read holds at least one token
        if _is_int(step) and pos.get("epoch", 0) > step:
            return f"{META} key 'data_position.epoch' is {pos['epoch']}, more than the {step} steps taken"
        seen = meta.get("tokens_seen")
        if _is_int(seen) and pos.get("offset", 0) > seen:
            return (f"{META} key 'data_position.offset' is {pos['offset']} rows, more than the {seen} tokens the "
                    "run had read (tokens_seen)")
    return None


def weights_only_load(f):
    """torch.load(f, weights_only=True) without torch's warning about a pickle protocol other than its own (two lines
    printed before shardwise's one line refusing a tampered file: torch.save never writes such a file, so the warning
    only ever comes before a refusal)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected pickle protocol", category=UserWarning)
        return torch.load(f, weights_only=True)


def _rng_problem(f: str) -> str | None:
    try:
        _read_rng(f)
    except ValueError as e:
        return str(e)
    return None


def _read_rng(f: str) -> dict:
    """An rng/rankR.pt file's states, read as weights only and tried on a spare generator (never the process's
    own); ValueError saying what is wrong with it."""
    try:
        st = weights_only_load(f)
    except Exception as e:  # noqa: BLE001 - a damaged file raises almost anything
        glob = _UNSUPPORTED_GLOBAL.search(str(e))
        if glob:
            raise ValueError(f"it asks for '{glob.group(1)}', which a checkpoint never needs (a tampered or foreign "
                             "file; loading it could run code); nothing from it was used") from None
        raise ValueError(_load_error_text(e)) from None
    if not isinstance(st, dict) or not isinstance(st.get("cpu"), torch.Tensor) or st["cpu"].dtype != torch.uint8:
        raise ValueError("no CPU generator state in it")
    if "cuda" in st and (not isinstance(st["cuda"], torch.Tensor) or st["cuda"].dtype != torch.uint8):
        raise ValueError("its CUDA generator state is not a byte tensor")
    try:
        torch.Generator().set_state(st["cpu"])
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"its CPU generator state is invalid: {first_line(e)}") from None
    return st


# torch's weights-only refusal of a global: "Unsupported global: GLOBAL m.f ..." or "... unsupported GLOBAL m.f whose
# module m is blocked"; a pickle naming one was made to run code, not damaged by chance
_UNSUPPORTED_GLOBAL = re.compile(r"\bGLOBAL ([\w.]+)")


def _load_error_text(e: BaseException) -> str:
    """A torch.load failure in a few words, without the advice torch gives with weights_only failures (to load the
    file with weights_only=False, that is, to let it run code): a checkpoint never needs that."""
    text = str(e)
    if "Weights only load failed" in text:
        m = re.search(r"WeightsUnpickler error:\s*([^\n]+)", text)
        return m.group(1).strip()[:120] if m else "a damaged pickle"
    return first_line(e).split(". ")[0]  # PytorchStreamReader's line goes on with advice of its own


class CorruptCheckpoint(ShardwiseError):
    pass


def verify(path: str, rng: bool = True) -> dcp_metadata.Metadata:
    """Refuse a checkpoint that is incomplete, corrupt or asks to run code; returns DCP's
    metadata, read without running anything. Every byte range it names must exist. `rng`: its
    RNG files are read too (a resume restores them; an export does not need them)."""
    why = problem(path, rng)
    if why is not None:
        raise CorruptCheckpoint(f"checkpoint {path} is incomplete or corrupt: {why}; use an older checkpoint "
                                "(--resume auto picks the newest complete one)")
    md = read_dcp_metadata(path)
    for info in (md.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        f = os.path.join(path, str(rel))
        if not isinstance(rel, str) or os.path.dirname(rel) or not os.path.isfile(f):
            raise CorruptCheckpoint(f"checkpoint {path} is incomplete or corrupt: shard {rel} named by "
                                    f"{DCP_METADATA} is missing")
        if info.offset + info.length > os.path.getsize(f):
            raise CorruptCheckpoint(f"checkpoint {path} is incomplete or corrupt: shard {rel} is truncated "
                                    f"({os.path.getsize(f)} bytes, needs {info.offset + info.length})")
    return md


@functools.cache
def _metadata_classes() -> tuple[str, frozenset]:
    """DCP's metadata module and its dataclasses' names. torch.distributed.checkpoint is imported here, when a
    checkpoint is read, not with this module: the launcher uses this module on every run, and importing DCP
    costs it 0.6 s of CPU before the first step."""
    from torch.distributed.checkpoint import metadata as dcp_metadata

    return dcp_metadata.__name__, frozenset(n for n, v in vars(dcp_metadata).items()
                                            if isinstance(v, type) and v.__module__ == dcp_metadata.__name__)


_SAFE_GLOBALS = frozenset({
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
    *(("builtins", n) for n in ("set", "frozenset", "tuple", "list", "dict", "int", "float", "complex", "bool", "str",
                                "bytes", "bytearray", "slice")),
})


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata dataclasses, torch dtypes/Size/layouts and plain values only."""

    def __init__(self, data: bytes, where: str):
        super().__init__(io.BytesIO(data))
        self.where = where

    def find_class(self, module: str, name: str):
        md_module, md_classes = _metadata_classes()
        ok = ((module == md_module and name in md_classes) or (module, name) in _SAFE_GLOBALS
              or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)))
        if not ok:
            raise ShardwiseError(f"checkpoint {self.where}: refused to load: its {DCP_METADATA} asks for "
                                 f"'{module}.{name}', which a checkpoint never needs (a tampered or foreign file; "
                                 "loading it could run code); nothing was loaded")
        return super().find_class(module, name)

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("persistent ids are not allowed")


def read_dcp_metadata(path: str, filename: str = DCP_METADATA) -> dcp_metadata.Metadata:
    from torch.distributed.checkpoint import metadata as dcp_metadata

    try:
        with open(os.path.join(path, filename), "rb") as fh:
            data = fh.read()
    except OSError as e:
        raise CorruptCheckpoint(f"checkpoint {path}: cannot read {filename} ({e.strerror})")
    try:
        md = _MetadataUnpickler(data, path).load()
    except ShardwiseError:
        raise
    except Exception as e:  # noqa: BLE001 - a damaged pickle raises almost anything
        raise CorruptCheckpoint(f"checkpoint {path} is incomplete or corrupt: {filename} unreadable "
                                f"({first_line(e)})")
    if not isinstance(md, dcp_metadata.Metadata):
        raise CorruptCheckpoint(f"checkpoint {path} is incomplete or corrupt: {filename} holds no DCP metadata")
    return md


@functools.cache
def _safe_io() -> tuple[type, type]:
    """(SafeReader, SafeLoadPlanner): DCP's reader and planner, subclassed here on first use (DCP imported then)."""
    from torch.distributed.checkpoint import metadata as dcp_metadata
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.futures import Future

    class SafeReader(FileSystemReader):
        """DCP's file reader with .metadata read by the restricted unpickler, and a shard that cannot be read
        named in one line (DCP's own error is torch's advice to load it with weights_only=False)."""

        def read_data(self, plan, planner):
            by_file: dict[str, list] = {}
            for item in plan.items:
                by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
            for rel, items in by_file.items():  # one file at a time, so that a failure names its file
                try:
                    super().read_data(dataclasses.replace(plan, items=items), planner).wait()
                except (ShardwiseError, AssertionError):  # refused by us; a size mismatch (another model)
                    raise
                except Exception as e:  # noqa: BLE001 - a damaged file raises almost anything
                    glob = _UNSUPPORTED_GLOBAL.search(str(e))
                    if glob:
                        raise ShardwiseError(f"checkpoint {self.path}: refused to load {rel}: it asks for "
                                             f"'{glob.group(1)}', which a checkpoint never needs (a tampered or "
                                             "foreign file; loading it could run code); nothing from it was used")
                    raise CorruptCheckpoint(damaged(str(self.path), f"{rel} is corrupt (unreadable tensor data: "
                                                                    f"{_load_error_text(e)})")) from None
            fut = Future()
            fut.set_result(None)
            return fut

        def read_metadata(self, *args, **kwargs) -> dcp_metadata.Metadata:
            rank = kwargs.get("rank")
            md = read_dcp_metadata(str(self.path), DCP_METADATA if rank is None else f"__{rank}{DCP_METADATA}")
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = dcp_metadata.StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    class SafeLoadPlanner(DefaultLoadPlanner):
        """DCP's planner, with non-tensor items (optimizer hyper-parameters, ...) checked by
        torch's weights_only unpickler before DCP reads them."""

        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            try:
                weights_only_load(value)
            except Exception as e:  # noqa: BLE001
                glob = _UNSUPPORTED_GLOBAL.search(str(e))
                if glob is None:  # damaged, not tampered: SafeReader names the file
                    raise
                raise ShardwiseError(f"refused to load item {read_item.dest_index.fqn} of the checkpoint: it asks "
                                     f"for '{glob.group(1)}', which a checkpoint never needs (a tampered or foreign "
                                     "file; loading it could run code); nothing from it was used")
            value.seek(0)
            super().load_bytes(read_item, value)

    return SafeReader, SafeLoadPlanner


def __getattr__(name: str):
    if name in ("SafeReader", "SafeLoadPlanner"):
        return _safe_io()[name == "SafeLoadPlanner"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    os.chmod(path, 0o777 & ~mask)
    for base, dirs, files in os.walk(path):
        for f in files:
            os.chmod(os.path.join(base, f), 0o666 & ~mask)
        for d in dirs:
            os.chmod(os.path.join(base, d), 0o777 & ~mask)


def disk_full(e: BaseException, path: str) -> bool:
    """Whether a failed write under `path` is a full disk (or quota): the error says so, or little space is left."""
    return rundir.is_disk_full(e) or _free_bytes(path) < 64 * 2**20


def _free_bytes(path: str) -> int:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 0


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:200]


def load(path: str, state: dict, no_dist: bool = False) -> None:
    """Fill `state` (from strategy.state_dict) in place from a checkpoint, resharding;
    verified first, and read without running anything it holds."""
    verify(path, rng=False)  # restore_rng reads the RNG files (and the launcher's verify did)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader, planner = _safe_io()
    try:
        with warnings.catch_warnings():  # in one process (export, chat): DCP says it assumes so, on every load
            warnings.filterwarnings("ignore", message=r"torch.distributed is disabled, unavailable or uninitialized",
                                    category=UserWarning)
            dcp.load(state, checkpoint_id=path, storage_reader=reader(path), planner=planner(),
                     no_dist=no_dist)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's exception is a BaseException
        inner = [f[0] if isinstance(f, tuple) else f for f in getattr(e, "failures", {}).values()]
        ours = [x for x in (e, *inner) if isinstance(x, ShardwiseError)]
        if ours:
            raise ShardwiseError(str(ours[0])) from None
        raise ShardwiseError(f"checkpoint {path}: cannot load it ({_load_error_text(inner[0] if inner else e)}); "
                             "it may not match this model or tuner") from None


def damaged(path: str, what: str) -> str:
    """The line for a checkpoint found damaged while it is read, naming the newest intact one before it."""
    older = _older_intact(path)
    return (f"checkpoint {path}: {what}; the checkpoint is damaged, use an older one"
            + (f": {older}" if older else " (none older is intact in its directory)"))


def _older_intact(path: str) -> str | None:
    root, name = os.path.split(os.path.normpath(path))
    if not STEP_RE.match(name) or not os.path.isdir(root):
        return None
    for d in sorted((d for d in os.listdir(root) if STEP_RE.match(d) and d < name), reverse=True):
        if os.path.isfile(os.path.join(root, d, META)) and problem(os.path.join(root, d)) is None:
            return os.path.join(root, d)
    return None


# the grouped form's list of names per group; the flat form has no "params" entry (a parameter named
# "<i>.params" gives "optim.param_groups.<i>.params.lr", never ".params" or ".params.<digits>")
_GROUPED_OPTIM = re.compile(r"^optim\.param_groups\.\d+\.params(\.\d+)?$")


def optimizer_is_flat(path: str) -> bool:
    """Whether the checkpoint keys its optimizer state by parameter name alone (Strategy.state_dict's flat
    form, every checkpoint written now) rather than by parameter-group index (written before): the form
    to ask the strategy for when loading it. Read from DCP's .metadata through the restricted unpickler."""
    keys = read_dcp_metadata(path).state_dict_metadata
    return not any(_GROUPED_OPTIM.match(k) for k in keys)


def rng_state() -> dict:
    out = {"cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def restore_rng(path: str, rank: int) -> bool:
    f = os.path.join(path, "rng", f"rank{rank}.pt")
    if not os.path.isfile(f):
        return False
    try:
        st = _read_rng(f)
    except ValueError as e:
        raise CorruptCheckpoint(damaged(path, f"rng/rank{rank}.pt is corrupt ({e})")) from None
    torch.random.set_rng_state(st["cpu"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state(st["cuda"])
    return True
