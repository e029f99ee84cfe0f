"""Facts the engine sets and the planner models, declared once: the engine (strategies/, models/) and the planner
import them from here, so the two cannot drift apart.

Torch-free (the planner imports no torch): dtypes are named, the engine turns a name into its torch dtype.
"""

from __future__ import annotations

# FSDP2's MixedPrecisionPolicy(reduce_dtype=...): gradients are reduce-scattered (and accumulated unsharded between
# micro-batches) in fp32 whatever the compute dtype
FSDP_REDUCE_DTYPE = "float32"
FSDP_REDUCE_BYTES = 4

# DDP(gradient_as_bucket_view=...): the gradients are views of the all-reduce buckets (allocated once, kept)
DDP_GRADIENT_AS_BUCKET_VIEW = True
DDP_BUCKET_BYTES = 25 * 2**20  # DDP's bucket_cap_mb default, which the engine keeps

# tokens per chunk of the fused linear + cross-entropy head (models/speed.py install_fused_loss)
FUSED_LOSS_CHUNK = 4096


# how task dpo's log-probability head (models/speed.py _LinearTokenLogProbs) cuts its tokens into chunks, and what
# the planner's memory of it holds (plan/memory.py preference_head_terms)
def even_chunks(n: int, chunk: int) -> list[tuple[int, int]]:
    """[start, stop) of the fewest chunks of at most `chunk` rows that cover n rows, their sizes differing by at
    most one: 4128 tokens in chunks of 4096 are two of 2064, not 4096 and 32, whose 32-token chunk would still pay a
    whole pass over the head weight's gradient (and, compiled, a kernel specialised to its odd size)."""
    k = -(-n // chunk)
    if k == 0:
        return []
    q, r = divmod(n, k)
    bounds, s = [], 0
    for i in range(k):
        e = s + q + (i < r)
        bounds.append((s, e))
        s = e
    return bounds


# Past this sequence length a packed sequence on CUDA (or any sequence-parallel one) is attended through
# FlexAttention's block mask, not a dense (B, 1, S, S) mask (models/sequence_parallel.py)
DENSE_MASK_MAX_SEQ = 8192

# float8 (models/float8.py): the block linears it leaves in bf16, whose amax reductions would cost more than the
# faster matmul saves: out_features <= FLOAT8_NARROW_OUT with in_features <= FLOAT8_NARROW_IN (and any dimension
# not a multiple of 16)
FLOAT8_NARROW_OUT, FLOAT8_NARROW_IN = 1024, 4096

# DeepSpeed's defaults, which the engine keeps (elements): reduce_bucket_size (ZeRO-1/2 allocate their gradient
# bucket at this size whatever the model's, in the parameters' dtype, for the backward; ZeRO-3 once at
# initialisation, in the reduce dtype, for good), stage3_prefetch_bucket_size, stage3_max_live_parameters (ZeRO-3's
# prefetcher gathers ahead until this many are gathered) and sub_group_size (ZeRO-3's optimizer step makes the
# fp32 gradient of one sub-group at a time)
DS_REDUCE_BUCKET = 5e8
DS_PREFETCH_BUCKET = 5e7
DS_MAX_LIVE = 1e9
DS_SUB_GROUP = 1e9
