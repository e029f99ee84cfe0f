"""The built-in `tiny` model: a small Llama-style config, random init, and a byte-level
BPE tokenizer with a chat template, all created by project code and written out as a
Hugging Face directory so it goes through the same loading path as a real model."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile

from shardwise.errors import ShardwiseError
from shardwise.models.save import save_pretrained

TINY_RECIPE_VERSION = 1
# 4 decoder layers, GQA (4 query / 2 KV heads), SwiGLU MLP: ~1.3M params with a 512-token vocab.
TINY_CONFIG = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=352,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    initializer_range=0.02,
)
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"]
# ChatML-style: each turn is <|im_start|>role\ncontent<|im_end|>\n; loss goes on the
# assistant content and its <|im_end|>.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def cache_root() -> str:
    return os.environ.get("SHARDWISE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "shardwise")


def tiny_dir(seed: int) -> str:
    """Build (once, atomically) and return the tiny model directory for this seed."""
    key = hashlib.sha1(json.dumps([TINY_RECIPE_VERSION, TINY_CONFIG, seed]).encode()).hexdigest()[:12]
    path = os.path.join(cache_root(), f"tiny-{key}")
    if os.path.lexists(path):  # built before; used only as what this user built (a link or another's is not)
        from shardwise.hardware import folder_problem

        why = folder_problem(path)
        if why:
            raise ShardwiseError(f"{why}: it is not the tiny model this user built; move it away, or set "
                                 "SHARDWISE_CACHE_DIR to a folder of your own")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    os.makedirs(cache_root(), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tiny-", dir=cache_root())
    try:
        write_tiny(tmp, seed)
        try:
            os.rename(tmp, path)
        except OSError:  # another process won the race; theirs is identical
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _training_corpus() -> list[str]:
    from shardwise.data.demo import demo_records

    tmpl_text = []
    for rec in demo_records():
        tmpl_text.append("".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in rec["messages"]))
    return tmpl_text


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_CONFIG["vocab_size"], special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_training_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def write_tiny(path: str, seed: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_tokenizer()
    if len(tok) > TINY_CONFIG["vocab_size"]:
        raise ShardwiseError(f"tiny tokenizer has {len(tok)} tokens, more than the model's vocab")
    config = LlamaConfig(**TINY_CONFIG, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    devnull_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    torch.random.set_rng_state(devnull_state)
    save_pretrained(model, path)
    tok.save_pretrained(path)


# Mixture-of-experts variants of the tiny model (the same attention, vocab and tokenizer; 4 experts, top-2), built
# from transformers' own config classes, for tests and docs/moe.md. Expert widths keep the active MLP near the dense
# tiny model's; Qwen-MoE adds its always-on shared expert (with its sigmoid gate).
_ATTN = {k: v for k, v in TINY_CONFIG.items() if k != "intermediate_size"}
TINY_MOE_CONFIGS = {
    "mixtral": dict(_ATTN, intermediate_size=176, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(_ATTN, intermediate_size=352, moe_intermediate_size=96, shared_expert_intermediate_size=160,
                      num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, norm_topk_prob=True),
    "qwen3_moe": dict(_ATTN, intermediate_size=352, moe_intermediate_size=176, head_dim=32, num_experts=4,
                      num_experts_per_tok=2, decoder_sparse_step=1, norm_topk_prob=True),
}


def write_tiny_moe(path: str, seed: int, model_type: str = "mixtral", **overrides) -> None:
    """A tiny random-init MoE model directory of `model_type` (a TINY_MOE_CONFIGS key); `overrides`
    are config fields (e.g. output_router_logits=True)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if model_type not in TINY_MOE_CONFIGS:
        raise ShardwiseError(f"tiny MoE model_type '{model_type}': choose one of {', '.join(TINY_MOE_CONFIGS)}")
    tok = build_tokenizer()
    config = AutoConfig.for_model(model_type, **{**TINY_MOE_CONFIGS[model_type], **overrides},
                                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                  pad_token_id=tok.pad_token_id)
    rng = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    torch.random.set_rng_state(rng)
    save_pretrained(model, path)
    tok.save_pretrained(path)
