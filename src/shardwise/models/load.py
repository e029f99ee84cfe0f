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


HUB_ID = r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*"


def hub_snapshot(model: str, where: str) -> str | None:
    """A hub id (ORG/NAME) that is no local path -> its snapshot directory in the local Hugging Face cache
    (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub), looked up offline by huggingface_hub itself;
    None for anything else (a path, 'tiny'). Not in the cache: one line naming the command that downloads it."""
    import re

    if model == "tiny" or os.path.exists(os.path.expanduser(model)) or not re.fullmatch(HUB_ID, model):
        return None
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = snapshot_download(model, local_files_only=True)
    except LocalEntryNotFoundError:
        raise ShardwiseError(f"{where}: {model} is no local directory and is not in the Hugging Face cache "
                             f"({constants.HF_HUB_CACHE}); download it with `hf download {model}` (or "
                             f"`huggingface-cli download {model}` with an older huggingface_hub), or give the "
                             "model's local directory") from None
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
    optimiser with the loss module (5.17 and 5.24: 0.4 s on a 2-core CPU host). Training never runs the code they
    serve.
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


def check_weights(model_dir: str, what: str | None = None) -> dict[str, list[int]]:
    """Every safetensors file is complete: its header parses and the file is as long as
    the header says. Catches truncated downloads and copies before any worker starts.
    Returns {tensor name: shape} from the headers. `what` names the directory in messages (default --model DIR)."""
    import json

    what = what or f"--model {model_dir}"
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as fh:
                files = sorted(set(json.load(fh)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ShardwiseError(f"{what}: model.safetensors.index.json is unreadable ({e}); re-copy it from the "
                                 "model it came from")
    else:
        files = ["model.safetensors"]
    shapes = {}
    for f in files:
        shapes.update(safetensors_shapes(os.path.join(model_dir, f), f"{what}: {f}", "re-copy the weights"))
    return shapes


def safetensors_shapes(path: str, where: str, todo: str) -> dict[str, list[int]]:
    """{tensor name: shape} from a safetensors file's header, the file checked to be as long as the header says;
    one line (`where`: what is wrong; `todo`) for a missing, corrupt or truncated file."""
    import json
    import struct

    try:
        size = os.path.getsize(path)
        with open(path, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > size:
                raise ValueError("header longer than the file")
            header = json.loads(fh.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, struct.error, KeyError, TypeError, AttributeError) as e:
        raise ShardwiseError(f"{where} is missing or corrupt ({e}); {todo}") from None
    if size < 8 + n + end:
        raise ShardwiseError(f"{where} is truncated ({size} of {8 + n + end} bytes); {todo}")
    return {k: v.get("shape") for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)}


def check_shapes(model_dir: str, shapes: dict, trust_remote_code: bool = False, what: str | None = None):
    """config.json builds a model, and the weights' shapes (from the safetensors headers) are those it describes:
    the config is read and the model built on the meta device (no memory, no weights read), as the workers'
    from_pretrained will, and every tensor both name is compared, so a value transformers refuses or a mismatch is
    one line before launch, not an error in each worker. Returns the meta-device model (None where it was not built:
    custom code without --trust-remote-code, packed weights)."""
    import json

    import torch

    what = what or f"--model {model_dir}"
    try:
        with open(os.path.join(model_dir, "config.json"), "rb") as fh:
            raw = json.load(fh)
    except (OSError, ValueError):  # AutoConfig says what is wrong with it, below
        raw = None
    if isinstance(raw, dict) and raw.get("auto_map") and not trust_remote_code:
        return None  # custom code: the worker's load refuses it with its own message
    lean_transformers()
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True, trust_remote_code=trust_remote_code)
        if getattr(config, "auto_map", None) and not trust_remote_code:
            return None
        if getattr(config, "quantization_config", None):
            return None  # pre-quantized weights are stored packed, in shapes of their own
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - transformers raises many types; from_pretrained in the workers would too
        raise ShardwiseError(config_problem(model_dir, e, what)) from None
    expected = {k: list(v.shape) for k, v in model.state_dict().items()}
    base = getattr(model, "base_model_prefix", "")
    for name, shape in shapes.items():
        want = expected.get(name, expected.get(f"{base}.{name}") if base else None)
        if want is not None and shape is not None and list(shape) != want:
            raise ShardwiseError(f"{what}: weight {name} has shape {list(shape)} but config.json "
                                 f"describes {want}; the weights and config.json are from different models")
    return model


# config.json sizes the launcher and the planner read before transformers does (heads for tensor and sequence
# parallelism, max_position_embeddings against seq_len): each a positive integer where given (null, or a list of
# them, as some families have, is left to transformers)
SIZE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "max_position_embeddings")


def config_size_problem(cfg: dict) -> str | None:
    """'KEY is VALUE (a string); it must be a positive integer' for the first size key of config.json (or of its
    text_config) that is not a number of things, else None."""
    import json

    for scope, d in (("", cfg), ("text_config.", cfg.get("text_config"))):
        if not isinstance(d, dict):
            continue
        for k in SIZE_KEYS:
            v = d.get(k)
            if v is None or isinstance(v, list) or (isinstance(v, int) and not isinstance(v, bool) and v > 0):
                continue
            kind = {str: " (a string)", bool: " (a boolean)", float: " (a decimal number)", dict: " (an object)"}
            return f"{scope}{k} is {json.dumps(v)}{kind.get(type(v), '')}; it must be a positive integer"
    return None


def _value_choices(key: str) -> str:
    """' (one of ...)' for a config key whose values transformers looks up in a table, else ''."""
    leaf = key.rsplit(".", 1)[-1]
    try:
        if leaf in ("hidden_act", "hidden_activation", "activation_function"):
            from transformers.activations import ACT2FN

            return f" (one of {', '.join(sorted(ACT2FN))})"
        if leaf in ("rope_type", "type"):
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            return f" (one of default, {', '.join(ROPE_INIT_FUNCTIONS)})"
    except ImportError:
        pass
    return ""


def _key_of(raw, value, prefix: str = "") -> str | None:
    """The dotted config.json key holding `value` (nested objects included), or None."""
    if not isinstance(raw, dict):
        return None
    for k, v in raw.items():
        if isinstance(v, str) and v == value:
            return prefix + k
    for k, v in raw.items():
        found = _key_of(v, value, f"{prefix}{k}.")
        if found:
            return found
    return None


def config_problem(model_dir: str, e: Exception, what: str) -> str:
    """One line for an error transformers raised reading config.json or building the model it describes: the key
    and its value where they can be told (a field of the wrong type, an unknown model_type, a value looked up in a
    table such as hidden_act or rope_type), else the error's first line; naming config.json and what to do."""
    import json
    import re

    from transformers import __version__ as tf_version

    try:
        with open(os.path.join(model_dir, "config.json"), "rb") as fh:
            raw = json.load(fh)
    except (OSError, ValueError):
        raw = {}
    raw = raw if isinstance(raw, dict) else {}
    text = str(e).strip()
    first = text.splitlines()[0][:200] if text else type(e).__name__
    fix = "fix it in config.json, or copy config.json from the model the weights come from"
    if "trust_remote_code" in text:
        return f"{what}: config.json needs the directory's own code (auto_map); pass --trust-remote-code if you trust it"
    field = re.match(r"Validation error for field '([^']+)'", text)
    if field:  # transformers' typed config fields: "... field 'hidden_size':\n  TypeError: Field ... got str ..."
        detail = text.splitlines()[-1].strip()[:200] if len(text.splitlines()) > 1 else first
        return f"{what}: config.json {field.group(1)} {json.dumps(raw.get(field.group(1)))}: {detail}; {fix}"
    family = raw.get("model_type")
    if "does not recognize this architecture" in text or ("Unrecognized model" in text and "model_type" in text):
        if not family:
            return f"{what}: config.json has no model_type; add the model's family (e.g. \"llama\", \"qwen2\"), {fix}"
        return (f"{what}: config.json model_type {json.dumps(family)} is not a model family transformers "
                f"{tf_version} knows; fix model_type, or upgrade transformers if the model is newer than it")
    if "Unrecognized configuration class" in text:
        return (f"{what}: config.json model_type {json.dumps(family)} is not a causal language model (transformers "
                "has no AutoModelForCausalLM class for it); give a decoder-only model such as Llama or Qwen")
    if isinstance(e, KeyError) and e.args and isinstance(e.args[0], str):
        key = _key_of(raw, e.args[0])
        if key:
            return (f"{what}: config.json {key} {json.dumps(e.args[0])} is not a value transformers {tf_version} "
                    f"knows{_value_choices(key)}; {fix}")
    return (f"{what}: transformers cannot build the model config.json describes ({type(e).__name__}: {first}); "
            f"{fix}")


# What passed the checks above is remembered: a repeat launch reaches its first step sooner. Building on the meta
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


# Files a tokenizer is built from (transformers' tokenizer classes' vocab_files_names, and tokenizer_config.json);
# a directory with none of them gets an empty tokenizer from transformers, not an error.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "spiece.model", "vocab.json",
                   "vocab.txt", "merges.txt", "tekken.json", "sentencepiece.bpe.model", "vocab.model")
TOKENIZER_JSON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")


def _has_tokenizer_files(model_dir: str) -> bool:
    try:
        names = os.listdir(model_dir)
    except OSError:
        return True  # AutoTokenizer says what is wrong
    return any(n in TOKENIZER_FILES or n.endswith((".tiktoken", ".model")) for n in names)


def _bad_json_file(model_dir: str, names) -> str | None:
    """'NAME:LINE: not valid JSON (why)' for the first of `names` in the directory that is not JSON, else None."""
    import json

    for name in names:
        path = os.path.join(model_dir, name)
        if not os.path.isfile(path):
            continue
        try:
            with open(path, "rb") as fh:
                json.load(fh)
        except json.JSONDecodeError as e:
            return f"{name}:{e.lineno}: not valid JSON ({e.msg})"
        except (OSError, ValueError) as e:
            return f"{name}: unreadable ({str(e).splitlines()[0][:200] if str(e) else type(e).__name__})"
    return None


def config_vocab_size(model_dir: str) -> int | None:
    """config.json's vocab_size (the rows of the model's input embedding), or None where it names none."""
    import json

    try:
        with open(os.path.join(model_dir, "config.json"), "rb") as fh:
            cfg = json.load(fh)
    except (OSError, ValueError):
        return None
    n = cfg.get("vocab_size") if isinstance(cfg, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def own_vocab_top(tok) -> int | None:
    """The largest id of the tokenizer's own vocabulary (its model's: added tokens not counted), or None."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        return max(backend.get_vocab(with_added_tokens=False).values(), default=-1)
    n = getattr(tok, "vocab_size", None)  # a Python tokenizer: its vocabulary's ids are 0..n-1
    return n - 1 if isinstance(n, int) else None


def load_tokenizer(model_dir: str, trust_remote_code: bool = False, what: str | None = None,
                   vocab_dir: str | None = None):
    """The directory's tokenizer, with a pad token; one line (`what`: default --model DIR) for missing or broken
    tokenizer files (naming the file), a config.json transformers refuses, or a tokenizer of another model.

    Token ids against the model's embedding (config.json vocab_size, of `vocab_dir`, default `model_dir`): the
    tokenizer's own vocabulary (its model's, the ids ordinary text becomes) must fit, else it is another model's
    and is refused here. Added tokens past the embedding are not refused here: real tokenizers have them and text
    never produces them (transformers' Qwen2 tokenizer adds <|endoftext|> at id vocab_size to a 512-token model);
    the tokenizer carries `shardwise_vocab` = (vocab_size or None, `what`), and encode refuses data holding one."""
    lean_transformers()
    from transformers import AutoTokenizer

    what = what or f"--model {model_dir}"
    copy = ("copy the tokenizer files (tokenizer.json or the model's vocabulary files, tokenizer_config.json) from "
            "the model it was trained from into this directory")
    if not _has_tokenizer_files(model_dir):
        raise ShardwiseError(f"{what}: cannot load its tokenizer (no tokenizer files: none of "
                             f"{', '.join(TOKENIZER_FILES[:4])}, ...); {copy}")
    try:
        tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as e:  # transformers raises many types here
        bad = _bad_json_file(model_dir, TOKENIZER_JSON)
        if bad:
            raise ShardwiseError(f"{what}: {bad}; fix the file, or copy it from the model it was trained from") \
                from None
        _check_config(model_dir, trust_remote_code, what)  # AutoTokenizer reads config.json too
        first = str(e).splitlines()[0][:200] if str(e).strip() else ""
        if "trust_remote_code" in str(e):
            copy = "it needs the directory's own code: pass --trust-remote-code if you trust it"
        raise ShardwiseError(f"{what}: cannot load its tokenizer ({type(e).__name__}: {first}); {copy}") from None
    try:
        probe = tok("hello world", add_special_tokens=False)["input_ids"]
    except Exception as e:  # noqa: BLE001 - a tokenizer that cannot encode text: one line, not a traceback
        raise ShardwiseError(f"{what}: its tokenizer cannot encode text ({type(e).__name__}: "
                             f"{str(e).splitlines()[0][:200] if str(e) else ''}); {copy}") from None
    if not probe:  # files present, no vocabulary in them
        raise ShardwiseError(f"{what}: its tokenizer has no vocabulary ({len(tok)} token(s); text encodes to "
                             f"nothing): the tokenizer files are incomplete; {copy}")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token if tok.eos_token is not None else tok.unk_token
    vocab = config_vocab_size(vocab_dir or model_dir)
    top = own_vocab_top(tok) if vocab is not None else None
    if top is not None and top >= vocab:
        if vocab_dir in (None, model_dir):
            config, todo = "config.json", ("the tokenizer is from another model: copy its tokenizer files from the "
                                           "model the weights come from")
        else:  # an adapter's tokenizer against the base model's vocabulary
            config, todo = os.path.join(vocab_dir, "config.json"), (
                "the tokenizer is not that model's: the adapter was trained on another base model; pass --base with "
                "the model it was trained from")
        raise ShardwiseError(f"{what}: its tokenizer's vocabulary has ids up to {top} ({len(tok)} tokens) but "
                             f"{config} vocab_size is {vocab} (the model embeds ids 0-{vocab - 1}); {todo}")
    tok.shardwise_vocab = (vocab, what)
    return tok


def _check_config(model_dir: str, trust_remote_code: bool, what: str) -> None:
    """Raise config_problem's line if transformers cannot read config.json."""
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(model_dir, local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - transformers raises many types here
        raise ShardwiseError(config_problem(model_dir, e, what)) from None


def load_model(model_dir: str, dtype, trust_remote_code: bool = False, what: str | None = None):
    """The model on the CPU in `dtype`, loaded from safetensors with SDPA attention."""
    lean_transformers()
    from transformers import AutoModelForCausalLM

    what = what or f"--model {model_dir}"
    try:
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=dtype, attn_implementation="sdpa", local_files_only=True,
            trust_remote_code=trust_remote_code, use_safetensors=True,
        )
    except Exception as e:
        _check_config(model_dir, trust_remote_code, what)
        raise ShardwiseError(load_failure(e, what)) from None
    model.config.use_cache = False
    return model


# what in a from_pretrained failure says the weights are at fault (missing, truncated, of other shapes)
_WEIGHTS_WORDS = ("safetensors", "size mismatch", "shape", "weight", "checkpoint", "header", "deserializ", "tensor")


def load_failure(e: Exception, what: str) -> str:
    """The one line for a model that transformers would not load: the weights' advice (re-copy them) only where the
    error is about the weights; transformers' own refusal of the model otherwise (an attention it lacks)."""
    msg = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
    if "does not support an attention implementation" in msg:
        return (f"{what}: transformers has no SDPA attention for {msg.split()[0]}, the attention shardwise trains "
                "with; shardwise cannot train this model family (current decoder families, Llama, Qwen, Mistral, Gemma, "
                "have SDPA)")
    if isinstance(e, OSError) or type(e).__name__ == "SafetensorError" or any(w in msg.lower()
                                                                              for w in _WEIGHTS_WORDS):
        return (f"{what}: cannot load the model ({type(e).__name__}: {msg}); check that its weights are complete "
                "and match config.json (re-copy them from where they came from)")
    return f"{what}: transformers cannot load this model ({type(e).__name__}: {msg})"


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
