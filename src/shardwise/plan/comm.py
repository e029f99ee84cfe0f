"""Communication per step and the step-time model. Pure arithmetic.

Collective sizes follow nccl-tests: a collective of M bytes (the full, unsharded buffer)
on n ranks puts 2(n-1)/n*M bytes per rank on the wire for all-reduce and (n-1)/n*M for
all-gather / reduce-scatter, and takes that many bytes divided by the bus bandwidth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from shardwise.plan.memory import (
    QLORA_BYTES_PER_PARAM,
    Job,
    Opts,
    float8_linears,
    local_params,
    local_root_params,
    reshards,
    unit_params,
    zero3_per_module,
)
from shardwise.plan.model_spec import ModelSpec

# The offloaded optimizer step's host share, parameters per second per node: torch's fused AdamW on the host's fp32
# state plus what each engine does around it there (FSDP2: the clip's norm over per-parameter host shards, now over
# the host's threads, strategies/gradnorm.py; DeepSpeed: its flat fp32 partition). Fitted on the 1.14B anchor on one
# 16-core H200 host (2026-12-02: fsdp-offload 0.803 s and zero2-offload 0.830 s a step; the kernel alone ran 4.1e9
# parameters/s there); both scale with the host's cores (docs/planner.md, "Where the constants come from").
DS_HOST_STEP_PARAMS_PER_S = 1.94e9
FSDP_HOST_STEP_PARAMS_PER_S = 1.98e9
HOST_LINK_GBPS = 200.0  # PCIe Gen4 x16 nominal, per GPU, for offload traffic
HBM_BYTES_PER_S = 2.0e12  # effective device memory bandwidth for the optimizer step (GPU)
# Per-step work of a strategy beyond the model's FLOPs, the collectives and the optimizer step, as device-memory bytes
# per local parameter at HBM_BYTES_PER_S (what each term stands for: docs/planner.md, "Speed overheads per strategy"):
#   ddp       the bucketed all-reduce's pass over the fp32 gradient buckets (average in place)
#   fsdp      FSDP2 copy-in per all-gather and the fp32 reduce-scatter input + copy-out of the gradient
#             (fsdp-grad-op: one all-gather fewer)
#   zero1/2   the gradients into the bucket and the fp32 partition, norm and overflow checks, master -> bf16 copy
#   zero3     fetching whole blocks: the gradients into the fp32 reduce bucket and the partition, master -> bf16
#             copy (one rank gathers nothing; what gathering adds on several ranks is not measured); per parameter
#             of the whole model.
#             Fitted on the compiled anchor on one H200 (2026-12-01: 0.237 s predicted without it, 0.251 measured;
#             the profile's kernels were 15 ms a step busier than fsdp's)
STRATEGY_BYTES_PER_PARAM = {"ddp": 4.0, "fsdp": 16.0, "fsdp-grad-op": 10.0, "zero12": 42.0, "zero3": 28.0}
# Memory-bound passes the FLOP count misses, bytes at HBM_BYTES_PER_S (elementwise_time): the loss's passes over the
# fp32 logits (per token per vocabulary entry), and LoRA's adapters (per token per unit of adapted width, per block)
LOSS_BYTES_PER_LOGIT = 42.0
LORA_BYTES_PER_WIDTH = 13.0  # compiled blocks, or eager under FSDP2 (its bf16 parameters: no fp32 adapter casts)
# eager blocks with fp32 adapters under autocast (single, ddp, DeepSpeed): peft casts each adapted input to fp32, the
# dropout and the two skinny matmuls' casts run as separate kernels; fitted on the eager LoRA single rows of one H200
# (2026-12-01: Qwen2.5-1.5B shape 3 x 3072 and 1.14B Llama 6 x 1536 both give 24.5)
LORA_BYTES_PER_WIDTH_EAGER = 24.5
# the adapters' forward passes, as a share of their bytes, run again under gradient checkpointing (same rows)
LORA_FORWARD_SHARE = 0.5
# ZeRO-3: DeepSpeed's fetch/release hooks run on the host for every submodule that holds parameters, in forward,
# backward and (checkpointing) the recomputed forward; the GPU's work hides them until the host's share is the longer:
# the step is max(GPU step, hooks) (zero3_hook_time). Seconds per parameterized submodule per pass, eager and with
# compiled blocks (dynamo's guards and graph breaks around every hook cost more), fitted on one H200 (2026-12-01:
# twelve zero3 rows, full and LoRA, checkpointing on and off, Qwen2.5-1.5B and 1.14B Llama shapes; docs/planner.md).
ZERO3_EAGER_S_PER_MODULE_PASS = 8.5e-4
ZERO3_COMPILED_S_PER_MODULE_PASS = 1.35e-3
# ZeRO-3 fetching whole blocks (deepspeed.fetch block, the default): one pair of hooks per block, and what the host
# still spends grows with the trained tensors instead (DeepSpeed's per-parameter bookkeeping in each pass and its
# gradient path): seconds per trained weight or norm tensor (LoRA: per adapter matrix) per pass, eager or compiled.
# Fitted on eleven zero3 rows of one H200 (2026-12-01, Qwen2.5-1.5B and 1.14B Llama shapes, full and LoRA,
# checkpointing on and off, eager and compiled: mean |error| 11%, max 26%; docs/planner.md).
ZERO3_BLOCK_S_PER_TENSOR_PASS = 7.0e-4
# float8 linears (float8_time): their matmuls run at the GPU's float8 peak at the job's MFU; each element counted as
# cast to float8 (each forward pass's input and weight, and the output gradient once) costs this many bytes of
# device-memory traffic. It stands for the amax reductions, the scaled casts, backward's recasts of the input and
# the weight, the transposed copies, and whatever else keeps the float8 matmuls from twice the bf16 rate. Fitted on
# one row, the 1.14B anchor under single on one H200 (2026-12-01: 229.2 -> 198.0 ms a step); docs/planner.md
# "float8" has the rows it was checked on.
FLOAT8_CAST_BYTES = 9.1


@dataclass(frozen=True)
class Links:
    """Bus bandwidths (bytes/s) and per-collective latency (s)."""

    intra_busbw: float
    inter_busbw: float  # per node, all NICs together
    intra_latency: float = 15e-6
    inter_latency: float = 40e-6
    host_bw: float = HOST_LINK_GBPS / 8 * 1e9 * 0.8


@dataclass(frozen=True)
class Compute:
    """Effective FLOP/s of one rank: peak * MFU."""

    peak_flops: float
    mfu: float
    device_mem_bw: float = HBM_BYTES_PER_S
    fp8_peak_flops: float = 0.0  # float8 tensor cores (0: none)


@dataclass
class Coll:
    op: str  # all_reduce | all_gather | reduce_scatter | all_to_all | h2d | d2h
    bytes: float  # M, the full buffer
    ranks: int
    where: str  # intra | inter | flat | host
    per_step: float  # how many times per optimizer step
    phase: str  # fwd | bwd | step
    kind: str = ""  # "" data parallel | tp (tensor parallel, exposed) | sp (sequence parallel)

    def wire(self) -> float:
        n = self.ranks
        if self.op in ("h2d", "d2h"):
            return self.bytes
        if n <= 1:
            return 0.0
        if self.op == "ring":  # `bytes` is one exchange (summed over the layers); n-1 exchanges pass the ring
            return (n - 1) * self.bytes
        f = 2 * (n - 1) / n if self.op == "all_reduce" else (n - 1) / n
        return f * self.bytes


@dataclass
class Timing:
    comm_bytes: float  # bytes on the wire per rank per optimizer step
    compute_s: float
    exposed_comm_s: float
    other_s: float  # offload transfers, CPU optimizer step, device optimizer step
    step_s: float
    tokens_per_s: float
    collectives: list = field(default_factory=list)
    overhead_s: float = 0.0  # the strategy's own per-step work (strategy_overhead), included in other_s


def sp_split(spec: ModelSpec, job: Job) -> tuple[int, int]:
    """(Ulysses degree, ring degree) of the sequence-parallel group, their product job.sp: `ulysses` all of it,
    `ring` none, `auto` Ulysses over gcd(heads, sp) ranks and ring attention over the rest. Under tensor
    parallelism the heads are each tp rank's (heads / tp), which Ulysses splits further (the engine's mesh,
    strategies/parallel.py ParallelDims.from_config)."""
    if job.sp_mode == "ring":
        return 1, job.sp
    if job.sp_mode == "ulysses":
        return job.sp, 1
    u = math.gcd(spec.num_heads // job.tp, job.sp)
    return u, job.sp // u


def _sp_kv_heads(spec: ModelSpec, job: Job, u: int) -> int:
    """One tp rank's KV heads after Ulysses over u ranks: replicated up to a multiple of u when fewer or not
    divisible (kv / tp per tp rank, at least 1)."""
    kv = max(1, spec.num_kv_heads // job.tp)
    return math.lcm(kv, u) if kv % u else kv


def _sp_where(job: Job) -> str:
    """A sequence group's link: its ranks are tp apart (the mesh puts tp innermost, strategies/parallel.py
    MESH_DIMS), so it stays in a node while sp x tp ranks fit in one."""
    return "intra" if job.sp * job.tp <= job.gpus_per_node else "flat"


def ulysses_exchanges(spec: ModelSpec, job: Job) -> list[Coll]:
    """Sequence parallelism (Ulysses, models/sequence_parallel.py): per layer, all-to-alls of q, k, v (KV heads
    replicated up to a multiple of the Ulysses degree) and the attention output over the Ulysses ranks of a group,
    in forward, backward, and the recomputed forward under checkpointing; each rank sends (u-1)/u of its slice.
    Under tensor parallelism each tp rank exchanges its own heads / tp (the tp ranks' exchanges run side by side,
    each in its own sequence group). On the critical path."""
    u, _ = sp_split(spec, job)
    if u <= 1:
        return []
    per_layer = job.tokens * job.c * (2 * spec.q_dim // job.tp + 2 * _sp_kv_heads(spec, job, u) * spec.head_dim)
    n = spec.num_layers * per_layer
    where = _sp_where(job)
    return [Coll("all_to_all", n, u, where, job.grad_accum, "fwd", "sp"),
            Coll("all_to_all", n * (2 if job.checkpointing else 1), u, where, job.grad_accum, "bwd", "sp")]


def ring_kv_bytes(spec: ModelSpec, job: Job) -> float:
    """Bytes of one ring-attention exchange of one layer: K and V of this rank's tokens,
    2 x tokens_local x kv_heads x head_dim x c (one tp rank's KV heads as Ulysses left them, under auto's
    Ulysses x ring)."""
    u, _ = sp_split(spec, job)
    return 2 * job.tokens * _sp_kv_heads(spec, job, u) * spec.head_dim * job.c


def ring_exchanges(spec: ModelSpec, job: Job) -> list[Coll]:
    """Ring attention (--sp-mode ring, or auto's ring part): per layer, r-1 exchanges of K and V around the ring of
    r ranks in forward; backward passes K and V again and their gradients (dK, dV) the other way, 2(r-1) exchanges;
    the recomputed forward under checkpointing once more. Each exchange overlaps the attention of the block
    already received (comm.step_time exposes only what exceeds the attention compute)."""
    _, r = sp_split(spec, job)
    if r <= 1:
        return []
    n = spec.num_layers * ring_kv_bytes(spec, job)
    where = _sp_where(job)
    return [Coll("ring", n, r, where, job.grad_accum, "fwd", "sp"),
            Coll("ring", n * (3 if job.checkpointing else 2), r, where, job.grad_accum, "bwd", "sp")]


def tensor_parallel_exchanges(spec: ModelSpec, job: Job) -> list[Coll]:
    """Tensor parallelism with sequence-parallel norms (the TP plan in plan/memory.py): per layer in forward an
    all-gather of the norm output before attention and before the MLP and a reduce-scatter of the row-wise
    linears' output after each; backward the reverse (2 reduce-scatters + 2 all-gathers per layer), and the
    recomputed forward's under checkpointing. The embedding's output is reduce-scattered and the head's input
    all-gathered once per pass (loss_parallel's all-reduces of a few floats per token are left out). Each of
    tokens x hidden x c bytes (the tp group's tokens), on the intra-node link, not overlapped with compute."""
    if job.tp <= 1:
        return []
    L = spec.num_layers
    M = job.tokens * spec.hidden_size * job.c
    fwd = (2 * L + 1) * M
    bwd = fwd + (2 * L * M if job.checkpointing else 0)
    where = "intra" if job.tp <= job.gpus_per_node else "flat"
    ga = job.grad_accum
    return [Coll("all_gather", fwd, job.tp, where, ga, "fwd", "tp"),
            Coll("reduce_scatter", fwd, job.tp, where, ga, "fwd", "tp"),
            Coll("all_gather", bwd, job.tp, where, ga, "bwd", "tp"),
            Coll("reduce_scatter", bwd, job.tp, where, ga, "bwd", "tp")]


def collectives(spec: ModelSpec, job: Job, o: Opts, shard_n: int) -> list[Coll]:
    """The collectives of one optimizer step for one strategy (under TP, of one rank's tp-local shards)."""
    P = local_params(spec, job.tp)
    full = job.tuner == "full"
    P_t = P if full else spec.lora_params(job.lora_r, job.lora_targets)
    c, w = job.c, job.w
    rd = 4  # FSDP2 reduces in fp32 (strategies/fsdp.py)
    ga = job.grad_accum
    flat = "flat" if job.nodes > 1 else "intra"
    gb = QLORA_BYTES_PER_PARAM if job.tuner == "qlora" else c
    root = local_root_params(spec, job.tp)
    blocks = P - root
    gathered = gb * blocks + c * root
    out: list[Coll] = []
    if o.base == "single" and job.sp > 1:
        # single under sequence parallelism (with TP, tp x sp = every rank): the sequence ranks hold other tokens of
        # the same rows, so strategies/single.py all-reduces every gradient (this rank's tp-local shard, in the
        # stored dtype) over them in its step, after backward: nothing to hide behind. One latency counted for
        # the per-parameter calls.
        out.append(Coll("all_reduce", w * P_t, job.sp, _sp_where(job), 1, "step"))
    elif o.base == "ddp" and job.world > 1:
        out.append(Coll("all_reduce", w * P_t, job.world, flat, 1, "bwd"))
    elif o.base == "fsdp" and job.world > 1:
        # a hybrid shard group that fits in a node gathers over NVLink; its replicas meet across nodes, or inside
        # the one node when there is only one
        where = "intra" if o.hybrid and shard_n <= job.gpus_per_node else flat
        # forward gathers every unit; backward gathers the blocks again unless kept (reshard_after_forward off);
        # the root stays gathered between forward and backward
        out.append(Coll("all_gather", gathered, shard_n, where, ga, "fwd"))
        if reshards(job, o):
            out.append(Coll("all_gather", gb * blocks, shard_n, where, ga, "bwd"))
        # gradients are reduced on the last micro-batch only (set_requires_gradient_sync(False) before it)
        out.append(Coll("reduce_scatter", rd * P_t, shard_n, where, 1, "bwd"))
        if o.hybrid and job.world > shard_n:
            out.append(Coll("all_reduce", rd * P_t / shard_n, job.world // shard_n, "inter" if job.nodes > 1 else "intra",
                            1, "bwd"))
        if o.cpu_offload:
            out.append(Coll("h2d", w * P / shard_n * (2 if reshards(job, o) else 1), 1, "host", ga, "fwd"))
            out.append(Coll("d2h", rd * P_t / shard_n, 1, "host", 1, "bwd"))
    elif o.base == "deepspeed" and job.world > 1:
        n = job.world
        if o.stage == 3:
            out.append(Coll("all_gather", gathered, n, flat, ga, "fwd"))
            out.append(Coll("all_gather", gathered, n, flat, ga, "bwd"))
            out.append(Coll("reduce_scatter", c * P_t, n, flat, ga, "bwd"))
        else:
            out.append(Coll("reduce_scatter", c * P_t, n, flat, ga if o.stage == 2 else 1, "bwd"))
            out.append(Coll("all_gather", c * P_t, n, flat, 1, "step"))
        if o.offload_optimizer:
            out.append(Coll("d2h", c * P_t / n, 1, "host", ga if o.stage >= 2 else 1, "bwd"))
            out.append(Coll("h2d", c * P_t / n, 1, "host", 1, "step"))
        if o.offload_params and o.stage == 3:
            out.append(Coll("h2d", 2 * c * P / n, 1, "host", ga, "fwd"))
    out += ulysses_exchanges(spec, job) + ring_exchanges(spec, job) + tensor_parallel_exchanges(spec, job)
    return out


def coll_time(cl: Coll, links: Links) -> float:
    if cl.where == "host":
        return cl.bytes / links.host_bw
    if cl.where == "intra":
        bw, lat = links.intra_busbw, links.intra_latency
    elif cl.where == "inter":
        bw, lat = links.inter_busbw, links.inter_latency
    else:  # a flat ring across nodes runs at the slower of the two
        bw, lat = min(links.intra_busbw, links.inter_busbw), links.inter_latency
    return cl.wire() / bw + lat


def flops_per_microbatch(spec: ModelSpec, job: Job) -> tuple[float, float]:
    """(forward, backward) FLOPs one micro-batch runs on one rank: 6N per token for the weights (MEASUREMENTS.md's
    convention) and the attention a causal kernel computes: SDPA's flash / memory-efficient kernels skip the masked
    upper triangle, so QK^T and PV cost 2*L*H*S per token forward, half the 12*L*H*S/3 of the MFU convention
    (which counts the full S x S square). At 2k tokens that is 5% of a step; at 32k-64k on an 8B shape, a third
    to a half (the long-sequence rows of docs/planner.md's measured table). Tensor parallelism divides every
    FLOP of a rank by tp (the tp ranks split the matmuls and the heads of the same tokens)."""
    T = job.tokens
    P = spec.active_params  # MoE: the experts a token runs through (model_spec.py); dense: total_params
    attn_f = attention_flops(spec, job)
    fwd = 2 * P * T + attn_f
    if job.tuner == "full":
        bwd = 4 * P * T + 2 * attn_f
    else:  # frozen weights need only input gradients
        P_t = spec.lora_params(job.lora_r, job.lora_targets)
        bwd = 2 * P * T + 6 * P_t * T + 2 * attn_f
    if job.checkpointing:  # blocks run forward again in backward
        bwd += 2 * (P - spec.root_params) * T + attn_f
    elif job.selective_checkpointing:
        bwd += selective_recompute_flops(spec, job)
    return fwd / job.tp, bwd / job.tp


def selective_recompute_flops(spec: ModelSpec, job: Job) -> float:
    """FLOPs selective checkpointing runs again in backward: only the operators between the kept matmul and attention
    outputs, a few per element: two RMSNorms (~5 per hidden element each), the rotary embedding of q and k (~3 per
    element) and SiLU times the gate (~5 per intermediate element)."""
    return spec.num_layers * job.tokens * (10 * spec.hidden_size + 3 * (spec.q_dim + spec.kv_dim)
                                           + 5 * spec.intermediate_size)


def attention_flops(spec: ModelSpec, job: Job) -> float:
    """Forward FLOPs of the causal attention (QK^T and PV) of one micro-batch, for all the heads of the tp group
    (one rank runs 1/tp of them): 2*L*q*S per token."""
    return 2 * spec.num_layers * spec.q_dim * job.seq_len * job.tokens


def elementwise_time(spec: ModelSpec, job: Job, comp: Compute, o_base: str = "single") -> float:
    """Seconds per micro-batch of memory-bound work the FLOP count misses (GPU only; both terms from
    docs/planner.md, "Where the constants come from"):
    - the loss over the vocabulary: the fp32 logits are written, reduced (log-sum-exp), exponentiated, masked
      and cast back, forward and backward, LOSS_BYTES_PER_LOGIT bytes per token per vocabulary entry, with or
      without the fused head (it makes the same passes, one chunk at a time);
    - LoRA's adapters: each adapted projection casts its input to the adapter dtype, drops it out, runs two
      skinny matmuls (rank r) and scales and adds the result, in forward and backward: LORA_BYTES_PER_WIDTH
      bytes per token per unit of the adapted inputs' and outputs' widths, per block."""
    if job.accelerator != "cuda":
        return 0.0
    t = LOSS_BYTES_PER_LOGIT * job.tokens * spec.vocab_size / job.tp / comp.device_mem_bw  # TP: V/tp per rank
    if job.tuner != "full":
        width = spec.lora_params(1, job.lora_targets) / max(spec.num_layers, 1)  # sum of (in + out) per block
        per = LORA_BYTES_PER_WIDTH if job.compile or o_base == "fsdp" else LORA_BYTES_PER_WIDTH_EAGER
        if job.checkpointing:  # the recomputed forward runs the adapters' forward passes again
            per *= 1 + LORA_FORWARD_SHARE
        t += per * job.tokens * width * spec.num_layers / comp.device_mem_bw
    return t


def float8_time(spec: ModelSpec, job: Job, comp: Compute) -> float:
    """Seconds float8 changes in one micro-batch (negative: faster): the converted linears' matmul passes (forward,
    input and weight gradients, and the recomputed forward under full checkpointing) at the float8 rate instead of
    the bf16 one, plus their casts (FLOAT8_CAST_BYTES per element counted: each forward pass's input and weight,
    the output gradient once). Nothing for LoRA/QLoRA or tensor parallelism (refused with float8)."""
    if (not job.float8 or job.tuner != "full" or job.tp != 1 or job.accelerator != "cuda"
            or not comp.fp8_peak_flops):
        return 0.0
    conv, T, L = float8_linears(spec), job.tokens, spec.num_layers
    fwd = 2 if job.checkpointing else 1  # forward passes
    flops = (fwd + 2) * 2 * T * L * sum(i * o for i, o in conv.values())
    mm = flops / (comp.fp8_peak_flops * comp.mfu) - flops / (comp.peak_flops * comp.mfu)
    casts = L * sum(fwd * (T * i + i * o) + T * o for i, o in conv.values())
    return mm + FLOAT8_CAST_BYTES * casts / comp.device_mem_bw


def zero3_hooked_modules(spec: ModelSpec, job: Job, o: Opts) -> int:
    """Submodules of one block fetched and released by ZeRO-3's hooks: the block itself when it is fetched whole
    (deepspeed.fetch block); with DeepSpeed's per-submodule fetch each one holding parameters, the projections and
    the norms, and LoRA adds each adapted projection's lora_A and lora_B."""
    if not zero3_per_module(o):
        return 1
    n = len(spec.linear_shapes()) + spec.norms_per_layer
    if job.tuner != "full":
        targets = job.lora_targets
        names = spec.linear_shapes() if targets in ("all-linear", "") else [t for t in targets.split(",") if t.strip()]
        n += 2 * len(names)
    return n


def zero3_trained_tensors(spec: ModelSpec, job: Job) -> int:
    """Trained weight and norm tensors (biases not counted): full fine-tuning every block's projections and norms,
    the embedding, the final norm and an untied head; LoRA each adapted projection's lora_A and lora_B."""
    if job.tuner == "full":
        return spec.num_layers * (len(spec.linear_shapes()) + spec.norms_per_layer) + 2 + (0 if spec.tied_embeddings
                                                                                           else 1)
    targets = job.lora_targets
    names = spec.linear_shapes() if targets in ("all-linear", "") else [t for t in targets.split(",") if t.strip()]
    return spec.num_layers * 2 * len(names)


def zero3_hook_time(spec: ModelSpec, job: Job, o: Opts) -> float:
    """Seconds a step's ZeRO-3 hooks keep the host busy, per pass (forward, backward, the recomputed forward under
    checkpointing) and micro-batch: with whole-block fetch per trained tensor (zero3_trained_tensors), with
    DeepSpeed's per-submodule fetch per parameterized submodule (zero3_hooked_modules)."""
    passes = 3 if job.checkpointing else 2
    if not zero3_per_module(o):
        return ZERO3_BLOCK_S_PER_TENSOR_PASS * zero3_trained_tensors(spec, job) * passes * job.grad_accum
    k = ZERO3_COMPILED_S_PER_MODULE_PASS if job.compile else ZERO3_EAGER_S_PER_MODULE_PASS
    return k * zero3_hooked_modules(spec, job, o) * spec.num_layers * passes * job.grad_accum


def strategy_overhead(spec: ModelSpec, job: Job, o: Opts, shard_n: int, comp: Compute, gpu_s: float = 0.0) -> float:
    """Seconds per optimizer step of the strategy's own work (STRATEGY_BYTES_PER_PARAM; ZeRO-3: what its host-bound
    hooks add to a step whose GPU work takes `gpu_s`, max(0, zero3_hook_time - gpu_s), and with whole-block fetch
    its copies on the GPU first).
    Single: 0. On the CPU (no HBM roofline, no measurement) 0."""
    if job.accelerator != "cuda" or o.base == "single":
        return 0.0
    P_t = local_params(spec, job.tp) if job.tuner == "full" else spec.lora_params(job.lora_r, job.lora_targets)
    if o.base == "ddp":
        return STRATEGY_BYTES_PER_PARAM["ddp"] * P_t / comp.device_mem_bw
    if o.base == "fsdp":
        key = "fsdp" if reshards(job, o) else "fsdp-grad-op"
        return STRATEGY_BYTES_PER_PARAM[key] * local_params(spec, job.tp) / shard_n / comp.device_mem_bw
    if o.stage == 3:
        if zero3_per_module(o):  # the fit of its hook constants holds its copies too
            return max(0.0, zero3_hook_time(spec, job, o) - gpu_s)
        copies = STRATEGY_BYTES_PER_PARAM["zero3"] * local_params(spec, job.tp) / comp.device_mem_bw
        return copies + max(0.0, zero3_hook_time(spec, job, o) - gpu_s - copies)
    return STRATEGY_BYTES_PER_PARAM["zero12"] * P_t / shard_n / comp.device_mem_bw


def step_time(spec: ModelSpec, job: Job, o: Opts, shard_n: int, links: Links, comp: Compute) -> Timing:
    colls = collectives(spec, job, o, shard_n)
    f_fwd, f_bwd = flops_per_microbatch(spec, job)
    rate = comp.peak_flops * comp.mfu
    t_fwd, t_bwd = f_fwd / rate, f_bwd / rate
    ga = job.grad_accum
    compute = ga * (t_fwd + t_bwd + float8_time(spec, job, comp))
    overlap = 1.0 if (o.prefetch or o.base != "fsdp") else 0.5
    exposed = 0.0
    other = 0.0
    net = [cl for cl in colls if cl.where != "host" and not cl.kind]
    exchanges = [cl for cl in colls if cl.kind]  # sequence and tensor parallel
    # Ulysses's all-to-alls and TP's all-gathers / reduce-scatters: nothing hides them
    exposed += sum(coll_time(cl, links) * cl.per_step for cl in exchanges if cl.op != "ring")
    # ring attention: each phase's exchanges overlap that phase's attention compute; only the excess is exposed
    attn = attention_flops(spec, job) / job.tp / rate
    attn_phase = {"fwd": attn, "bwd": attn * (3 if job.checkpointing else 2)}
    exposed += sum(max(0.0, coll_time(cl, links) - attn_phase[cl.phase]) * cl.per_step
                   for cl in exchanges if cl.op == "ring")
    if o.base == "ddp":
        for cl in net:  # overlapped with the last micro-batch's backward, except the last bucket
            t = coll_time(cl, links)
            exposed += max(0.0, t - t_bwd) + min(t, t * 25 * 2**20 / max(cl.bytes, 1.0))
    elif o.base == "fsdp" or (o.base == "deepspeed" and o.stage == 3):
        units = max(unit_params(spec, o)[1], 1)
        for phase, t_comp in (("fwd", t_fwd), ("bwd", t_bwd)):
            ph = [cl for cl in net if cl.phase == phase]
            every = sum(coll_time(cl, links) for cl in ph if cl.per_step == ga)  # each micro-batch
            once = sum(coll_time(cl, links) * cl.per_step for cl in ph if cl.per_step != ga)  # the last one
            exposed += (ga - 1) * max(0.0, every - overlap * t_comp) + max(0.0, every + once - overlap * t_comp)
            exposed += ga * every / units  # the first unit's gather has nothing to hide behind
    else:  # ZeRO-1/2: overlap_comm is off by default in DeepSpeed
        exposed += sum(coll_time(cl, links) * cl.per_step for cl in net)
    for cl in colls:
        if cl.where == "host":
            other += coll_time(cl, links) * cl.per_step
    P_t = local_params(spec, job.tp) if job.tuner == "full" else spec.lora_params(job.lora_r, job.lora_targets)
    per_rank_params = P_t / (shard_n if o.base in ("fsdp", "deepspeed") else 1)
    cpu_step = (o.base == "fsdp" and o.cpu_offload) or (o.base == "deepspeed" and o.offload_optimizer)
    host_s = 0.0  # the host's own share of the step (the offloaded optimizer step)
    if cpu_step:
        node_rate = DS_HOST_STEP_PARAMS_PER_S if o.base == "deepspeed" else FSDP_HOST_STEP_PARAMS_PER_S
        host_s = per_rank_params / (node_rate / job.gpus_per_node)
        other += host_s
    else:  # AdamW reads p, g, m, v and writes p, m, v in the state dtype
        other += 7 * job.w * per_rank_params / comp.device_mem_bw
    other += ga * elementwise_time(spec, job, comp, o.base)  # memory-bound passes beside the FLOPs, per micro-batch
    # ZeRO-3's hooks run on the host beside the GPU's work, not beside the host's own optimizer step
    overhead = strategy_overhead(spec, job, o, shard_n, comp, compute + exposed + other - host_s)
    other += overhead
    step = compute + exposed + other
    comm_bytes = sum(cl.wire() * cl.per_step for cl in net + exchanges)
    tokens = job.world // job.tp * job.tokens * ga  # the tp ranks of a group train the same tokens
    return Timing(comm_bytes, compute, exposed, other, step, tokens / step if step > 0 else 0.0, colls, overhead)
