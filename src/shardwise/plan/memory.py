"""Per-rank memory of one training step, by strategy. Pure arithmetic on a ModelSpec.

All sizes are bytes per rank. The formulas are written out in docs/planner.md; the names
here follow it: P parameters (P_t trainable), N ranks that share a shard, c compute-dtype
bytes, w storage bytes of trainable weights, r bytes of the residual stream, T = B*S tokens
per micro-batch per rank, V vocab, h hidden, i intermediate. Tensor parallelism (Job.tp): the "tensor parallelism"
section below says what one rank of a tp group holds.

The peak is the largest of these moments of a step (gradients are freed by zero_grad and
activations are freed by backward, so they are not alive in full at the same time):
  A  end of forward / loss backward: states + all saved activations + logits and their
     fp32 loss tensors + gathered parameters (+ gradients when accumulating);
  B  end of backward / optimizer step: states + all gradients + the last block's
     activations and their gradients + reduce buffers (the fused AdamW makes no temporaries);
  B0 start of a checkpointed backward where the gradients leave the device (offload on a GPU):
     states + the other blocks' checkpointed inputs + the recomputed block + its buffers;
  C  ZeRO-3 reducing a gradient bucket: states + the bucket's copies + the parameters and
     saved activations of the blocks not yet through backward.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from shardwise import presets
from shardwise.plan.calibration import value
from shardwise.plan.costs import cost_of
from shardwise.plan.facts import (  # noqa: F401 (DDP_BUCKET_BYTES and the DS_* are re-exported)
    DDP_BUCKET_BYTES,
    DDP_GRADIENT_AS_BUCKET_VIEW,
    DENSE_MASK_MAX_SEQ,
    DS_MAX_LIVE,
    DS_PREFETCH_BUCKET,
    DS_REDUCE_BUCKET,
    DS_SUB_GROUP,
    FLOAT8_NARROW_IN,
    FLOAT8_NARROW_OUT,
    FUSED_LOSS_CHUNK,
    even_chunks,
)
from shardwise.plan.long_context import auto_mlp_tiles, offload_host_bytes
from shardwise.plan.model_spec import ModelSpec

GiB = 2**30
QLORA_BYTES_PER_PARAM = 0.5 + 1 / 64 + 4 / (64 * 256)  # NF4 + double-quantised absmax per 64-block
CUDA_CONTEXT_GIB = value("cuda_context_gib")  # CUDA context + cuBLAS/NCCL workspaces, outside the allocator's count
FRAGMENTATION = value("fragmentation")  # caching allocator: reserved exceeds allocated by a few percent
HOST_PROCESS_GIB = value("host_process_gib")  # a rank's own host memory: interpreter, libraries, CUDA context
HOST_COMPILE_WORKERS_GIB = value("host_compile_workers_gib")  # compiled blocks: inductor's worker pool per rank
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# torch.compile per decoder block (inductor fuses the elementwise ops and recomputes them in backward): saved
# activations of a block, compiled / eager. Under DDP the engine keeps each compiled block one graph
# (strategies/ddp.py: optimize_ddp = False), so DDP uses this factor too.
COMPILE_ACT_FACTOR = value("compile_act_factor")
# ZeRO-3 (and zero3-offload) with DeepSpeed's per-submodule fetch (deepspeed.fetch module): its fetch/release hooks
# run around every submodule and dynamo breaks the graph at them, so a compiled block is fused only between its
# linears and saves more. Whole-block fetch (the default) keeps each block one graph.
COMPILE_ACT_FACTOR_ZERO3 = value("compile_act_factor_zero3_module")


@dataclass(frozen=True)
class Job:
    """What one step does, per rank, and where it runs."""

    world: int = 1
    nodes: int = 1
    micro_batch: int = 1
    seq_len: int = 2048
    grad_accum: int = 1
    tuner: str = "full"  # full | lora | qlora
    lora_r: int = 16
    lora_targets: str = "all-linear"
    lora_dropout: float = 0.05
    compute: str = "bf16"  # fp32 | bf16 | fp16
    param_dtype: str = "fp32"  # fp32 | bf16
    checkpointing: bool = False
    packing: bool = False
    device_mem_gib: float = 80.0
    host_mem_gib: float = 512.0  # per node
    accelerator: str = "cuda"  # cuda | cpu
    hold_outputs: bool = False  # the loop keeps model outputs (logits) alive until backward (train_step does not)
    fused_loss: bool = False  # chunked linear + cross-entropy head, gradients in the forward (config `fused_loss`)
    compile: bool = False  # torch.compile of each decoder block (config `compile`, resolved for the device)
    sp: int = 1  # sequence-parallel degree: each rank holds 1/sp of every sequence (config `sequence_parallel`)
    tp: int = 1  # tensor-parallel degree: each rank holds 1/tp of every block linear (config `tensor_parallel`)
    sp_mode: str = "auto"  # ulysses | ring | auto (Ulysses gcd(heads, sp), ring for the rest; config `sp_mode`)
    # op-level selective checkpointing (config activation_checkpointing selective; `checkpointing` is the full one)
    selective_checkpointing: bool = False
    float8: bool = False  # the blocks' large linears as torchao float8 linears (config `float8`; float8_linears)
    # full checkpointing with the kept block inputs in host memory (config activation_checkpointing offload)
    offload_checkpoints: bool = False
    mlp_tiles: int = 1  # the MLP over this many sequence tiles (config `mlp_tiles`); 0 = auto (plan/long_context.py)
    # task dpo's reference during training (train/objective.py): none (sft, simpo/orpo, --precompute-ref), "model"
    # (a frozen copy: whole per rank, or sharded like the policy where the family gathers parameters) or "adapters"
    # (LoRA: the policy with its adapters off; no memory, one more forward). micro_batch then counts rows: 2 per pair.
    reference: str = "none"
    # what the step optimises (config `task`): sft, or dpo, whose head gives per-token log-probabilities of the rows
    # (any loss_type, with or without a reference in training: comm.head_time)
    task: str = "sft"

    @property
    def gpus_per_node(self) -> int:
        return max(1, self.world // max(1, self.nodes))

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch on one rank (a 1/sp slice of each sequence under sequence parallelism); under
        tensor parallelism the tp ranks share these tokens (the formulas divide what each holds by tp)."""
        return self.micro_batch * self.seq_len // self.sp

    @property
    def dp(self) -> int:
        """Data-parallel degree: the groups that train different rows (world / (sp x tp))."""
        return max(1, self.world // (self.sp * self.tp))

    @property
    def c(self) -> int:
        return 2 if self.param_dtype == "bf16" else DTYPE_BYTES[self.compute]

    @property
    def w(self) -> int:
        return DTYPE_BYTES[self.param_dtype]


@dataclass(frozen=True)
class Opts:
    """The options of one strategy preset that change memory or communication."""

    base: str  # single | ddp | fsdp | deepspeed
    reshard_after_forward: bool = True
    keep_gathered_one_rank: bool = True  # fsdp.keep_gathered_one_rank
    cpu_offload: bool = False
    hybrid: bool = False
    shard_group_size: int = 0
    wrap: str = "block"
    prefetch: bool = True
    stage: int = 2
    offload_optimizer: bool = False
    offload_params: bool = False
    ds_fetch: str = "block"  # deepspeed.fetch: ZeRO-3's fetch unit (block: each decoder block; module: DeepSpeed's own)
    ddp_bucket_view: bool = DDP_GRADIENT_AS_BUCKET_VIEW  # DDP(gradient_as_bucket_view=...) (facts.py)


@dataclass
class Memory:
    """Bytes per rank on the device; `host` is what offload keeps in host RAM per rank (offloaded states, offloaded
    checkpoints), `host_peak` the rank's process at its largest in host RAM (memory.host_peak())."""

    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float
    peak_tensors: float  # max over the step of live tensor bytes
    allowance: float  # context + fragmentation
    host: float
    phase: str  # which moment sets the peak
    host_peak: float = 0.0
    detail: dict = field(default_factory=dict)

    @property
    def total(self) -> float:
        return self.peak_tensors + self.allowance

    def gib(self) -> dict:
        d = {k: getattr(self, k) / GiB for k in ("params", "grads", "optimizer", "activations", "buffers")}
        d.update(peak_tensors=self.peak_tensors / GiB, allowance=self.allowance / GiB, total=self.total / GiB,
                 host_per_rank=self.host / GiB, host_peak_per_rank=self.host_peak / GiB)
        return {k: round(v, 6) for k, v in d.items()}


# ----------------------------------------------------------------------------- units


def shard_ranks(job: Job, o: Opts) -> int:
    """How many ranks share one copy of the sharded state (the family's rule, presets.StrategySpec.shard_ranks)."""
    return presets.SPECS[o.base].shard_ranks(job.world, job.gpus_per_node, o.hybrid,
                                             o.shard_group_size)


def keeps_gathered(o: Opts, shard_n: int, compute_bytes: int, stored_bytes: int) -> bool:
    """FSDPStrategy's rule (presets.FSDPSpec.keeps_gathered): gathered weights kept from forward to backward."""
    return presets.FSDP.keeps_gathered(o.keep_gathered_one_rank, o.cpu_offload, shard_n, compute_bytes, stored_bytes)


def reshards(job: Job, o: Opts) -> bool:
    """Whether FSDP frees gathered units after forward."""
    return o.reshard_after_forward and not keeps_gathered(o, shard_ranks(job, o), job.c, job.w)


def unit_params(spec: ModelSpec, o: Opts) -> tuple[float, int]:
    """(parameters of one FSDP unit, number of block units) under the wrap policy."""
    P_l = spec.layer_params
    if o.wrap.startswith("size:"):
        n = int(o.wrap[5:])
        if n >= P_l:
            per = min(spec.num_layers, math.ceil(n / P_l))
            return per * P_l, math.ceil(spec.num_layers / per)
        pieces = min(len(spec.linear_shapes()), max(1, P_l // max(n, 1)))
        return P_l / pieces, spec.num_layers * pieces
    return P_l, spec.num_layers


# ----------------------------------------------------------------------------- tensor parallelism
# The TP plan modelled (strategies/parallelize.py): q/k/v/gate/up column-wise, o/down row-wise, the norms
# SequenceParallel (the residual stream between the linears is sharded over the tp ranks along the sequence), the
# embedding vocabulary-sharded (RowwiseParallel) and the head column-wise with loss_parallel (logits sharded over the
# vocabulary, never gathered). Split over tp: every block linear, the embedding and the head; replicated: the norms.


def tp_split(spec: ModelSpec) -> float:
    """Parameters that tensor parallelism splits over the tp ranks (block linears, embedding, untied head)."""
    return spec.num_layers * spec.layer_linear_params + spec.embed_params + spec.head_params


def local_params(spec: ModelSpec, tp: int) -> float:
    """Parameters one rank of a tp group holds (all of them at tp 1)."""
    return spec.total_params - tp_split(spec) * (1 - 1 / tp)


def local_layer_params(spec: ModelSpec, tp: int) -> float:
    """One block's parameters on one rank of a tp group."""
    return spec.layer_params - spec.layer_linear_params * (1 - 1 / tp)


def local_root_params(spec: ModelSpec, tp: int) -> float:
    """The root unit's parameters (embedding, final norm, head) on one rank of a tp group."""
    return spec.root_params - (spec.embed_params + spec.head_params) * (1 - 1 / tp)


def tp_degrees(spec: ModelSpec, gpus_per_node: int) -> list[int]:
    """Tensor-parallel degrees > 1 a node can take for this model: dividing the GPUs per node (TP stays on the
    intra-node link), the attention heads, the KV heads and the MLP width (launch.preflight.check_tensor_parallel's rule)."""
    return [d for d in range(2, gpus_per_node + 1)
            if not (gpus_per_node % d or spec.num_heads % d or spec.num_kv_heads % d or spec.intermediate_size % d)]


# ----------------------------------------------------------------------------- activations


def mlp_tiles(spec: ModelSpec, job: Job) -> int:
    """The MLP tile count of the job (auto resolved as the engine resolves it: models/tiles.py)."""
    if job.mlp_tiles >= 1:
        return job.mlp_tiles
    return auto_mlp_tiles(job.tokens, spec.hidden_size, spec.mlp_width, job.c)


def uses_ds_linear(job: Job, o: Opts) -> bool:
    """Whether the linears save their uncast input and weight, as DeepSpeed's LinearFunctionForZeroStage3 does: it
    saves the linear's input and weight as passed and casts inside, so no autocast weight copies are kept and
    projections that share an input save it once (the family's cost model says when: linear_saves_input)."""
    return cost_of(o.base).linear_saves_input(job, o)


def residual_bytes(job: Job, o: Opts) -> int:
    """dtype of the residual stream: fp32 under autocast with fp32 weights (DDP/single), else compute."""
    if job.tuner != "full" or not cost_of(o.base).autocast:
        return job.c
    return job.w if job.w > job.c else job.c


def layer_activations(spec: ModelSpec, job: Job, o: Opts) -> dict[str, float]:
    """Saved-for-backward bytes of one decoder block, without checkpointing (HF Llama, SDPA).
    Tensor parallelism (job.tp > 1) divides every term by tp: the attention and MLP interiors by heads and columns,
    the norms (SequenceParallel) by sequence; only the inputs of the column-wise linears stay whole, because each
    is the all-gathered (full-sequence) norm output, saved once by the q/k/v (gate/up) matmuls."""
    # an MoE block's MLP interior is the width a token runs through (top-k experts + shared expert), not all experts
    T, h, i, c, tp = job.tokens, spec.hidden_size, spec.mlp_width, job.c, job.tp
    r = residual_bytes(job, o)
    # inputs of linears are cast per consumer under autocast (nothing shares them), unless DeepSpeed's linear saves
    # the uncast input, once for the projections that share it
    autocast = r != c and not uses_ds_linear(job, o)
    gqa_native = not job.packing and spec.head_dim <= 256  # transformers uses enable_gqa when there is no mask
    kv = spec.kv_dim if gqa_native else spec.q_dim
    nrm = spec.norms_per_layer
    full = job.tuner == "full"
    n = mlp_tiles(spec, job)
    d = {}
    # RMSNorm: fp32 copy of the input (saved by pow/mul) + normalised value (saved by weight*x when the weight trains)
    d["norms"] = nrm * T * h * (4 + (r if full else 0)) / tp
    # inputs of the projections: q/k/v share the first norm's output, gate/up the second's (3+2 casts under autocast)
    lin_in = {"qkv": T * h * (3 * c if autocast else r), "o": T * spec.q_dim * c / tp,
              "gate_up": T * h * (2 * c if autocast else r), "down": T * i * c / tp / n}
    # attention: rotated q, k, v (repeated to all heads when a mask is used), SDPA output, its contiguous copy
    # (the o_proj input, counted above) and the fp32 log-sum-exp
    d["attention"] = (T * c * (spec.q_dim + 2 * kv + spec.q_dim) + 4 * spec.num_heads * job.tokens) / tp
    # gated MLP: gate (silu input), up, silu(gate) (mul inputs); the product is the down_proj input
    # tiled (models/tiles.py): each tile's interior exists alone, in forward and in the recomputed backward; saved
    # for backward is only the tile input (a view of gate/up's input), so 1/n is an upper bound without checkpointing
    d["mlp"] = 3 * T * i * c / tp / n
    if spec.num_experts:  # routing: each token's copy for each of its k experts (the experts' gate/up input) and
        # each expert's output before it is weighted and summed back (the weighting multiply saves it), plus the
        # router's fp32 logits and softmax; measured on transformers' Mixtral block (tests/unit/test_moe.py)
        routed = 2 * spec.experts_per_token * T * h * c + 8 * T * spec.num_experts
        d["moe_routing"] = spec.moe_layer_fraction * routed / tp
    if spec.family == "gemma2":  # eager attention for softcapping: scores through tanh and softmax, O(S^2)
        d["attention"] += 2 * c * job.micro_batch * spec.num_heads * job.seq_len ** 2 / tp
    if full:
        d["linear_inputs"] = sum(lin_in.values())
    else:
        width = spec.lora_input_width(job.lora_targets)
        if job.lora_dropout > 0:  # each adapter keeps its own dropped-out input (c) and mask: peft casts the input
            # to the adapter's dtype first; CUDA's fused dropout saves a 1-byte mask, the CPU path (input * noise)
            # saves the noise in the input's dtype: the stored one (w) under autocast, the compute dtype (c) where
            # the adapters compute in it (FSDP's MixedPrecisionPolicy casts them, DeepSpeed holds them in it)
            adapter = job.w if cost_of(o.base).autocast else job.c
            mask = 1 if job.accelerator == "cuda" else adapter
            d["lora_inputs"] = T * width * (c + mask)
        else:
            d["lora_inputs"] = sum(lin_in.values())
        d["lora_inputs"] += 7 * T * job.lora_r * c  # lora_A outputs, saved by lora_B
        if uses_ds_linear(job, o):  # DeepSpeed's linear saves its input whether or not the weight trains: the
            # frozen base projections' inputs too (q/k/v's and gate/up's shared ones once)
            d["lora_inputs"] += T * c * (2 * h + spec.q_dim / tp + i / tp)
    return d




# float8 (config `float8`): which block linears the engine converts, by models/float8.py's rule (its thresholds are
# declared in facts.py; tests/unit/test_plan_float8.py checks the two agree)
def float8_linears(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """(in, out) of the block linears the engine runs as float8 linears (models/float8.py `wanted`)."""
    return {n: (i, o) for n, (i, o) in spec.linear_shapes().items()
            if not (i % 16 or o % 16) and not (o <= FLOAT8_NARROW_OUT and i <= FLOAT8_NARROW_IN)}


# the block linears that share one input (q/k/v: the first norm's output; gate/up: the second's; down: its own)
FLOAT8_INPUT_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("down_proj",))


def _float8_applies(job: Job) -> bool:
    """float8 as the engine runs it: full fine-tuning without tensor parallelism (the config refuses the rest)."""
    return job.float8 and job.tuner == "full" and job.tp == 1


def _float8_input_groups(spec: ModelSpec, job: Job) -> list[tuple[tuple[str, ...], int, bool]]:
    """(group, its input's width, whether all of it is converted) for each FLOAT8_INPUT_GROUPS group with a converted
    linear, where the compiled graph's saving is known: compiled dense blocks without selective checkpointing
    (float8_block_bytes says why); [] elsewhere."""
    if not _float8_applies(job) or not job.compile or spec.num_experts or job.selective_checkpointing:
        return []
    conv = float8_linears(spec)
    out = []
    for group in FLOAT8_INPUT_GROUPS:
        some = [n for n in group if n in conv]
        if some:
            out.append((group, conv[some[0]][0], len(some) == len(group)))
    return out


def float8_block_bytes(spec: ModelSpec, job: Job) -> float:
    """What float8 changes in one compiled block's saved activations (bytes; negative: less). Measured on the
    compiled graphs (benchmarks/float8_probe.py, docs/planner.md "float8"): the partitioner recomputes a converted
    linear's float8 input in backward from what the block saves anyway, so per group of linears sharing an input
    (_float8_input_groups)
    - all converted: that input is no longer saved (q/k/v, gate/up: -c*h, the norms' outputs; down: -c*i, its input
      silu(gate) * up is recomputed from gate and up);
    - only some (q without k and v): their float8 copy of it is saved besides (+h);
    - o: nothing (its input is the attention output, which attention's backward keeps).
    Eager blocks (compile off): torchao's float8 linear saves its high-precision input and weight, as a bf16 linear
    does (read from its source, not measured): no change. Not measured, so no change counted: MoE blocks, selective
    checkpointing (its policy decides what is kept). float8 is refused with LoRA/QLoRA and tensor parallelism."""
    c = job.c
    return job.tokens * sum(-c * width if whole else width for _, width, whole in _float8_input_groups(spec, job))


def float8_backward_bytes(spec: ModelSpec, job: Job) -> float:
    """A converted linear's backward transients beside a block's backward: the float8 casts of its output gradient
    and of its (recomputed) input, each also transposed for the weight gradient, and the recomputed input itself
    where the block did not save it (float8_block_bytes); the largest linear's, bytes (docs/planner.md "float8"
    compares it with the measured change)."""
    if not _float8_applies(job):
        return 0.0
    recomputed = {n for group, _, whole in _float8_input_groups(spec, job) if whole for n in group}
    return job.tokens * max((2 * (i + o) + (job.c * i if n in recomputed else 0)
                             for n, (i, o) in float8_linears(spec).items()), default=0)


def float8_params(spec: ModelSpec) -> float:
    """Parameters of the linears float8 converts, whole model."""
    return spec.num_layers * sum(i * o for i, o in float8_linears(spec).values())




def long_packed(job: Job) -> bool:
    return job.accelerator == "cuda" and job.seq_len > DENSE_MASK_MAX_SEQ


def head_activations(spec: ModelSpec, job: Job, o: Opts) -> dict[str, float]:
    """Outside the blocks: inputs, final norm, logits and the fp32 loss tensors."""
    T, h, V, c = job.tokens, spec.hidden_size, spec.vocab_size, job.c
    r = residual_bytes(job, o)
    full = job.tuner == "full"
    tp = job.tp
    # under TP the final norm runs on a sequence shard (SequenceParallel) and the head's input is all-gathered
    d = {"inputs": 16 * T + 2 * r * T * spec.head_dim,  # ids + labels (int64), rotary cos/sin
         "final_norm": T * h * (4 + (r if full else 0)) / tp + T * h * (c if full else 0)}
    if fused_head(spec, job):
        d.update(preference_head_terms(spec, job, o) if job.task == "dpo" else fused_loss_terms(spec, job, o))
    else:
        # logits in compute dtype (kept by the model output), log_softmax output in fp32 (saved), and during the
        # loss backward its incoming gradient and its result, both fp32: c*T*V + 3 * 4*T*V at the peak
        # (the c-dtype logits are freed after forward unless the caller keeps the output: log_softmax saves its own
        # fp32 result, and .float() keeps nothing). Under TP, loss_parallel: each rank holds V/tp of every row.
        d["logits"] = ((c * T * V if job.hold_outputs else 0) + 12 * T * V) / tp
        if spec.family == "gemma2":  # final logit softcapping keeps two more T*V tensors
            d["logits"] += 2 * c * T * V
    if job.packing and not long_packed(job):  # block-diagonal attention mask, bool, shared by the layers
        d["mask"] = job.micro_batch * job.seq_len ** 2
    return d


def fused_head(spec: ModelSpec, job: Job) -> bool:
    """Whether the engine's fused loss head runs (install_fused_loss skips heads whose logits are post-processed).
    Under tensor parallelism it runs on the vocabulary-sharded head (models/speed.py: a vocabulary-parallel chunked
    cross-entropy); without it, the sharded logits go through loss_parallel."""
    return job.fused_loss and spec.family != "gemma2"


def head_weight_bytes(job: Job, o: Opts) -> int:
    """dtype of the head weight the loss sees: the stored one under autocast (single/ddp), else the compute dtype
    (LoRA/QLoRA: the frozen base, head included, is stored in the compute dtype)."""
    return job.w if cost_of(o.base).autocast and job.tuner == "full" else job.c


def fused_loss_terms(spec: ModelSpec, job: Job, o: Opts) -> dict[str, float]:
    """The fused head at its peak (its last chunk, or its backward), models/speed.py's _LinearCrossEntropy:
    one chunk's fp32 logits (turned into the softmax gradient in place) + its compute-dtype copy; the gradient of
    the hidden states (T*h in the residual dtype) and an fp32 gradient of the head weight, both held until backward
    (plus a copy in the weight's dtype when that is not fp32); compute-dtype casts of the hidden states and the
    weight while the head runs. No T*V tensor exists. A frozen head (LoRA, QLoRA) gets no weight gradient: neither
    the fp32 V*h buffer nor the per-chunk gradient matmul exists (_LinearCrossEntropy checks needs_input_grad)."""
    # under TP each rank's head holds V/tp rows (vocabulary-parallel chunks); its input, the hidden states, is the
    # all-gathered whole sequence, so the hidden-state terms stay T*h
    T, h, V, c = job.tokens, spec.hidden_size, spec.vocab_size / job.tp, job.c
    r = residual_bytes(job, o)
    hw = head_weight_bytes(job, o)
    chunk = min(FUSED_LOSS_CHUNK, T)
    # a chunk: fp32 logits -> softmax gradient in place, its compute-dtype copy, the head-gradient matmul result
    # and its fp32 upcast; the compute-dtype casts of the hidden states and the weight
    trains = job.tuner == "full"
    casts = (T * h * c if r != c else 0) + (V * h * c if hw != c else 0)
    # one chunk at a time: the loop drops a chunk's logits before the next chunk's are made (tests/unit/test_speed.py
    # measures the head's peak on the CPU)
    forward = chunk * V * (4 + c) + (V * h * (c + 4 if c != 4 else 4) if trains else 0) + casts
    # its backward instead: the returned gradients (hidden states, head weight)
    backward = T * h * r + (V * h * hw if trains else 0)
    d = {"loss_grad_hidden": T * h * r,
         "loss_grad_head": V * h * (4 + (hw if hw != 4 else 0)) if trains else 0.0,
         "loss_transient": max(forward, backward)}
    if cost_of(o.base).gathers_root:  # the root unit (embeddings, norm, head) is gathered while the head runs
        d["loss_root_gathered"] = c * local_root_params(spec, job.tp)
    return d


def preference_head_terms(spec: ModelSpec, job: Job, o: Opts) -> dict[str, float]:
    """task dpo's fused head at its peak (models/speed.py's _LinearTokenLogProbs): per-token log-probabilities,
    whose gradients need each token's upstream value, so nothing of the head's gradients exists before backward.
    Chunks are even (facts.even_chunks: 4,128 tokens are two of 2,064). Forward: one chunk's logits, in the compute
    dtype from the matmul and, eager, their fp32 copy (compiled, one fused reduction reads the matmul's output);
    backward: the chunk's logits again and its gradient in the compute dtype (eager: the fp32 logits, turned into
    the gradient in place, and its cast), the hidden states' gradient, and where the head trains the fp32 weight
    gradient beside the next chunk's part of it and that part's matmul output. The compute-dtype casts of the
    hidden states and the weight live through both passes."""
    T, h, V, c = job.tokens, spec.hidden_size, spec.vocab_size / job.tp, job.c
    r = residual_bytes(job, o)
    hw = head_weight_bytes(job, o)
    chunk = max((e - s for s, e in even_chunks(T, FUSED_LOSS_CHUNK)), default=0)
    casts = (T * h * c if r != c else 0) + (V * h * c if hw != c else 0)
    wide = 4 if c != 4 else 0  # eager: the fp32 copy of compute-dtype logits
    forward = chunk * V * (c if job.compile else c + wide)
    backward = chunk * V * (2 * c if job.compile else 4 + (c if c != 4 else 0)) + T * h * r
    if job.tuner == "full":
        backward += V * h * (4 + 4 + c)
    d = {"loss_transient": casts + max(forward, backward)}
    if cost_of(o.base).gathers_root:
        d["loss_root_gathered"] = c * local_root_params(spec, job.tp)
    return d


def block_activations(spec: ModelSpec, job: Job, o: Opts) -> float:
    """Saved bytes of one decoder block, compiled or not. Compilation shrinks what the frozen or trained block
    itself saves; the LoRA adapters' saved inputs (peft casts each to the adapter dtype, drops it out and feeds
    lora_A, which saves it) are kept whole: the compile factor applied to them too predicts well under the
    measured compiled LoRA rows (docs/planner.md)."""
    d = layer_activations(spec, job, o)
    adapters = d.pop("lora_inputs", 0.0)
    factor = cost_of(o.base).compile_factor(o) if job.compile else 1.0
    return sum(d.values()) * factor + adapters + float8_block_bytes(spec, job)


def selective_block_activations(spec: ModelSpec, job: Job, o: Opts) -> float:
    """Saved bytes of one block under selective checkpointing (models/checkpointing.py): its input, and the outputs of
    its matmuls (q, k, v, o, gate, up, down) and of the attention kernel (with its fp32 log-sum-exp); everything
    else is recomputed from those in backward. The policy, not the compiler, decides what is kept: no compile
    factor; but compiled, the partitioner drops what backward never reads (down's output, the block's own output),
    while eager the policy's cache holds it until backward."""
    T, h, i, c = job.tokens, spec.hidden_size, spec.intermediate_size, job.c
    mm_out = T * c * (spec.q_dim + 2 * spec.kv_dim + h + 2 * i + (0 if job.compile else h))
    attention = T * c * spec.q_dim + 4 * spec.num_heads * T
    return (T * h * residual_bytes(job, o) + mm_out + attention) / job.tp


def activations(spec: ModelSpec, job: Job, o: Opts) -> tuple[float, float, dict]:
    """(bytes alive at the end of forward, bytes of one block's activations, detail)."""
    per_layer = block_activations(spec, job, o)
    head = head_activations(spec, job, o)
    block_input = job.tokens * spec.hidden_size * residual_bytes(job, o) / job.tp
    host = 0.0
    if job.checkpointing and job.offload_checkpoints:  # the inputs live in host memory (models/offload.py); on the
        # device: the input whose copy out is in flight beside the running block's, or in backward the recomputed
        # block's input and the next one's prefetch
        kept = min(2, spec.num_layers) * block_input
        host = offload_host_bytes(spec.num_layers, job.tokens // job.tp, spec.hidden_size, residual_bytes(job, o),
                                  pinned=job.accelerator == "cuda")
    elif job.checkpointing:  # only each block's input is kept; one block is recomputed at a time in backward
        kept = spec.num_layers * block_input
    elif job.selective_checkpointing:
        kept = spec.num_layers * min(per_layer, selective_block_activations(spec, job, o))
    else:
        kept = spec.num_layers * per_layer
    detail = {"per_layer": per_layer, "layers_kept": kept, "host_checkpoints": host,
              **{f"head.{k}": v for k, v in head.items()}}
    return kept + sum(head.values()), per_layer, detail


# ----------------------------------------------------------------------------- states and buffers


@dataclass
class States:
    """What one strategy family keeps per rank, filled in by its `*_states` function below: its states, the
    buffers alive at each moment of the step (A end of forward, B end of backward; module docstring), and the
    facts the peak needs."""

    P_t: float  # trainable parameters
    frozen: float  # bytes of the frozen base (LoRA / QLoRA), unsharded
    tw: int  # bytes per trainable weight (and its gradient and each Adam moment)
    params: float = 0.0
    grads: float = 0.0
    opt: float = 0.0
    host: float = 0.0  # per rank, in host RAM (offload)
    extraA: dict = field(default_factory=dict)  # buffers alive at moment A
    extraB: dict = field(default_factory=dict)  # buffers alive at moment B
    persist: dict = field(default_factory=dict)  # buffers alive all step
    grads_persist: bool = False  # gradients allocated once and kept between steps
    root_bwd: float = 0.0  # FSDP: the root unit's gathered params + unsharded grads at the end of backward
    zero3_kept: float | None = None  # ZeRO-3: parameters its prefetcher keeps gathered (0: none); else None


def trainable(spec: ModelSpec, job: Job) -> tuple[float, float, int]:
    """(trainable parameters, bytes of the frozen base, bytes per trainable weight)."""
    P, c, w = spec.total_params, job.c, job.w
    if job.tuner == "full":  # under TP, what one rank of the tp group holds
        return local_params(spec, job.tp), 0.0, w
    base_linear = spec.num_layers * spec.layer_linear_params
    if job.tuner == "qlora":
        frozen = base_linear * QLORA_BYTES_PER_PARAM + (P - base_linear) * c
    else:  # models/lora.py apply_lora casts the frozen base to the compute dtype (adapters stay in param_dtype)
        frozen = P * c
    return spec.lora_params(job.lora_r, job.lora_targets), frozen, w


def reference_bytes(spec: ModelSpec, job: Job, shard_n: int, autocast: bool) -> float:
    """task dpo's frozen reference model per rank: its weights in the policy's storage dtype under autocast, else in
    the narrower of the compute and storage dtypes (Strategy.reference_dtype), over the `shard_n` ranks that share
    them (1: a whole copy). Its forward runs before the policy's and frees its gathered units and activations, so
    nothing else of it is alive at the step's moments."""
    return spec.total_params * (job.w if autocast else min(job.c, job.w)) / shard_n


# fp32 (tokens x hidden) tensors alive at once in an eager RMSNorm's backward (HF's norm computes in fp32): the
# gradient in fp32 and the temporaries of pow, mean and rsqrt's backward (tests/unit/test_plan_eager_norm_backward.py)
NORM_FP32_ROWS = 5


def norm_backward(spec: ModelSpec, job: Job, o: Opts, per_layer: float) -> float:
    """A block's backward at its second RMSNorm. Eager, autograd runs the norm's variance branch op by op, so
    NORM_FP32_ROWS fp32 (tokens x hidden) tensors are alive at once beside the gradient coming into the block
    (compute dtype). In a Llama-style block the MLP above that norm has finished its backward, so its interior (and
    an MoE block's routing) is gone; the rest of the block's saved tensors (`per_layer`) are still held. Blocks with
    a norm after the MLP (Gemma 2) run one such backward before the MLP's, with its interior still held. Traced on
    the CPU (the same eager ops, tests/unit/test_plan_eager_norm_backward.py) and seen in the allocator's history of
    an eager 256K block on an H100 (docs/planner.md, "the 256K gap").
    Compiled blocks are counted the same way (with their smaller saved tensors): inductor fuses the norm's backward,
    yet every compiled row measured at 256K (2 and 32 layers, LoRA and QLoRA, with and without adapter dropout) peaks
    where this moment puts it, within 9%, and 25-32% above the compiled blocks' other moments; the cause is not
    found. At 64K the 2-layer compiled row peaks 14% lower than this moment: an overestimate, the safe side, where
    an underestimate makes `--mlp-tiles auto` choose tile counts that run out of memory."""
    if not spec.num_layers:
        return 0.0
    d = layer_activations(spec, job, o)
    gone = d["mlp"] + d.get("moe_routing", 0.0) if spec.norms_per_layer <= 2 else 0.0
    return per_layer - gone + job.tokens * spec.hidden_size * (job.c + NORM_FP32_ROWS * 4) / job.tp


def host_peak(spec: ModelSpec, job: Job, kept: float) -> tuple[float, str]:
    """Host RAM of one rank's process at its largest, on a GPU: the larger of its start, where train.loop.build_model
    loads the whole model on the CPU in its storage dtype (every rank, before the strategy moves or shards it), and
    its steady state, where it keeps `kept` bytes there (offloaded states, pinned checkpoints) and, with compiled
    blocks, the compiler's worker processes; the process's own memory under both. Returns (bytes, "load" or
    "steady": which sets it). On the CPU host memory is the device's: 0 (the device figures count it)."""
    if job.accelerator != "cuda":
        return 0.0, "steady"
    load = spec.total_params * job.w
    steady = kept + (HOST_COMPILE_WORKERS_GIB * GiB if job.compile else 0.0)
    return HOST_PROCESS_GIB * GiB + max(load, steady), "load" if load > steady else "steady"


def estimate(spec: ModelSpec, job: Job, o: Opts) -> Memory:
    """Per-rank memory of one steady-state step (optimizer states exist; grads set to None by zero_grad)."""
    if o.base not in presets.SPECS:
        raise ValueError(o.base)
    cost = cost_of(o.base)
    N = max(1, shard_ranks(job, o) // job.tp)  # FSDP shards over the data-parallel ranks, not the tp ones
    st = States(*trainable(spec, job))
    cost.states(spec, job, o, N, st)
    if job.reference == "model":
        st.persist["reference"] = reference_bytes(spec, job, N if cost.gathers_params(o) else 1, cost.autocast)
    P_t, grads, extraA, extraB, persist = st.P_t, st.grads, st.extraA, st.extraB, st.persist

    if job.tuner == "qlora":  # bitsandbytes dequantises one weight at a time for the matmul
        extraB["dequant"] = job.c * spec.hidden_size * spec.intermediate_size
        extraA["dequant"] = job.c * spec.hidden_size * spec.intermediate_size

    act_end, per_layer, act_detail = activations(spec, job, o)
    # accumulating: earlier micro-batches' gradients are alive (FSDP keeps them unsharded, counted above)
    accum_grads = grads if job.grad_accum > 1 and not st.grads_persist and not cost.counts_own_accumulation else 0.0
    states = st.params + st.opt + sum(persist.values()) + (grads if st.grads_persist else 0.0)
    moment_a = states + act_end + sum(extraA.values()) + accum_grads
    # end of backward: all grads, the first block's activations and their gradients (or the recomputed block)
    # a block's backward: its saved activations (recomputed under checkpointing) plus the gradients in flight
    workspace = (per_layer + job.tokens * (3 * spec.mlp_width * job.c / mlp_tiles(spec, job) + 8 * spec.hidden_size) / job.tp
                 + float8_backward_bytes(spec, job))
    workspace = max(workspace, norm_backward(spec, job, o, per_layer))
    g = 0.0 if st.grads_persist else grads
    moment_b = states + g + max(workspace + sum(extraB.values()), st.root_bwd)  # the fused AdamW: no temporaries
    # start of backward (the last block's backward) under checkpointing, where the gradients leave the device
    # (offloaded): the inputs saved at the other blocks' boundaries are still alive beside the recomputed block.
    # Where the gradients stay on the device, the end of backward holds them in place of the boundaries; without
    # checkpointing moment A holds more than this.
    moment_b0 = 0.0
    # (LoRA/QLoRA too: only the adapters' gradients are made, so the end of backward holds little and the last
    # block's recompute beside the other blocks' boundaries is the peak)
    if job.checkpointing and spec.num_layers and ((g == 0 and not st.grads_persist) or job.tuner != "full"):
        bwd = sum(v for k, v in extraB.items() if k != "fp32_grad_partition")
        accumulated = extraA.get("unsharded_accumulated_grads", 0.0) + accum_grads  # earlier micro-batches'
        others = 1.0 if job.offload_checkpoints else (spec.num_layers - 1) / spec.num_layers  # offload: in flight only
        moment_b0 = (states + act_detail["layers_kept"] * others + workspace + bwd
                     + accumulated)
    moment_c, phase_c, extraC = cost.extra_moment(spec, job, o, N, st, states, per_layer, act_detail)
    peak = max(moment_a, moment_b, moment_b0, moment_c)
    phase = ("end of forward (activations + logits)" if peak == moment_a else
             phase_c if peak == moment_c else
             "start of backward (checkpointed boundaries + a recomputed block)" if peak == moment_b0 else
             "end of backward (gradients)")
    if job.accelerator == "cuda":
        allowance = CUDA_CONTEXT_GIB * GiB + FRAGMENTATION * peak
    else:
        allowance = 0.0
    buffers = max(sum(extraA.values()), sum(extraB.values()), sum(extraC.values())) + sum(persist.values())
    detail = {**{f"buffer.{k}": v for k, v in {**persist, **extraA}.items()},
              **{f"buffer_bwd.{k}": v for k, v in extraB.items()},
              **{f"buffer_reduce.{k}": v for k, v in extraC.items()},
              **{f"act.{k}": v for k, v in act_detail.items()},
              "moment_a": moment_a, "moment_b": moment_b, "moment_b0": moment_b0, "moment_c": moment_c,
              "trainable_params": P_t if job.tp == 1 else trainable(spec, dataclasses.replace(job, tp=1))[0],
              "shard_ranks": N, **({"tp_local_params": P_t} if job.tp > 1 else {})}
    host = st.host + act_detail["host_checkpoints"]
    host_max, detail["host_phase"] = host_peak(spec, job, host)
    return Memory(params=st.params, grads=grads, optimizer=st.opt, activations=act_end, buffers=buffers,
                  peak_tensors=peak, allowance=allowance, host=host, phase=phase, detail=detail, host_peak=host_max)
