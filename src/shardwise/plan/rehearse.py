"""`plan --rehearse`: run one rank of each planned job for a few real steps and put what it measured beside the
plan.

For each strategy row that fits (or the configured one: `plan CONFIG.yaml`, `--strategy`), a subprocess
(`python -m shardwise.train.rehearse`, train/rehearse.py) becomes rank 0 of the row's world through torch's fake
process group and runs the engine's own pipeline and step on the local GPU (or, for the tiny model, the CPU).
The planner imports no process group and no torch: the request and the result travel as JSON files in a
temporary directory, removed afterwards; nothing is written to a run directory and nothing is downloaded.

What a row gets: the rank's measured peak memory (CUDA: allocated and reserved; CPU: live tensor bytes), its
compute-only step time (nothing moves over the fake group), the predicted step time (that plus the planner's
exposed communication), and the differences from the analytic plan. Where the memory differs by more than
MEMORY_TOLERANCE, the row says so and its "fits" follows the rehearsal.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile

from shardwise.errors import ShardwiseError
from shardwise.plan.memory import CUDA_CONTEXT_GIB, FRAGMENTATION, GiB

MEMORY_TOLERANCE = 0.10  # rehearsal and plan further apart than this in memory: the row says so, trusts the rehearsal
STEPS = 3  # the worker's steps: one warm-up, two measured
HOST_SHARE = 0.9  # of the RAM available now, what one rehearsed rank may plan to keep in host memory
RANK = 0  # FSDP's and tensor parallelism's dim-0 chunks (torch.chunk) give rank 0 the largest share
RANK_WHY = "rank 0: torch.chunk gives the first ranks the larger FSDP / tensor-parallel shards where they do not divide"
COMPUTE = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


def row_config(cfg, name: str, job):
    """The config a row's job trains with: the preset's options over the user's (the configured strategy keeps
    the user's own, as opts_for plans it), the plan's compute dtype and compile (which the worker turns off on a
    CPU: inductor's CPU build would time the compiler, not the step)."""
    from shardwise import presets

    c = dataclasses.replace(cfg, fsdp=dataclasses.replace(cfg.fsdp), deepspeed=dataclasses.replace(cfg.deepspeed),
                            lora=dataclasses.replace(cfg.lora))
    if c.strategy != name:
        c.strategy = name
        for key, value in presets.PRESETS[name].options.items():
            sec, attr = key.split(".", 1)
            setattr(getattr(c, sec), attr, value)
    c.mixed_precision = COMPUTE[job.compute]
    c.compile = "on" if job.compile else "off"
    c.output_dir = ""  # nothing is written: the worker has no run directory
    return c


def model_source(cfg, spec) -> dict:
    """How the worker builds the model: a local directory's own config.json, or the planner's shape."""
    if os.path.isdir(str(cfg.model)):
        return {"model_dir": os.path.abspath(cfg.model)}
    return {"hf_config": spec.to_hf_config()}


def rows_to_rehearse(plan, only: str | None) -> list:
    """The rows that fit, or the one named."""
    if only:
        return [plan.for_strategy(only)]
    return [s for s in plan.strategies if s.fits]


def worker_env(env: dict, cwd: str) -> dict:
    """The worker's environment: this process's, with PYTHONPATH's relative entries made absolute against `cwd`
    (the worker runs in its own temporary folder, where `PYTHONPATH=src` would name nothing)."""
    path = env.get("PYTHONPATH")
    if not path:
        return dict(env)
    entries = [os.path.join(cwd, p) if p and not os.path.isabs(p) else p for p in path.split(os.pathsep)]
    return {**env, "PYTHONPATH": os.pathsep.join(e for e in entries if e)}


def run_worker(request: dict, timeout_s: float | None = None) -> dict:
    """One rehearsal in a subprocess; its result (or why there is none)."""
    with tempfile.TemporaryDirectory(prefix="shardwise-rehearse-") as tmp:
        req, out = os.path.join(tmp, "request.json"), os.path.join(tmp, "result.json")
        with open(req, "w") as fh:
            json.dump(request, fh)
        try:
            proc = subprocess.run([sys.executable, "-m", "shardwise.train.rehearse", req, out], cwd=tmp,
                                  env=worker_env(dict(os.environ), os.getcwd()), capture_output=True, text=True,
                                  timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"ok": False, "oom": False, "error": f"did not finish within {timeout_s:.0f} s"}
        if not os.path.exists(out):
            tail = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1][:300]
            return {"ok": False, "oom": False,
                    "error": f"the worker ended without a result (exit code {proc.returncode}: {tail})"}
        with open(out) as fh:
            return json.load(fh)


def compare(sp, result: dict, accelerator: str, mem, same_device: bool) -> dict:
    """The rehearsal beside the row's analytic numbers (`mem`: the plan's memory of the job as rehearsed; the
    step times are compared only where the rehearsal ran on the planned device, `same_device`)."""
    t = sp.timing
    tensors = result["peak_allocated_bytes"]
    if accelerator == "cuda":  # the allocator's reserved peak holds its fragmentation; the context is outside it
        need = result["peak_reserved_bytes"] + CUDA_CONTEXT_GIB * GiB
        analytic, measured, what = mem.total, need, "reserved + CUDA context"
    else:  # live tensor bytes only: compared with the analytic tensor peak; the allowance added for "fits"
        need = tensors + (mem.allowance and CUDA_CONTEXT_GIB * GiB + FRAGMENTATION * tensors)
        analytic, measured, what = mem.peak_tensors, tensors, "live tensor bytes"
    mem_diff = (analytic - measured) / max(measured, 1)
    predicted = result["step_s"] + t.exposed_comm_s
    out = {"strategy": sp.strategy, "ok": True, "rank": result["rank"], "rank_why": RANK_WHY,
           "world": result["world"], "dims": result["dims"], "device": result["device"], "memory_kind": what,
           "peak_allocated_gib": tensors / GiB,
           "peak_reserved_gib": (result["peak_reserved_bytes"] / GiB if result["peak_reserved_bytes"] is not None
                                 else None),
           "analytic_tensors_gib": mem.peak_tensors / GiB, "analytic_total_gib": mem.total / GiB,
           "need_gib": need / GiB, "memory_diff_pct": 100 * mem_diff,
           "compute_s": result["step_s"], "first_step_s": result["first_step_s"],
           "analytic_compute_s": t.compute_s, "comm_s": t.exposed_comm_s, "predicted_step_s": predicted,
           "analytic_step_s": t.step_s,
           "step_diff_pct": 100 * (t.step_s - predicted) / max(predicted, 1e-9) if same_device else None,
           "describe": result.get("describe", ""), "applied": result.get("applied", [])}
    out["disagrees"] = abs(mem_diff) > MEMORY_TOLERANCE
    out["fits"] = need / GiB <= sp.device_mem_gib
    return out


def refused(sp, result: dict) -> dict:
    row = {"strategy": sp.strategy, "ok": False, "analytic_total_gib": sp.memory.total / GiB}
    if result.get("oom"):
        dev = f"{result.get('device')} ({result['device_gib']:.1f} GiB)" if result.get("device_gib") else "the device"
        row["error"] = (f"one rank does not fit the local GPU {dev}: out of memory; the plan predicts "
                        f"{sp.memory.total / GiB:.1f} GiB per rank")
        row["oom"] = True
    else:
        row["error"] = f"not rehearsed: {result.get('error', 'no result')}"
    return row


def host_refused(sp, free_gib: float) -> dict | None:
    """A row whose one rank keeps more in host RAM (offloaded states, offloaded checkpoints: the plan's per-rank host
    bytes) than this machine has free is not run: it would take the machine's memory, not measure the job."""
    host = sp.memory.host / GiB
    if not free_gib or host <= HOST_SHARE * free_gib:  # 0: the machine's RAM is unknown, so nothing is refused
        return None
    return {"strategy": sp.strategy, "ok": False, "analytic_total_gib": sp.memory.total / GiB, "host": True,
            "error": f"not rehearsed: one rank keeps {host:.1f} GiB in host RAM by the plan, over "
                     f"{HOST_SHARE:.0%} of the {free_gib:.1f} GiB this machine has available; rehearse it on a "
                     "host with more RAM"}


NO_GPU = ("--rehearse: this machine has no GPU, and one rank of {model} runs on a GPU; rehearse on a machine with one "
          "(the tiny model, --model tiny, rehearses on the CPU)")


def rehearse_plan(plan, cfg, only: str | None = None, steps: int = STEPS, timeout_s: float | None = None) -> dict:
    """Rehearse the plan's rows; trust the rehearsal for "fits" where it disagrees with the plan in memory. The
    worker says what it ran on (torch's view of the machine); a real model on a machine without a GPU is refused
    by the first row's worker."""
    from shardwise.hardware import host_available_gib
    from shardwise.plan.memory import estimate

    results, where = [], {"accelerator": "cpu", "device": "cpu", "device_gib": 0.0}
    source = model_source(cfg, plan.spec)
    eager_job = dataclasses.replace(plan.job, compile=False)
    for sp in rows_to_rehearse(plan, only):
        too_big = host_refused(sp, host_available_gib())
        if too_big:
            results.append(too_big)
            continue
        request = {"config": dataclasses.asdict(row_config(cfg, sp.strategy, plan.job)),
                   "world": plan.setup.world, "gpus_per_node": plan.setup.gpus_per_node, "rank": RANK,
                   "steps": steps, "needs_gpu": plan.spec.name != "tiny", **source}
        result = run_worker(request, timeout_s)
        if result.get("no_gpu"):
            raise ShardwiseError(NO_GPU.format(model=plan.spec.name))
        if "accelerator" in result:
            where = {k: result[k] for k in where}
        cuda = where["accelerator"] == "cuda"
        # on the CPU the blocks run eager: compared with the eager plan of the same job
        mem = sp.memory if cuda or not plan.job.compile else estimate(plan.spec, eager_job, sp.opts)
        row = (compare(sp, result, where["accelerator"], mem, same_device(plan, where)) if result.get("ok")
               else refused(sp, result))
        if row["ok"] and row["disagrees"] and row["fits"] != sp.fits:
            sp.notes.append(f"fits by the rehearsal ({row['need_gib']:.2f} GiB measured against "
                            f"{sp.memory.total / GiB:.2f} GiB planned)")
            sp.fits = row["fits"]
        results.append(row)
    if any(r.get("ok") and r["disagrees"] for r in results):
        from shardwise.plan.decide import recommend

        plan.recommended, plan.reasons = recommend(plan)
    if all(r.get("host") for r in results):  # no worker ran: nothing measured says what this machine is
        where["device"] = "this machine (no row ran)"
    cuda = where["accelerator"] == "cuda"
    return {**where, "steps": steps, "rows": results, "same_device": same_device(plan, where),
            "eager": not cuda and plan.job.compile,
            "note": "one rank of each job through torch's fake process group: the engine's own wrapping, buffers "
                    "and activations, no communication; predicted step = measured compute + the planner's exposed "
                    "communication" + ("" if cuda else "; on the CPU the blocks run eager and memory is live "
                                                        "tensor bytes")}


def same_device(plan, where: dict) -> bool:
    """Whether the rehearsal ran on the planned device (a CPU plan on the CPU, or the planned GPU model)."""
    if where["accelerator"] != plan.setup.accelerator:
        return False
    return where["accelerator"] == "cpu" or plan.setup.device_name.lower() in where["device"].lower()


def render(rehearsal: dict) -> list[str]:
    """The rehearsal's lines under the plan."""
    where = rehearsal["device"] + (f" ({rehearsal['device_gib']:.0f} GiB)" if rehearsal["device_gib"] else "")
    lines = ["", f"rehearsed on {where}, {rehearsal['steps']} steps of one rank each "
                 "(torch's fake process group: real wrapping and activations, no communication):"]
    rows = rehearsal["rows"]
    small = all(r.get("analytic_total_gib", 1) < 1 for r in rows)
    unit, scale = ("MiB", 1024.0) if small else ("GiB", 1.0)
    lines.append(f"  {'strategy':14s}{'measured ' + unit:>14s}{'plan ' + unit:>11s}{'diff':>8s}  {'fits':5s}"
                 f"{'compute s':>10s}{'+ comm s':>10s}{'= step s':>10s}{'plan s':>9s}{'diff':>8s}")
    for r in rows:
        if not r["ok"]:
            lines.append(f"  {r['strategy']:14s}{r['error']}")
            continue
        measured = r["need_gib"] if rehearsal["accelerator"] == "cuda" else r["peak_allocated_gib"]
        plan_mem = r["analytic_total_gib"] if rehearsal["accelerator"] == "cuda" else r["analytic_tensors_gib"]
        lines.append(f"  {r['strategy']:14s}{measured * scale:14.2f}{plan_mem * scale:11.2f}"
                     f"{r['memory_diff_pct']:+7.0f}%  {'yes' if r['fits'] else 'NO':5s}{r['compute_s']:10.3f}"
                     f"{r['comm_s']:10.3f}{r['predicted_step_s']:10.3f}{r['analytic_step_s']:9.3f}"
                     + (f"{r['step_diff_pct']:+7.0f}%" if r["step_diff_pct"] is not None else f"{'-':>8s}"))
    for r in rows:
        if r["ok"] and r["disagrees"]:
            lines.append(f"  {r['strategy']}: rehearsal and plan disagree by {r['memory_diff_pct']:+.0f}% in memory "
                         f"(more than {MEMORY_TOLERANCE:.0%}); fits is the rehearsal's: "
                         f"{'yes' if r['fits'] else 'NO'}")
    ok = [r for r in rows if r["ok"]]
    if ok:
        lines.append(f"  {ok[0]['rank_why']}; memory: "
                     + ("peak reserved + CUDA context against the plan's total" if rehearsal["accelerator"] == "cuda"
                        else "peak live tensor bytes against the plan's tensor peak (no allocator on the CPU)")
                     + "; diff = (plan - measured) / measured"
                     + ("" if rehearsal["same_device"] else "; step times: not the planned device, so not compared")
                     + ("; the plan's memory here is its eager one (the CPU runs the blocks eager)"
                        if rehearsal["eager"] else ""))
    return lines
