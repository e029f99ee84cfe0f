"""DeepSpeed ZeRO-1/2/3: fp32 master weights and Adam moments sharded; gradients from stage 2, weights at 3; the
presets differ by options (stage, optimizer and parameter offload, ZeRO-3's fetch unit)."""

from __future__ import annotations

import math

from shardwise.plan.comm import (
    ZERO3_BLOCK_S_PER_TENSOR_PASS,
    ZERO3_COMPILED_S_PER_MODULE_PASS,
    ZERO3_EAGER_S_PER_MODULE_PASS,
    Coll,
    coll_time,
)
from shardwise.plan.costs import CostModel
from shardwise.plan.costs.fsdp import exposed_by_unit
from shardwise.plan.facts import DS_MAX_LIVE, DS_PREFETCH_BUCKET, DS_REDUCE_BUCKET, DS_SUB_GROUP
from shardwise.plan.memory import (
    Job,
    Opts,
    States,
    local_params,
    unit_params,
)
from shardwise.plan.model_spec import ModelSpec


class DeepSpeedCost(CostModel):
    autocast = False  # DeepSpeed holds the weights in the compute dtype (fp32 master partition aside)
    simulated = False
    not_simulated = ("not simulated: DeepSpeed's engine needs real storage (it flattens parameters into real buffers, "
                     "partitions with real collectives and pins memory), which fake tensors do not have; its analytic "
                     "estimate is the one checked against measurements (docs/planner.md, H200 tables)")

    def offloads(self, o) -> bool:
        return o.offload_optimizer or o.offload_params

    def without_offload(self, o) -> tuple[str, str]:
        return f"zero{o.stage}", "deepspeed.offload_optimizer"

    def gathers_params(self, o) -> bool:
        return o.stage == 3

    def linear_saves_input(self, job, o) -> bool:
        """ZeRO-3 keeps DeepSpeed's memory_efficient_linear (LinearFunctionForZeroStage3) on except for compiled
        blocks fetched whole (strategies/deepspeed.py)."""
        return zero3_per_module(o) or (o.stage == 3 and not job.compile)

    def compile_factor(self, o) -> float:
        from shardwise.plan.memory import COMPILE_ACT_FACTOR, COMPILE_ACT_FACTOR_ZERO3

        return COMPILE_ACT_FACTOR_ZERO3 if zero3_per_module(o) else COMPILE_ACT_FACTOR

    def states(self, spec, job, o, N, st) -> None:
        deepspeed_states(spec, job, o, N, st)

    def extra_moment(self, spec, job, o, N, st, states, per_layer, act_detail) -> tuple[float, str, dict]:
        if st.zero3_kept is None:
            return 0.0, "", {}
        moment_c, reduce_end, extra = zero3_reduce_moment(spec, job, o, N, st, states, per_layer, act_detail)
        return moment_c, ("ZeRO-3 reducing its gradients at the end of backward" if reduce_end else
                          "ZeRO-3 reducing its first gradient bucket"), extra

    def collectives(self, spec, job, o, shard_n, sizes) -> list:
        if job.world <= 1:
            return []
        n, c, ga, flat, P_t = job.world, job.c, job.grad_accum, sizes.flat, sizes.P_t
        out = []
        if o.stage == 3:
            out.append(Coll("all_gather", sizes.gathered, n, flat, ga, "fwd"))
            out.append(Coll("all_gather", sizes.gathered, n, flat, ga, "bwd"))
            out.append(Coll("reduce_scatter", c * P_t, n, flat, ga, "bwd"))
        else:
            out.append(Coll("reduce_scatter", c * P_t, n, flat, ga if o.stage == 2 else 1, "bwd"))
            out.append(Coll("all_gather", c * P_t, n, flat, 1, "step"))
        if o.offload_optimizer:
            out.append(Coll("d2h", c * P_t / n, 1, "host", ga if o.stage >= 2 else 1, "bwd"))
            out.append(Coll("h2d", c * P_t / n, 1, "host", 1, "step"))
        if o.offload_params and o.stage == 3:
            out.append(Coll("h2d", 2 * c * sizes.P / n, 1, "host", ga, "fwd"))
        return out

    def exposed(self, spec, job, o, net, links, t_fwd, t_bwd, acc: float) -> float:
        if o.stage == 3:  # gathers and reduces block by block, overlapped with compute
            return exposed_by_unit(spec, job, o, net, links, t_fwd, t_bwd, 1.0, acc)
        return acc + sum(coll_time(cl, links) * cl.per_step for cl in net)  # ZeRO-1/2: overlap_comm off by default

    def overhead(self, spec, job, o, shard_n, comp, gpu_s) -> float:
        """ZeRO-3: what its host-bound hooks add to a step whose GPU work takes `gpu_s`, max(0, zero3_hook_time -
        gpu_s), and with whole-block fetch its copies on the GPU first; ZeRO-1/2 its copies."""
        from shardwise.plan.comm import STRATEGY_BYTES_PER_PARAM

        if o.stage == 3:
            if zero3_per_module(o):  # the fit of its hook constants holds its copies too
                return max(0.0, zero3_hook_time(spec, job, o) - gpu_s)
            copies = STRATEGY_BYTES_PER_PARAM["zero3"] * local_params(spec, job.tp) / comp.device_mem_bw
            return copies + max(0.0, zero3_hook_time(spec, job, o) - gpu_s - copies)
        P_t = local_params(spec, job.tp) if job.tuner == "full" else spec.lora_params(job.lora_r, job.lora_targets)
        return STRATEGY_BYTES_PER_PARAM["zero12"] * P_t / shard_n / comp.device_mem_bw

    def host_step_rate(self, o) -> float | None:
        from shardwise.plan.comm import DS_HOST_STEP_PARAMS_PER_S

        return DS_HOST_STEP_PARAMS_PER_S if o.offload_optimizer else None


def zero3_per_module(o) -> bool:
    """ZeRO-3 with DeepSpeed's per-submodule fetch (deepspeed.fetch module) rather than whole blocks."""
    return o.stage == 3 and o.ds_fetch == "module"
def deepspeed_states(spec: ModelSpec, job: Job, o: Opts, N: int, st: States) -> None:
    """DeepSpeed ZeRO-1/2/3: fp32 master weights and Adam moments sharded; gradients from stage 2, weights at 3."""
    P, c, w, P_t = spec.total_params, job.c, job.w, st.P_t
    offload_moves = job.accelerator != "cpu"  # on CPU ranks "offloaded" state stays in the same memory
    U, _ = unit_params(spec, o)
    master = 4 * P_t / N
    st.opt = 8 * P_t / N + master
    if job.tuner == "full":
        st.params = c * P / (N if o.stage == 3 else 1)
    else:
        st.params = (st.frozen + c * P_t) / (N if o.stage == 3 else 1)
    st.grads = c * P_t / (1 if o.stage == 1 else N)
    st.extraB["fp32_grad_partition"] = 4 * P_t / N
    if o.stage == 3:
        if not o.offload_optimizer:  # the step upcasts one sub-group at a time
            st.extraB["fp32_grad_partition"] = 4 * zero3_fp32_grad_elements(spec, job, N)
        # reduce dtype: fp32 over fp32 weights (the engine sets communication_data_type fp32), else the weights'
        st.persist["reduce_bucket"] = DS_REDUCE_BUCKET * w
        st.grads_persist = True  # grad_partitions_flat_buffer: allocated (zeros) at initialisation, kept
        st.zero3_kept = 0.0
        if N > 1 or (o.offload_params and offload_moves):
            st.zero3_kept = max(zero3_kept_gathered(spec), max(U, spec.embed_params))
            st.extraA["gathered"] = c * st.zero3_kept
            st.extraB["gathered"] = c * (max(U, spec.embed_params) + min(DS_PREFETCH_BUCKET, U))
        # else one rank, partitions on the device: ZeRO-3 does not all-gather there, a fetched parameter's data
        # is its partition (partition_parameters.py, _no_gather_coalesced: ds_tensor.to(device) is a no-op)
    else:  # ZeRO-1/2: allocated at the first gradient hook, when the activations are still all alive (so it
        # counts at the start of backward, moment A), freed at the end of backward: not alive between steps
        # (the H200 rows' state before the second step lacks it), which the peak does not see
        st.persist["reduce_bucket"] = DS_REDUCE_BUCKET * c
    if o.offload_optimizer and o.stage < 3:  # ZeRO-2 offload's staging buffers of the largest parameter's size
        largest = max(spec.embed_params, spec.hidden_size * spec.intermediate_size)
        st.persist["offload_staging"] = c * largest * (1 if offload_moves else 2)  # device one (+ the host one)
    if o.offload_optimizer:
        if offload_moves:
            st.host += st.opt + st.extraB.pop("fp32_grad_partition")
            st.opt = 0.0
            # the gradients go to the host as they are reduced: ZeRO-3 keeps its flat gradient partition there
            # (stage3.py allocates grad_partitions_flat_buffer on self.device, the CPU under offload), ZeRO-2
            # copies each reduced bucket into the host's fp32 partition (stage_1_and_2.py)
            # (ZeRO-1 keeps full gradients in param.grad on the GPU until the boundary's reduction)
            if o.stage == 3:
                st.host += st.grads
            if o.stage >= 2:
                st.grads, st.grads_persist = 0.0, False
        else:  # CPU ranks: the offloaded fp32 gradient partition is allocated once and kept
            st.persist["fp32_grad_partition"] = st.extraB.pop("fp32_grad_partition")
    if o.offload_params and o.stage == 3 and offload_moves:
        st.host += st.params
        st.params = 0.0




def zero3_reduce_moment(spec: ModelSpec, job: Job, o: Opts, N: int, st: States, states: float,
                        per_layer: float, act_detail: dict) -> tuple[float, bool, dict]:
    """Moment C, ZeRO-3's gradient reduces: (peak bytes, whether it is the end-of-backward reduce, its buffers).
    The blocks not yet through backward keep their saved activations (checkpointed: their inputs; eager: all, and
    the block being run); the gradient flowing into the block and its recomputed first norm (fp32 and c) are alive;
    kept parameters not yet through backward stay gathered."""
    c = job.c
    U, _ = unit_params(spec, o)
    L = max(spec.num_layers, 1)
    moment_c, reduce_end, extraC = 0.0, False, {}
    for red in zero3_reduces(spec, job, N):
        if job.checkpointing:
            act_c = red["layers_left"] * act_detail["layers_kept"] / L
        else:
            act_c = min(red["layers_left"] + 1, spec.num_layers) * per_layer
        act_c += job.tokens * spec.hidden_size * (4 + 2 * c)
        held = c * (min(st.zero3_kept, red["rest"]) + min(DS_PREFETCH_BUCKET, U)) if st.zero3_kept else 0.0
        m_c = states + act_c + red["copy"] + held
        if m_c > moment_c:
            moment_c, reduce_end = m_c, red["layers_left"] == 0
            extraC = {"reduce_copy": red["copy"], **({"gathered": held} if held else {})}
    return moment_c, reduce_end, extraC


def zero3_kept_gathered(spec: ModelSpec) -> float:
    """Parameters ZeRO-3 holds gathered at the end of forward, from the second step on (the first records the trace
    and prefetches nothing). The prefetcher walks the traced parameter queue ahead of the running module; a parameter
    it meets already gathered is skipped but marked as fetched for that later use, and a marked parameter is not
    released after its module (partitioned_param_coordinator.py, fetch_sub_module and __params_to_release). So
    modules stay gathered after their forward and the gathered count grows to stage3_max_live_parameters (1e9):
    all of a model under that (docs/planner.md, "Where the constants come from")."""
    return min(spec.total_params, DS_MAX_LIVE)


def zero3_reduces(spec: ModelSpec, job: Job, N: int) -> list[dict[str, float]]:
    """ZeRO-3's backward when it reduces a gradient bucket (stage3.py, __reduce_and_partition_ipg_grads), the
    first time (what is still alive is largest then). reduce_scatter_coalesced copies the bucket's gradients into
    one flat buffer in the reduce dtype (torch.cat, coalesced_collectives.py) and __avg_scatter_grads casts this
    rank's partitions to the gradients' dtype when they differ. A parameter larger than the bucket (an untied head
    over 5e8) is reduced alone: its gradient is not copied into the bucket (it stays alive, c bytes), it is cast to
    the reduce dtype, there is nothing to concatenate, and the bucket's first fill follows it as a second event.
    Per event: `elements` reduced, `layers_left` (blocks whose backward has not run: their saved activations and
    weights are still alive), `rest` (parameters not yet through backward), `copy` (bytes made for the reduce)."""
    full = job.tuner == "full"
    P_t = spec.total_params if full else spec.lora_params(job.lora_r, job.lora_targets)
    L = max(spec.num_layers, 1)
    per_block = spec.layer_params if full else P_t / L
    cast = job.c != job.w  # gradients in c, reduced in w (mixed precision over fp32 weights)

    def event(elements: float, done_blocks: float, copy: float) -> dict[str, float]:
        left = max(0, spec.num_layers - math.ceil(done_blocks / per_block - 1e-9)) if elements < P_t else 0
        rest = left * spec.layer_params + spec.embed_params if elements < P_t else 0.0
        return {"elements": elements, "layers_left": left, "rest": rest, "copy": copy}

    head = spec.head_params if full else 0
    if head > DS_REDUCE_BUCKET:
        first = event(head, 0.0, job.c * head + ((job.w + job.c / N) * head if cast else 0.0))
        blocks = min(DS_REDUCE_BUCKET, P_t - head)
        return [first, event(head + blocks, blocks, job.w * blocks + (job.c * blocks / N if cast else 0.0))]
    elements = min(DS_REDUCE_BUCKET, P_t)
    return [event(elements, max(0.0, elements - head), job.w * elements + (job.c * elements / N if cast else 0.0))]


def zero3_fp32_grad_elements(spec: ModelSpec, job: Job, N: int) -> float:
    """The largest fp32 gradient ZeRO-3 holds at once in its step: one sub-group of the weight-decay group (the
    2-D weights in model order; the engine's other group holds the norms), closed greedily at DS_SUB_GROUP."""
    if job.tuner != "full":
        return min(spec.lora_params(job.lora_r, job.lora_targets) / N, DS_SUB_GROUP)
    sizes = [spec.embed_params] + [a * b for a, b in spec.linear_shapes().values()] * spec.num_layers
    if spec.head_params:
        sizes.append(spec.head_params)
    largest, acc = 0.0, 0.0
    for n in sizes:
        acc += n / N
        if acc >= DS_SUB_GROUP:
            largest, acc = max(largest, acc), 0.0
    return max(largest, acc)


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
