"""Load a local Hugging Face causal LM and its tokenizer: no network, SDPA attention,
safetensors only, `trust_remote_code` off unless asked."""

from __future__ import annotations

import os
import sys

from shardwise.errors import ShardwiseError

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def resolve_model_dir(model: str, seed: int) -> str:
    """'tiny' -> the built-in model's directory; a path -> checked to be a usable HF dir."""
    if model == "tiny":
        from shardwise.models.tiny import tiny_dir

        return tiny_dir(seed)
    path = os.path.abspath(os.path.expanduser(model))
    if not os.path.isdir(path):
        raise ShardwiseError(f"--model {model}: no such directory; give a local Hugging Face model directory or 'tiny'")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ShardwiseError(f"--model {model}: no config.json in it; is this a Hugging Face model directory?")
    if not any(os.path.isfile(os.path.join(path, f)) for f in WEIGHT_FILES):
        bins = [f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth"))]
        hint = (" (found pickle weights " + ", ".join(sorted(bins)[:3]) + ": convert them to safetensors, "
                "e.g. load and save_pretrained once in a trusted environment)") if bins else ""
        raise ShardwiseError(f"--model {model}: no safetensors weights (model.safetensors or its index){hint}")
    return path


# (transformers' availability check, the transformers module that imports the package when it is itself imported):
# optional packages imported for code a causal LM's training never runs
LEAN_SKIPS = (
    ("is_sklearn_available", "transformers.generation.candidate_generator"),  # assisted decoding's roc_curve
    ("is_scipy_available", "transformers.loss.loss_for_object_detection"),  # detection losses' matching
)


def _unavailable() -> bool:
    return False


def lean_transformers() -> None:
    """Keep scikit-learn and SciPy out of a training process. transformers imports them, where installed, when
    modules every model class and AutoTokenizer import are imported (LEAN_SKIPS): scikit-learn with the generation
    module in some releases (5.17, on the H200 machine: 1.8-1.9 s there, SciPy's stats and pandas with it), SciPy's
    optimiser with the loss module (5.17 and 5.24: 0.4 s on this CPU box). Training never runs the code they serve.
    Called before shardwise's first import of transformers' model or tokenizer classes: for each package whose
    importing module is not imported yet, transformers' availability check reports it unavailable in this process.
    A model's own code can still import either package itself."""
    try:
        import transformers.utils as tu
        from transformers.utils import import_utils
    except Exception:  # noqa: BLE001 - no transformers: the caller's own import reports it
        return
    for check, importer in LEAN_SKIPS:
        if importer not in sys.modules:  # imported already: nothing left to save
            for module in (tu, import_utils):
                if hasattr(module, check):
                    setattr(module, check, _unavailable)


def check_weights(model_dir: str) -> dict[str, list[int]]:
    """Every safetensors file is complete: its header parses and the file is as long as
    the header says. Catches truncated downloads and copies before any worker starts.
    Returns {tensor name: shape} from the headers."""
    import json
    import struct

    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as fh:
                files = sorted(set(json.load(fh)["weight_map"].values()))
        except (OSError, ValueError, KeyError) as e:
            raise ShardwiseError(f"--model {model_dir}: model.safetensors.index.json is unreadable ({e})")
    else:
        files = ["model.safetensors"]
    shapes = {}
    for f in files:
        path = os.path.join(model_dir, f)
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                if n > size:
                    raise ValueError("header longer than the file")
                header = json.loads(fh.read(n))
            end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        except (OSError, ValueError, struct.error, KeyError, TypeError) as e:
            raise ShardwiseError(f"--model {model_dir}: {f} is missing or corrupt ({e}); re-copy the weights")
        if size < 8 + n + end:
            raise ShardwiseError(f"--model {model_dir}: {f} is truncated ({size} of {8 + n + end} bytes); "
                                 "re-copy the weights")
        shapes.update({k: v.get("shape") for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)})
    return shapes


def check_shapes(model_dir: str, shapes: dict, trust_remote_code: bool = False):
    """The weights' shapes (from the safetensors headers) are those config.json describes:
    the model is built on the meta device (no memory, no weights read) and every tensor both
    name is compared, so a mismatch is one line before launch, not an error in each worker.
    Returns the meta-device model (None where it was not built: custom code, packed weights, a build error)."""
    import torch

    lean_transformers()
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True, trust_remote_code=trust_remote_code)
        if getattr(config, "auto_map", None) and not trust_remote_code:
            return None  # custom code: the worker's load refuses it with its own message
        if getattr(config, "quantization_config", None):
            return None  # pre-quantized weights are stored packed, in shapes of their own
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except Exception:
        return None  # the worker's load_model reports what is wrong with the directory
    expected = {k: list(v.shape) for k, v in model.state_dict().items()}
    base = getattr(model, "base_model_prefix", "")
    for name, shape in shapes.items():
        want = expected.get(name, expected.get(f"{base}.{name}") if base else None)
        if want is not None and shape is not None and list(shape) != want:
            raise ShardwiseError(f"--model {model_dir}: weight {name} has shape {list(shape)} but config.json "
                                 f"describes {want}; the weights and config.json are from different models")
    return model


# What passed the checks above is remembered (issue 17.3: time to first step). Building the model on the meta
# device imports transformers' modelling stack, 1.9 s of the launcher's CPU on the tiny job, for a directory whose
# config and weight headers the launcher has already checked in an earlier run. An entry is an empty-named marker,
# $SHARDWISE_CACHE_DIR/checks/<key>.json: its key covers everything the checks read, and the checks' own code, so a
# changed file, version, setting or check is checked again; a refusal is never remembered.
CHECKS_KEEP = 64


def checks_dir() -> str:
    from shardwise.hardware import cache_dir

    return os.path.join(cache_dir(), "checks")


def checks_key(model_dir: str, shapes: dict, settings: list) -> str:
    """SHA-256 over everything the model checks read: config.json and the directory's code files (*.py), the
    weights' names and shapes (from their headers), the torch and transformers versions, `settings` (the checks'
    other inputs: remote code, tuner, adapter targets and rank), and the source of the modules the checks live in
    (this one, models/lora.py), so a check made stricter is made again."""
    import hashlib
    import json
    from importlib import metadata

    import torch

    try:
        tf_version = metadata.version("transformers")
    except metadata.PackageNotFoundError:  # a source tree on PYTHONPATH: no installed metadata
        import transformers

        tf_version = transformers.__version__
    h = hashlib.sha256(json.dumps([torch.__version__, tf_version, settings, sorted(shapes.items())],
                                  default=repr).encode())
    here = os.path.dirname(os.path.abspath(__file__))
    for path in (os.path.join(here, "load.py"), os.path.join(here, "lora.py")):
        with open(path, "rb") as fh:
            h.update(fh.read())
    for name in sorted(os.listdir(model_dir)):
        path = os.path.join(model_dir, name)
        if (name == "config.json" or name.endswith(".py")) and os.path.isfile(path):
            h.update(f"\0{name}\0".encode())
            with open(path, "rb") as fh:
                h.update(fh.read())
    return h.hexdigest()


def passed_before(key: str) -> bool:
    """Whether these files and settings passed the checks in an earlier run: a record this user wrote, in a folder
    nobody else can write (a record planted by another user, or through a link, does not skip the checks)."""
    import stat

    from shardwise.hardware import folder_problem

    folder = checks_dir()
    path = os.path.join(folder, f"{key}.json")
    try:
        if folder_problem(folder, tighten=True):  # only the folder's writers can make a record: its name is the key
            return False
        st = os.lstat(path)
    except OSError:  # no folder, no record
        return False
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        return False
    try:
        os.utime(path, follow_symlinks=False)  # most recently used: kept by the pruning below
    except OSError:
        pass
    return True


def remember_passed(key: str, model_dir: str) -> None:
    """Best effort: a cache directory that cannot be written costs the next run the checks, nothing else."""
    import json
    import time

    from shardwise.rundir import atomic_write, prune_keyed

    folder = checks_dir()
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        atomic_write(os.path.join(folder, f"{key}.json"),
                     json.dumps({"model_dir": model_dir, "checked": time.strftime("%Y-%m-%dT%H:%M:%S")}))
    except OSError:
        return
    prune_keyed(folder, ".json", CHECKS_KEEP)


def load_tokenizer(model_dir: str, trust_remote_code: bool = False):
    lean_transformers()
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as e:  # transformers raises many types here
        first = str(e).splitlines()[0][:200] if str(e).strip() else ""
        raise ShardwiseError(f"--model {model_dir}: cannot load its tokenizer ({type(e).__name__}: {first}); copy the "
                             "tokenizer files (tokenizer.json or the model's vocabulary files, tokenizer_config.json) "
                             "from the model it was trained from into this directory") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token if tok.eos_token is not None else tok.unk_token
    return tok


def load_model(model_dir: str, dtype, trust_remote_code: bool = False):
    """The model on the CPU in `dtype`, loaded from safetensors with SDPA attention."""
    lean_transformers()
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=dtype, attn_implementation="sdpa", local_files_only=True,
            trust_remote_code=trust_remote_code, use_safetensors=True,
        )
    except Exception as e:
        msg = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
        raise ShardwiseError(f"--model {model_dir}: cannot load the model ({type(e).__name__}: {msg}); "
                             "check that its weights are complete and match config.json")
    model.config.use_cache = False
    return model


def max_positions(model_dir: str) -> int | None:
    import json

    with open(os.path.join(model_dir, "config.json")) as fh:
        cfg = json.load(fh)
    return cfg.get("max_position_embeddings")


def model_family(model_dir: str, trust_remote_code: bool = False) -> str | None:
    """config.json's model_type: the transformers family whose modelling code trains it. None when it names none,
    or when the directory's own code runs instead (--trust-remote-code with an auto_map naming a causal LM)."""
    import json

    with open(os.path.join(model_dir, "config.json")) as fh:
        cfg = json.load(fh)
    if trust_remote_code and "AutoModelForCausalLM" in (cfg.get("auto_map") or {}):
        return None
    family = cfg.get("model_type")
    return family if isinstance(family, str) else None
