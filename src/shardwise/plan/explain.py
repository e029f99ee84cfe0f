"""What a plan says in words beside its numbers: the article's decision tree and the assumptions behind the plan.

Reads a decide.Plan (passed in; this module sits under decide, which imports it).
"""

from __future__ import annotations

from shardwise.plan import text
from shardwise.plan.memory import COMPILE_ACT_FACTOR, COMPILE_ACT_FACTOR_ZERO3, GiB, Job
from shardwise.plan.model_spec import ModelSpec

# the decision tree's source (the project's seed text; there is no link to give)
ARTICLE = ("a Chinese-language article comparing DDP and FSDP on several GPUs and advising which to choose in ms-swift, "
           "a fine-tuning framework that runs several distributed backends behind one interface")


def _gib(x: float) -> str:
    return f"{x:.1f} GiB"


def decision_tree(plan) -> dict:
    """What the article's decision tree says, and whether the numbers agree."""
    P = plan.spec.total_params
    mem_gb = plan.setup.device_mem_gib * GiB / 1e9
    big_mem = mem_gb >= 79  # "80 GB" cards report ~79.6-85 GB
    size = text.count(P) if P >= 8e9 or P < 7.995e9 else f"{P / 1e9:.3f}B"  # never "8B ... under 8B"
    big = f"model {size} params, 8B or more (above the tree's 7B class),"
    # each leaf: the preset it names, and which of the article's own caveats explain a disagreement there (a
    # replica's bytes per parameter, offload's cost, the checkpointing it also asks for)
    replica = offload = checkpointing = False
    if P < 8e9:  # the article's "7B" class: Mistral 7.2B and Qwen2.5-7B 7.6B are in it, Llama 3.1 8B is not
        cls = f"model {size} params, under 8B (the tree's 7B class),"
        if big_mem:
            says, path, replica = "ddp", f"{cls} with >= 80 GB per GPU -> DDP", True
        else:
            says, path, offload = "fsdp-offload", f"{cls} with < 80 GB per GPU -> FSDP + CPU offload", True
    elif plan.setup.world >= 8:
        says, path = "fsdp", f"{big} with >= 8 GPUs -> FSDP + mixed precision + gradient checkpointing"
        checkpointing = True
    else:
        says, path = "fsdp", f"{big} with < 8 GPUs -> FSDP with sharding optimizations"
    rec = plan.for_strategy(plan.recommended)
    tree_plan = next((s for s in plan.strategies if s.strategy == says), None)
    why = []
    if says == plan.recommended:
        why.append("the numbers agree")
    elif tree_plan is not None and not tree_plan.fits:
        why.append(f"{says} does not fit here ({_gib(tree_plan.memory.total / GiB)} per rank)")
        if replica:
            bpp = (tree_plan.memory.params + tree_plan.memory.grads + tree_plan.memory.optimizer) / max(P, 1)
            why.append(f"the article budgets 8 bytes/param for a replica (fp16 weights, grads, Adam: 7B -> 56 GB); "
                       f"this job keeps {bpp:.0f} bytes/param (param_dtype {plan.job.param_dtype}, "
                       f"tuner {plan.job.tuner})")
    elif tree_plan is not None:
        why.append(f"{says} fits too, but {plan.recommended} is predicted faster or simpler "
                   f"({rec.tokens_per_s:,.0f} vs {tree_plan.tokens_per_s:,.0f} tokens/s)")
        if offload:
            why.append("offload is only worth it when nothing else fits: the optimizer step on the CPU and the "
                       "host transfers cost time")
    if checkpointing and not plan.job.checkpointing:
        why.append("the tree also says gradient checkpointing; " +
                   ("it is not needed at this micro-batch" if rec.fits else "turning it on cuts activations"))
    return {"source": ARTICLE, "says": says, "path": path, "planner": plan.recommended,
            "agree": says == plan.recommended, "why": why}


def assumptions(plan) -> list[str]:
    j, s = plan.job, plan.setup
    out = [f"compute dtype {'fp32' if j.c == 4 else ('bf16' if j.compute != 'fp16' else 'fp16')}, "
           f"stored weights/grads/optimizer in {j.param_dtype}"
           + (" (autocast for DDP: fp32 residual stream + bf16 weight copies; FSDP2 MixedPrecisionPolicy "
              "casts weights, reduces in fp32)" if j.w > j.c else ""),
           "AdamW with two states per trainable parameter; zero_grad(set_to_none=True); "
           + ("the fused head returns the summed loss" if j.fused_loss else
              "the loop keeps the model output (logits) until backward" if j.hold_outputs else
              "outputs dropped before backward"),
           "HF Llama-style block with SDPA (flash / memory-efficient: no S^2 term"
           + ("; packing uses a bool block-diagonal mask, so K/V are repeated to all heads)" if j.packing else ")"),
           ("fused loss head: chunks of 4096 tokens, no T x V logits; " if j.fused_loss else
            "the loss upcasts the full logits to fp32; ")
           + ("decoder blocks compiled (torch.compile): block activations x "
              f"{COMPILE_ACT_FACTOR} (x {COMPILE_ACT_FACTOR_ZERO3} under ZeRO-3 with deepspeed.fetch module, whose "
              "per-submodule hooks split them)"
              if j.compile else "decoder blocks eager (no torch.compile)"),
           "DDP: 25 MiB buckets, gradient_as_bucket_view=True (gradients are views of the buckets, alive all step); "
           "FSDP2: each decoder layer a unit, embeddings/norm/head in the root unit, two units gathered at a time "
           "in forward, the root and one unit in backward; "
           "DeepSpeed: default buckets (reduce 5e8, prefetch 5e7 elements), fp32 master partition, "
           "overlap_comm off for ZeRO-1/2; ZeRO-3 fetches each decoder block whole (deepspeed.fetch block: one hook "
           "pair a block, DeepSpeed's linear only in eager blocks) unless deepspeed.fetch is module",
           f"step time: FLOPs (6N + 12*L*H*S per token) at {s.mfu_for(j, plan.spec):.0%} of {text.flops(s.peak_flops)}"
           + ("" if s.mfu is not None else " (compiled blocks)" if j.compile else " (eager blocks)")
           + (" (measured matmul rate)" if "doctor" in " ".join(s.notes) and s.accelerator == "cpu" else "")
           + "; communication overlapped with compute where the strategy does it",
           ]
    if j.tp > 1:
        out.append(f"tensor parallel {j.tp}: q/k/v/gate/up column-wise, o/down row-wise, norms sequence-parallel, "
                   "embedding and head vocabulary-sharded with loss_parallel (no fused chunked head: the logits are "
                   "T x V/tp per rank); per layer 2 all-gathers + 2 reduce-scatters of T x h each way on the "
                   "intra-node link, not overlapped; FLOPs per rank / tp")
    if j.float8:
        from shardwise.plan.comm import FLOAT8_CAST_BYTES
        from shardwise.plan.memory import float8_linears

        names = ", ".join(n.removesuffix("_proj") for n in float8_linears(plan.spec)) or "none"
        out.append(f"float8 linears in every block ({names}; the narrow ones left as they are): their matmuls at "
                   f"{text.flops(s.fp8_peak_flops)} (float8) at the same MFU, {FLOAT8_CAST_BYTES:g} bytes of memory "
                   "traffic per element cast; no bf16 weight copies; " + (
                       "activations as without float8 under selective checkpointing"
                       if j.selective_checkpointing else "their inputs recomputed in backward rather than saved"))
    if j.sp > 1:
        from shardwise.plan.comm import sp_split

        u, r = sp_split(plan.spec, j)
        out.append(f"sequence parallel {j.sp} ({sp_mode_label(plan.spec, j)}): "
                   + (f"Ulysses over {u} ranks, 4 all-to-alls per layer each way, not overlapped" if u > 1 else "")
                   + ("; " if u > 1 and r > 1 else "")
                   + (f"ring attention over {r} ranks, {r - 1} KV exchanges per layer each way (and dK/dV in "
                      "backward), overlapped with the attention compute" if r > 1 else ""))
    if s.accelerator == "cuda":
        out.append(f"allowance per GPU: CUDA context {hardware_ctx():.2f} GiB + 7% allocator fragmentation")
    else:
        out.append("CPU: 'device memory' is host RAM divided by the ranks of the node; no context allowance")
    if not j.packing:
        out.append("tokens/s counts sequence slots; padding is not subtracted (use --packing for full sequences)")
    return out


def hardware_ctx() -> float:
    from shardwise.plan.memory import CUDA_CONTEXT_GIB

    return CUDA_CONTEXT_GIB


def sp_mode_label(spec: ModelSpec, job: Job) -> str:
    """How a sequence-parallel degree splits attention: 'ulysses', 'ring', or 'ulysses U x ring R'."""
    from shardwise.plan.comm import sp_split

    if job.sp <= 1:
        return "-"
    u, r = sp_split(spec, job)
    return "ulysses" if r == 1 else "ring" if u == 1 else f"ulysses {u} x ring {r}"
