"""What each candidate speed lever buys on one GPU, measured in one process through the engine's path.

A variant is a strategy preset plus optional levers; each builds what `shardwise train` builds
(`train.loop.build_model`: the fused loss head; the registry's
strategy and its `setup`) and runs `train.loop.forward_backward_step` + a step, as plan_accuracy.py does:

    single, fsdp, fsdp-grad-op, ddp ...   the preset as the engine runs it now
    +bf16reduce     FSDP's MixedPrecisionPolicy without reduce_dtype: gradients reduced (on one rank:
                    copied) in the compute dtype, then kept in fp32
    (+nosync, the fused AdamW's `found_inf` with no host sync, was a lever of run a at 757fe6f; it is
    the engine's step since e45764c. Runs a and b read no flags; since 9b86ecf every variant reads the
    previous step's flag where loop.run does, a pinned copy behind an event.)
    +sync           the engine's step before that: the non-finite check reads the norm on the host every step
    +reshard        fsdp on one rank resharding after forward, as before FSDPStrategy.keeps_gathered
    +noprefetch     fsdp.prefetch off (FSDP2's implicit prefetching only)
    +sac            activation_checkpointing selective (op-level: matmul and attention outputs kept)
    +fullac         activation_checkpointing full (every block recomputed in backward)
    +float8         float8 true (torchao's float8 linears in the blocks; refused, and recorded so, off Hopper/Ada)
    +module         deepspeed.fetch module (ZeRO-3: DeepSpeed's own per-submodule fetch hooks, not whole blocks)

A variant the engine refuses (a ShardwiseError: float8 on the CPU, say) or that fails (out of memory) is
recorded with its one-line reason and the others go on.

--curve A,B runs the loss-curve comparison after the timed variants: each variant --curve-steps optimizer steps
on the same learnable synthetic batches (a fixed random successor table over the vocabulary, followed with
probability 0.75; the rest uniform), the same seed and the same learning-rate schedule (--curve-lr after a
linear warm-up of 20 steps), micro-batch --curve-micro-batch x --seq-len; every step's loss goes to --curve-json
with the mean and largest gap between the curves over the last 50 steps.

Variants run in the order given, --repeat times round-robin (A B C A B C: drift hits all alike); each
run warms up (--warmup steps, compiling) and then times --steps steps with CUDA events. Reported per
run: tokens/s, MFU (6N + 12·L·H·T per token against 989 TF/s, as the engine logs it), peak memory of
the timed steps; per variant the median over repeats. --profile NAME,... also writes the top CUDA
kernels of two profiled steps of those variants, and the GPU's busy fraction (kernel time / wall).

    python benchmarks/one_gpu_levers.py --variants single+sync,single,fsdp+sync+reshard,fsdp --json OUT.json
    python benchmarks/one_gpu_levers.py --device cpu --model cpu-b --variants single+sync,fsdp --steps 2 --warmup 1

    python benchmarks/one_gpu_levers.py --variants single,single+float8,single+sac --curve single,single+float8 \
        --curve-steps 300 --json OUT.json --curve-json CURVE.json

`--device cpu` runs the same code at a tiny size on the CPU (a smoke test; speeds mean nothing there).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import plan_accuracy as pa  # noqa: E402  (the engine-path helpers: config, random-init loader, batch)

LEVERS = ("bf16reduce", "sync", "reshard", "noprefetch", "sac", "fullac", "float8", "module")


def parse(variant: str) -> tuple[str, set[str]]:
    preset, *levers = variant.split("+")
    bad = set(levers) - set(LEVERS)
    if bad:
        raise SystemExit(f"--variants: unknown lever(s) {sorted(bad)} in {variant!r}; known: {', '.join(LEVERS)}")
    return preset, set(levers)


def sync_step(strategy, model, optimizer):
    """The step as it was: clip, read the norm on the host, step or skip."""
    import torch

    norm = strategy.clip_grad_norm(model, optimizer)
    if bool(torch.isfinite(norm)):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def run_variant(variant: str, a, env, repeat: int = 0) -> dict:
    """One variant, built and timed; a refusal or failure is returned as {"variant", "refused" or "error"}."""
    from shardwise.errors import ShardwiseError

    try:
        return _run_variant(variant, a, env, repeat)
    except ShardwiseError as e:
        return {"variant": variant, "refused": str(e)}
    except Exception as e:  # noqa: BLE001  (an OOM or a library error: record it, run the other variants)
        return {"variant": variant, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}


def variant_config(variant: str, a, micro_batch: int):
    preset, levers = parse(variant)
    c = pa.case(a.model, preset, micro_batch, a.seq_len, a.ckpt, "bf16", 1, a.device == "cuda" and not a.eager, True)
    cfg = pa.config_for(c, 1)
    if "noprefetch" in levers:
        cfg.fsdp.prefetch = False
    if "sac" in levers:
        cfg.activation_checkpointing = "selective"
    if "fullac" in levers:
        cfg.activation_checkpointing = "full"
    if "float8" in levers:
        cfg.float8 = True
    if "module" in levers:
        cfg.deepspeed.fetch = "module"
    return c, cfg, levers


def planned_peak_gib(c: dict, cfg, accelerator: str) -> float:
    """The planner's peak tensor memory for this variant (its checkpointing mode included)."""
    from shardwise.plan.decide import opts_for
    from shardwise.plan.memory import estimate

    m = estimate(pa.spec_for(c["model"]), _job(c, cfg, accelerator), opts_for(c["strategy"], cfg))
    return round(m.peak_tensors / 2**30, 2)


def _job(c: dict, cfg, accelerator: str):
    from shardwise.config import checkpointing_mode
    from shardwise.plan.memory import Job

    mode = checkpointing_mode(cfg)
    return Job(world=1, micro_batch=cfg.micro_batch_size, seq_len=cfg.seq_len, grad_accum=cfg.grad_accum,
               compute=c["compute"], param_dtype=cfg.param_dtype, checkpointing=mode == "full",
               selective_checkpointing=mode == "selective", accelerator=accelerator, fused_loss=cfg.fused_loss,
               compile=c["compile"], float8=bool(cfg.float8))


def _run_variant(variant: str, a, env, repeat: int = 0) -> dict:
    import torch

    from shardwise import strategies
    from shardwise.strategies.fsdp import FSDPStrategy
    from shardwise.train import dist as sdist
    from shardwise.train import loop
    from shardwise.train.faults import Faults
    from shardwise.train.metrics import flops_per_token

    c, cfg, levers = variant_config(variant, a, a.micro_batch_size)
    orig_policy, orig_keep = FSDPStrategy.mp_policy, FSDPStrategy.keeps_gathered
    if "reshard" in levers:
        FSDPStrategy.keeps_gathered = lambda self: False
    if "bf16reduce" in levers:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        FSDPStrategy.mp_policy = lambda self: MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=None)
    cuda = env.device.type == "cuda"
    out = {"variant": variant, "pred_peak_gib": planned_peak_gib(c, cfg, env.device.type)}
    try:
        with pa.random_init_loader(c, env.device):
            torch.manual_seed(cfg.seed)
            model = loop.build_model(cfg, "random-init")
        n_params = sum(p.numel() for p in model.parameters())
        head = model.get_output_embeddings()
        fused_head = head if getattr(head, "loss_targets", "absent") is None else None
        sdist.ensure_same_weights(model, env)
        strategy = strategies.get(cfg.strategy)(cfg, env)
        model, optimizer = strategy.setup(model)
        batch = pa.make_batch(c, 1, 0, pa.vocab_of(a.model))
        faults = Faults(0)
        model.train()

        def one(step):
            for g in optimizer.param_groups:
                g["lr"] = 1e-5
            loss = loop.forward_backward_step(model, strategy, batch, 1, env.device, faults, step + 1, fused_head)
            strategy.take_nonfinite()  # the previous step's flag, read where loop.run reads it
            if "sync" in levers:
                sync_step(strategy, model, optimizer)
            else:
                strategy.step(model, optimizer)
            return loss

        t0 = time.time()
        for s in range(a.warmup):
            float(one(s))
        out["warmup_s"] = round(time.time() - t0, 1)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ev0.record()
        t0 = time.time()
        for s in range(a.steps):
            loss = one(a.warmup + s)
        if cuda:
            ev1.record()
            torch.cuda.synchronize()
            elapsed = ev0.elapsed_time(ev1) / 1e3
            out["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        else:
            elapsed = time.time() - t0
        out["loss"] = float(loss)
        tokens = a.micro_batch_size * a.seq_len * a.steps
        out["step_s"] = round(elapsed / a.steps, 4)
        out["tokens_per_s"] = round(tokens / elapsed)
        spec = pa.spec_for(a.model)
        L, H = spec.num_layers, spec.hidden_size
        out["mfu"] = round(flops_per_token(n_params, L, H, a.seq_len) * tokens / elapsed / 989e12, 4)
        if cuda and repeat == 0 and variant in a.profile.split(","):
            out["profile"] = profile(one, a.warmup + a.steps)
        model = optimizer = strategy = batch = head = fused_head = None  # free them before cleanup (one() holds them)
    finally:
        FSDPStrategy.mp_policy, FSDPStrategy.keeps_gathered = orig_policy, orig_keep
        pa.cleanup(cuda)
    return out


def profile(one, step0: int) -> dict:
    """Two profiled steps: the top CUDA kernels by total time and the GPU's busy fraction."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    torch.cuda.synchronize()
    t0 = time.time()
    with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for s in range(2):
            one(step0 + s)
        torch.cuda.synchronize()
    wall = time.time() - t0
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = merged_us([(k.time_range.start, k.time_range.end) for k in kernels])
    span = (max(k.time_range.end for k in kernels) - min(k.time_range.start for k in kernels)) if kernels else 0
    averages = prof.key_averages()
    table = averages.table(sort_by="device_time_total", row_limit=25, max_name_column_width=70)
    host = averages.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=70)
    return {"wall_s": round(wall, 3), "kernel_span_ms": round(span / 1e3, 1), "busy_ms": round(busy / 1e3, 1),
            "busy_fraction_of_span": round(busy / span, 4) if span else None, "top": table, "top_host": host}


def merged_us(ranges) -> float:
    total, end = 0.0, None
    for s, e in sorted(ranges):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default="single,ddp,fsdp")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--model", default="llama-1.1B", choices=sorted(pa.MODELS) + sorted(pa.PRESET_MODELS))
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--ckpt", action="store_true", help="gradient checkpointing on")
    ap.add_argument("--eager", action="store_true", help="no torch.compile (on by default on CUDA, as the engine)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--profile", default="", help="comma-separated variants to profile (two steps after timing, first repeat)")
    ap.add_argument("--json")
    ap.add_argument("--curve", default="", help="comma-separated variants for the loss-curve comparison (first = reference)")
    ap.add_argument("--curve-steps", type=int, default=300)
    ap.add_argument("--curve-micro-batch", type=int, default=4)
    ap.add_argument("--curve-lr", type=float, default=3e-4)
    ap.add_argument("--curve-json")
    a = ap.parse_args()
    for v in [*a.variants.split(","), *a.curve.split(",")]:
        if v:
            parse(v)
    import torch

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    from common import free_port

    os.environ.setdefault("MASTER_PORT", str(free_port()))
    if a.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    from shardwise.train import dist as sdist

    env = sdist.init_distributed(600.0)
    pa.quiet()
    import transformers

    meta = {"torch": torch.__version__, "transformers": transformers.__version__,
            "device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu",
            "date": time.strftime("%Y-%m-%d %H:%M"), "model": a.model, "micro_batch": a.micro_batch_size,
            "seq_len": a.seq_len, "ckpt": a.ckpt, "compile": a.device == "cuda" and not a.eager,
            "steps": a.steps, "warmup": a.warmup}
    try:
        import torchao

        meta["torchao"] = torchao.__version__
    except Exception:  # noqa: BLE001  (absent, or it failed to import: float8 variants say why)
        meta["torchao"] = None
    runs = []
    variants = [v for v in a.variants.split(",") if v]
    for r in range(a.repeat):
        for v in variants:
            res = run_variant(v, a, env, r)
            res["repeat"] = r
            runs.append(res)
            if "tokens_per_s" in res:
                print(f"[{r}] {v}: {res['tokens_per_s']:,} tok/s, MFU {100 * res['mfu']:.1f}%, "
                      f"{res.get('peak_gib', '-')} GiB, step {res['step_s']} s (warmup {res['warmup_s']} s)", flush=True)
            else:
                print(f"[{r}] {v}: {'refused' if 'refused' in res else 'failed'}: {res.get('refused') or res['error']}",
                      flush=True)
            if a.json:
                pa.write_json(a.json, {"meta": meta, "runs": runs})
    if variants:
        print(table(runs, variants, a.repeat))
    for x in runs:
        if "profile" in x:
            p = x["profile"]
            print(f"\n## profile {x['variant']} (repeat {x['repeat']}): kernels busy {p['busy_ms']} ms of a "
                  f"{p['kernel_span_ms']} ms span ({p['busy_fraction_of_span']}), wall {p['wall_s']} s\n{p['top']}\n"
                  f"host (by self CPU time):\n{p.get('top_host', '')}")
    if a.curve:
        curves = loss_curves(a, env, meta)
        if a.curve_json:
            pa.write_json(a.curve_json, curves)
        print(curve_summary_text(curves))


def table(runs: list[dict], variants: list[str], repeat: int) -> str:
    """Markdown: per variant the median tokens/s over the repeats, against the first variant."""
    lines = [f"\n| variant | tokens/s (median of {repeat}) | vs first | MFU (bf16 peak) | peak GiB | planned GiB |",
             "|---|---|---|---|---|---|"]
    base = None
    for v in variants:
        rs = [x for x in runs if x["variant"] == v and "tokens_per_s" in x]
        if not rs:
            why = next((x.get("refused") or x.get("error") for x in runs if x["variant"] == v), "")
            lines.append(f"| {v} | — | — | — | — | {why} |")
            continue
        tps = statistics.median(x["tokens_per_s"] for x in rs)
        base = base or tps
        lines.append(f"| {v} | {tps:,.0f} | {100 * (tps / base - 1):+.1f}% | "
                     f"{100 * statistics.median(x['mfu'] for x in rs):.1f}% | {max((x.get('peak_gib') or 0) for x in rs)} "
                     f"| {rs[0].get('pred_peak_gib', '—')} |")
    return "\n".join(lines)


def curve_batches(steps: int, micro_batch: int, seq_len: int, vocab: int, seed: int = 0):
    """The same learnable batches for every curve: a fixed random successor for each token, followed with
    probability 0.75, otherwise a uniform token; targets are the next tokens."""
    import torch

    from shardwise.data.batches import MicroBatch, StepBatch

    g = torch.Generator().manual_seed(seed)
    succ = torch.randperm(vocab, generator=g)
    rows = steps * micro_batch  # every step's rows at once: one pass over the positions
    ids = torch.empty(rows, seq_len + 1, dtype=torch.int64)
    ids[:, 0] = torch.randint(0, vocab, (rows,), generator=g)
    follow = torch.rand(rows, seq_len, generator=g) < 0.75
    noise = torch.randint(0, vocab, (rows, seq_len), generator=g)
    for t in range(seq_len):
        ids[:, t + 1] = torch.where(follow[:, t], succ[ids[:, t]], noise[:, t])
    n = micro_batch * seq_len
    pos = torch.arange(seq_len, dtype=torch.int64).repeat(micro_batch, 1)
    out = []
    for s in range(steps):
        part = ids[s * micro_batch:(s + 1) * micro_batch]
        out.append(StepBatch([MicroBatch(part[:, :-1].contiguous(), part[:, 1:].contiguous(), pos)], n, n,
                             list(range(micro_batch))))
    return out


def loss_curves(a, env, meta: dict) -> dict:
    """Each --curve variant trained --curve-steps steps on curve_batches (same data, seed and schedule)."""
    variants = [v for v in a.curve.split(",") if v]
    t0 = time.time()
    batches = curve_batches(a.curve_steps, a.curve_micro_batch, a.seq_len, pa.vocab_of(a.model))
    out = {"meta": {**meta, "curve_steps": a.curve_steps, "curve_micro_batch": a.curve_micro_batch,
                    "curve_lr": a.curve_lr, "curve_warmup": CURVE_WARMUP, "data_s": round(time.time() - t0, 1)},
           "curves": {}}
    for v in variants:
        out["curves"][v] = run_curve(v, a, env, batches)
        res = out["curves"][v]
        print(f"curve {v}: " + (f"loss {res['loss'][0]:.3f} -> {res['loss'][-1]:.3f}, {res['tokens_per_s']:,} tok/s"
                                if "loss" in res else res.get("refused") or res.get("error")), flush=True)
        if a.curve_json:
            pa.write_json(a.curve_json, out)
    done = [v for v in variants if "loss" in out["curves"][v]]
    if len(done) >= 2:
        ref, other = out["curves"][done[0]]["loss"], out["curves"][done[1]]["loss"]
        tail = range(max(0, len(ref) - 50), len(ref))
        out["compare"] = {"reference": done[0], "other": done[1],
                          "mean_last50": [statistics.fmean(ref[i] for i in tail), statistics.fmean(other[i] for i in tail)],
                          "mean_abs_gap_last50": statistics.fmean(abs(ref[i] - other[i]) for i in tail),
                          "max_abs_gap_last50": max(abs(ref[i] - other[i]) for i in tail),
                          "max_abs_gap_all": max(abs(x - y) for x, y in zip(ref, other))}
    return out


CURVE_WARMUP = 20


def run_curve(variant: str, a, env, batches) -> dict:
    from shardwise.errors import ShardwiseError

    try:
        return _run_curve(variant, a, env, batches)
    except ShardwiseError as e:
        return {"refused": str(e)}
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}


def _run_curve(variant: str, a, env, batches) -> dict:
    import torch

    from shardwise import strategies
    from shardwise.train import dist as sdist
    from shardwise.train import loop
    from shardwise.train.faults import Faults

    c, cfg, _ = variant_config(variant, a, a.curve_micro_batch)
    cuda = env.device.type == "cuda"
    try:
        with pa.random_init_loader(c, env.device):
            torch.manual_seed(cfg.seed)
            model = loop.build_model(cfg, "random-init")
        head = model.get_output_embeddings()
        fused_head = head if getattr(head, "loss_targets", "absent") is None else None
        sdist.ensure_same_weights(model, env)
        strategy = strategies.get(cfg.strategy)(cfg, env)
        model, optimizer = strategy.setup(model)
        model.train()
        faults = Faults(0)
        losses = []
        t0 = time.time()
        for step, batch in enumerate(batches):
            for g in optimizer.param_groups:
                g["lr"] = a.curve_lr * min(1.0, (step + 1) / CURVE_WARMUP)
            loss = loop.forward_backward_step(model, strategy, batch, 1, env.device, faults, step + 1, fused_head)
            strategy.take_nonfinite()
            strategy.step(model, optimizer)
            losses.append(float(loss))  # one host sync a step: the curve, not the speed, is the point here
        wall = time.time() - t0
        tokens = sum(b.tokens for b in batches)
        model = optimizer = strategy = head = fused_head = None
        return {"loss": [round(x, 5) for x in losses], "wall_s": round(wall, 1), "tokens_per_s": round(tokens / wall)}
    finally:
        pa.cleanup(cuda)


def curve_summary_text(curves: dict) -> str:
    cmp = curves.get("compare")
    if not cmp:
        return "loss curves: fewer than two ran; nothing to compare"
    return (f"loss curves, last 50 of {curves['meta']['curve_steps']} steps: {cmp['reference']} "
            f"{cmp['mean_last50'][0]:.4f}, {cmp['other']} {cmp['mean_last50'][1]:.4f} (mean |gap| "
            f"{cmp['mean_abs_gap_last50']:.4f}, max {cmp['max_abs_gap_last50']:.4f}; whole run max {cmp['max_abs_gap_all']:.4f})")


if __name__ == "__main__":
    main()
