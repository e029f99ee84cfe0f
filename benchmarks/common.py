"""Helpers shared by the GPU benchmark scripts: build a random-init Llama-style model
directory with a 32k word-level tokenizer, and text data a model can learn from."""

from __future__ import annotations

import json
import os
import platform
import random
import signal
import subprocess
import sys

ANCHOR = dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
              num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=4096)


def build_model_dir(path: str, shape: dict = ANCHOR, seed: int = 0, disk_dtype: str = "float32") -> str:
    """A Hugging Face directory: random-init LlamaForCausalLM (safetensors) + a word-level
    tokenizer whose vocabulary is w0 ... w{V-6} plus special tokens and a chat template."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    specials = ["<unk>", "<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials)}
    for i in range(shape["vocab_size"] - len(specials)):
        vocab[f"w{i}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>")
    fast.chat_template = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
                          "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")
    config = LlamaConfig(**{"tie_word_embeddings": False, **shape}, bos_token_id=2, eos_token_id=3, pad_token_id=1)
    torch.manual_seed(seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config).to(getattr(torch, disk_dtype))
    model.save_pretrained(path)
    fast.save_pretrained(path)
    del model
    if torch.cuda.is_available():  # the runs that follow need the card: an 8B model held here was 31.5 GiB of it
        torch.cuda.empty_cache()
    return path


def write_text_data(path: str, n_records: int, words_per_record: int, vocab: int, seed: int = 0) -> str:
    """Text from a random sparse bigram model (each word has 8 likely successors), so the
    loss has somewhere to go: from ln(vocab) towards about ln(8)."""
    rng = random.Random(seed)
    n = vocab - 6
    succ = [[rng.randrange(n) for _ in range(8)] for _ in range(n)]
    with open(path, "w") as fh:
        for _ in range(n_records):
            w = rng.randrange(n)
            words = []
            for _ in range(words_per_record):
                words.append(f"w{w}")
                w = rng.choice(succ[w]) if rng.random() < 0.9 else rng.randrange(n)
            fh.write(json.dumps({"text": " ".join(words)}) + "\n")
    return path


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def versions() -> dict:
    out = {"python": platform.python_version()}
    for mod in ("torch", "transformers", "accelerate", "deepspeed"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            pass
    try:
        import torch

        if torch.cuda.is_available():
            out["gpu"] = torch.cuda.get_device_name(0)
            out["cuda"] = torch.version.cuda
    except Exception:  # noqa: BLE001
        pass
    try:
        out["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                       capture_output=True, text=True).stdout.strip()
    except OSError:
        pass
    return out


def shardwise(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardwise", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})


def run_killable(cmd: list[str], timeout: float, env: dict | None = None) -> tuple[int | str, str]:
    """Exit code (or 'timeout') and the merged output of `cmd`, run in its own process group so that on
    timeout the launcher and its workers (holding GPU memory) are killed together."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                         start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
        return p.returncode, out or ""
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        return "timeout", out or ""
