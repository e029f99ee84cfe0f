"""DeepSpeed-specific planner terms, against cases computed by hand from DeepSpeed's code."""

from __future__ import annotations

from dataclasses import replace

from shardwise.plan.costs.deepspeed import zero3_fp32_grad_elements, zero3_reduces
from shardwise.plan.memory import DS_SUB_GROUP, GiB, Job, Opts, estimate
from shardwise.plan.model_spec import ModelSpec

# Llama-3.2-3B's shape with a 32k vocabulary, untied (benchmarks/plan_accuracy.py "llama-3B")
L3B = ModelSpec("3b", "test", 32000, 3072, 8192, 28, 24, 8, 128, False)
ZERO3 = Opts(base="deepspeed", stage=3)


def test_zero3_step_upcasts_one_sub_group_at_a_time():
    # weight-decay group in model order: embedding 98,304,000, then per layer q 9,437,184, k 3,145,728,
    # v 3,145,728, o 9,437,184, gate/up/down 25,165,824 each (100,663,296 a layer), then the head 98,304,000.
    # Sub-groups close once they reach 1e9: embedding + 9 layers = 1,004,273,664; the next
    # 10 x 100,663,296 = 1,006,632,960 (closed at the 10th layer's down_proj); 9 layers + head = 1,004,273,664.
    assert zero3_fp32_grad_elements(L3B, Job(), 1) == 1_006_632_960
    # on 4 ranks each partition is a quarter: all of it fits one sub-group
    two_d = 98_304_000 * 2 + 28 * 100_663_296
    assert zero3_fp32_grad_elements(L3B, Job(), 4) == two_d / 4
    small = ModelSpec("t", "test", 512, 128, 352, 4, 4, 2, 32, False)
    assert zero3_fp32_grad_elements(small, Job(), 1) < DS_SUB_GROUP


def test_zero3_backward_peak_counts_one_sub_group_not_the_whole_partition():
    job = Job(micro_batch=4, seq_len=2048, checkpointing=True, compute="bf16", param_dtype="fp32",
              accelerator="cuda", fused_loss=True)
    m = estimate(L3B, job, ZERO3)
    assert m.detail["buffer_bwd.fp32_grad_partition"] == 4 * 1_006_632_960
    # measured on one H200 (benchmarks/results/plan_accuracy_h200_2026-11-29-b.json): 52.43 GiB
    assert abs(m.peak_tensors / GiB - 52.43) / 52.43 < 0.02
    # ZeRO-1/2 upcast a whole parameter group at once (stage_1_and_2.py): unchanged
    m2 = estimate(L3B, job, Opts(base="deepspeed", stage=2))
    assert m2.detail["buffer_bwd.fp32_grad_partition"] == 4 * L3B.total_params


def test_offloaded_optimizer_keeps_gradients_on_the_host():
    anchor = ModelSpec("a", "test", 32000, 2048, 8192, 16, 16, 8, 128, False)
    P = anchor.total_params
    job = Job(micro_batch=8, seq_len=2048, checkpointing=True, compute="bf16", param_dtype="fp32",
              accelerator="cuda", fused_loss=True)
    z2, z2o = estimate(anchor, job, Opts(base="deepspeed", stage=2)), \
        estimate(anchor, job, Opts(base="deepspeed", stage=2, offload_optimizer=True))
    assert z2.grads == 2 * P and z2o.grads == 0.0  # ZeRO-2 copies each reduced bucket into the host fp32 partition
    assert z2o.host == 12 * P + 4 * P  # fp32 master + Adam moments + the fp32 gradient partition
    z1o = estimate(anchor, job, Opts(base="deepspeed", stage=1, offload_optimizer=True))
    assert z1o.grads == 2 * P  # ZeRO-1 keeps full gradients in param.grad until the boundary's reduction
    z3o = estimate(anchor, job, Opts(base="deepspeed", stage=3, offload_optimizer=True, offload_params=True))
    assert z3o.grads == 0.0 and z3o.params == 0.0
    assert z3o.host == 12 * P + 4 * P + 2 * P + 2 * P  # + the bf16 flat gradient partition and bf16 parameters
    # on CPU ranks "offloaded" state stays in the rank's memory: the gradients are counted there
    assert estimate(anchor, replace(job, accelerator="cpu"), Opts(base="deepspeed", stage=2,
                                                                   offload_optimizer=True)).grads == 2 * P


def test_zero3_on_one_rank_counts_no_gathered_copies_unless_parameters_are_offloaded():
    """partition_parameters.py, _no_gather_coalesced: on one rank a fetched parameter's data is
    ds_tensor.to(device), the partition itself when it is on the GPU, a copy when it is on the CPU."""
    job = Job(micro_batch=4, seq_len=2048, compute="bf16", param_dtype="fp32", accelerator="cuda", fused_loss=True)
    one = estimate(L3B, job, ZERO3)
    two = estimate(L3B, replace(job, world=2), ZERO3)
    off = estimate(L3B, job, Opts(base="deepspeed", stage=3, offload_optimizer=True, offload_params=True))
    assert "buffer.gathered" not in one.detail and "buffer_bwd.gathered" not in one.detail
    assert two.detail["buffer.gathered"] > 0 and off.detail["buffer.gathered"] > 0
    # what the prefetcher keeps (stage3_max_live_parameters, 1e9), in bf16, is what one rank does not hold twice
    assert two.detail["buffer.gathered"] == off.detail["buffer.gathered"] == 2 * 1e9


def test_zero3_first_bucket_reduce_is_the_offloaded_checkpointed_peak():
    """The 1.14B anchor, zero3-offload with checkpointing, one H200: the second step peaks in backward, inside
    __reduce_and_partition_ipg_grads, with (plan_accuracy --snapshot, acc_gpu6): the 5e8-element fp32 bucket
    (1.86 GiB, for good), its torch.cat copy in reduce_scatter_coalesced (1.86 GiB, fp32), the partitions cast to
    the bf16 gradient dtype (0.93 GiB), 1.47 GiB of fetched parameters, 9 checkpointed block inputs (64 MiB each);
    6.98 GiB in all."""
    a = ModelSpec("a", "test", 32000, 2048, 8192, 16, 16, 8, 128, False)
    job = Job(micro_batch=8, seq_len=2048, checkpointing=True, compute="bf16", param_dtype="fp32",
              accelerator="cuda", fused_loss=True)
    [red] = zero3_reduces(a, job, 1)
    # gradients arrive head first (65,536,000), then 62,918,656 a block: 5e8 is reached inside the 7th block
    assert a.head_params == 65_536_000 and a.layer_params == 62_918_656
    assert red["elements"] == 5e8 and red["layers_left"] == 16 - 7
    assert red["rest"] == 9 * a.layer_params + a.embed_params  # weights not yet through backward
    assert red["copy"] == 4 * 5e8 + 2 * 5e8  # fp32 flat copy + bf16 partitions (one rank: the whole bucket)
    m = estimate(a, job, Opts(base="deepspeed", stage=3, offload_optimizer=True, offload_params=True))
    assert m.detail["buffer_reduce.gathered"] == 2 * (red["rest"] + 5e7)
    # the reduce moment is the measured one; the end of forward (the fused head's two chunks beside the prefetched
    # parameters, plan_accuracy_h200_2026-12-01) is within 2% of it, so the peak, whichever moment names it, is too
    assert abs(m.detail["moment_c"] / GiB - 6.98) / 6.98 < 0.05
    assert abs(m.peak_tensors / GiB - 6.98) / 6.98 < 0.05
    # fp32 compute: gradients and the reduce dtype agree, DeepSpeed casts nothing
    assert zero3_reduces(L3B, replace(job, compute="fp32", world=4), 4)[0]["copy"] == 4 * 5e8
    # a model whose gradients all fit the bucket: one reduce at the end of backward, every block done
    small = ModelSpec("t", "test", 512, 128, 352, 4, 4, 2, 32, False)
    [end] = zero3_reduces(small, job, 2)
    assert end["elements"] == small.total_params and end["layers_left"] == 0 and end["rest"] == 0
    assert end["copy"] == 4 * small.total_params + 2 * small.total_params / 2
    z3 = estimate(small, replace(job, world=2, micro_batch=1, seq_len=16), Opts(base="deepspeed", stage=3,
                                                                             offload_optimizer=True))
    assert z3.detail["moment_c"] > 0


def test_zero3_reduces_a_head_larger_than_the_bucket_alone():
    """stage3.py: the bucket is flushed before a parameter that would overflow it only when it holds something, and
    a gradient larger than the bucket is not copied into it; reduce_scatter_coalesced concatenates nothing for one
    tensor. Llama-3-8B's untied head (128256 x 4096 = 525,336,576) is such a parameter."""
    l8 = ModelSpec("8b", "test", 128256, 4096, 14336, 32, 32, 8, 128, False)
    job = Job(world=8, micro_batch=1, seq_len=4096, checkpointing=True, compute="bf16", param_dtype="fp32",
              accelerator="cuda", fused_loss=True)
    head, blk = 525_336_576, l8.layer_params
    first, second = zero3_reduces(l8, job, 8)
    assert first["elements"] == head and first["layers_left"] == 32
    assert first["copy"] == 2 * head + 4 * head + 2 * head / 8  # its bf16 grad, the fp32 cast, bf16 partitions
    assert second["elements"] == head + 5e8
    assert second["layers_left"] == 32 - -(-5e8 // blk)  # the blocks that filled the bucket after it
    assert second["copy"] == 4 * 5e8 + 2 * 5e8 / 8


def test_zero3_moments_survive_a_model_without_blocks():
    empty = ModelSpec("e", "test", 512, 128, 352, 0, 4, 2, 32, False)
    job = Job(world=2, micro_batch=1, seq_len=16, checkpointing=True, compute="bf16", accelerator="cpu")
    assert estimate(empty, job, Opts(base="deepspeed", stage=3)).peak_tensors > 0
