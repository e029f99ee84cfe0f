"""The planner's prediction for one strategy's config, or why there is none.

The planner is optional here: a build without `shardwise.plan` (or a planner that cannot
plan this setup) gives "n/a" columns, never a failed bench.
"""

from __future__ import annotations


def predict(cfg, world_size: int) -> dict:
    """{"available": True, fits, mem_gib, peak_mem_gib, step_time_s, tokens_per_s, ...} or
    {"available": False, "note": why}. `cfg` is the runtime-resolved Config of the run."""
    try:
        from shardwise.plan import plan_run
    except ImportError:
        return {"available": False, "note": "this build has no planner (shardwise.plan)"}
    try:
        sp = plan_run(cfg, None, world_size).for_strategy(cfg.strategy)
        mem = {k: float(v) for k, v in dict(sp.mem_gib).items()}
        # measured peak is tensor bytes (CUDA max_memory_allocated / CPU tensors): compare
        # with the planner's tensor peak, not with its total (which adds the CUDA context
        # and allocator allowance)
        out = {"available": True, "fits": bool(sp.fits), "mem_gib": mem, "peak_mem_gib": mem.get("peak_tensors", mem.get("total")),
               "step_time_s": float(sp.step_time_s),
               # the planner's tokens/s counts sequence slots (padding included); the bench compares throughput
               # at the measured tokens per step instead (report.real_tokens_per_s)
               "slot_tokens_per_s": float(sp.tokens_per_s), "tokens_per_s": float(sp.tokens_per_s)}
    except Exception as e:  # a planner bug must not cost the measurements; the report says what happened
        return {"available": False, "note": f"the planner failed: {type(e).__name__}: {str(e)[:200]}"}
    # Optional extras of the current planner (exposed communication, the collectives).
    try:
        detail = sp.to_json()
        out["exposed_comm_s"] = detail.get("exposed_comm_s")
        out["detail"] = detail
    except Exception:
        pass
    return out
