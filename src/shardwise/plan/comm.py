"""Communication per step and the step-time model. Pure arithmetic.

Collective sizes follow nccl-tests (plan/collective.py); each family's collectives, what of them overlaps with
compute and its own per-step work come from its cost model (plan/costs/). The fitted constants are read from
calibration.json, which holds where each was fitted; this module says what each stands for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from shardwise import hardware
from shardwise.plan.calibration import value
from shardwise.plan.collective import HOST_LINK_GBPS, Coll, Links, coll_time  # noqa: F401 (re-exported)
from shardwise.plan.costs import cost_of
from shardwise.plan.memory import (
    QLORA_BYTES_PER_PARAM,
    Job,
    Opts,
    float8_linears,
    local_params,
    local_root_params,
    mlp_tiles,
    residual_bytes,
)
from shardwise.plan.model_spec import ModelSpec

# The offloaded optimizer step's host share, parameters per second per node: torch's fused AdamW on the host's fp32
# state plus what each engine does around it there (FSDP2: the clip's norm over per-parameter host shards, over the
# host's threads, strategies/gradnorm.py; DeepSpeed: its flat fp32 partition); both scale with the host's cores.
DS_HOST_STEP_PARAMS_PER_S = value("ds_host_step_params_per_s")
FSDP_HOST_STEP_PARAMS_PER_S = value("fsdp_host_step_params_per_s")
# effective device memory bandwidth of the memory-bound passes (optimizer step, loss, adapters, strategy copies) on
# the GPU the per-byte constants below were fitted on; another GPU runs the same passes at its own datasheet
# bandwidth (device_mem_bw)
HBM_BYTES_PER_S = value("hbm_bytes_per_s")
HBM_FITTED_ON = "H200"
# Per-step work of a strategy beyond the model's FLOPs, the collectives and the optimizer step, as device-memory bytes
# per local parameter at HBM_BYTES_PER_S (what each term stands for: docs/planner.md, "Speed overheads per strategy"):
#   ddp       the bucketed all-reduce's pass over the fp32 gradient buckets (average in place)
#   fsdp      FSDP2 copy-in per all-gather and the fp32 reduce-scatter input + copy-out of the gradient
#             (fsdp-grad-op: one all-gather fewer)
#   zero12    the gradients into the bucket and the fp32 partition, norm and overflow checks, master -> bf16 copy
#   zero3     fetching whole blocks: the gradients into the fp32 reduce bucket and the partition, master -> bf16
#             copy (one rank gathers nothing; what gathering adds on several ranks is not measured); per parameter
#             of the whole model
STRATEGY_BYTES_PER_PARAM = {k: value(f"strategy_bytes_per_param.{k}")
                            for k in ("ddp", "fsdp", "fsdp-grad-op", "zero12", "zero3")}
# Memory-bound passes the FLOP count misses, bytes at HBM_BYTES_PER_S (elementwise_time): the loss's passes over the
# fp32 logits (per token per vocabulary entry), and LoRA's adapters (per token per unit of adapted width, per block)
LOSS_BYTES_PER_LOGIT = value("loss_bytes_per_logit")
LORA_BYTES_PER_WIDTH = value("lora_bytes_per_width")  # compiled blocks, or eager adapters in the compute dtype
# eager blocks with fp32 adapters under autocast (single, ddp, DeepSpeed): peft casts each adapted input to fp32, the
# dropout and the two skinny matmuls' casts run as separate kernels
LORA_BYTES_PER_WIDTH_EAGER = value("lora_bytes_per_width_eager")
# the adapters' forward passes, as a share of their bytes, run again under gradient checkpointing
LORA_FORWARD_SHARE = value("lora_forward_share")
# task dpo's head (models/speed.py) gives per-token log-probabilities. Their gradient needs each token's upstream
# value, so the fused head cannot make its gradients in the forward as the cross-entropy head does
# (LOSS_BYTES_PER_LOGIT): its backward makes each chunk's logits again (one more head matmul, flops_per_microbatch).
# Device-memory bytes per token per vocabulary entry, counted pass by pass, (forward, backward), keyed by
# (fused head, compiled run):
#   fused, compiled: forward the bf16 logits written (2) and read once by the fused log-sum-exp (2): 4. Backward
#          the logits again (2), read by the fused softmax-gradient kernel (2), which writes the bf16 gradient (2): 6
#   fused, eager: forward the logits (2), cast to fp32 (read 2, write 4), max (read 4), shift and exp in place
#          (read 8, write 8), sum (read 4): 32. Backward the logits (2), cast (6), shift and exp in place (16), cast
#          back to bf16 (read 4, write 2): 30
#   plain (either): forward the model's bf16 logits (2), cast (6), log_softmax (read 12, write 4): 24. Backward the
#          gather's zero-filled gradient (4), log_softmax's (read 12, write 4), the cast's (read 4, write 2): 26
# The policy runs both; a reference in training (a frozen copy, or the policy with its adapters off) the forward.
PREFERENCE_HEAD_BYTES_PER_LOGIT = {(True, True): (4, 6), (True, False): (32, 30), (False, True): (24, 26),
                                   (False, False): (24, 26)}
# ZeRO-3: DeepSpeed's fetch/release hooks run on the host for every submodule that holds parameters, in forward,
# backward and (checkpointing) the recomputed forward; the GPU's work hides them until the host's share is the longer:
# the step is max(GPU step, hooks) (costs/deepspeed.py zero3_hook_time). Seconds per parameterized submodule per
# pass, eager and with compiled blocks (dynamo's guards and graph breaks around every hook cost more).
ZERO3_EAGER_S_PER_MODULE_PASS = value("zero3_eager_s_per_module_pass")
ZERO3_COMPILED_S_PER_MODULE_PASS = value("zero3_compiled_s_per_module_pass")
# ZeRO-3 fetching whole blocks (deepspeed.fetch block, the default): one pair of hooks per block, and what the host
# still spends grows with the trained tensors instead (DeepSpeed's per-parameter bookkeeping in each pass and its
# gradient path): seconds per trained weight or norm tensor (LoRA: per adapter matrix) per pass, eager or compiled.
ZERO3_BLOCK_S_PER_TENSOR_PASS = value("zero3_block_s_per_tensor_pass")
# float8 linears (float8_time): their matmuls run at the GPU's float8 peak at the job's MFU; each element counted as
# cast to float8 (each forward pass's input and weight, and the output gradient once) costs this many bytes of
# device-memory traffic. It stands for the amax reductions, the scaled casts, backward's recasts of the input and
# the weight, the transposed copies, and whatever else keeps the float8 matmuls from twice the bf16 rate.
FLOAT8_CAST_BYTES = value("float8_cast_bytes")


def device_mem_bw(device_name: str) -> float | None:
    """Effective memory bandwidth of the memory-bound passes on a GPU: HBM_BYTES_PER_S scaled by its datasheet
    bandwidth over that of HBM_FITTED_ON (hardware.MEMORY_TBPS); None for a GPU not in the table."""
    bw = hardware.memory_bandwidth(device_name)
    return None if bw is None else HBM_BYTES_PER_S * bw / hardware.memory_bandwidth(HBM_FITTED_ON)


@dataclass(frozen=True)
class Compute:
    """Effective FLOP/s of one rank: peak * MFU."""

    peak_flops: float
    mfu: float
    device_mem_bw: float = HBM_BYTES_PER_S
    fp8_peak_flops: float = 0.0  # float8 tensor cores (0: none)


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


def sp_where(job: Job) -> str:
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
    where = sp_where(job)
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
    where = sp_where(job)
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


@dataclass(frozen=True)
class Sizes:
    """What one rank's collectives move, in parameters or bytes (under TP, of its tp-local shards)."""

    P: float  # parameters one rank holds
    P_t: float  # trainable parameters
    gb: float  # bytes per gathered block parameter (QLoRA: its 4-bit storage)
    blocks: float  # block parameters
    gathered: float  # bytes of the whole model gathered (blocks in gb, the root in c)
    flat: str  # the data-parallel link: flat across nodes, else intra


def sizes_for(spec: ModelSpec, job: Job) -> Sizes:
    P = local_params(spec, job.tp)
    P_t = P if job.tuner == "full" else spec.lora_params(job.lora_r, job.lora_targets)
    gb = QLORA_BYTES_PER_PARAM if job.tuner == "qlora" else job.c
    root = local_root_params(spec, job.tp)
    blocks = P - root
    return Sizes(P, P_t, gb, blocks, gb * blocks + job.c * root, "flat" if job.nodes > 1 else "intra")


def collectives(spec: ModelSpec, job: Job, o: Opts, shard_n: int) -> list[Coll]:
    """The collectives of one optimizer step for one strategy (its family's, then the sequence- and
    tensor-parallel exchanges; under TP, of one rank's tp-local shards)."""
    cost, sizes = cost_of(o.base), sizes_for(spec, job)
    out = cost.collectives(spec, job, o, shard_n, sizes)
    if job.reference != "none" and job.world > 1 and cost.gathers_params(o):
        # task dpo: the reference's forward (a sharded copy, or LoRA's policy with its adapters off) gathers its
        # weights once more per micro-batch, in the compute dtype; hidden behind that forward like the policy's
        out.append(Coll("all_gather", sizes.gathered, shard_n, sizes.flat, job.grad_accum, "fwd"))
    out += ulysses_exchanges(spec, job) + ring_exchanges(spec, job) + tensor_parallel_exchanges(spec, job)
    return out


def flops_per_microbatch(spec: ModelSpec, job: Job) -> tuple[float, float]:
    """(forward, backward) FLOPs one micro-batch runs on one rank: 6N per token for the weights (docs/measurements.md's
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
    if job.reference != "none":  # task dpo: the reference's forward of the same rows, a third of a full step's FLOPs
        fwd += 2 * P * T + attn_f
    if job.task == "dpo" and job.fused_loss:  # the log-probability head makes each chunk's logits again in backward
        bwd += 2 * spec.vocab_size * spec.hidden_size * T
    if job.checkpointing:  # blocks run forward again in backward
        bwd += 2 * (P - spec.root_params) * T + attn_f
    elif job.selective_checkpointing:
        bwd += selective_recompute_flops(spec, job)
    if mlp_tiles(spec, job) > 1:  # each tile's MLP runs forward once more in backward (models/tiles.py)
        bwd += 2 * 3 * spec.hidden_size * spec.mlp_width * spec.num_layers * T
    return fwd / job.tp, bwd / job.tp


def offload_exposed_s(spec: ModelSpec, job: Job, o: Opts, links: Links, t_fwd: float, t_bwd: float) -> float:
    """Seconds per micro-batch that offloaded checkpointing's copies add (models/offload.py): each block input goes
    out during the next block's forward and comes back during the later block's recompute and backward, on a side
    stream; only what a copy takes beyond its block's compute is exposed."""
    if not (job.checkpointing and job.offload_checkpoints) or job.accelerator != "cuda" or not spec.num_layers:
        return 0.0
    L = spec.num_layers
    copy = job.tokens * spec.hidden_size * residual_bytes(job, o) / job.tp / links.host_bw
    return L * (max(0.0, copy - t_fwd / L) + max(0.0, copy - t_bwd / L))


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


def elementwise_time(spec: ModelSpec, job: Job, comp: Compute, adapters_in_compute_dtype: bool = False,
                     autocast: bool = False) -> float:
    """Seconds per micro-batch of memory-bound work the FLOP count misses (GPU only; the terms from
    docs/planner.md, "Where the constants come from"):
    - the loss over the vocabulary: the fp32 logits are written, reduced (log-sum-exp), exponentiated, masked
      and cast back, forward and backward, LOSS_BYTES_PER_LOGIT bytes per token per vocabulary entry, with or
      without the fused head (it makes the same passes, one chunk at a time); task dpo's log-probability head
      its own passes instead (PREFERENCE_HEAD_BYTES_PER_LOGIT) and the weight casts of its extra passes
      (preference_cast_bytes; `autocast`: the family runs autocast over the stored weights);
    - LoRA's adapters: each adapted projection casts its input to the adapter dtype, drops it out, runs two
      skinny matmuls (rank r) and scales and adds the result, in forward and backward: LORA_BYTES_PER_WIDTH
      bytes per token per unit of the adapted inputs' and outputs' widths, per block."""
    if job.accelerator != "cuda":
        return 0.0
    if job.task == "dpo":
        fwd, bwd = PREFERENCE_HEAD_BYTES_PER_LOGIT[job.fused_loss, job.compile]
        per_logit = fwd * (2 if job.reference != "none" else 1) + bwd
    else:
        per_logit = LOSS_BYTES_PER_LOGIT
    t = per_logit * job.tokens * spec.vocab_size / job.tp / comp.device_mem_bw  # TP: V/tp per rank
    t += preference_cast_bytes(spec, job, autocast) / comp.device_mem_bw
    if job.tuner != "full":
        width = spec.lora_params(1, job.lora_targets) / max(spec.num_layers, 1)  # sum of (in + out) per block
        per = LORA_BYTES_PER_WIDTH if job.compile or adapters_in_compute_dtype else LORA_BYTES_PER_WIDTH_EAGER
        if job.checkpointing:  # the recomputed forward runs the adapters' forward passes again
            per *= 1 + LORA_FORWARD_SHARE
        t += per * job.tokens * width * spec.num_layers / comp.device_mem_bw
    return t


def preference_cast_bytes(spec: ModelSpec, job: Job, autocast: bool) -> float:
    """Bytes per micro-batch that task dpo's passes beyond the SFT step's spend casting weights stored wider than the
    compute dtype (autocast over fp32 weights; FSDP's and DeepSpeed's wrappers hold them in the compute dtype
    already, and LoRA's frozen base is stored in it): the frozen reference copy casts every linear weight in its
    forward (autocast caches only the casts of weights that require gradients; a compiled block casts inside its
    graph), and the fused head casts the policy's weight once more in backward. Each cast reads the stored bytes
    and writes the compute dtype's. The policy's own casts are the SFT step's, inside the calibrated MFU."""
    if job.task != "dpo" or not autocast or job.w <= job.c:
        return 0.0
    per = job.w + job.c
    n = spec.linear_params if job.reference == "model" else 0
    if job.fused_loss and job.tuner == "full":
        n += spec.vocab_size * spec.hidden_size
    return per * n / job.tp


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


def strategy_overhead(spec: ModelSpec, job: Job, o: Opts, shard_n: int, comp: Compute, gpu_s: float = 0.0) -> float:
    """Seconds per optimizer step of the strategy's own work (its cost model's `overhead`: STRATEGY_BYTES_PER_PARAM;
    ZeRO-3 what its host-bound hooks add to a step whose GPU work takes `gpu_s`). On the CPU (no HBM roofline, no
    measurement) 0."""
    if job.accelerator != "cuda":
        return 0.0
    return cost_of(o.base).overhead(spec, job, o, shard_n, comp, gpu_s)


def step_time(spec: ModelSpec, job: Job, o: Opts, shard_n: int, links: Links, comp: Compute) -> Timing:
    colls = collectives(spec, job, o, shard_n)
    f_fwd, f_bwd = flops_per_microbatch(spec, job)
    rate = comp.peak_flops * comp.mfu
    t_fwd, t_bwd = f_fwd / rate, f_bwd / rate
    ga = job.grad_accum
    compute = ga * (t_fwd + t_bwd + float8_time(spec, job, comp))
    cost = cost_of(o.base)
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
    exposed = cost.exposed(spec, job, o, net, links, t_fwd, t_bwd, exposed)
    exposed += ga * offload_exposed_s(spec, job, o, links, t_fwd, t_bwd)
    for cl in colls:
        if cl.where == "host":
            other += coll_time(cl, links) * cl.per_step
    P_t = local_params(spec, job.tp) if job.tuner == "full" else spec.lora_params(job.lora_r, job.lora_targets)
    per_rank_params = P_t / shard_n  # (shard_n is 1 for a family that shards nothing)
    node_rate = cost.host_step_rate(o)
    host_s = 0.0  # the host's own share of the step (the offloaded optimizer step)
    if node_rate is not None:
        host_s = per_rank_params / (node_rate / job.gpus_per_node)
        other += host_s
    else:  # AdamW reads p, g, m, v and writes p, m, v in the state dtype
        other += 7 * job.w * per_rank_params / comp.device_mem_bw
    # memory-bound passes beside the FLOPs, per micro-batch
    other += ga * elementwise_time(spec, job, comp, cost.adapters_in_compute_dtype, cost.autocast)
    # ZeRO-3's hooks run on the host beside the GPU's work, not beside the host's own optimizer step
    overhead = strategy_overhead(spec, job, o, shard_n, comp, compute + exposed + other - host_s)
    other += overhead
    step = compute + exposed + other
    comm_bytes = sum(cl.wire() * cl.per_step for cl in net + exchanges)
    tokens = job.world // job.tp * job.tokens * ga  # the tp ranks of a group train the same tokens
    return Timing(comm_bytes, compute, exposed, other, step, tokens / step if step > 0 else 0.0, colls, overhead)
