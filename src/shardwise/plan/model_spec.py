"""The shape of a decoder-only model, as far as the planner needs it.

Mixture-of-experts models (Mixtral, Qwen-MoE) add routed experts: memory counts every expert
(`total_params`), FLOPs only the ones a token runs through (`active_params`: the top-k routed
experts, the shared expert, attention, router, embeddings and head).

A shape comes from a Hugging Face config.json (only read, with json), the project's `tiny`
model, or a bare parameter count ("7B", "350M"); plan/model_presets.py adds the published
presets and `resolve_model`, which picks one of them for --model. No torch, no transformers.
"""

from __future__ import annotations

import ast
import json
import os
import re
from dataclasses import dataclass, replace

from shardwise.errors import ShardwiseError

LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelSpec:
    """A Llama-style decoder: embeddings, L blocks (attention + gated MLP), final norm, LM head."""

    name: str
    source: str  # where the numbers came from (HF repo, directory, "assumed shape")
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tied_embeddings: bool
    max_positions: int = 4096
    attention_bias: bool = False  # q/k/v biases (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    norms_per_layer: int = 2  # Gemma 2 has 4 (pre/post attention and MLP)
    family: str = "llama"  # llama | qwen2 | qwen3 | mistral | gemma2
    model_type: str = "llama"  # the HF model_type, used by --simulate
    # mixture of experts (0 experts: a dense model): routed experts per MoE layer, how many each token runs
    # through, each one's gated-MLP width, the always-on shared expert's width (Qwen-MoE; 0: none, and no
    # sigmoid gate for it), and how many of the layers have a dense MLP (intermediate_size) instead
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    dense_layers: int = 0

    # ------------------------------------------------------------ parameter counts
    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear projection of one block (nn.Linear modules: of an MoE block, the
        shared expert's; the routed experts are 3-D tensors, `expert_params`)."""
        h, i = self.hidden_size, self.intermediate_size
        if self.num_experts:
            i = self.shared_expert_intermediate_size
        mlp = {"gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)} if i else {}
        return {"q_proj": (h, self.q_dim), "k_proj": (h, self.kv_dim), "v_proj": (h, self.kv_dim),
                "o_proj": (self.q_dim, h), **mlp}

    @property
    def expert_params(self) -> int:
        """One routed expert: a gated MLP of moe_intermediate_size."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    def _per_layer(self, moe: int, dense: int) -> int:
        """A per-layer count averaged over the MoE layers and the dense ones (all MoE: `moe`)."""
        d = self.dense_layers if self.num_experts else self.num_layers
        return round(((self.num_layers - d) * moe + d * dense) / max(self.num_layers, 1))

    def _layer_linear(self, experts: int) -> int:
        attn_mlp = sum(a * b for a, b in self.linear_shapes().values())
        if not self.num_experts:
            return attn_mlp
        h = self.hidden_size
        router = self.num_experts * h + (h if self.shared_expert_intermediate_size else 0)  # + shared expert's gate
        dense_mlp = 3 * h * self.intermediate_size - 3 * h * self.shared_expert_intermediate_size
        return self._per_layer(attn_mlp + experts * self.expert_params + router, attn_mlp + dense_mlp)

    @property
    def layer_linear_params(self) -> int:
        """Weights of one block that go through a matmul (an MoE block: every expert)."""
        return self._layer_linear(self.num_experts)

    @property
    def moe_layer_fraction(self) -> float:
        """The share of the blocks that route tokens to experts (0 for a dense model)."""
        if not self.num_experts:
            return 0.0
        return (self.num_layers - self.dense_layers) / max(self.num_layers, 1)

    @property
    def mlp_width(self) -> int:
        """Gated-MLP width a token runs through in one block: intermediate_size, or of an MoE block the
        top-k routed experts' and the shared expert's."""
        if not self.num_experts:
            return self.intermediate_size
        moe = self.experts_per_token * self.moe_intermediate_size + self.shared_expert_intermediate_size
        return self._per_layer(moe, self.intermediate_size)

    @property
    def layer_params(self) -> int:
        p = self.layer_linear_params + self.norms_per_layer * self.hidden_size
        if self.attention_bias:
            p += self.q_dim + 2 * self.kv_dim
        if self.qk_norm:
            p += 2 * self.head_dim
        return p

    @property
    def embed_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def head_params(self) -> int:
        """LM head weights that are not shared with the embedding."""
        return 0 if self.tied_embeddings else self.vocab_size * self.hidden_size

    @property
    def root_params(self) -> int:
        """Everything outside the blocks: embeddings, final norm, untied head."""
        return self.embed_params + self.head_params + self.hidden_size

    @property
    def total_params(self) -> int:
        """Every parameter (all experts): what memory holds."""
        return self.num_layers * self.layer_params + self.root_params

    @property
    def active_params(self) -> int:
        """Parameters one token computes with (the top-k routed experts of each MoE block, not all): what the
        FLOPs count. A dense model's are its total_params."""
        idle = self.num_layers * (self.layer_linear_params - self._layer_linear(self.experts_per_token))
        return self.total_params - idle

    @property
    def linear_params(self) -> int:
        """Weights that go through a matmul (blocks + the LM head, tied or not)."""
        return self.num_layers * self.layer_linear_params + self.vocab_size * self.hidden_size

    def lora_params(self, r: int, targets: str = "all-linear") -> int:
        """Trainable adapter parameters: r * (in + out) per adapted projection."""
        names = LINEAR_NAMES if targets in ("all-linear", "") else [t.strip() for t in targets.split(",")]
        shapes = self.linear_shapes()
        return self.num_layers * sum(r * (shapes[n][0] + shapes[n][1]) for n in names if n in shapes)

    def lora_input_width(self, targets: str = "all-linear") -> int:
        """Sum of input widths of the adapted projections of one block (each has its own dropout copy)."""
        names = LINEAR_NAMES if targets in ("all-linear", "") else [t.strip() for t in targets.split(",")]
        shapes = self.linear_shapes()
        return sum(shapes[n][0] for n in names if n in shapes)

    def to_hf_config(self) -> dict:
        """A config.json dict for transformers (used by --simulate)."""
        d = {"model_type": self.model_type, "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
             "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
             "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
             "head_dim": self.head_dim, "tie_word_embeddings": self.tied_embeddings,
             "max_position_embeddings": self.max_positions}
        if self.model_type == "llama":
            d["attention_bias"] = self.attention_bias
        if self.num_experts:
            experts = "num_local_experts" if self.model_type == "mixtral" else "num_experts"
            d.update({experts: self.num_experts, "num_experts_per_tok": self.experts_per_token})
            if self.model_type != "mixtral":
                d.update(moe_intermediate_size=self.moe_intermediate_size,
                         mlp_only_layers=list(range(self.dense_layers)))
            if self.shared_expert_intermediate_size:
                d["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
        return d


# ----------------------------------------------------------------------------- parsing


def from_hf_config(cfg: dict, name: str, source: str) -> ModelSpec:
    """Read the fields the planner needs from a config.json dict."""
    if "text_config" in cfg and "hidden_size" not in cfg:  # multimodal wrappers: plan the language model
        cfg = {**cfg["text_config"], "tie_word_embeddings": cfg.get("tie_word_embeddings", False)}
    need = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    wrong = [k for k in need if k in cfg and not (isinstance(cfg[k], int) and not isinstance(cfg[k], bool)
                                                   and cfg[k] > 0)]
    if wrong:
        raise ShardwiseError(f"{source}: key '{wrong[0]}' must be a positive integer, got "
                             f"{json.dumps(cfg[wrong[0]])[:40]}; fix config.json")
    missing = [k for k in need if not isinstance(cfg.get(k), int)]
    if missing:
        raise ShardwiseError(f"{source}: config.json lacks {', '.join(missing)}; the planner needs a decoder-only "
                             f"model config (Llama, Qwen, Mistral, Gemma style)")
    mt = str(cfg.get("model_type", "llama"))
    heads = cfg["num_attention_heads"]
    base = MOE_BASE.get(mt, mt)  # an MoE model's attention is that of its dense family
    family = {"qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral", "gemma2": "gemma2"}.get(base, "llama")
    return ModelSpec(
        name=name, source=source,
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
        num_heads=heads, num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_positions=int(cfg.get("max_position_embeddings") or 4096),
        attention_bias=bool(cfg.get("attention_bias", base == "qwen2")),
        qk_norm=base == "qwen3",
        norms_per_layer=4 if mt == "gemma2" else 2,
        family=family, model_type=mt,
        **moe_fields(cfg),
    )


# MoE model types whose attention is that of a dense family (biases, q/k norms)
MOE_BASE = {"mixtral": "mistral", "qwen2_moe": "qwen2", "qwen3_moe": "qwen3"}


def moe_fields(cfg: dict) -> dict:
    """The mixture-of-experts fields of ModelSpec from a config.json (none for a dense model): experts from
    num_local_experts (Mixtral) or num_experts (Qwen-MoE), each expert's width from moe_intermediate_size
    (Mixtral's experts are intermediate_size wide), and the dense layers from decoder_sparse_step and
    mlp_only_layers, as transformers' Qwen-MoE decoder layer decides."""
    n = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    k = int(cfg.get("num_experts_per_tok") or 0)
    if n <= 0 or k <= 0:
        return {}
    L = cfg["num_hidden_layers"]
    step = int(cfg.get("decoder_sparse_step") or 1)
    only = set(cfg.get("mlp_only_layers") or [])
    dense = sum(1 for i in range(L) if i in only or (i + 1) % step)
    return dict(num_experts=n, experts_per_token=min(k, n),
                moe_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
                shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
                dense_layers=dense)


PARAM_COUNT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMbBtT])\s*$")
_SCALE = {"k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}
# Llama-style shapes by size: (up to params, hidden, heads, kv heads)
_SHAPES = [(2e8, 768, 12, 12), (6e8, 1024, 16, 16), (1.5e9, 2048, 16, 16), (4e9, 3072, 24, 24),
           (9e9, 4096, 32, 32), (2e10, 5120, 40, 40), (4e10, 6656, 52, 8), (1e11, 8192, 64, 8),
           (float("inf"), 12288, 96, 8)]


def from_count(text: str) -> ModelSpec:
    """A Llama-style model of about this many parameters ("7B", "350M")."""
    m = PARAM_COUNT.match(text)
    if not m:
        raise ShardwiseError(f"--model '{text}': not a directory, preset or parameter count; "
                             f"give a local Hugging Face directory, a preset (shardwise plan --list-models) or a count like 7B or 350M")
    target = float(m.group(1)) * _SCALE[m.group(2).lower()]
    if not 1e6 <= target <= 1e13:
        raise ShardwiseError(f"--model '{text}': a parameter count must be between 1M and 10T")
    for limit, h, a, k in _SHAPES:
        if target <= limit:
            break
    vocab = 32000
    inter = int(round(8 * h / 3 / 256)) * 256
    probe = ModelSpec("", "", vocab, h, inter, 1, a, k, h // a, False)
    layers = max(1, round((target - probe.root_params) / probe.layer_params))
    return replace(probe, name=text.strip(), num_layers=layers,
                   source=f"assumed Llama-style shape for {text.strip()}: hidden {h}, {layers} layers, "
                          f"{a} heads ({k} KV), intermediate {inter}, vocab {vocab}, untied")


def tiny_config() -> dict:
    """The project's tiny model config: TINY_CONFIG read from models/tiny.py without importing it."""
    fallback = dict(vocab_size=512, hidden_size=128, intermediate_size=352, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                    tie_word_embeddings=False)
    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "models", "tiny.py")
    try:
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read())
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "TINY_CONFIG" for t in node.targets):
                v = node.value
                if isinstance(v, ast.Call) and getattr(v.func, "id", "") == "dict":
                    return {kw.arg: ast.literal_eval(kw.value) for kw in v.keywords}
                return ast.literal_eval(v)
    except (OSError, SyntaxError, ValueError):
        pass
    return fallback
