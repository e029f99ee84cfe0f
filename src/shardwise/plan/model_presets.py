"""Published configs of common model families, written from their config.json values, and
`resolve_model`, which turns --model (a directory, a preset, 'tiny' or a count) into a ModelSpec.

Each entry names the Hugging Face repository whose config.json the numbers come from.
Columns: vocab, hidden, intermediate, layers, heads, KV heads, head_dim, tied, max positions.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace

from shardwise.errors import ShardwiseError
from shardwise.plan.model_spec import PARAM_COUNT, ModelSpec, from_count, from_hf_config, tiny_config

_ROWS = {
    # name: (HF repo, model_type, vocab, hidden, inter, layers, heads, kv, head_dim, tied, max_pos)
    "llama-3.2-1b": ("meta-llama/Llama-3.2-1B", "llama", 128256, 2048, 8192, 16, 32, 8, 64, True, 131072),
    "llama-3.2-3b": ("meta-llama/Llama-3.2-3B", "llama", 128256, 3072, 8192, 28, 24, 8, 128, True, 131072),
    "llama-3.1-8b": ("meta-llama/Llama-3.1-8B", "llama", 128256, 4096, 14336, 32, 32, 8, 128, False, 131072),
    "llama-3.1-70b": ("meta-llama/Llama-3.1-70B", "llama", 128256, 8192, 28672, 80, 64, 8, 128, False, 131072),
    "llama-3.3-70b": ("meta-llama/Llama-3.3-70B-Instruct", "llama", 128256, 8192, 28672, 80, 64, 8, 128, False, 131072),
    "qwen2.5-0.5b": ("Qwen/Qwen2.5-0.5B", "qwen2", 151936, 896, 4864, 24, 14, 2, 64, True, 32768),
    "qwen2.5-1.5b": ("Qwen/Qwen2.5-1.5B", "qwen2", 151936, 1536, 8960, 28, 12, 2, 128, True, 131072),
    "qwen2.5-3b": ("Qwen/Qwen2.5-3B", "qwen2", 151936, 2048, 11008, 36, 16, 2, 128, True, 32768),
    "qwen2.5-7b": ("Qwen/Qwen2.5-7B", "qwen2", 152064, 3584, 18944, 28, 28, 4, 128, False, 131072),
    "qwen2.5-14b": ("Qwen/Qwen2.5-14B", "qwen2", 152064, 5120, 13824, 48, 40, 8, 128, False, 131072),
    "qwen2.5-32b": ("Qwen/Qwen2.5-32B", "qwen2", 152064, 5120, 27648, 64, 40, 8, 128, False, 131072),
    "qwen2.5-72b": ("Qwen/Qwen2.5-72B", "qwen2", 152064, 8192, 29568, 80, 64, 8, 128, False, 131072),
    "qwen3-0.6b": ("Qwen/Qwen3-0.6B", "qwen3", 151936, 1024, 3072, 28, 16, 8, 128, True, 40960),
    "qwen3-1.7b": ("Qwen/Qwen3-1.7B", "qwen3", 151936, 2048, 6144, 28, 16, 8, 128, True, 40960),
    "qwen3-4b": ("Qwen/Qwen3-4B", "qwen3", 151936, 2560, 9728, 36, 32, 8, 128, True, 40960),
    "qwen3-8b": ("Qwen/Qwen3-8B", "qwen3", 151936, 4096, 12288, 36, 32, 8, 128, False, 40960),
    "qwen3-14b": ("Qwen/Qwen3-14B", "qwen3", 151936, 5120, 17408, 40, 40, 8, 128, False, 40960),
    "qwen3-32b": ("Qwen/Qwen3-32B", "qwen3", 151936, 5120, 25600, 64, 64, 8, 128, False, 40960),
    "mistral-7b": ("mistralai/Mistral-7B-v0.3", "mistral", 32768, 4096, 14336, 32, 32, 8, 128, False, 32768),
    "gemma-2-2b": ("google/gemma-2-2b", "gemma2", 256000, 2304, 9216, 26, 8, 4, 256, True, 8192),
    "gemma-2-9b": ("google/gemma-2-9b", "gemma2", 256000, 3584, 14336, 42, 16, 8, 256, True, 8192),
    "gemma-2-27b": ("google/gemma-2-27b", "gemma2", 256000, 4608, 36864, 46, 32, 16, 128, True, 8192),
}


def _spec(name: str, row: tuple) -> ModelSpec:
    repo, mt, v, h, i, L, a, k, d, tied, maxpos = row
    family = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral", "gemma2": "gemma2"}[mt]
    return ModelSpec(name=name, source=f"{repo} config.json", vocab_size=v, hidden_size=h, intermediate_size=i,
                     num_layers=L, num_heads=a, num_kv_heads=k, head_dim=d, tied_embeddings=tied,
                     max_positions=maxpos, attention_bias=mt == "qwen2", qk_norm=mt == "qwen3",
                     norms_per_layer=4 if mt == "gemma2" else 2, family=family, model_type=mt)


MODEL_PRESETS: dict[str, ModelSpec] = {name: _spec(name, row) for name, row in _ROWS.items()}
# a bare size that names one well-known shape: what a user typing it means (other counts get an assumed shape)
NOMINAL_SIZES = {"8B": "llama-3.1-8b", "70B": "llama-3.1-70b"}


def find_preset(text: str) -> ModelSpec | None:
    """A preset by name or by its HF repo id, case-insensitive; None when unknown."""
    key = text.strip().lower()
    if key in MODEL_PRESETS:
        return MODEL_PRESETS[key]
    for name, row in _ROWS.items():
        if row[0].lower() == key or row[0].split("/")[-1].lower() == key:
            return MODEL_PRESETS[name]
    return None


def resolve_model(text: str) -> ModelSpec:
    """--model: a directory with config.json, a preset name, 'tiny', or a parameter count."""
    text = str(text).strip()
    if not text:
        raise ShardwiseError("--model is empty; give a local model directory, a preset or a count like 7B")
    if text == "tiny":
        return from_hf_config({"model_type": "llama", **tiny_config()}, "tiny", "shardwise tiny model (models/tiny.py)")
    if os.path.isdir(text):
        path = os.path.join(text, "config.json")
        try:
            with open(path, encoding="utf-8") as fh:
                cfg = json.load(fh)
        except FileNotFoundError:
            raise ShardwiseError(f"{path}: no config.json in the model directory; point --model at a Hugging Face "
                                 f"model directory (the one holding config.json)")
        except (OSError, ValueError) as e:
            raise ShardwiseError(f"{path}: cannot read config.json ({e}); fix or replace the file")
        if not isinstance(cfg, dict):
            raise ShardwiseError(f"{path}: config.json must hold a JSON object")
        return from_hf_config(cfg, os.path.basename(os.path.normpath(text)), path)
    preset = find_preset(text)
    if preset is not None:
        return preset
    nominal = NOMINAL_SIZES.get(text.upper())
    if nominal is not None:
        p = MODEL_PRESETS[nominal]
        return replace(p, name=text, source=f"a bare {text} taken as {p.name}'s shape ({p.source}; "
                                            f"--model {p.name} says so, a directory gives your own)")
    if PARAM_COUNT.match(text) or text[0].isdigit():
        return from_count(text)
    if "/" in text or text.startswith("."):
        raise ShardwiseError(f"--model '{text}': no such directory; give a local Hugging Face model directory "
                             f"(nothing is downloaded), a preset or a count like 7B")
    import difflib

    close = difflib.get_close_matches(text.lower(), list(MODEL_PRESETS), n=3)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    raise ShardwiseError(f"--model '{text}': unknown preset{hint}; `shardwise plan --list-models` lists presets, "
                         f"or give a local directory or a count like 7B")
