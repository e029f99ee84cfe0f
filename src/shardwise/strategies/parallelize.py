"""The steps that turn a loaded model (adapters added) into the one a strategy trains, each a
small function that does one thing to the module tree and says what it did. The strategy
composes them in a fixed order (`Strategy.parallelize`):

    loss head -> float8 -> attention -> tensor parallel -> MLP tiles -> activation checkpointing -> compile
    -> data-parallel wrapping

The loss head (the fused linear + cross-entropy, models/speed.py) changes what the head returns, not its module
or parameters, so every later step sees the model as loaded. Float8 swaps module classes (keeping parameters and
names), so it goes before anything wraps or splits them. The attention step routes attention through the sequence
group (Ulysses / ring) or a document mask; it replaces the attention function only.
Tensor parallelism comes next because it replaces weights by DTensors over the `tp` mesh
dimension, and the later steps must see those; the MLP tiles (models/tiles.py) replace the MLPs' forward inside
the blocks, so the block checkpoint that comes next recomputes them tile by tile; checkpointing wraps the (parallel) blocks;
compile traces each block with its checkpointing inside; the data-parallel wrapper (FSDP, DDP,
DeepSpeed) goes around the compiled blocks (FSDP's per-block units and DDP's buckets, see
strategies/ddp.py, are laid over whole compiled blocks). The order is torchtitan's.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from shardwise.models.speed import compile_blocks
from shardwise.strategies.parallel import ParallelDims

log = logging.getLogger(__name__)


# The decoder families whose blocks carry these linears and norms (transformers' Llama-style attention and
# SwiGLU MLP, pre-norm blocks; the attention reshapes with -1 heads, so it runs on each rank's local heads).
TP_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")
NORMS = ("input_layernorm", "post_attention_layernorm")


def block_plan(first: bool) -> dict:
    """One decoder block's plan (Megatron's with sequence parallelism, torchtitan's layout).

    Between blocks the hidden states are sharded over the sequence (each tp rank holds S / N positions,
    plain local tensors): the norms (`SequenceParallel`) and the residual adds run on that slice. The
    attention's and MLP's input is gathered over the sequence (`PrepareModuleInput`: an all-gather);
    q/k/v and gate/up split by output features compute each rank's heads / MLP columns; o and down split
    by input features give partial sums, reduce-scattered back over the sequence. Per block: two
    all-gathers and two reduce-scatters in forward, the same in backward. `first`: the block's input
    arrives replicated from the embedding (see model_plan) and is cut to this rank's slice (no
    communication)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    plan = {**{n: SequenceParallel() for n in NORMS},
            # transformers' blocks call the attention with hidden_states= and the MLP positionally
            "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                            desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            **{n: ColwiseParallel() for n in COLWISE},
            **{n: RowwiseParallel(output_layouts=Shard(1)) for n in ROWWISE}}
    if first:
        plan[""] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                      use_local_output=True)
    return plan


def _vocab_head_style():
    """The output head split by rows (the vocabulary), its input gathered over the sequence, its logits
    a DTensor sharded over the vocabulary (never gathered: the loss takes them under `loss_parallel`).
    With the fused loss (models/speed.py) the head returns the summed loss instead, which passes through."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    class VocabParallelHead(ColwiseParallel):
        @staticmethod
        def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
            if not isinstance(outputs, DTensor):  # the fused head's loss, the same on every tp rank
                return outputs
            return ColwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)

    return VocabParallelHead(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)


def model_plan(model: nn.Module) -> tuple[dict, str, str]:
    """The plan outside the blocks: (plan, embedding's name, head's name). The embedding is split by rows
    (the vocabulary: each rank looks up the tokens it holds, zeros elsewhere) and all-reduced into
    replicated hidden states; transformers builds the attention mask and rotary tables from the
    embedding's output, so it stays whole until the first block cuts it over the sequence. The final
    norm is sequence-parallel; the head is `_vocab_head_style`."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import RowwiseParallel, SequenceParallel

    names = {id(m): n for n, m in model.named_modules()}
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    norm = getattr(model.get_decoder() if hasattr(model, "get_decoder") else model.base_model, "norm", None)
    if not isinstance(embed, nn.Embedding) or not isinstance(head, nn.Linear) or head.bias is not None \
            or not isinstance(norm, nn.Module):
        return {}, "", ""
    return ({names[id(embed)]: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
             names[id(norm)]: SequenceParallel(), names[id(head)]: _vocab_head_style()},
            names[id(embed)], names[id(head)])


def apply_tensor_parallel(model: nn.Module, dims: ParallelDims) -> str:
    """Split the model over the `tp` mesh dimension (torch's DTensor `parallelize_module`): every decoder
    block's linears (block_plan), the embedding and the head over the vocabulary, the norms over the
    sequence (model_plan). Every parameter becomes a DTensor on the tp mesh: sharded (linears, embedding,
    head) or replicated (norms, whose gradients DTensor sums over the sequence slices). Tied input and
    output embeddings share one DTensor (both split by vocabulary rows)."""
    if dims.tp == 1:
        return "tensor parallel: off"
    from torch.distributed.tensor.parallel import parallelize_module

    from shardwise.errors import ShardwiseError
    from shardwise.models.speed import decoder_blocks

    blocks = decoder_blocks(model)
    need = (*COLWISE, *ROWWISE, *NORMS, "self_attn", "mlp")
    for block in blocks:
        missing = [n for n in need if _find(block, n) is None]
        if missing:
            raise ShardwiseError(f"tensor_parallel {dims.tp}: the model's decoder block {type(block).__name__} has "
                                 f"no {', '.join(missing)}; tensor parallelism knows the Llama-style families "
                                 f"({', '.join(TP_FAMILIES)}); use tensor_parallel 1")
    plan, embed_name, head_name = model_plan(model)
    if not plan:
        raise ShardwiseError(f"tensor_parallel {dims.tp}: the model {type(model).__name__} has no embedding, final "
                             "norm and bias-free linear head where tensor parallelism splits them; use "
                             "tensor_parallel 1")
    embed, head = model.get_submodule(embed_name), model.get_submodule(head_name)
    tied = embed.weight is head.weight
    tp_mesh = dims.mesh["tp"]
    for i, block in enumerate(blocks):
        parallelize_module(block, tp_mesh, block_plan(first=i == 0))
    parallelize_module(model, tp_mesh, plan)
    if tied:  # each style made its own Parameter from the one weight: share the head's (same rows, same DTensor)
        embed.weight = head.weight
    return (f"tensor parallel: {len(blocks)} blocks' q/k/v/gate/up column-wise, o/down row-wise, norms "
            f"sequence-parallel; embedding{' and head (tied)' if tied else ', head'} split over the vocabulary; "
            f"over {dims.tp} ranks")


def _find(module: nn.Module, name: str):
    try:
        return module.get_submodule(name)
    except AttributeError:
        return None


def apply_float8(model: nn.Module, cfg, device: torch.device) -> str:
    """--float8: the decoder blocks' large linears become torchao's float8 linears (models/float8.py); refused in
    one line where the GPU, or torchao, cannot run them."""
    if not cfg.float8:
        return "float8: off"
    from shardwise.errors import ShardwiseError
    from shardwise.models import float8

    why = float8.refusal(device)
    if why:
        raise ShardwiseError(f"--float8: {why}")
    names = float8.convert(model)
    return f"float8: {len(names)} linears ({', '.join(sorted({n.rsplit('.', 1)[-1] for n in names}))})"


def apply_loss_head(model: nn.Module, cfg) -> str:
    """--fused-loss: the output head returns the summed token loss when the loop sets its targets, computed in
    chunks that never hold the full logits (models/speed.py; a head whose logits the model post-processes keeps
    its plain forward). Where the run compiles, so does the log-probability head's per-chunk work (task dpo)."""
    from shardwise.models.speed import install_fused_loss
    from shardwise.plan.facts import FUSED_LOSS_CHUNK

    if not cfg.fused_loss:
        return "fused loss: off"
    if install_fused_loss(model, FUSED_LOSS_CHUNK, compile=compile_enabled(cfg)):
        return "fused loss head"
    return "fused loss: off (the model post-processes its logits)"


def apply_attention(model: nn.Module, cfg, dims: ParallelDims) -> str:
    """Sequence parallelism's attention over the run's sequence group (models/sequence_parallel.py); on one rank,
    long packed sequences on CUDA get a block mask instead of transformers' dense (B, 1, S, S) one. On the loaded
    model under any adapters (its attention function and its training flag are the model's own)."""
    from shardwise.models.sequence_parallel import DENSE_MASK_LIMIT, apply_sequence_parallel

    if not (cfg.sequence_parallel > 1 or (cfg.packing and cfg.seq_len ** 2 > DENSE_MASK_LIMIT
                                          and torch.cuda.is_available())):
        return "attention: off"
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return apply_sequence_parallel(base, dims if cfg.sequence_parallel > 1 else None, cfg.sp_mode)


def apply_mlp_tiles(model: nn.Module, cfg, dims: ParallelDims, device: torch.device) -> str:
    """--mlp-tiles: each block's MLP over sequence tiles, each checkpointed (models/tiles.py); auto resolves the
    count for this rank's tokens (a 1/sp slice of each sequence) and the compute dtype."""
    if str(cfg.mlp_tiles).strip() == "1":
        return "mlp tiles: off"
    from shardwise.models.tiles import tile_blocks
    from shardwise.plan.inputs import compute_dtype

    c = 4 if compute_dtype(cfg.mixed_precision, device.type) == "fp32" and cfg.param_dtype == "fp32" else 2
    tokens = cfg.micro_batch_size * cfg.seq_len // max(1, cfg.sequence_parallel)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return tile_blocks(base, cfg.mlp_tiles, tokens, c)


def apply_activation_checkpointing(model: nn.Module, cfg) -> str:
    """Recompute activations in backward: every block whole (full: HF's non-reentrant checkpointing; offload: the same
    with the kept inputs in host memory) or the cheap operators between the kept matmul and attention outputs
    (selective); models/checkpointing.py."""
    from shardwise.config import checkpointing_mode
    from shardwise.models.checkpointing import checkpoint_blocks

    return checkpoint_blocks(model, checkpointing_mode(cfg))


def compile_enabled(cfg) -> bool:
    """--compile on, or auto on a machine with CUDA."""
    return cfg.compile == "on" or (cfg.compile == "auto" and torch.cuda.is_available())


def apply_compile(model: nn.Module, cfg, dims: ParallelDims | None = None, hooks_eager: bool = False) -> str:
    """torch.compile each decoder block in place (parameter names unchanged). Each block's forward only under
    tensor parallelism (its TP input hooks stay eager: models/speed.py compile_blocks says why) and where the
    strategy asks (`hooks_eager`: ZeRO-3's fetch hooks on whole blocks)."""
    if not compile_enabled(cfg):
        return "compile: off"
    tp = dims is not None and dims.tp > 1
    why = "TP hooks eager" if tp else "ZeRO-3 hooks eager" if hooks_eager else ""
    return f"compile: {compile_blocks(model, hooks_eager=bool(why))} blocks" + (f" (forward only; {why})" if why else "")
