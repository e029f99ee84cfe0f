"""Put memory, communication and time together for every preset, and choose.

`plan_model` is the pure core; `plan_run` builds its inputs from a training Config.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field

from shardwise import hardware, presets
from shardwise.errors import ShardwiseError
from shardwise.plan import text
from shardwise.plan.calibration import value
from shardwise.plan.comm import HBM_BYTES_PER_S, Compute, Links, Timing, step_time
from shardwise.plan.costs import cost_of
from shardwise.plan.explain import assumptions, decision_tree, sp_mode_label  # noqa: F401 (re-exported)
from shardwise.plan.long_context import auto_mlp_tiles
from shardwise.plan.memory import (
    GiB,
    Job,
    Memory,
    Opts,
    estimate,
    mlp_tiles,
    shard_ranks,
    tp_degrees,
)
from shardwise.plan.model_spec import ModelSpec

# MFU of the forward/backward compute on a GPU (the optimizer step is timed separately, comm.step_time), with eager
# and with compiled blocks; checkpointing needs no constant of its own (its recompute FLOPs at the same MFU)
EAGER_MFU = value("eager_mfu")
COMPILED_MFU = value("compiled_mfu")
EAGER_MFU_WIDTH = value("eager_mfu_width")  # the hidden size EAGER_MFU was fitted on
EAGER_MFU_PER_DOUBLING = value("eager_mfu_per_width_doubling")  # per doubling of a rank's matmul width beyond it
CPU_PEAK_FLOPS = value("cpu_peak_flops")  # per rank, when `shardwise doctor` has not measured a matmul
CPU_MFU = value("cpu_mfu")  # of the measured matmul rate
TIE = 0.05  # strategies within 5% of the fastest count as equally fast; the simpler one wins
TIGHT = 0.05  # less than 5% of device memory left is reported as tight


def eager_mfu(hidden_size: int, tp: int = 1, experts: int = 0) -> float:
    """Eager blocks pay a fixed host cost per op beside matmul work that grows with the width of a rank's matmuls
    (hidden / tp): EAGER_MFU at the width it was fitted on, more for each doubling beyond it
    (calibration.json eager_mfu_per_width_doubling), never above COMPILED_MFU. A mixture-of-experts block's matmuls
    are its experts', narrow and looped over: EAGER_MFU."""
    if experts:
        return EAGER_MFU
    doublings = max(0.0, math.log2(hidden_size / tp / EAGER_MFU_WIDTH))
    return min(COMPILED_MFU, EAGER_MFU + EAGER_MFU_PER_DOUBLING * doublings)


@dataclass
class Setup:
    """The hardware a plan is for, and where each number came from."""

    gpus_per_node: int
    nodes: int
    accelerator: str  # cuda | cpu
    device_name: str
    device_mem_gib: float
    host_mem_gib: float  # per node
    intra_gbps: float
    intra_label: str
    inter_gbps: float
    inter_label: str
    peak_flops: float
    mfu: float | None  # None: by the job, eager_mfu (by width) or COMPILED_MFU (GPU); --mfu or CPU_MFU otherwise
    notes: list = field(default_factory=list)
    measured_busbw: float | None = None  # bytes/s from doctor.json, replaces intra when set
    fp8_peak_flops: float = 0.0  # float8 tensor cores (0: none, or a CPU)
    device_mem_bw: float = HBM_BYTES_PER_S  # effective bytes/s of the memory-bound passes (comm.device_mem_bw)

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    def mfu_for(self, job: Job, spec: ModelSpec) -> float:
        """The MFU a job runs at: the given one, else compiled or eager blocks (GPU; eager by the model's width)."""
        if self.mfu is not None:
            return self.mfu
        return COMPILED_MFU if job.compile else eager_mfu(spec.hidden_size, job.tp, spec.num_experts)

    def links(self) -> Links:
        eff = hardware.LINK_EFFICIENCY
        intra = self.measured_busbw or self.intra_gbps / 8 * 1e9 * eff
        lat = 200e-6 if self.accelerator == "cpu" else 15e-6
        return Links(intra_busbw=intra, inter_busbw=self.inter_gbps / 8 * 1e9 * eff, intra_latency=lat)


@dataclass
class StrategyPlan:
    strategy: str
    base: str
    description: str
    opts: Opts
    memory: Memory
    timing: Timing
    fits: bool
    device_mem_gib: float
    notes: list = field(default_factory=list)

    @property
    def mem_gib(self) -> dict:
        return self.memory.gib()

    @property
    def headroom_gib(self) -> float:
        return self.device_mem_gib - self.memory.total / GiB

    @property
    def step_time_s(self) -> float:
        return self.timing.step_s

    @property
    def tokens_per_s(self) -> float:
        return self.timing.tokens_per_s

    @property
    def comm_gb_per_step(self) -> float:
        return self.timing.comm_bytes / 1e9

    def to_json(self) -> dict:
        t = self.timing
        return {"strategy": self.strategy, "base": self.base, "fits": self.fits,
                "mem_gib": self.mem_gib, "headroom_gib": round(self.headroom_gib, 3),
                "peak_phase": self.memory.phase,
                "comm_gb_per_step": round(self.comm_gb_per_step, 4),
                "step_time_s": round(t.step_s, 5), "tokens_per_s": round(t.tokens_per_s, 1),
                "compute_s": round(t.compute_s, 5), "exposed_comm_s": round(t.exposed_comm_s, 5),
                "other_s": round(t.other_s, 5),
                "collectives": [{"op": c.op, "gb": round(c.bytes / 1e9, 4), "ranks": c.ranks, "link": c.where,
                                 "per_step": c.per_step, **({"kind": c.kind} if c.kind else {})}
                                for c in t.collectives],
                "notes": self.notes}


@dataclass
class Plan:
    spec: ModelSpec
    job: Job
    setup: Setup
    strategies: list
    recommended: str
    reasons: list
    tree: dict
    configured: str | None = None
    lint: list = field(default_factory=list)
    assumptions: list = field(default_factory=list)
    sp_rows: list = field(default_factory=list)  # sequence_parallel_rows(): one per feasible SP degree
    tp_rows: list = field(default_factory=list)  # tensor_parallel_rows(): per TP degree and fsdp preset
    # the degrees the recommendation runs with: the job's, or those auto chose when data parallelism alone does not
    # fit (choose_parallel); `launch` applies them with the recommended strategy
    parallel: dict = field(default_factory=dict)

    def for_strategy(self, name: str) -> StrategyPlan:
        for s in self.strategies:
            if s.strategy == name:
                return s
        known = ", ".join(s.strategy for s in self.strategies)
        raise ShardwiseError(f"strategy '{name}' is not planned for this setup; planned: {known}")

    def to_json(self) -> dict:
        s, j, h = self.spec, self.job, self.setup
        return {
            "model": {"name": s.name, "source": s.source, "params": s.total_params,
                      "trainable_params": self.strategies[0].memory.detail["trainable_params"],
                      "layers": s.num_layers, "hidden": s.hidden_size, "intermediate": s.intermediate_size,
                      "heads": s.num_heads, "kv_heads": s.num_kv_heads, "vocab": s.vocab_size,
                      "tied_embeddings": s.tied_embeddings},
            "job": {**dataclasses.asdict(j), "mlp_tiles_resolved": mlp_tiles(s, j)},  # mlp_tiles 0 is auto
            "hardware": {"gpus_per_node": h.gpus_per_node, "nodes": h.nodes, "world_size": h.world,
                         "accelerator": h.accelerator, "device": h.device_name,
                         "device_mem_gib": h.device_mem_gib, "host_mem_gib": h.host_mem_gib,
                         "intra_node_gbps": h.intra_gbps, "intra_node_link": h.intra_label,
                         "inter_node_gbps": h.inter_gbps, "inter_node_link": h.inter_label,
                         "measured_busbw_gbps": h.measured_busbw * 8 / 1e9 if h.measured_busbw else None,
                         "peak_tflops": h.peak_flops / 1e12, "mfu": h.mfu_for(j, s), "notes": h.notes},
            "strategies": [x.to_json() for x in self.strategies],
            "recommended": self.recommended,
            "reasons": self.reasons,
            "configured": self.configured,
            "decision_tree": self.tree,
            "lint": self.lint,
            "assumptions": self.assumptions,
            "sequence_parallel": self.sp_rows,
            "tensor_parallel": self.tp_rows,
            "parallel": self.parallel or {"strategy": self.recommended, "tensor_parallel": j.tp,
                                          "sequence_parallel": j.sp, "sp_mode": j.sp_mode, "chosen": False},
        }


# ----------------------------------------------------------------------------- options


def opts_for(name: str, cfg=None) -> Opts:
    """A preset's options over the config defaults; the config's own options for the configured strategy."""
    from shardwise.config import Config

    if cfg is None or cfg.strategy != name:
        base_cfg = Config()
        for key, value in presets.PRESETS[name].options.items():
            sec, attr = key.split(".", 1)
            setattr(getattr(base_cfg, sec), attr, value)
        cfg = base_cfg
    f, d = cfg.fsdp, cfg.deepspeed
    return Opts(base=presets.base_strategy(name), reshard_after_forward=f.reshard_after_forward,
                keep_gathered_one_rank=f.keep_gathered_one_rank,
                cpu_offload=f.cpu_offload, hybrid=f.hybrid, shard_group_size=f.shard_group_size, wrap=f.wrap,
                prefetch=f.prefetch, stage=d.stage, offload_optimizer=d.offload_optimizer,
                offload_params=d.offload_params, ds_fetch=d.fetch)


def preset_names(setup: Setup, tp: int = 1, sp: int = 1, float8: bool = False) -> list[str]:
    """The presets `plan` lists; under tensor parallelism only those TP composes with (the fsdp presets, and
    single when tp x sp is the whole world: pure TP, or TP x SP with the gradients averaged over the sequence
    ranks, as launch/preflight.py allows single); with float8 not the DeepSpeed ones (the config refuses them)."""
    settings = {"float8": float8, "tensor_parallel": tp}
    names = [name for name, p in presets.PRESETS.items() if p.planned_for(setup.world, setup.nodes)
             and not presets.check_composition(name, settings)]
    if tp > 1:  # a one-replica family (single) where its tp x sp ranks are the whole world, listed last
        names = [n for n in names if presets.replica_world(n, tp, sp) is None]
        names += [n for n in presets.PRESETS if presets.replica_world(n, tp, sp) == setup.world
                  and not presets.check_composition(n, settings)]
    return names


def offloads(o: Opts) -> bool:
    """Whether a preset keeps its state in host RAM (its family's cost model says by its options)."""
    return cost_of(o.base).offloads(o)


def replica_plan(plan: Plan) -> StrategyPlan | None:
    """The planned data-parallel replica preset (ddp), if any."""
    return next((s for s in plan.strategies if presets.SPECS[s.base].replicates), None)


# ----------------------------------------------------------------------------- core


def host_peak_parts(mem, job: Job) -> str:
    """What sets a rank's host peak (memory.host_peak), in words: the model's load at the start, or what the
    steady state keeps there."""
    if mem.detail.get("host_phase") == "load":
        return (f"each rank loads the whole model in {job.param_dtype}"
                + ("; --param-dtype bf16 halves it" if job.param_dtype == "fp32" else ""))
    checkpoints = mem.detail.get("act.host_checkpoints", 0.0)
    parts = (["offloaded states"] if mem.host - checkpoints > 0 else []) + (["checkpoints"] if checkpoints else []) \
        + (["compile workers"] if job.compile else []) + ["the process"]
    return " + ".join(parts)


def plan_strategy(spec: ModelSpec, job: Job, setup: Setup, name: str, opts: Opts) -> StrategyPlan:
    mem = estimate(spec, job, opts)
    n = max(1, shard_ranks(job, opts) // job.tp)  # data-parallel sharding: over the ranks of one tp position
    timing = step_time(spec, job, opts, n, setup.links(),
                       Compute(setup.peak_flops, setup.mfu_for(job, spec), setup.device_mem_bw, setup.fp8_peak_flops))
    fits_dev = mem.total / GiB <= setup.device_mem_gib
    host_need = mem.host * setup.gpus_per_node / GiB
    fits_host = host_need <= setup.host_mem_gib * 0.9
    notes = []
    if not fits_dev:
        notes.append(f"needs {mem.total / GiB:.1f} GiB per rank, {setup.device_mem_gib:.1f} GiB available")
    elif (setup.device_mem_gib - mem.total / GiB) < TIGHT * setup.device_mem_gib:
        notes.append(f"tight: {setup.device_mem_gib - mem.total / GiB:.1f} GiB left per rank")
    peak_need = mem.host_peak * setup.gpus_per_node / GiB
    over = fits_host and setup.host_mem_gib and peak_need > setup.host_mem_gib * 0.9
    if mem.host:
        notes.append(f"offloads {host_need:.1f} GiB per node to host RAM ({setup.host_mem_gib:.0f} GiB)"
                     + (f", ~{peak_need:.0f} GiB at its peak ({host_peak_parts(mem, job)})"
                        if peak_need and not over else ""))
        if not fits_host:
            notes.append("host RAM is too small for the offloaded state")
    if over:
        notes.append(f"host RAM at its peak: ~{peak_need:,.0f} GiB per node ({host_peak_parts(mem, job)}), over 90% "
                     f"of {setup.host_mem_gib:.0f} GiB: the host may run out of memory")
    return StrategyPlan(name, opts.base, presets.PRESETS[name].description, opts, mem, timing,
                        fits_dev and fits_host, setup.device_mem_gib, notes)


def plan_model(spec: ModelSpec, job: Job, setup: Setup, configured: str | None = None, cfg=None,
               escalate: bool = True) -> Plan:
    """Plan every preset for a model, a job and a setup; recommend one (with a sequence- or tensor-parallel degree
    when data parallelism alone does not fit: choose_parallel; `escalate` False plans the job's degrees only)."""
    if setup.world < 1 or setup.gpus_per_node < 1 or setup.nodes < 1:
        raise ShardwiseError(f"a plan needs at least one rank (gpus {setup.gpus_per_node}, nodes {setup.nodes})")
    names = preset_names(setup, job.tp, job.sp, job.float8)
    if configured and configured in presets.PRESETS and configured not in names:
        names.append(configured)
    if job.mlp_tiles == 0 and names:  # --mlp-tiles auto: one count for every row, the configured strategy's
        job = auto_tiles(spec, job, setup, configured if configured in names else names[0], cfg)
    plans = [plan_strategy(spec, job, setup, n, opts_for(n, cfg)) for n in names]
    plan = Plan(spec, job, setup, plans, "", [], {}, configured)
    plan.recommended, plan.reasons = recommend(plan)
    plan.reasons += activation_lever_reasons(plan)
    plan.tree = decision_tree(plan)
    if escalate:
        choose_parallel(plan, cfg)
    plan.assumptions = assumptions(plan)
    return plan


def _gib(x: float) -> str:
    return f"{x:.1f} GiB"


def recommend(plan: Plan) -> tuple[str, list[str]]:
    fitting = [s for s in plan.strategies if s.fits]
    mem = plan.setup.device_mem_gib
    if not fitting:
        best = min(plan.strategies, key=lambda s: s.memory.total)
        reasons = [f"nothing fits in {mem:.1f} GiB per rank; the smallest is {best.strategy} at "
                   f"{_gib(best.memory.total / GiB)}",
                   fit_advice(plan, best.strategy)]
        return best.strategy, reasons
    fastest = max(fitting, key=lambda s: s.tokens_per_s)
    close = [s for s in fitting if s.tokens_per_s >= (1 - TIE) * fastest.tokens_per_s]
    best = min(close, key=lambda s: presets.PRESETS[s.strategy].simplicity)
    t = best.timing
    reasons = [f"{best.strategy} fits: {_gib(best.memory.total / GiB)} of {mem:.1f} GiB per rank "
               f"({_gib(best.headroom_gib)} headroom; peak at {best.memory.phase})"]
    if len(fitting) == 1:
        reasons.append(f"it is the only strategy that fits: {best.tokens_per_s:,.0f} tokens/s predicted")
    elif best is fastest:
        reasons.append(f"it is the fastest of the {len(fitting)} strategies that fit: "
                       f"{best.tokens_per_s:,.0f} tokens/s predicted")
    else:
        reasons.append(f"it is within {TIE:.0%} of the fastest ({fastest.strategy}, "
                       f"{fastest.tokens_per_s:,.0f} tokens/s) and simpler: {best.tokens_per_s:,.0f} tokens/s predicted")
    if t.comm_bytes:
        reasons.append(f"it moves {t.comm_bytes / 1e9:.2f} GB per rank per step; {t.exposed_comm_s * 1e3:.0f} ms of "
                       f"that is not hidden behind {t.compute_s * 1e3:.0f} ms of compute")
    ddp = replica_plan(plan)  # the data-parallel replica (ddp): what sharding is weighed against
    best_replicates = presets.SPECS[best.base].replicates
    if not best_replicates and ddp is not None and not ddp.fits:
        m = ddp.memory
        reasons.append(f"{ddp.strategy} does not fit: a full replica needs {_gib(m.total / GiB)} "
                       f"(weights {_gib(m.params / GiB)}, optimizer {_gib(m.optimizer / GiB)}, "
                       f"activations {_gib(m.activations / GiB)})")
    if best_replicates:
        sharded = [s for s in fitting if not presets.SPECS[s.base].replicates]
        if sharded:
            f = max(sharded, key=lambda s: s.tokens_per_s)
            lean = min(sharded, key=lambda s: s.memory.total)
            if lean.memory.total < best.memory.total:
                reasons.append(f"sharding would free memory ({lean.strategy}: {text.size(lean.memory.total)} vs "
                               f"{text.size(best.memory.total)}) but is not meaningfully faster here "
                               f"({f.strategy}: {f.tokens_per_s:,.0f} tokens/s) and adds collectives")
            else:  # small models: a sharded strategy's buffers outweigh the states it splits
                reasons.append(f"sharding would not free memory here (the smallest, {lean.strategy}, needs "
                               f"{text.size(lean.memory.total)} vs {text.size(best.memory.total)}) and is not "
                               f"meaningfully faster ({f.strategy}: {f.tokens_per_s:,.0f} tokens/s)")
    return best.strategy, reasons


# ----------------------------------------------------------------------------- advice


def _variant(plan: Plan, name: str, job: Job | None = None, setup: Setup | None = None) -> StrategyPlan:
    job = job or plan.job
    setup = setup or plan.setup
    if job.mlp_tiles == 0:  # a lever's --mlp-tiles auto: the count it would take for this preset
        job = auto_tiles(plan.spec, job, setup, name)
    base = plan.for_strategy(name).opts if any(s.strategy == name for s in plan.strategies) else opts_for(name)
    if presets.PRESETS[name].options.get("fsdp.hybrid") and setup.nodes <= 1:  # one node: no replica groups
        base = dataclasses.replace(base, hybrid=False)
    return plan_strategy(plan.spec, job, setup, name, base)


def fit_advice(plan: Plan, strategy_name: str) -> str:
    """One line: the estimate for a strategy and, when it does not fit, the cheapest change that would."""
    sp = plan.for_strategy(strategy_name)
    m = sp.memory
    head = (f"{strategy_name}: ~{m.total / GiB:.1f} GiB per rank of {plan.setup.device_mem_gib:.1f} GiB "
            f"(weights {m.params / GiB:.1f}, grads {m.grads / GiB:.1f}, optimizer {m.optimizer / GiB:.1f}, "
            f"activations {m.activations / GiB:.1f}, buffers {m.buffers / GiB:.1f})")
    if sp.fits:
        return head + f"; fits with {sp.headroom_gib:.1f} GiB headroom"
    host_need = m.host * plan.setup.gpus_per_node / GiB
    if host_need > plan.setup.host_mem_gib * 0.9:
        head += (f"; host RAM: {host_need:.1f} GiB per node to hold, of {plan.setup.host_mem_gib:.0f} GiB "
                 f"(90% usable){' (offloaded checkpoints)' if plan.job.offload_checkpoints else ''}")
    j = plan.job
    cands: list[tuple[float, str, StrategyPlan]] = []

    def add(rank: float, text: str, job: Job | None = None, name: str | None = None, setup: Setup | None = None):
        cands.append((rank, text, _variant(plan, name or strategy_name, job, setup)))

    mb = j.micro_batch
    while mb > 1:
        mb //= 2
        ga = j.grad_accum * (j.micro_batch // mb)
        add(0, f"--micro-batch-size {mb} --grad-accum {ga} (same global batch)",
            dataclasses.replace(j, micro_batch=mb, grad_accum=ga))
    if not j.checkpointing:
        add(0, "--gradient-checkpointing", dataclasses.replace(j, checkpointing=True))
    # cheap levers that keep the strategy and the global batch: each alone above, together here (ranked with the
    # offload presets: more than one change)
    levers: list[tuple[str, dict]] = []
    if j.param_dtype == "fp32" and j.compute == "bf16":
        add(0, "--param-dtype bf16", dataclasses.replace(j, param_dtype="bf16"))
        levers.append(("--param-dtype bf16", {"param_dtype": "bf16"}))
    if not j.checkpointing:
        levers.append(("--gradient-checkpointing", {"checkpointing": True}))
    for c in activation_changes(j):
        add(*c)
    if j.micro_batch > 1:
        levers.append((f"--micro-batch-size 1 --grad-accum {j.grad_accum * j.micro_batch}",
                       {"micro_batch": 1, "grad_accum": j.grad_accum * j.micro_batch}))
    for k in range(2, len(levers) + 1):
        for combo in itertools.combinations(levers, k):
            changes = {key: v for _, ch in combo for key, v in ch.items()}
            add(1, " ".join(t for t, _ in combo), dataclasses.replace(j, **changes))
    for name in preset_names(plan.setup, j.tp, j.sp, j.float8):
        if name != strategy_name and "offload" not in name:
            add(0, f"--strategy {name}", name=name)
            if not j.checkpointing:
                add(0, f"--strategy {name} --gradient-checkpointing", dataclasses.replace(j, checkpointing=True), name)
    for name in ("fsdp-offload", "zero3-offload"):
        if name != strategy_name and not presets.check_composition(name, {"tensor_parallel": j.tp, "float8": j.float8}):
            add(1, f"--strategy {name}", name=name)
    s = plan.setup
    if j.sp == 1 and j.tp == 1 and s.world > 1:  # split the sequence, or the weights (TP: fsdp, full fine-tune)
        if not presets.SPECS[sp.base].one_replica:
            for d in sp_degrees(plan.spec, j, s.world):
                add(1, f"--sequence-parallel {d}", dataclasses.replace(j, sp=d))
        if presets.SPECS[sp.base].tp_in_data_parallel and j.tuner == "full":
            # float8 is not built with TP: those variants drop it, and say so
            no8, off = (" --no-float8", {"float8": False}) if j.float8 else ("", {})
            for d in tp_degrees(plan.spec, s.gpus_per_node):
                add(1, f"--tensor-parallel {d}{no8}", dataclasses.replace(j, tp=d, **off))
            # both together only where neither alone fits (as --strategy auto: choose_parallel)
            if not any(c[2].fits for c in cands if c[1].startswith(("--sequence-parallel", "--tensor-parallel"))):
                for t, d in tp_sp_pairs(plan.spec, j, s):
                    add(1, f"--tensor-parallel {t} --sequence-parallel {d}{no8}",
                        dataclasses.replace(j, tp=t, sp=d, **off))
    for c in last_resorts(plan, sp.base, strategy_name):
        add(*c)
    ok = [c for c in cands if c[2].fits]
    if not ok:
        return head + "; no change found that fits (alone, or param dtype, checkpointing and micro-batch together): use a smaller model, more or larger GPUs"
    rank = min(c[0] for c in ok)
    _, text, best = max((c for c in ok if c[0] == rank), key=lambda c: c[2].tokens_per_s)
    return (head + f"; does not fit. Cheapest change that fits: {text} "
            f"(~{best.memory.total / GiB:.1f} GiB, ~{best.tokens_per_s:,.0f} tokens/s)")


def activation_changes(j: Job) -> list[tuple[float, str, Job]]:
    """fit_advice's (rank, flags, job) for what shrinks a rank's activations on its own device. The long-context
    levers (docs/long-context.md) keep the strategy, the batch and every state on the device, and need host RAM and
    recompute: ranked with the offload presets and the sequence split (the faster wins). Without LoRA dropout each
    adapter reads the projection's own input instead of keeping a dropped-out copy (a block's 7 at long lengths);
    it changes the training (peft's, torchtune's and LLaMA-Factory's defaults have no adapter dropout), so the line
    says it, and it comes only where nothing that keeps the training as it is fits (after those, before more GPUs)."""
    out = [(1.0, flags, dataclasses.replace(j, **changes)) for flags, changes in activation_levers(j)]
    if j.tuner != "full" and j.lora_dropout > 0:
        out += [(1.5, f"--lora-dropout 0 {flags}".strip() + " (no adapter dropout)",
                 dataclasses.replace(j, lora_dropout=0.0, **changes))
                for flags, changes in [("", {}), *activation_levers(j)]]
    return out


def last_resorts(plan: Plan, base: str, strategy_name: str) -> list[tuple]:
    """fit_advice's (rank, text, job, strategy, setup) that change the machine or the method: more nodes (GPUs),
    with a strategy that shards the states, then an adapter (LoRA, QLoRA) instead of full fine-tuning."""
    j, s, out = plan.job, plan.setup, []
    sharded = strategy_name if presets.SPECS[base].shards_state else "fsdp"
    if s.accelerator == "cuda":
        for mult in (2, 4, 8):
            more = dataclasses.replace(s, nodes=s.nodes * mult)
            out.append((2, f"{more.world} GPUs ({more.nodes} nodes) with --strategy {sharded}",
                        dataclasses.replace(j, world=more.world, nodes=more.nodes), sharded, more))
    adapters = {"full": ["lora", "qlora"], "lora": ["qlora"]}.get(j.tuner, []) if j.tp == 1 else []  # TP: full only
    for tuner in adapters:  # float8 is full fine-tuning only: an adapter drops it
        out.append((3, f"--tuner {tuner}" + (" --no-float8" if j.float8 else ""),
                    dataclasses.replace(j, tuner=tuner, float8=False), None, None))
    return out


def auto_tiles(spec: ModelSpec, job: Job, setup: Setup, name: str, cfg=None) -> Job:
    """`--mlp-tiles auto`: none where preset `name` fits the device without tiles (tiles cost one more MLP forward,
    the same for any count); else the size rule's count (plan/long_context.py auto_mlp_tiles, the engine's own
    when it is given auto without a plan), doubled while the run still does not fit and a tile keeps 1024 tokens."""
    opts = opts_for(name, cfg)

    def fits(n: int) -> bool:
        return plan_strategy(spec, dataclasses.replace(job, mlp_tiles=n), setup, name, opts).fits

    if fits(1):
        return dataclasses.replace(job, mlp_tiles=1)
    n = auto_mlp_tiles(job.tokens, spec.hidden_size, spec.mlp_width, job.c)
    while not fits(n) and n * 2 <= job.tokens // 1024:
        n *= 2
    return dataclasses.replace(job, mlp_tiles=n)


def activation_lever_reasons(plan: Plan) -> list[str]:
    """Where no preset fits without host offload of its states and activations are what does not fit (at least half
    the leanest such preset's peak), the activation levers (offloaded checkpointing, MLP tiles) that make it fit with
    the states on the device: said before an optimizer-offload preset is taken (`--strategy auto` prints it)."""
    plain = [s for s in plan.strategies if not offloads(s.opts)]
    if not plain or any(s.fits for s in plain):
        return []
    lean = min(plain, key=lambda s: s.memory.total)
    m = lean.memory
    if m.peak_tensors - m.params - m.grads - m.optimizer < 0.5 * m.peak_tensors:  # the states are the peak
        return []
    found = [(flags, _variant(plan, lean.strategy, dataclasses.replace(plan.job, **changes)))
             for flags, changes in activation_levers(plan.job)]
    found = [(f, v) for f, v in found if v.fits]
    if not found:
        return []
    flags, v = max(found, key=lambda f: f[1].tokens_per_s)
    return [f"activations are what does not fit: {lean.strategy} with {flags} fits ({_gib(v.memory.total / GiB)} "
            f"per rank, {v.memory.host * plan.setup.gpus_per_node / GiB:.1f} GiB of host RAM per node, "
            f"~{v.tokens_per_s:,.0f} tokens/s), keeping every state on the device: prefer it to optimizer offload"]


def activation_levers(j: Job) -> list[tuple[str, dict]]:
    """The single-device activation levers a job does not use yet, alone and together: offloaded checkpointing and
    MLP tiles (auto), each with the changes to the job."""
    out: list[tuple[str, dict]] = []
    offload = ("--activation-checkpointing offload", {"checkpointing": True, "offload_checkpoints": True,
                                                       "selective_checkpointing": False})
    tiles = ("--mlp-tiles auto", {"mlp_tiles": 0})
    if not j.offload_checkpoints:
        out.append(offload)
    if j.mlp_tiles == 1 and j.tp == 1:
        out.append(tiles)
        if not j.offload_checkpoints:
            out.append((f"{offload[0]} {tiles[0]}", {**offload[1], **tiles[1]}))
    return out


def sp_degrees(spec: ModelSpec, job: Job, world: int) -> list[int]:
    """Sequence-parallel degrees > 1 for these ranks: d x tp dividing them; under --sp-mode ulysses also the heads
    per tp rank (heads / tp; ring and auto's Ulysses x ring take any degree)."""
    return [d for d in range(2, world // job.tp + 1)
            if world % (d * job.tp) == 0 and (job.sp_mode != "ulysses" or (spec.num_heads // job.tp) % d == 0)]


def tp_sp_ok(spec: ModelSpec, job: Job, world: int, tp: int) -> bool:
    """Whether tensor parallel `tp` composes with job.sp on `world` ranks: tp x sp divides the ranks, and under
    --sp-mode ulysses the sp degree divides each tp rank's heads / tp (the engine's check, launch/preflight.py)."""
    return world % (tp * job.sp) == 0 and (job.sp == 1 or job.sp_mode != "ulysses" or (spec.num_heads // tp) % job.sp == 0)


def tp_sp_pairs(spec: ModelSpec, job: Job, setup: Setup) -> list[tuple[int, int]]:
    """(tp, sp) pairs, both > 1, these ranks and this model take together: tp a degree of the node
    (memory.tp_degrees), sp one of the ranks at that tp (sp_degrees: tp x sp divides the ranks; under --sp-mode
    ulysses sp divides the heads / tp of each tensor rank, tp_sp_ok); by tp x sp, then tp."""
    pairs = [(t, d) for t in tp_degrees(spec, setup.gpus_per_node)
             for d in sp_degrees(spec, dataclasses.replace(job, tp=t), setup.world)
             if tp_sp_ok(spec, dataclasses.replace(job, sp=d), setup.world, t)]
    return sorted(pairs, key=lambda p: (p[0] * p[1], p[0]))


def _exchange_gb(sp: StrategyPlan, kind: str) -> float:
    return round(sum(c.wire() * c.per_step for c in sp.timing.collectives if c.kind == kind) / 1e9, 4)


def sequence_parallel_rows(spec: ModelSpec, job: Job, setup: Setup, strategy: str, cfg=None) -> list[dict]:
    """`strategy` at every sequence-parallel degree this setup allows (sp_degrees): per-rank memory, fit and speed,
    so a length that does not fit shows the degree that does."""
    rows = []
    for d in [1] + sp_degrees(spec, job, setup.world):
        j = dataclasses.replace(job, sp=d)
        sp = plan_model(spec, j, setup, configured=strategy, cfg=cfg, escalate=False).for_strategy(strategy)
        rows.append({"sp": d, "mode": sp_mode_label(spec, j), "strategy": strategy,
                     "mem_gib": round(sp.memory.total / GiB, 4), "fits": sp.fits,
                     "step_time_s": round(sp.timing.step_s, 5), "tokens_per_s": round(sp.timing.tokens_per_s, 1),
                     "exchange_gb_per_step": _exchange_gb(sp, "sp")})
    return rows


def tensor_parallel_rows(spec: ModelSpec, job: Job, setup: Setup, cfg=None) -> list[dict]:
    """The fsdp presets (and single where tp x sp is every rank) at every tensor-parallel degree the node and the
    model allow (memory.tp_degrees; 1 first, for comparison). With sequence parallelism (job.sp) the degrees whose
    tp x sp divides the ranks and whose heads per tp rank the sp mode takes (tp_sp_ok); single there only where
    tp x sp is the whole world, as launch/preflight.py runs it (its gradients averaged over the sequence ranks, counted in
    its step: comm.collectives), and those rows also carry the attention exchanges (`exchange_gb_per_step`).
    None for LoRA/QLoRA or float8 (refused before launch) or where no degree divides."""
    degrees = [d for d in tp_degrees(spec, setup.gpus_per_node) if tp_sp_ok(spec, job, setup.world, d)]
    if job.tuner != "full" or job.float8 or not degrees or setup.world < 2:
        return []
    rows = []
    for d in [1] + degrees:
        sub = plan_model(spec, dataclasses.replace(job, tp=d), setup, cfg=cfg, escalate=False)
        for sp in sub.strategies:
            family = presets.SPECS[sp.base]
            if family.tp_in_data_parallel or (family.one_replica and d > 1 and d * job.sp == setup.world):
                rows.append({"tp": d, "strategy": sp.strategy, "mem_gib": round(sp.memory.total / GiB, 4),
                             "fits": sp.fits, "step_time_s": round(sp.timing.step_s, 5),
                             "tokens_per_s": round(sp.timing.tokens_per_s, 1),
                             "tp_comm_gb_per_step": _exchange_gb(sp, "tp"),
                             **({"exchange_gb_per_step": _exchange_gb(sp, "sp")} if job.sp > 1 else {})})
    return rows


# ----------------------------------------------------------------------------- sequence / tensor parallel when
# data parallelism alone does not fit (--strategy auto)

TREE_TP = "model > 70B -> Megatron / tensor parallel"
TREE_SP = "long sequences -> Ulysses / Ring"


def _fastest_simplest(fitting: list) -> StrategyPlan:
    """recommend()'s rule: the fastest, and within TIE of it the simplest."""
    fastest = max(fitting, key=lambda s: s.tokens_per_s)
    close = [s for s in fitting if s.tokens_per_s >= (1 - TIE) * fastest.tokens_per_s]
    return min(close, key=lambda s: presets.PRESETS[s.strategy].simplicity)


def _first_fit(plan: Plan, kind: str, cfg) -> tuple[tuple[int, StrategyPlan, bool] | None, tuple[int, float] | None]:
    """The smallest degree of `kind` (sp | tp) at which a preset without offload fits, the preset, and whether a
    smaller degree was tried (None when no degree fits); and the leanest degree tried with its per-rank bytes
    (what the reasons cite when none fits; None when there is no degree to try)."""
    spec, job, setup = plan.spec, plan.job, plan.setup
    if kind == "tp":
        if job.tuner != "full" or job.float8:  # TP with LoRA or float8 is refused before launch
            return None, None
        degrees = tp_degrees(spec, setup.gpus_per_node)
    else:
        degrees = sp_degrees(spec, job, setup.world)
    lean = None
    for n, d in enumerate(degrees):
        sub = plan_model(spec, dataclasses.replace(job, **{kind: d}), setup, cfg=cfg, escalate=False)
        # TP: the presets that run it inside data-parallel ranks (FSDP over those ranks, TP inside the node)
        plain = [s for s in sub.strategies if not offloads(s.opts)
                 and (kind == "sp" or presets.SPECS[s.base].tp_in_data_parallel)]
        ok = [s for s in plain if s.fits]
        if ok:
            return (d, _fastest_simplest(ok), n > 0), lean
        least = min((s.memory.total for s in plain), default=None)
        if least is not None and (lean is None or least < lean[1]):
            lean = (d, least)
    return None, lean


def _pair_fit(plan: Plan, cfg) -> tuple[int, int, StrategyPlan, bool] | None:
    """Tensor and sequence parallelism together, for when neither alone fits: the smallest tp x sp (tp_sp_pairs)
    at which an fsdp preset without offload fits (TP composes with FSDP only; full fine-tuning only, as TP), and
    among the pairs of that product the fastest, within TIE the simplest (_fastest_simplest; between pairs of one
    preset, the faster). (tp, sp, the preset, whether a smaller product was tried), or None."""
    spec, job, setup = plan.spec, plan.job, plan.setup
    if job.tuner != "full" or job.float8:
        return None
    pairs = tp_sp_pairs(spec, job, setup)
    for total in sorted({t * d for t, d in pairs}):
        fit = []
        for t, d in (p for p in pairs if p[0] * p[1] == total):
            sub = plan_model(spec, dataclasses.replace(job, tp=t, sp=d), setup, cfg=cfg, escalate=False)
            fit += [(t, d, s) for s in sub.strategies
                    if s.fits and not offloads(s.opts) and presets.SPECS[s.base].tp_in_data_parallel]
        if fit:
            fit.sort(key=lambda f: -f[2].tokens_per_s)  # equally simple: the faster first, which min() keeps
            pick = _fastest_simplest([f[2] for f in fit])
            t, d, _ = next(f for f in fit if f[2] is pick)
            return t, d, pick, total > pairs[0][0] * pairs[0][1]
    return None


def _tp_how(spec: ModelSpec, d: int) -> str:
    return (f"tensor parallel {d} splits every weight, its gathered copy and the activations over {d} ranks of a "
            f"node ({spec.num_heads // d} heads and {text.plural(spec.num_kv_heads // d, 'KV head')} per rank)")


def _tp_why(spec: ModelSpec, mem: float) -> str:
    return ("the numbers agree: the model is above 70B" if spec.total_params > 70e9 else
            f"the tree reaches tensor parallelism above 70B; this model has {text.count(spec.total_params)}"
            f" params, but data parallelism alone does not fit {mem:.1f} GiB per rank")


def _alone(kind: str, lean: tuple[int, float] | None) -> str:
    name = {"sp": "sequence", "tp": "tensor"}[kind]
    if lean is None:
        return f"no {name}-parallel degree these ranks and this model allow"
    return f"{name} parallelism alone (the leanest, {name} parallel {lean[0]}, needs {_gib(lean[1] / GiB)})"


def _explain_pair(plan: Plan, pair: tuple, head: str, leanest: dict, long_seq: bool) -> tuple:
    """choose_parallel's words for tensor x sequence parallelism together: (the job, the preset, whether a smaller
    product was tried, head, what, how, the tree's entry)."""
    job, spec, mem = plan.job, plan.spec, plan.setup.device_mem_gib
    t, d, pick, tried_smaller = pair
    j = dataclasses.replace(job, tp=t, sp=d)
    head += (f"; but neither {_alone('sp', leanest.get('sp'))} nor {_alone('tp', leanest.get('tp'))} fits, so "
             f"both together: tensor parallelism divides the weights and sequence parallelism the tokens")
    what = f"{pick.strategy} + tensor parallel {t} x sequence parallel {d} ({sp_mode_label(spec, j)})"
    how = (f"{_tp_how(spec, t)}, and sequence parallel {d} gives each rank {job.seq_len // d} of the "
           f"{job.seq_len} tokens of a sequence ({sp_mode_label(spec, j)} over each tensor rank's "
           f"{spec.num_heads // t} heads): {t} x {d} = {t * d} ranks hold one copy of the model and its sequence, "
           f"data-parallel degree {j.dp}; it adds {_exchange_gb(pick, 'tp'):.2f} GB of all-gathers and "
           f"reduce-scatters on the intra-node link and {_exchange_gb(pick, 'sp'):.2f} GB of attention "
           "exchanges per rank per step, not hidden behind compute")
    tree = {"path": f"{TREE_TP}, and {TREE_SP}", "paths": [TREE_TP, TREE_SP],
            "says": "tensor parallel + sequence parallel",
            "why": [_tp_why(spec, mem),
                    "the sequence is what does not fit" if long_seq else
                    "the sequence is not what takes most of the memory, but neither alone fits: both split it"]}
    return j, pick, tried_smaller, head, what, how, tree


def _explain_one(plan: Plan, found: tuple, kind: str, first: str, cause: str, head: str, lean: StrategyPlan,
                 long_seq: bool) -> tuple:
    """choose_parallel's words for one kind of parallelism (sp | tp; `first` the kind tried first): (the job, the
    preset, whether a smaller degree was tried, head, what, how, the tree's entry)."""
    job, spec, mem, m = plan.job, plan.spec, plan.setup.device_mem_gib, lean.memory
    d, pick, tried_smaller = found
    if kind != first:
        cause += ("; but no sequence-parallel degree fits (the states stay), so tensor parallelism, which "
                  "divides them too" if kind == "tp" else "; but no tensor-parallel degree fits, so sequence "
                                                          "parallelism")
        head = (f"data parallelism alone does not fit in {mem:.1f} GiB per rank without offload (the smallest, "
                f"{lean.strategy}, needs {_gib(m.total / GiB)}); {cause}")
    j = dataclasses.replace(job, **{kind: d})
    if kind == "tp":
        what = f"{pick.strategy} + tensor parallel {d}"
        how = (f"{_tp_how(spec, d)}; it adds {_exchange_gb(pick, 'tp'):.2f} GB of all-gathers and "
               "reduce-scatters per rank per step on the intra-node link, not hidden behind compute")
        tree = {"path": TREE_TP, "says": "tensor parallel", "why": [_tp_why(spec, mem)]}
    else:
        what = f"{pick.strategy} + sequence parallel {d} ({sp_mode_label(spec, j)})"
        how = (f"sequence parallel {d} gives each rank {job.seq_len // d} of the {job.seq_len} tokens of a "
               f"sequence; it adds {_exchange_gb(pick, 'sp'):.2f} GB of attention exchanges per rank per step")
        tree = {"path": TREE_SP, "says": "sequence parallel",
                "why": ["the numbers agree: the sequence is what does not fit" if long_seq else
                        "the numbers reach it though the sequence is not what takes most of the memory"]}
    return j, pick, tried_smaller, head, what, how, tree


def choose_parallel(plan: Plan, cfg=None) -> None:
    """When no data-parallel preset fits without offload, the smallest sequence- or tensor-parallel degree that
    does: activations at least half of the smallest preset's peak mean the sequence is what does not fit
    (sequence parallelism first, the tree's "long sequences -> Ulysses/Ring"); otherwise the model's states and
    gathered weights (tensor parallelism first: every weight, its gathered copy and the activations divide by tp;
    the tree's "> 70B -> Megatron/tensor parallel"). When neither alone fits at any degree, both together: the
    smallest tp x sp that fits (_pair_fit), TP dividing the weights inside a node and SP the sequence of each tensor
    rank. Chosen over an offload preset that fits only when faster.
    Sets plan.recommended, plan.reasons, plan.parallel and the tree's `parallel` entry."""
    job, setup = plan.job, plan.setup
    if job.tp > 1 or job.sp > 1 or setup.world < 2:
        return
    plain = [s for s in plan.strategies if not offloads(s.opts)]
    if not plain or any(s.fits for s in plain):
        return
    if getattr(cfg, "task", "sft") == "dpo":  # preflight refuses tensor and sequence parallelism with task dpo
        if not any(s.fits for s in plan.strategies):
            plan.reasons.append("task dpo is not built with tensor or sequence parallelism, so neither is tried; "
                                "--precompute-ref, --tuner lora or a smaller --micro-batch-size / --seq-len may fit")
        return
    lean = min(plain, key=lambda s: s.memory.total)
    m = lean.memory
    long_seq = m.activations >= 0.5 * m.peak_tensors
    if long_seq and job.micro_batch > 1:
        # several sequences per micro-batch: a smaller --micro-batch-size (fit advice) is the lever, not splitting
        # each sequence, which would also shrink the data-parallel degree and so the global batch
        return
    order = ("sp", "tp") if long_seq else ("tp", "sp")
    found, kind, leanest = None, order[0], {}
    for kind in order:
        found, leanest[kind] = _first_fit(plan, kind, cfg)
        if found:
            break
    mem = setup.device_mem_gib
    cause = (f"activations are {_gib(m.activations / GiB)} of its {_gib(m.peak_tensors / GiB)} peak: the sequence "
             f"({job.micro_batch} x {job.seq_len} tokens) is what does not fit" if long_seq else
             f"weights, gradients and optimizer states are {_gib((m.params + m.grads + m.optimizer) / GiB)} and "
             f"activations {_gib(m.activations / GiB)} of its {_gib(m.peak_tensors / GiB)} peak: the model is what "
             "does not fit")
    head = (f"data parallelism alone does not fit in {mem:.1f} GiB per rank without offload (the smallest, "
            f"{lean.strategy}, needs {_gib(m.total / GiB)}); {cause}")
    pair = None if found else _pair_fit(plan, cfg)
    if found is None and pair is None:
        if not any(s.fits for s in plan.strategies):  # (where an offload preset fits, recommend() said why)
            plan.reasons.append(head + ("; no sequence-parallel degree these ranks and this model allow fits "
                                        "either, and tensor parallelism is not built with float8 (drop --float8 to "
                                        "plan it)" if job.float8 else
                                        "; no sequence- or tensor-parallel degree these ranks and this model "
                                        "allow fits either, alone or together"))
        return
    if pair is not None:
        j, pick, tried_smaller, head, what, how, tree = _explain_pair(plan, pair, head, leanest, long_seq)
    else:
        j, pick, tried_smaller, head, what, how, tree = _explain_one(plan, found, kind, order[0], cause, head, lean,
                                                                     long_seq)
    offload = [s for s in plan.strategies if s.fits and offloads(s.opts)]
    if offload:
        o = max(offload, key=lambda s: s.tokens_per_s)
        if o.tokens_per_s > pick.tokens_per_s:
            plan.reasons.append(head + f"; {what} fits ({_gib(pick.memory.total / GiB)}) but {o.strategy} is faster "
                                       f"({o.tokens_per_s:,.0f} vs {pick.tokens_per_s:,.0f} tokens/s)")
            return
    smaller = ("; no smaller product fits" if pair else "; no smaller degree fits") if tried_smaller else ""
    plan.recommended = pick.strategy
    plan.reasons = [head,
                    f"{what} fits: {_gib(pick.memory.total / GiB)} of {mem:.1f} GiB per rank "
                    f"({_gib(pick.headroom_gib)} headroom; peak at {pick.memory.phase}), "
                    f"{pick.tokens_per_s:,.0f} tokens/s predicted{smaller}", how]
    if offload:
        o = max(offload, key=lambda s: s.tokens_per_s)
        plan.reasons.append(f"{o.strategy} fits too but is slower ({o.tokens_per_s:,.0f} tokens/s): offload is only "
                            "worth it when nothing else fits")
    plan.parallel = {"strategy": pick.strategy, "tensor_parallel": j.tp, "sequence_parallel": j.sp,
                     "sp_mode": j.sp_mode, "chosen": True, "mem_gib": round(pick.memory.total / GiB, 4),
                     "tokens_per_s": round(pick.tokens_per_s, 1), "step_time_s": round(pick.step_time_s, 5)}
    plan.tree = {**plan.tree, "planner": pick.strategy, "agree": plan.tree["says"] == pick.strategy,
                 "parallel": {**tree, "planner": what, "agree": True}}
