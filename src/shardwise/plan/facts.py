"""Facts the engine sets and the planner models, declared once: strategies/ and models/ import them from here.

Torch-free (the planner imports no torch): dtypes are named, the engine turns a name into its torch dtype.
"""

from __future__ import annotations

# FSDP2's MixedPrecisionPolicy(reduce_dtype=...): gradients are reduce-scattered (and accumulated unsharded
# between micro-batches) in fp32 whatever the compute dtype
FSDP_REDUCE_DTYPE = "float32"
FSDP_REDUCE_BYTES = 4
