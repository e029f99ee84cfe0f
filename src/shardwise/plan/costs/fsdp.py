"""FSDP2 (fully_shard): parameters, gradients and optimizer states sharded over a shard group, each decoder block
a unit gathered around its forward and backward; the presets differ by options (reshard after forward, CPU
offload, hybrid shard groups)."""

from __future__ import annotations

from shardwise.plan.comm import Coll, coll_time
from shardwise.plan.costs import CostModel
from shardwise.plan.facts import FSDP_REDUCE_BYTES
from shardwise.plan.memory import (
    QLORA_BYTES_PER_PARAM,
    local_layer_params,
    local_params,
    local_root_params,
    reshards,
    unit_params,
)


def reduce_bytes() -> int:
    """Bytes per element FSDP2 reduces gradients in (MixedPrecisionPolicy.reduce_dtype, facts.FSDP_REDUCE_DTYPE)."""
    return FSDP_REDUCE_BYTES


class FSDPCost(CostModel):
    autocast = False  # MixedPrecisionPolicy casts the gathered weights: the residual stream runs in the compute dtype
    adapters_in_compute_dtype = True  # its bf16 parameters: no fp32 adapter casts
    gathers_root = True
    counts_own_accumulation = True  # no-sync micro-batches keep unsharded gradients, counted in states()
    wraps_units = True
    hybrid_preset = "hybrid"

    def without_offload(self, o) -> tuple[str, str]:
        return "fsdp", "fsdp.cpu_offload"

    def gathers_params(self, o) -> bool:
        return True

    def offloads(self, o) -> bool:
        return o.cpu_offload

    def states(self, spec, job, o, N, st) -> None:
        """States sharded over N ranks; units gathered around their forward and backward. Under tensor
        parallelism every count is one tp rank's share (local_*): FSDP gathers the tp-local shards."""
        c, P_t, tw = job.c, st.P_t, st.tw
        P, root_params = local_params(spec, job.tp), local_root_params(spec, job.tp)
        U, _ = unit_params(spec, o)
        U *= local_layer_params(spec, job.tp) / spec.layer_params
        rd = reduce_bytes()
        st.params, st.grads, st.opt = (st.frozen + tw * P_t) / N, tw * P_t / N, 2 * tw * P_t / N
        gb = QLORA_BYTES_PER_PARAM if job.tuner == "qlora" else c  # gathered bytes per block parameter
        root = root_params * c  # embeddings, final norm, head: the root unit
        if reshards(job, o):  # the root is resharded after forward too and gathered again for the head's backward
            st.extraA["gathered_units"] = 2 * gb * U  # the last unit (kept) + a prefetched one
        else:  # every unit stays gathered from its forward to its backward
            st.extraA["gathered_all"] = root + gb * (P - root_params)
        # backward of a block: the root and the block's unit gathered, its unsharded grads (c) and their fp32
        # reduce-scatter input; the root's own backward comes last, when the block activations are gone (moment B)
        full = job.tuner == "full"
        g_unit = U if full else P_t / max(spec.num_layers, 1)
        # the root unit is gathered again for the head's backward, at the start of backward, and resharded after
        # the embedding's gradient, at its end: it is gathered beside every block's backward
        st.extraB["gathered"] = (root if reshards(job, o) else gb * U) + gb * U
        st.extraB["unsharded_grads+reduce_scatter"] = (c + rd) * g_unit
        st.root_bwd = root + (c + rd) * (root_params if full else 0)
        if job.grad_accum > 1:  # no-sync micro-batches keep unsharded gradients, accumulated in the reduce dtype
            st.extraA["unsharded_accumulated_grads"] = rd * P_t  # (freed unit by unit in the last backward)
        if o.cpu_offload and job.accelerator != "cpu":  # on CPU ranks "offloaded" state stays in the same memory
            st.host = st.params + st.grads + st.opt
            st.params = st.grads = st.opt = 0.0

    def collectives(self, spec, job, o, shard_n, sizes) -> list:
        if job.world <= 1:
            return []
        rd, ga, P_t = reduce_bytes(), job.grad_accum, sizes.P_t
        # a hybrid shard group that fits in a node gathers over NVLink; its replicas meet across nodes, or inside
        # the one node when there is only one
        where = "intra" if o.hybrid and shard_n <= job.gpus_per_node else sizes.flat
        # forward gathers every unit; backward gathers the blocks again unless kept (reshard_after_forward off);
        # the root stays gathered between forward and backward
        out = [Coll("all_gather", sizes.gathered, shard_n, where, ga, "fwd")]
        if reshards(job, o):
            out.append(Coll("all_gather", sizes.gb * sizes.blocks, shard_n, where, ga, "bwd"))
        # gradients are reduced on the last micro-batch only (set_requires_gradient_sync(False) before it)
        out.append(Coll("reduce_scatter", rd * P_t, shard_n, where, 1, "bwd"))
        if o.hybrid and job.world > shard_n:
            out.append(Coll("all_reduce", rd * P_t / shard_n, job.world // shard_n,
                            "inter" if job.nodes > 1 else "intra", 1, "bwd"))
        if o.cpu_offload:
            out.append(Coll("h2d", job.w * sizes.P / shard_n * (2 if reshards(job, o) else 1), 1, "host", ga, "fwd"))
            out.append(Coll("d2h", rd * P_t / shard_n, 1, "host", 1, "bwd"))
        return out

    def exposed(self, spec, job, o, net, links, t_fwd, t_bwd, acc: float) -> float:
        return exposed_by_unit(spec, job, o, net, links, t_fwd, t_bwd, 1.0 if o.prefetch else 0.5, acc)

    def overhead(self, spec, job, o, shard_n, comp, gpu_s) -> float:
        from shardwise.plan.comm import STRATEGY_BYTES_PER_PARAM

        key = "fsdp" if reshards(job, o) else "fsdp-grad-op"
        return STRATEGY_BYTES_PER_PARAM[key] * local_params(spec, job.tp) / shard_n / comp.device_mem_bw

    def host_step_rate(self, o) -> float | None:
        from shardwise.plan.comm import FSDP_HOST_STEP_PARAMS_PER_S

        return FSDP_HOST_STEP_PARAMS_PER_S if o.cpu_offload else None


def exposed_by_unit(spec, job, o, net, links, t_fwd, t_bwd, overlap: float, acc: float) -> float:
    """Gathers and reduces unit by unit, each phase's hidden behind that phase's compute (`overlap` of it): what
    exceeds the compute is exposed, and the first unit's gather has nothing to hide behind."""
    ga = job.grad_accum
    units = max(unit_params(spec, o)[1], 1)
    out = acc
    for phase, t_comp in (("fwd", t_fwd), ("bwd", t_bwd)):
        ph = [cl for cl in net if cl.phase == phase]
        every = sum(coll_time(cl, links) for cl in ph if cl.per_step == ga)  # each micro-batch
        once = sum(coll_time(cl, links) * cl.per_step for cl in ph if cl.per_step != ga)  # the last one
        out += (ga - 1) * max(0.0, every - overlap * t_comp) + max(0.0, every + once - overlap * t_comp)
        out += ga * every / units  # the first unit's gather has nothing to hide behind
    return out
