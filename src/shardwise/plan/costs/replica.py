"""single and ddp: every rank holds all of the model, its gradients and its optimizer states."""

from __future__ import annotations

from shardwise.plan.comm import Coll, coll_time
from shardwise.plan.costs import CostModel
from shardwise.plan.facts import DDP_BUCKET_BYTES, DDP_GRADIENT_AS_BUCKET_VIEW
from shardwise.plan.memory import _float8_applies, float8_params, fused_head, uses_ds_linear


def replica_states(spec, job, o, N, st) -> None:
    """single and ddp: every rank holds everything (ddp's gradient buckets: DDPCost.states)."""
    c, w, P_t, tw = job.c, job.w, st.P_t, st.tw
    st.params, st.grads, st.opt = st.frozen + tw * P_t, tw * P_t, 2 * tw * P_t
    if w > c and not uses_ds_linear(job, o):  # autocast keeps a compute-dtype copy of each linear weight
        # (its weight cache holds them to the end of the autocast region, i.e. the end of forward, checkpointing or
        # not; the fused head runs with autocast off and casts its weight itself: counted in its terms). Under
        # LoRA the frozen base is already in the compute dtype: only the adapters' weights are cast.
        head = spec.vocab_size * spec.hidden_size if fused_head(spec, job) else 0
        # float8 linears cast their fp32 weights to float8 themselves (for backward again): no bf16 copies of those
        f8 = float8_params(spec) if _float8_applies(job) else 0.0
        st.extraA["autocast_weights"] = c * ((spec.linear_params - head - f8) / job.tp if job.tuner == "full" else P_t)


class SingleCost(CostModel):
    """One replica (and, under sequence parallelism, the gradients averaged over the sequence ranks)."""

    def states(self, spec, job, o, N, st) -> None:
        replica_states(spec, job, o, N, st)

    def collectives(self, spec, job, o, shard_n, sizes) -> list:
        if job.sp <= 1:
            return []
        # under sequence parallelism (with TP, tp x sp = every rank) the sequence ranks hold other tokens of the same
        # rows, so strategies/single.py all-reduces every gradient (this rank's tp-local shard, in the stored dtype)
        # over them in its step, after backward: nothing to hide behind. One latency counted for the per-parameter
        # calls.
        from shardwise.plan.comm import sp_where

        return [Coll("all_reduce", job.w * sizes.P_t, job.sp, sp_where(job), 1, "step")]


class DDPCost(CostModel):
    """DistributedDataParallel: one bucketed all-reduce of the gradients, overlapped with backward."""

    persistent_grads = DDP_GRADIENT_AS_BUCKET_VIEW  # the gradients are views of the buckets

    def states(self, spec, job, o, N, st) -> None:
        replica_states(spec, job, o, N, st)
        if o.ddp_bucket_view:  # gradients are views of DDP's buckets: allocated once, never freed
            st.grads_persist = True
        else:
            st.persist["ddp_buckets"] = st.tw * st.P_t  # a flat bucket copy besides the gradients

    def collectives(self, spec, job, o, shard_n, sizes) -> list:
        if job.world <= 1:
            return []
        return [Coll("all_reduce", job.w * sizes.P_t, job.world, sizes.flat, 1, "bwd")]

    def exposed(self, spec, job, o, net, links, t_fwd, t_bwd, acc: float) -> float:
        out = acc
        for cl in net:  # overlapped with the last micro-batch's backward, except the last bucket
            t = coll_time(cl, links)
            out += max(0.0, t - t_bwd) + min(t, t * DDP_BUCKET_BYTES / max(cl.bytes, 1.0))
        return out

    def overhead(self, spec, job, o, shard_n, comp, gpu_s) -> float:
        from shardwise.plan.comm import STRATEGY_BYTES_PER_PARAM

        return STRATEGY_BYTES_PER_PARAM["ddp"] * sizes_trained(spec, job) / comp.device_mem_bw


def sizes_trained(spec, job) -> float:
    """Trainable parameters of one rank (its tp-local share under full fine-tuning)."""
    from shardwise.plan.memory import local_params

    return local_params(spec, job.tp) if job.tuner == "full" else spec.lora_params(job.lora_r, job.lora_targets)
