"""`shardwise plan`: per-rank memory, communication and step time for every strategy preset.

    shardwise plan --model PATH|PRESET|7B --gpus 8 --gpu-memory 80 [--nodes 2] ... [--json]
    shardwise plan CONFIG.yaml        # plan exactly what `train CONFIG.yaml` would run

The analytic path imports no torch; --simulate imports torch and transformers.
"""

from __future__ import annotations

import argparse
import json
import sys

from shardwise.errors import ShardwiseError
from shardwise.plan.calibration import value

# config keys that `plan` shares with `train` (same flag spelling and meaning)
SHARED_KEYS = ["model", "strategy", "seq_len", "micro_batch_size", "grad_accum", "tuner", "lora.r", "lora.targets", "lora.dropout",
               "mixed_precision", "param_dtype", "gradient_checkpointing", "packing", "nproc_per_node",
               "fsdp.reshard_after_forward", "fsdp.keep_gathered_one_rank", "fsdp.hybrid", "fsdp.shard_group_size",
               "fsdp.cpu_offload", "fsdp.wrap", "fsdp.prefetch", "deepspeed.stage", "deepspeed.offload_optimizer",
               "deepspeed.offload_params", "deepspeed.fetch", "compile", "fused_loss", "sequence_parallel", "tensor_parallel", "sp_mode",
               "activation_checkpointing", "mlp_tiles", "float8", "task", "loss_type", "precompute_ref"]


def add_parser(subparsers) -> None:
    from shardwise import config

    p = subparsers.add_parser(
        "plan", help="Predict per-rank memory, communication and speed of every strategy; recommend one.",
        description="Predict per-rank memory, communication and step time of every strategy preset and recommend "
                    "one. --model also takes a preset name (--list-models) or a parameter count such as 7B; "
                    "with CONFIG.yaml it plans exactly what `shardwise train CONFIG.yaml` would run and lints it.")
    p.add_argument("config", nargs="?", help="YAML config file: plan what `train CONFIG` would run.")
    p.add_argument("--gpus", metavar="N", help="GPUs per node (default: detected; on a CPU-only machine 2 ranks).")
    p.add_argument("--nodes", metavar="N", help="Number of nodes (default 1, or nnodes from the config).")
    p.add_argument("--gpu-memory", metavar="GIB", help="Memory per GPU in GiB (default: detected, else 80).")
    p.add_argument("--gpu-type", metavar="NAME", help="GPU model for peak FLOP/s and links, e.g. H100, A100 (default: detected, else H100).")
    p.add_argument("--intra-node-gbps", metavar="X", help="GPU-to-GPU bandwidth in a node, Gb/s per GPU "
                   "(default: measured by `shardwise doctor`, else NVLink for H100/H200/A100, PCIe otherwise).")
    p.add_argument("--inter-node-gbps", metavar="Y", help="Network bandwidth per node, Gb/s (default 100; 25/100/400 Ethernet/IB).")
    p.add_argument("--mfu", metavar="F", help="Model FLOPs utilisation of the forward/backward to assume (default on GPU: "
                   f"{value('compiled_mfu'):g} with compiled blocks, {value('eager_mfu'):g} eager, more for matmuls wider "
                   f"than hidden {value('eager_mfu_width'):g}; calibrated on one H200 and one H100, docs/planner.md).")
    p.add_argument("--json", action="store_true", help="Print the plan as JSON.")
    p.add_argument("--explain", action="store_true", help="Also print the article's decision tree: the path it "
                   "takes for this model and hardware, and why the planner agrees or differs (without it, one line "
                   "says whether they agree; --json always holds it).")
    p.add_argument("--simulate", action="store_true", help="Also measure per-rank memory exactly by running one step of "
                   "the real model under fake tensors and a fake process group (imports torch; slower).")
    p.add_argument("--rehearse", action="store_true", help="Also run a few real steps of rank 0 of each job that fits "
                   "(or the configured strategy's) on the local GPU through a fake process group, and show its "
                   "measured memory and compute beside the plan (a real model needs a GPU; the tiny model runs on "
                   "the CPU). Nothing is written or downloaded.")
    p.add_argument("--list-models", action="store_true", help="List the model presets and exit.")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    config.add_flags(p, only=SHARED_KEYS)
    p.set_defaults(func=run)


def _num(value, flag: str, kind=int):
    if value is None:
        return None
    try:
        v = kind(value)
    except (TypeError, ValueError):
        raise ShardwiseError(f"{flag} must be {'an integer' if kind is int else 'a number'}, got '{value}'")
    return v


def _cached_hub_model(model: str, where: str) -> str | None:
    """A hub id's snapshot in the local Hugging Face cache (as `train` reads it), else None: a preset name or the
    planner's own line for what it cannot read."""
    from shardwise.models.load import hub_snapshot

    try:
        return hub_snapshot(model, where)
    except ShardwiseError:
        return None


def build(args):
    """(plan, resolved config) for parsed arguments."""
    from shardwise import config, presets
    from shardwise.plan.decide import plan_model
    from shardwise.plan.inputs import check_counts, job_from_config, make_setup
    from shardwise.plan.lint import lint
    from shardwise.plan.model_presets import resolve_model

    flags = config.flags_from_namespace(args)
    res = config.load_config(getattr(args, "config", None), flags)
    cfg = res.cfg
    gpus = _num(getattr(args, "gpus", None), "--gpus")
    nodes = _num(getattr(args, "nodes", None), "--nodes")
    check_counts(gpus, nodes)  # before they are compared with the config below (make_setup checks them too)
    nodes = nodes or cfg.nnodes
    per_node = cfg.nproc_per_node or None
    one = presets.replica_world(cfg.strategy, cfg.tensor_parallel, cfg.sequence_parallel)
    if one is not None:  # one process, or the tp x sp ranks of one replica (as launch/preflight.py runs it)
        if (gpus or one) * nodes != one:
            raise ShardwiseError("strategy 'single' runs one process" + (
                f" per rank of one tensor_parallel {cfg.tensor_parallel} x sequence_parallel "
                f"{cfg.sequence_parallel} replica ({one} ranks); use --gpus {one} --nodes 1" if one > 1 else
                "; drop --strategy single or use --gpus 1"))
        per_node = one
    if gpus is not None and per_node is not None and gpus != per_node:
        raise ShardwiseError(f"--gpus {gpus} disagrees with nproc_per_node {per_node} "
                             f"({res.where('nproc_per_node')}); give one of them")
    setup = make_setup(None, gpus=gpus, nodes=nodes,
                       gpu_memory=_num(getattr(args, "gpu_memory", None), "--gpu-memory", float),
                       gpu_type=getattr(args, "gpu_type", None),
                       intra_gbps=_num(getattr(args, "intra_node_gbps", None), "--intra-node-gbps", float),
                       inter_gbps=_num(getattr(args, "inter_node_gbps", None), "--inter-node-gbps", float),
                       mfu=_num(getattr(args, "mfu", None), "--mfu", float),
                       ranks_per_node=per_node if gpus is None else None)
    spec = resolve_model(_cached_hub_model(cfg.model, res.where("model")) or cfg.model)
    job = job_from_config(cfg, setup)
    if job.float8 and not setup.fp8_peak_flops:
        where = setup.device_name if setup.accelerator == "cuda" else "this CPU-only plan"
        raise ShardwiseError(f"{res.where('float8')}: float8 runs on float8 tensor cores (Hopper, Ada: H100, H200, "
                             f"L40S, RTX 4090); {where} has none: drop --float8, or plan for such a GPU "
                             "(--gpu-type H100 --gpus N --gpu-memory GIB)")
    heads = spec.num_heads // job.tp  # each tp rank's, which Ulysses splits
    if job.sp > 1 and (setup.world % (job.sp * job.tp) or (job.sp_mode == "ulysses" and heads % job.sp)):
        raise ShardwiseError(f"{res.where('sequence_parallel')}: sequence_parallel {job.sp}"
                             + (f" x tensor_parallel {job.tp}" if job.tp > 1 else "") + " must divide the "
                             f"{setup.world} ranks" + (f" and the model's {spec.num_heads} attention "
                                                       "heads" + (f" / tensor_parallel {job.tp} = {heads} per tensor "
                                                                  "rank" if job.tp > 1 else "") + " (Ulysses)"
                                                       if job.sp_mode == "ulysses" else "")
                             + "; --sp-mode auto or ring takes any degree that divides the ranks"
                             * (job.sp_mode == "ulysses"))
    if job.tp > 1:
        from shardwise.plan.memory import tp_degrees

        if job.tp not in tp_degrees(spec, setup.gpus_per_node):
            ok = tp_degrees(spec, setup.gpus_per_node)
            raise ShardwiseError(f"{res.where('tensor_parallel')}: tensor_parallel {job.tp} must divide the "
                                 f"{setup.gpus_per_node} GPUs per node, the model's {spec.num_heads} attention heads, "
                                 f"{spec.num_kv_heads} KV heads and MLP width {spec.intermediate_size}; "
                                 + (f"degrees that do: {', '.join(map(str, ok))}" if ok else "no degree > 1 does"))
    configured = None
    if getattr(args, "config", None) or res.explicit("strategy"):
        configured = cfg.strategy if cfg.strategy != "auto" else None
    plan = plan_model(spec, job, setup, configured=configured, cfg=cfg)
    if setup.world > 1:
        from shardwise import presets
        from shardwise.plan.decide import sequence_parallel_rows, tensor_parallel_rows

        # under TP the sequence degrees the fsdp presets take at this tp (single runs only where tp x sp is every
        # rank: its rows at the other degrees would be runs launch refuses)
        strategy = configured or plan.recommended
        if job.tp == 1 or presets.spec_of(strategy).tp_in_data_parallel:
            plan.sp_rows = sequence_parallel_rows(spec, job, setup, strategy, cfg)
        plan.tp_rows = tensor_parallel_rows(spec, job, setup, cfg)
    plan.lint = lint(plan, res)
    return plan, res


def run(args) -> int:
    if getattr(args, "list_models", False):
        from shardwise.plan.model_presets import MODEL_PRESETS

        for name, s in MODEL_PRESETS.items():
            print(f"{name:16s} {s.total_params / 1e9:7.2f}B  {s.source}")
        print(f"{'tiny':16s}  (shardwise's demo model)  — or any local HF directory, or a count like 7B / 350M")
        return 0
    plan, res = build(args)
    sim = None
    if getattr(args, "simulate", False):
        from shardwise.plan.simulate import simulate_plan

        sim = simulate_plan(plan)
    rehearsal = None
    if getattr(args, "rehearse", False):
        from shardwise.plan.rehearse import rehearse_plan

        rehearsal = rehearse_plan(plan, res.cfg, only=plan.configured)
    if getattr(args, "json", False):
        d = plan.to_json()
        if sim is not None:
            d["simulated"] = sim
        if rehearsal is not None:
            d["rehearsed"] = rehearsal
        json.dump(d, sys.stdout, indent=2)
        print()
    else:
        print(render(plan, sim, rehearsal, explain=getattr(args, "explain", False)))
    return 0


# ----------------------------------------------------------------------------- text


def _checkpointing(plan) -> str:
    """The job's checkpointing for the job line, with its long-context levers (MLP tiles as auto resolves them)."""
    from shardwise.plan.memory import mlp_tiles

    j = plan.job
    out = ("on, inputs offloaded to host" if j.offload_checkpoints else "on") if j.checkpointing else \
        "selective" if j.selective_checkpointing else "off"
    n = mlp_tiles(plan.spec, j)
    return out + (f"; MLP in {n} tiles{' (auto)' if j.mlp_tiles == 0 else ''}" if n > 1 else "")


def _job_line(plan) -> str:
    j = plan.job
    dt = {4: "fp32"}.get(j.c, "fp16" if j.compute == "fp16" else "bf16")
    tuner = {"full": "full fine-tune", "lora": f"LoRA r={j.lora_r}", "qlora": f"QLoRA r={j.lora_r} (4-bit base)"}[j.tuner]
    return (f"{tuner}; micro-batch {j.micro_batch} x {j.seq_len} tokens, grad-accum {j.grad_accum} "
            f"(global {j.micro_batch * j.grad_accum * j.dp} sequences)"
            + (f"; sequence parallel {j.sp} ({j.seq_len // j.sp} tokens per rank)" if j.sp > 1 else "")
            + (f"; tensor parallel {j.tp}" if j.tp > 1 else "")
            + f"; compute {dt}, weights/grads/optimizer "
            f"{j.param_dtype}; checkpointing {_checkpointing(plan)}; packing {'on' if j.packing else 'off'}; "
            f"compile {'on' if j.compile else 'off'}; fused loss {'on' if j.fused_loss else 'off'}"
            + (f"; task dpo (2 rows a pair), reference {j.reference}" if j.micro_batch and j.reference != "none" else ""))


def render(plan, sim=None, rehearsal=None, explain: bool = True) -> str:
    from shardwise.plan import text
    from shardwise.plan.memory import GiB, Opts, block_activations, head_activations

    s, h = plan.spec, plan.setup
    lines = [f"model     {s.name}: {text.count(s.total_params)} params ({s.num_layers} layers, hidden {s.hidden_size}, "
             f"vocab {s.vocab_size}) — {s.source}",
             f"job       {_job_line(plan)}",
             f"hardware  {h.gpus_per_node} x {h.device_name} ({h.device_mem_gib:.1f} GiB) x {text.plural(h.nodes, 'node')} = "
             f"{text.plural(h.world, 'rank')}; intra-node {h.intra_label}"
             + (f"; inter-node {h.inter_label}" if h.nodes > 1 else "")]
    for n in h.notes:
        lines.append(f"          - {n}")
    fo = Opts("fsdp")
    per = block_activations(s, plan.job, fo)
    ck = plan.job.tokens * s.hidden_size * plan.job.c
    head = head_activations(s, plan.job, fo)
    loss = sum(v for k, v in head.items() if k.startswith(("logits", "loss_")))
    what = "fused loss head (one 4096-token chunk, no full logits)" if "loss_transient" in head else "logits + fp32 loss"
    lines.append(f"activations per block: {per / 2**20:,.1f} MiB without checkpointing"
                 f"{' (compiled)' if plan.job.compile else ''}, {ck / 2**20:,.1f} MiB with "
                 f"(block input only); {what} at the peak: {loss / GiB:.2f} GiB")
    lines.append("")
    small = max(sp.memory.total for sp in plan.strategies) < GiB  # tiny models: MiB
    unit, scale = ("MiB", 1024.0) if small else ("GiB", 1.0)
    hdr = (f"{'per rank (' + unit + ')':15s}{'params':>8s}{'grads':>8s}{'optim':>8s}{'activ':>8s}{'buffers':>8s}"
           f"{'total':>8s}  {'fits':5s}{'comm GB':>9s}{'step s':>9s}{'tokens/s':>11s}")
    lines += [hdr, "-" * len(hdr)]
    for sp in plan.strategies:
        m = {k: v * scale for k, v in sp.mem_gib.items()}
        mark = "*" if sp.strategy == plan.recommended else (">" if sp.strategy == plan.configured else " ")
        lines.append(f"{mark}{sp.strategy:14s}{m['params']:8.2f}{m['grads']:8.2f}{m['optimizer']:8.2f}"
                     f"{m['activations']:8.2f}{m['buffers']:8.2f}{m['total']:8.2f}  {'yes' if sp.fits else 'NO':5s}"
                     f"{sp.comm_gb_per_step:9.2f}{sp.step_time_s:9.3f}{sp.tokens_per_s:11,.0f}")
    lines.append("* recommended" + ("   > configured" if plan.configured and plan.configured != plan.recommended else "")
                 + "   total = peak of the step + allowance (not the sum of the columns); comm = bytes on the wire "
                   "per rank per optimizer step")
    for sp in plan.strategies:
        if sp.notes:
            lines.append(f"  {sp.strategy}: " + "; ".join(sp.notes))
    if plan.sp_rows:
        which = (f"degrees dividing the ranks and the {s.num_heads} heads" if plan.job.sp_mode == "ulysses" else
                 f"--sp-mode {plan.job.sp_mode}: degrees dividing the ranks")
        lines += ["", f"sequence parallel ({which}), {plan.sp_rows[0]['strategy']}:",
                  f"  {'SP':>3s} {'mode':18s}{'per rank ' + unit:>14s}  {'fits':5s}{'step s':>9s}{'tokens/s':>11s}"
                  f"{'exchange GB':>13s}"]
        for r in plan.sp_rows:
            mark = ">" if r["sp"] == plan.job.sp else " "
            lines.append(f"{mark} {r['sp']:>3d} {r['mode']:18s}{r['mem_gib'] * scale:14.2f}  "
                         f"{'yes' if r['fits'] else 'NO':5s}{r['step_time_s']:9.3f}{r['tokens_per_s']:11,.0f}"
                         f"{r['exchange_gb_per_step']:13.2f}")
    if plan.tp_rows:
        lines += ["", f"tensor parallel (degrees dividing the {h.gpus_per_node} GPUs per node, the {s.num_heads} heads, "
                      f"{s.num_kv_heads} KV heads and MLP width {s.intermediate_size}):",
                  f"  {'TP':>3s} {'strategy':14s}{'per rank ' + unit:>14s}  {'fits':5s}{'step s':>9s}{'tokens/s':>11s}"
                  f"{'TP comm GB':>12s}"]
        for r in plan.tp_rows:
            mark = ">" if r["tp"] == plan.job.tp and r["strategy"] == (plan.configured or plan.recommended) else " "
            lines.append(f"{mark} {r['tp']:>3d} {r['strategy']:14s}{r['mem_gib'] * scale:14.2f}  "
                         f"{'yes' if r['fits'] else 'NO':5s}{r['step_time_s']:9.3f}{r['tokens_per_s']:11,.0f}"
                         f"{r['tp_comm_gb_per_step']:12.2f}")
    if rehearsal is not None:
        from shardwise.plan.rehearse import render as rehearsal_lines

        lines += rehearsal_lines(rehearsal)
    lines += _verdict_lines(plan, sim, explain)
    return "\n".join(lines)


def _verdict_lines(plan, sim=None, explain: bool = True) -> list[str]:
    """The recommendation and its reasons, the article's tree (its paragraph with `explain`, else one line), the
    configured strategy's advice and lint, the simulation's results and the assumptions."""
    lines: list[str] = []
    par = plan.parallel
    chosen = ""
    if par.get("chosen"):
        chosen = " with" + (f" --tensor-parallel {par['tensor_parallel']}" if par["tensor_parallel"] > 1 else "") + (
            f" --sequence-parallel {par['sequence_parallel']} (--sp-mode {par['sp_mode']})"
            if par["sequence_parallel"] > 1 else "")
    lines += ["", f"recommended: {plan.recommended}{chosen}"] + [f"  - {r}" for r in plan.reasons]
    t = plan.tree
    if not explain:  # one line: the paragraph would repeat itself on every plan (--explain prints it)
        lines += ["", f"article's decision tree: says {t['says']}; planner: {t['planner']} — "
                      f"{'agree' if t['agree'] else 'differ'} (--explain: its path and why)"]
    else:
        lines += _tree_lines(t)
    return lines + _configured_lines(plan, sim)


def _tree_lines(t: dict) -> list[str]:
    lines = ["", f"article's decision tree: {t['path']} (says {t['says']}); planner: {t['planner']} — "
                  f"{'agree' if t['agree'] else 'differ'}"] + [f"  - {w}" for w in t["why"]]
    if "parallel" in t:
        tp_ = t["parallel"]
        lines += [f"  and further down: {tp_['path']} (says {tp_['says']}); planner: {tp_['planner']}"] + \
            [f"  - {w}" for w in tp_["why"]]
    lines.append(f"  (the tree comes from {t['source']})")
    return lines


def _configured_lines(plan, sim) -> list[str]:
    lines: list[str] = []
    if plan.configured:
        from shardwise.plan.decide import fit_advice

        lines += ["", f"configured: {fit_advice(plan, plan.configured)}"]
        if plan.lint:
            lines += ["lint:"] + [f"  [{f['severity']}] {f['message']}" for f in plan.lint]
        else:
            lines += ["lint: nothing to report"]
    if sim:
        lines += ["", "simulated (one step under fake tensors and a fake process group):"]
        for r in sim.get("results", []):
            lines.append(f"  {r['strategy']:12s} peak {r['peak_gib']:.3f} GiB per rank (analytic tensors "
                         f"{r['analytic_gib']:.3f} GiB, {r['diff_pct']:+.1f}%), {r['seconds']:.1f} s")
        for e in sim.get("errors", []):
            lines.append(f"  {e}")
    lines += ["", "assumptions:"] + [f"  - {a}" for a in plan.assumptions]
    return lines
