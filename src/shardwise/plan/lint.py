"""Check a configured run against the article's pitfalls, using the plan's numbers.

Each finding says what it sees (with the config line when known) and what to do.
"""

from __future__ import annotations

from shardwise import presets
from shardwise.plan.costs import cost_of
from shardwise.plan.decide import TIE, Plan, replica_plan
from shardwise.plan.memory import GiB, unit_params

SMALL_UNIT = 1e8  # the article: min_num_params=1e8 for size-based wrapping
ROOMY = 0.20  # "plenty of memory": at least 20% of the device left
SLOW_INTRA_GBPS = 400.0  # below this the GPUs of a node talk over PCIe (or gloo)
SLOW_INTER_GBPS = 800.0  # below this (per node) cross-node parameter gathers hurt
FLOAT8_WORTH = 0.05  # suggest --float8 where it is predicted at least this much faster


def _where(res, key: str) -> str:
    return res.where(key) + ": " if res is not None and key in res.origins else ""


def lint(plan: Plan, res=None) -> list[dict]:
    """Findings for the configured strategy (plan.configured); [] when none is configured."""
    name = plan.configured
    if not name or name not in {s.strategy for s in plan.strategies}:
        return []
    sp = plan.for_strategy(name)
    o, spec, setup = sp.opts, plan.spec, plan.setup
    cost = cost_of(o.base)
    mem = setup.device_mem_gib
    out: list[dict] = []

    def add(check: str, severity: str, msg: str) -> None:
        out.append({"check": check, "severity": severity, "message": msg})

    def get(n: str):
        return next((s for s in plan.strategies if s.strategy == n), None)

    # 1. tiny wrap units
    if cost.wraps_units and o.wrap.startswith("size:"):
        n = int(o.wrap[5:])
        U, units = unit_params(spec, o)
        if n < min(SMALL_UNIT, spec.layer_params):
            add("tiny-wrap-units", "warn",
                f"{_where(res, 'fsdp.wrap')}fsdp.wrap {o.wrap} makes {units} units of ~{U / 1e6:.1f}M params: "
                f"{units} all-gathers and reduce-scatters per pass, each small and latency-bound (the article's "
                f"pitfall 1: over-sharding made FSDP slower than DDP); use fsdp.wrap: block "
                f"({spec.num_layers} units of {spec.layer_params / 1e6:.0f}M) or size:{int(SMALL_UNIT)}")

    # 2. CPU offload where memory is plentiful
    if cost.offloads(o):
        alt_name, key = cost.without_offload(o)
        alt = get(alt_name)
        if alt and alt.fits and alt.headroom_gib >= ROOMY * mem:
            add("offload-not-needed", "warn",
                f"{_where(res, key) or _where(res, 'strategy')}{name} offloads to the CPU, but {alt_name} fits in "
                f"{alt.memory.total / GiB:.1f} of {mem:.1f} GiB per rank without it; offload costs "
                f"~{sp.step_time_s - alt.step_time_s:.2f} s per step ({sp.tokens_per_s:,.0f} vs "
                f"{alt.tokens_per_s:,.0f} tokens/s): use --strategy {alt_name}")

    # 3. sharding a model that DDP fits with room to spare, on a slow link
    sharded = cost.gathers_params(o)
    slow = (setup.intra_gbps < SLOW_INTRA_GBPS and not setup.measured_busbw) or \
           (setup.measured_busbw is not None and setup.measured_busbw * 8 / 1e9 < SLOW_INTRA_GBPS) or \
           (setup.nodes > 1 and setup.inter_gbps < SLOW_INTER_GBPS)
    ddp = replica_plan(plan)
    # only where ddp is predicted as fast, or within the planner's tie (and simpler): never quoting a faster sp
    if (sharded and slow and ddp and ddp.fits and ddp.headroom_gib >= ROOMY * mem
            and ddp.tokens_per_s >= (1 - TIE) * sp.tokens_per_s):
        speed = (f"ddp {ddp.tokens_per_s:,.0f} vs {sp.tokens_per_s:,.0f} tokens/s" if ddp.tokens_per_s >= sp.tokens_per_s
                 else f"ddp within {TIE:.0%} at {ddp.tokens_per_s:,.0f} vs {sp.tokens_per_s:,.0f} tokens/s, and simpler")
        add("fsdp-where-ddp-fits", "warn",
            f"{_where(res, 'strategy')}{name} shards a model that ddp fits with {ddp.headroom_gib:.1f} GiB to spare, on "
            f"a slow link; it moves {sp.comm_gb_per_step:.2f} GB per rank per step against ddp's "
            f"{ddp.comm_gb_per_step:.2f} GB ({speed}): use --strategy ddp")

    # 4. FSDP across nodes on a slow network without hybrid sharding
    if cost.hybrid_preset and not o.hybrid and setup.nodes > 1 and setup.inter_gbps < SLOW_INTER_GBPS:
        hyb = get(cost.hybrid_preset)
        extra = (f" (predicted {hyb.tokens_per_s:,.0f} vs {sp.tokens_per_s:,.0f} tokens/s"
                 f"{'' if hyb.fits else '; but hybrid does not fit: ' + format(hyb.memory.total / GiB, '.1f') + ' GiB'})"
                 if hyb else "")
        add("no-hybrid-across-nodes", "warn",
            f"{_where(res, 'strategy')}{name} gathers parameters across {setup.nodes} nodes over a "
            f"{setup.inter_gbps:g} Gb/s link every micro-batch; hybrid sharding keeps the gathers inside a node "
            f"and sends only one gradient all-reduce across: use --strategy hybrid{extra}")

    _checkpointing_off(plan, sp, res, add)
    _float8_off(plan, sp, name, add)
    return out


def _checkpointing_off(plan: Plan, sp, res, add) -> None:
    """5. activations dominate and checkpointing is off."""
    o, spec, job, mem = sp.opts, plan.spec, plan.job, plan.setup.device_mem_gib
    if not job.checkpointing:
        m = sp.memory
        if m.activations >= 0.5 * m.peak_tensors:
            from dataclasses import replace

            from shardwise.plan.memory import estimate

            ck = estimate(spec, replace(job, checkpointing=True), o)
            tight = not sp.fits or sp.headroom_gib < 0.1 * mem
            add("checkpointing-off", "warn" if tight else "info",
                f"{_where(res, 'gradient_checkpointing')}activations are {m.activations / GiB:.1f} of "
                f"{m.peak_tensors / GiB:.1f} GiB at the peak with gradient checkpointing off; turning it on keeps "
                f"{ck.activations / GiB:.1f} GiB (total ~{ck.total / GiB:.1f} GiB) for ~25-30% more compute"
                + ("" if tight else " — not needed while it fits, useful to raise the micro-batch"))


def _float8_off(plan: Plan, sp, name: str, add) -> None:
    """6. float8 tensor cores left unused (an opt-in lever: worth saying only where it is predicted to pay)."""
    spec, setup, job = plan.spec, plan.setup, plan.job
    o = sp.opts
    # (not with eager blocks: float8 needs the compiled ones, the config refuses it without them)
    if (setup.fp8_peak_flops and not job.float8 and job.tuner == "full" and job.tp == 1 and job.compute == "bf16"
            and presets.composes(name, "float8") and setup.accelerator == "cuda" and job.compile):
        from dataclasses import replace

        from shardwise.plan.decide import plan_strategy

        f8 = plan_strategy(spec, replace(job, float8=True), setup, name, o)
        gain = f8.tokens_per_s / sp.tokens_per_s - 1 if sp.tokens_per_s else 0.0
        if gain >= FLOAT8_WORTH:
            add("float8-off", "info",
                f"{setup.device_name} has float8 tensor cores: --float8 (pip install 'shardwise[float8]') is "
                f"predicted at {f8.tokens_per_s:,.0f} vs {sp.tokens_per_s:,.0f} tokens/s ({gain:+.0%}) and "
                f"{(sp.memory.total - f8.memory.total) / GiB:.1f} GiB less per rank; it rounds the blocks' large "
                "matmuls to float8 (docs/speed.md has its loss curve against bf16)")
