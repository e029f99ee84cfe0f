"""Predicted vs measured peak memory per rank, through the engine's own code path.

Every case builds what `shardwise train` builds and runs what its loop runs:

* the model: `train.loop.build_model(cfg, ...)` (storage dtype, adapters, the fused loss
  head), with its `load_model` swapped for a
  random init from a Llama config (`AutoModelForCausalLM.from_config`, SDPA) instead of
  a safetensors directory: nothing is written to disk;
* `train.dist.init_distributed` and `ensure_same_weights`, then the strategy from the
  registry (`shardwise.strategies.get(preset)(cfg, env)`) and `strategy.setup(model)` (its
  parallelize pipeline: gradient checkpointing, torch.compile of the blocks, the wrapping),
  the Config built by `config.load_config` (preset options under the case's flags);
* two (or --steps) optimizer steps of `train.loop.forward_backward_step` (per micro-batch: `strategy.sync`,
  `strategy.autocast`, the loop's loss: the fused chunked head when on, else `loss_sum`,
  `strategy.backward`) and `strategy.step` (clip, step, zero_grad). The batch is a
  `StepBatch` of random tokens at full length (no padding), as the sampler makes it.

This harness calls `forward_backward_step` and `strategy.step` the way the loop's
`Trainer.train_step` does and skips only data loading, logging and
checkpointing, which hold no tensors at the peak.

Measured: the largest peak of the steps after the first (the steady state; each step's own peak is
kept in the row as `step_peaks`). On the CPU each rank counts its
live tensor storages with `shardwise.plan.simulate.LiveBytes` (a TorchDispatchMode,
entered before the model is built so that DDP's buckets and DeepSpeed's flat buffers,
which are allocated through the dispatcher, are counted); the table shows the larger
rank. Each CPU row also records how many bytes of live tensors `gc` finds that the
tracker did not see (`untracked_end`: tensors allocated outside the dispatcher's view).
On CUDA: `torch.cuda.max_memory_allocated` (LiveBytes is not used there: it slows the
step and would trace into torch.compile). Predicted: the planner's tensor peak
(`plan.memory.estimate(...).peak_tensors`, before the CUDA context / fragmentation
allowance).

    python benchmarks/plan_accuracy.py [--quick] [--json OUT.json]        # CPU, 2 gloo ranks
    python benchmarks/plan_accuracy.py --gpu --json OUT.json [--gpu-quick] [--budget-s 270]
    python benchmarks/plan_accuracy.py --gpu --device cpu --json OUT.json   # the GPU list, tiny, on CPU
    python benchmarks/plan_accuracy.py --gpu --dry-run                      # list the GPU cases
    python benchmarks/plan_accuracy.py --table OUT.json                     # re-print with today's planner
    PYTHONPATH=src python -m shardwise.plan.calibration docs/planner.md     # the page's tables (accuracy_blocks)

`--gpu` runs in this process as one rank (a one-rank NCCL group, as torchrun would give
it) on cuda:0, one case after another, freeing memory between cases; an OOM or error is
recorded in the row and the run goes on; rows are written to --json after every case,
so a run that is cut short keeps what it finished. It stops starting cases after
--budget-s seconds. `--device cpu` runs the same case list with tiny shapes on the CPU
(a smoke test of the GPU path: same strategies, compile/fused/checkpointing flags).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "..", "src")
if SRC not in sys.path:
    sys.path.insert(0, SRC)

MODELS = {  # name: (vocab, hidden, intermediate, layers, heads, kv heads)
    # CPU table
    "tiny-0.9M": (512, 128, 352, 4, 4, 2),
    "s-5M": (4096, 256, 704, 4, 4, 2),
    "m-27M": (8192, 512, 1408, 8, 8, 4),
    # H200 table
    "llama-0.3B": (32000, 1024, 4096, 16, 16, 8),
    "llama-1.1B": (32000, 2048, 8192, 16, 16, 8),  # the anchor of docs/planner.md's H200 table
    "llama-3B": (32000, 3072, 8192, 28, 24, 8),  # Llama-3.2-3B's shape, 32k vocab, untied
    # --gpu --device cpu: the GPU list shrunk (same strategies and flags, CPU-sized)
    "cpu-a": (512, 128, 352, 4, 4, 2),
    "cpu-b": (1024, 128, 384, 2, 4, 2),
    "cpu-c": (1024, 192, 512, 3, 6, 2),
}
# shapes from the planner's published presets (plan/model_presets.py), built from `ModelSpec.to_hf_config()`
# (Qwen2: q/k/v biases, tied embeddings); "cpu-q" is the tied Qwen2 shape shrunk for --gpu --device cpu
PRESET_MODELS = {"qwen2.5-1.5B": "qwen2.5-1.5b", "cpu-q": "qwen2.5-1.5b"}
CPU_PRESET_SHAPE = dict(vocab_size=2048, hidden_size=128, intermediate_size=352, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=32, max_positions=4096)
GPU_TO_CPU = {"llama-0.3B": "cpu-a", "llama-1.1B": "cpu-b", "llama-3B": "cpu-c", "qwen2.5-1.5B": "cpu-q"}
# (hybrid needs two shard groups: one node of 2 ranks is refused by the config's validation)
CPU_STRATEGIES = ("ddp", "fsdp", "fsdp-grad-op", "fsdp-offload", "zero1", "zero2", "zero3",
                  "zero2-offload", "zero3-offload")
HYBRID = {"shard_group_size": 2, "nproc": 4}  # hybrid's cases: their own launch of 4 ranks
GiB, MiB = 2**30, 2**20
WARMUP_STEPS = 2  # steps not counted in the measured step time (the first builds optimizer states; ZeRO-3 traces)


# ----------------------------------------------------------------------------- case lists


def case(model, strategy, mb, seq, ckpt, compute="fp32", accum=1, compile_=False, fused=False, tuner="full") -> dict:
    c = dict(model=model, strategy=strategy, micro_batch=mb, seq_len=seq, ckpt=ckpt, compute=compute,
             grad_accum=accum, compile=compile_, fused_loss=fused)
    if tuner != "full":  # LoRA / QLoRA: r 16 on every block linear (the config's defaults otherwise)
        c.update(tuner=tuner, lora_r=LORA_R)
    return c


LORA_R = 16


def cpu_cases(quick: bool) -> list[dict]:
    """2 gloo ranks: every preset that runs there, fp32 (what CPU training runs) plus the bf16 regime."""
    out = []
    models = ["s-5M"] if quick else ["tiny-0.9M", "s-5M", "m-27M"]
    shapes = [(2, 128), (4, 256)] if quick else [(2, 128), (8, 512)]
    for model in models:
        for mb, seq in shapes:
            for strategy in CPU_STRATEGIES:
                for ckpt in (False, True):
                    out.append(case(model, strategy, mb, seq, ckpt))
    # the GPU regime on the CPU: bf16 compute over fp32 weights, the fused head, accumulation
    for strategy in CPU_STRATEGIES:
        out.append(case("s-5M", strategy, 4, 256, False, "bf16", 2, fused=True))
    # hybrid: 4 ranks of one node split into shard groups of 2 (fsdp.shard_group_size), replicated across them
    for model in models:
        for mb, seq in shapes:
            for ckpt in (False, True):
                out.append({**case(model, "hybrid", mb, seq, ckpt), **HYBRID})
    out.append({**case("s-5M", "hybrid", 4, 256, False, "bf16", 2, fused=True), **HYBRID})
    return out


def gpu_cases(quick: bool = False) -> list[dict]:
    """One H200, bf16 compute over fp32 weights, the fused loss head on (the engine's CUDA defaults);
    eager unless marked. Ordered by value: the anchor's strategies first, compile rows last."""
    A, S, L = "llama-1.1B", "llama-0.3B", "llama-3B"
    shapes = {S: [(8, 2048), (2, 4096)], A: [(8, 2048), (2, 4096)], L: [(4, 2048), (1, 4096)]}
    g = lambda m, s, sh, ck, comp=False: case(m, s, sh[0], sh[1], ck, "bf16", 1, comp, True)  # noqa: E731
    out = []
    for strategy in ("single", "fsdp", "ddp", "fsdp-grad-op", "zero2", "zero3"):  # the anchor, first shape
        for ck in (False, True):
            out.append(g(A, strategy, shapes[A][0], ck))
    if quick:
        out += [g(S, "single", shapes[S][0], False), g(L, "single", shapes[L][0], True),
                g(A, "single", shapes[A][0], False, True)]
        return out
    for strategy in ("single", "fsdp", "zero3"):  # the anchor, second shape
        for ck in (False, True):
            out.append(g(A, strategy, shapes[A][1], ck))
    for m in (S, L):
        for strategy in ("single", "fsdp"):
            for sh in shapes[m]:
                for ck in (False, True):
                    out.append(g(m, strategy, sh, ck))
    for m in (S, L):
        for ck in (False, True):
            out.append(g(m, "zero3", shapes[m][0], ck))
    for strategy in ("single", "fsdp", "zero3"):  # torch.compile per block, as the engine runs on CUDA
        out.append(g(A, strategy, shapes[A][0], False, True))
    for strategy in ("zero1", "fsdp-offload", "zero2-offload", "zero3-offload"):  # the rest of one node's presets
        for ck in (False, True):
            out.append(g(A, strategy, shapes[A][0], ck))
    return out


def issue16_cases() -> list[dict]:
    """Issue 16 item 1, the one-H200 half: every one-GPU preset x {full, LoRA, QLoRA} x checkpointing {off, on} on two
    shapes, at micro-batches and lengths no earlier table used: Qwen2.5-1.5B's shape (152k vocabulary, tied) at
    3 x 3072 and the 1.14B Llama anchor shape (32k, untied) at 6 x 1536. bf16 autocast over fp32 weights, the fused
    head, eager blocks (`--compile off`: a compiled case costs 15-25 s of compile on a cold machine); then the
    compiled engine default on a subset (full and LoRA, single/fsdp/zero3, no checkpointing), as the budget allows.
    ddp on one rank runs single's step plus its buckets (measured in the earlier tables), so it is not repeated;
    QLoRA runs under single only: the config refuses it with fsdp/zero* (config.py: the 4-bit base is not sharded)."""
    shapes = {"qwen2.5-1.5B": (3, 3072), "llama-1.1B": (6, 1536)}
    out = []
    for m, (mb, seq) in shapes.items():
        for tuner in ("full", "lora", "qlora"):
            for strategy in (("single",) if tuner == "qlora" else ("single", "fsdp", "zero2", "zero3")):
                for ck in (False, True):
                    out.append(case(m, strategy, mb, seq, ck, "bf16", 1, False, True, tuner))
    for m, (mb, seq) in shapes.items():  # compiled blocks (the engine's CUDA default)
        for tuner in ("full", "lora"):
            for strategy in ("single", "fsdp", "zero3"):
                out.append(case(m, strategy, mb, seq, False, "bf16", 1, True, True, tuner))
    return out


CASE_SETS = {"default": lambda quick: gpu_cases(quick), "issue16": lambda quick: issue16_cases()}


def shrink(c: dict) -> dict:
    """A GPU case at CPU size (for --gpu --device cpu)."""
    mb, seq = c["micro_batch"], c["seq_len"]
    return {**c, "model": GPU_TO_CPU.get(c["model"], c["model"]), "micro_batch": max(1, mb // 4),
            "seq_len": max(64, seq // 16), "gpu_model": c["model"]}


# ----------------------------------------------------------------------------- prediction


def spec_for(name: str):
    from dataclasses import replace

    from shardwise.plan.model_presets import find_preset
    from shardwise.plan.model_spec import ModelSpec

    if name in PRESET_MODELS:
        spec = replace(find_preset(PRESET_MODELS[name]), name=name)
        return replace(spec, **CPU_PRESET_SHAPE) if name.startswith("cpu-") else spec
    v, h, i, L, a, k = MODELS[name]
    return ModelSpec(name, "benchmark", v, h, i, L, a, k, h // a, False)


def vocab_of(name: str) -> int:
    return spec_for(name).vocab_size


def config_for(c: dict, world: int):
    """The Config `shardwise train` would run for this case."""
    from shardwise.config import load_config

    flags = {"model": "random-init", "strategy": c["strategy"], "micro_batch_size": c["micro_batch"],
             "seq_len": c["seq_len"], "grad_accum": c["grad_accum"], "gradient_checkpointing": c["ckpt"],
             "mixed_precision": "no" if c["compute"] == "fp32" else c["compute"], "param_dtype": "fp32",
             "compile": "on" if c["compile"] else "off", "fused_loss": c["fused_loss"], "nproc_per_node": world,
             "lr": 1e-4, "collective_timeout": 600.0}
    if c.get("shard_group_size"):
        flags["fsdp.shard_group_size"] = c["shard_group_size"]
    if c.get("tuner", "full") != "full":
        flags["tuner"] = c["tuner"]
        flags["lora.r"] = c.get("lora_r", LORA_R)
    if c.get("keep_gathered_one_rank") is not None:  # rows measured under another one-rank fsdp rule
        flags["fsdp.keep_gathered_one_rank"] = c["keep_gathered_one_rank"]
    if c.get("ds_fetch"):  # ZeRO-3's fetch unit (rows measured before whole-block fetch: "module")
        flags["deepspeed.fetch"] = c["ds_fetch"]
    return load_config(None, {k: (v, "plan_accuracy") for k, v in flags.items()}).cfg


def predict(c: dict, world: int, accelerator: str) -> "object":
    """The planner's Memory for this case (job_from_config's mapping, the preset's Opts)."""
    return plan_case(c, world, accelerator).memory


def plan_case(c: dict, world: int, accelerator: str, **job_fields) -> "object":
    """The planner's StrategyPlan for this case, as `shardwise plan --gpu-type H200` makes it: the Job from the
    case's Config (plan.inputs.job_from_config: tuner, LoRA rank, dtypes, checkpointing, compile), the preset's
    Opts, one H200 per rank (peak FLOP/s, links; no doctor.json) for the step time (so for `--device cpu` rows the
    predicted step time is an H200's, not the CPU's: that mode checks the harness, not the speed model). The planner
    models today's engine: rows measured under an older one are compared as they are (docs/planner.md says which
    were archived for it). `job_fields`: Job fields to set besides the case's (float8=True)."""
    import dataclasses

    from shardwise.plan.decide import opts_for, plan_strategy
    from shardwise.plan.inputs import job_from_config, make_setup

    cfg = config_for(c, world)
    setup = make_setup(gpus=world, gpu_memory=139.8, gpu_type="H200", use_doctor=False)
    job = dataclasses.replace(job_from_config(cfg, setup), compute=c["compute"], compile=c["compile"],
                              accelerator=accelerator, **job_fields)
    return plan_strategy(spec_for(c["model"]), job, setup, c["strategy"], opts_for(c["strategy"], cfg))


def predicted_bytes(c: dict, world: int, accelerator: str) -> float:
    """Tensor peak on the measured device. On the CPU offloaded state shares the measured memory
    (host = device), so the offload presets are compared with their device peak + host state."""
    m = predict(c, world, accelerator)
    return m.peak_tensors + (m.host if accelerator == "cpu" else 0.0)


# ----------------------------------------------------------------------------- one case


@contextlib.contextmanager
def random_init_loader(c: dict, device):
    """Make the loop's build_model get a random-init model of the case's shape (on `device`)."""
    from shardwise.train import loop

    def load(model_dir, dtype, trust_remote_code=False):
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

        if c["model"] in PRESET_MODELS:  # the preset's config.json values (Qwen2: biases, tied head)
            d = spec_for(c["model"]).to_hf_config()
            d["max_position_embeddings"] = max(4096, c["seq_len"])
            cfg = AutoConfig.for_model(d.pop("model_type"), bos_token_id=2, eos_token_id=3, pad_token_id=1, **d)
        else:
            v, h, i, L, a, k = MODELS[c["model"]]
            cfg = LlamaConfig(vocab_size=v, hidden_size=h, intermediate_size=i, num_hidden_layers=L,
                              num_attention_heads=a, num_key_value_heads=k,
                              max_position_embeddings=max(4096, c["seq_len"]), tie_word_embeddings=False,
                              bos_token_id=2, eos_token_id=3, pad_token_id=1)
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=dtype)
        model.config.use_cache = False
        return model

    orig = loop.load_model
    loop.load_model = load
    try:
        yield
    finally:
        loop.load_model = orig


def make_batch(c: dict, world: int, rank: int, vocab: int):
    import torch

    from shardwise.data.batches import MicroBatch, StepBatch

    g = torch.Generator().manual_seed(1000 + rank)
    B, S = c["micro_batch"], c["seq_len"]
    micro = []
    for _ in range(c["grad_accum"]):
        ids = torch.randint(0, vocab, (B, S), generator=g)
        tg = torch.randint(0, vocab, (B, S), generator=g)
        micro.append(MicroBatch(ids, tg, torch.arange(S, dtype=torch.int64).repeat(B, 1)))
    n = B * S * c["grad_accum"] * world
    return StepBatch(micro, n, n, list(range(B * c["grad_accum"] * world)))


def untracked_bytes(tracked_sizes) -> int:
    """Bytes of live tensor storages that gc can reach but the tracker never saw."""
    import torch

    from shardwise.plan.simulate import _storages

    seen, total = set(), 0
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor):
            try:
                sts = _storages(o)
            except Exception:
                continue
            for st in sts:
                key = st.data_ptr()
                if key in seen or st.nbytes() == 0 or st.device.type == "meta":
                    continue
                seen.add(key)
                if st not in tracked_sizes:
                    total += st.nbytes()
    return total


TORCH_LINEAR = None  # torch.nn.functional.linear as torch defines it (saved before the first case)


def restore_linear() -> None:
    """DeepSpeed's ZeRO-3 replaces torch.nn.functional.linear process-wide when it converts a model
    (partition_parameters.Init(module=...) -> _enable_mem_efficient_linear: "persists unless manually reset").
    Every later case would run DeepSpeed's LinearFunctionForZeroStage3 (no autocast weight copies saved, shared
    inputs saved once): put torch's back after each case. Rows measured so carry linear_restored: true; rows of
    older runs without it ran after a ZeRO-3 case with DeepSpeed's linear (`ran_with_ds_linear`)."""
    global TORCH_LINEAR
    import torch

    if TORCH_LINEAR is None:
        TORCH_LINEAR = torch.nn.functional.linear
    elif torch.nn.functional.linear is not TORCH_LINEAR:
        torch.nn.functional.linear = TORCH_LINEAR


def measure_case(c: dict, env, use_tracker: bool, snapshot: bool = False) -> dict:
    """Build, set up and run c["steps"] (at least two) steps as the engine does; the largest peak after the first."""
    import torch

    restore_linear()

    from shardwise.plan.simulate import LiveBytes

    cuda = env.device.type == "cuda"
    out: dict = {}
    if cuda:  # anything an earlier case left behind is not this case's (subtracted from the peak)
        out["allocated_at_start"] = torch.cuda.memory_allocated()
    holder: dict = {"snapshot": snapshot}
    try:
        return _steps(c, env, LiveBytes() if use_tracker else None, out, holder)
    finally:
        engine = getattr(holder.get("strategy"), "engine", None)
        if engine is not None:
            release_deepspeed(engine)
        holder.clear()
        restore_linear()
        out["linear_restored"] = True


def release_deepspeed(engine) -> None:
    """DeepSpeed 0.19's engine stays reachable after a case (its module hooks' closures are
    held from outside Python's view, even after engine.destroy()), and with it every buffer
    of its optimizer: on a GPU each case would leak its whole state. Empty the engine and
    its optimizer, so what stays reachable holds no tensors."""
    import torch

    try:
        engine.destroy()
    except Exception:
        pass
    module = getattr(engine, "module", None)
    if module is not None:  # ZeRO-3's parameters (and their partitions) stay reachable through its hooks
        for p in module.parameters():
            p.grad = None
            for t in (p, getattr(p, "ds_tensor", None)):
                if isinstance(t, torch.Tensor):
                    t.data = torch.empty(0, dtype=t.dtype, device=t.device)
    opt = getattr(engine, "optimizer", None)
    for obj in (getattr(opt, "optimizer", None), opt, engine):
        if obj is not None:
            try:
                obj.__dict__.clear()
            except Exception:
                pass


def _steps(c: dict, env, tracker, out: dict, holder: dict) -> dict:
    import torch

    from shardwise import strategies
    from shardwise.train import dist as sdist
    from shardwise.train import loop
    from shardwise.train.faults import Faults

    cfg = config_for(c, env.world_size)
    cuda = env.device.type == "cuda"
    t0 = time.time()
    with (tracker if tracker is not None else contextlib.nullcontext()):
        with random_init_loader(c, env.device if cuda else "cpu"):
            torch.manual_seed(cfg.seed)
            model = loop.build_model(cfg, "random-init")
        head = model.get_output_embeddings()
        fused_head = head if getattr(head, "loss_targets", "absent") is None else None
        sdist.ensure_same_weights(model, env)
        strategy = holder["strategy"] = strategies.get(cfg.strategy)(cfg, env)
        model, optimizer = strategy.setup(model)
        out["setup_s"] = round(time.time() - t0, 2)
        batch = make_batch(c, env.world_size, env.rank, vocab_of(c["model"]))
        faults = Faults(env.rank)
        model.train()
        step_times, step_peaks, event_times = [], [], []
        n_steps = max(2, int(c.get("steps", 2)))
        for step in range(n_steps):
            if tracker is not None:
                tracker.reset_peak()
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                if step == 1:
                    out["allocated_before_step2"] = torch.cuda.memory_allocated()
                    if holder.get("snapshot"):
                        _window_mark()
            ts = time.time()
            if cuda:
                ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                ev[0].record()
            for g in optimizer.param_groups:
                g["lr"] = loop.lr_at(cfg, step, n_steps)
            loss = loop.forward_backward_step(model, strategy, batch, env.world_size, env.device, faults, step + 1, fused_head)
            strategy.step(model, optimizer)
            if cuda:
                ev[1].record()
            out["loss"] = float(loss)  # a host sync: the step has finished
            if cuda:
                torch.cuda.synchronize()
                event_times.append(ev[0].elapsed_time(ev[1]) / 1e3)
            step_times.append(time.time() - ts)
            step_peaks.append(tracker.peak if tracker is not None else torch.cuda.max_memory_allocated())
        # the steady state: the largest peak after the first step (the first also builds optimizer states)
        out["peak_bytes"] = max(step_peaks[1:])
        out["step_peaks"] = step_peaks
        if tracker is not None:
            out["live_end"] = tracker.current
        if cuda:
            out["reserved_peak"] = torch.cuda.max_memory_reserved()
    out["step_s"] = [round(t, 4) for t in step_times]
    # the step time: CUDA events around each step (the GPU's time from the step's first launch to the optimizer step's
    # last), the median of the steps after the warm-up (WARMUP_STEPS: optimizer states, ZeRO-3's trace, compiles)
    times = event_times or step_times
    if event_times:
        out["step_s_cuda"] = [round(t, 4) for t in event_times]
    counted = times[WARMUP_STEPS:] if len(times) > WARMUP_STEPS else times[-1:]
    out["measured_step_s"] = round(statistics.median(counted), 4)
    out["tokens_per_s"] = round(c["micro_batch"] * c["seq_len"] * c["grad_accum"] * env.world_size
                                / out["measured_step_s"])
    if cuda:
        out["peak_bytes"] -= out["allocated_at_start"]
        out["step_peaks"] = [p - out["allocated_at_start"] for p in out["step_peaks"]]
    if tracker is not None:
        out["untracked_end"] = untracked_bytes(tracker._sizes)
    del model, optimizer, strategy, batch, head, fused_head
    return out


OWN_CODE = ("deepspeed/", "shardwise/", "transformers/", "peft/", "bitsandbytes/")


WINDOW_MARK = "_window_mark"  # the function whose allocation opens the measured window in the allocation trace


def _window_mark() -> None:
    """Allocate (and free) one small CUDA block: its alloc event, with this function in its frames, marks where the
    measured window (the second step) starts in the allocation trace, for peak_breakdown."""
    import torch

    torch.empty(1, device="cuda")  # freed at once: only its allocation event is wanted


def _frame_key(f: dict) -> str:
    return f"{'/'.join(f.get('filename', '?').split('/')[-2:])}:{f.get('line', '?')} {f.get('name', '?')}"


def peak_breakdown(snapshot: dict, top: int = 15) -> dict:
    """What was alive at the largest total of the measured window in a `torch.cuda.memory._snapshot()` taken with
    history recording on: replay its alloc/free trace (the window opens at the _window_mark allocation, else at the
    start), take the largest total inside the window, group the blocks alive there by the innermost frame in
    DeepSpeed, shardwise, transformers, peft or bitsandbytes code (else the innermost frame), largest first. `at`:
    those frames of the allocation that reached the peak (where in the step it was)."""
    events = [e for trace in snapshot.get("device_traces", []) for e in trace]
    start = next((i for i, e in enumerate(events) if e["action"] == "alloc"
                  and any(f.get("name") == WINDOW_MARK for f in e.get("frames") or [])), 0)
    total, best, best_i = 0, -1, -1
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            total += e["size"]
            if i > start and total > best:
                best, best_i = total, i
        elif e["action"] == "free_completed":
            total -= e["size"]
    live: dict = {}
    for e in events[:best_i + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)

    def own(frames):
        return [f for f in frames if any(k in f.get("filename", "") for k in OWN_CODE)]

    groups: dict = {}
    for e in live.values():
        frames = e.get("frames") or []
        f = next(iter(own(frames)), frames[0] if frames else {})
        key = _frame_key(f)
        n, b = groups.get(key, (0, 0))
        groups[key] = (n + 1, b + e["size"])
    rows = sorted(groups.items(), key=lambda kv: -kv[1][1])[:top]
    at = [_frame_key(f) for f in own(events[best_i].get("frames") or [])][:6] if best_i >= 0 else []
    largest = sorted(live.values(), key=lambda e: -e["size"])[:top]
    return {"peak_bytes_in_trace": best, "events": len(events), "window_from_event": start, "at": at,
            "top": [{"where": k, "blocks": n, "bytes": b} for k, (n, b) in rows],
            "largest": [{"bytes": e["size"], "made_in": [_frame_key(f) for f in (e.get("frames") or [])[:3]],
                         "own": [_frame_key(f) for f in own(e.get("frames") or [])][:2]} for e in largest]}


def cleanup(cuda: bool) -> None:
    gc.collect()
    try:
        import torch._dynamo

        torch._dynamo.reset()
    except Exception:
        pass
    if cuda:
        import torch

        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


# ----------------------------------------------------------------------------- CPU: 2 gloo ranks


def cpu_worker(out_path: str, cases_json: str) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch.distributed as dist

    from shardwise.train import dist as sdist

    env = sdist.init_distributed(600.0)
    quiet()
    rows = []
    for i, c in enumerate(json.loads(cases_json)):
        t = time.time()
        try:
            r = measure_case(c, env, use_tracker=True)
            err = None
        except Exception as e:  # both ranks fail alike (same case, same code)
            r, err = {}, f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            if env.rank == 0:
                traceback.print_exc()
        cleanup(False)
        rs = [None] * env.world_size
        dist.all_gather_object(rs, {**r, "error": err})
        row = {**c, "world": env.world_size, "device": "cpu", "seconds": round(time.time() - t, 1),
               "error": next((x["error"] for x in rs if x["error"]), None)}
        if row["error"] is None:
            row.update(measured=max(x["peak_bytes"] for x in rs), per_rank=[x["peak_bytes"] for x in rs],
                       linear_restored=all(x.get("linear_restored") for x in rs),
                       untracked_end=max(x["untracked_end"] for x in rs), step_s=rs[0]["step_s"],
                       loss=rs[0]["loss"])
        rows.append(row)
        if env.rank == 0:
            print(f"[{i + 1}] {label(row)}: " + (f"{row['measured'] / MiB:.2f} MiB" if row["error"] is None
                                                 else row["error"]) + f" ({row['seconds']} s)", flush=True)
            write_json(out_path, rows)
    dist.destroy_process_group()


def select(sel: list[dict], a) -> list[dict]:
    """The cases that --only/--models/--compute/--pick/--limit keep (to re-run part of a table), with --steps."""
    if a.pick:
        keep = {int(x) for x in a.pick.split(",")}
        sel = [c for i, c in enumerate(sel, 1) if i in keep]
    sel = [{**c, "steps": a.steps} for c in sel]
    for flag, key in ((a.only, "strategy"), (a.models, "model"), (a.compute, "compute")):
        if flag:
            sel = [c for c in sel if c[key] in flag.split(",")]
    return sel[:a.limit] if a.limit else sel


def run_cpu(a) -> list[dict]:
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    sel = cpu_cases(a.quick)
    sel = select(sel, a)
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    rows: list = []
    for nproc in sorted({c.get("nproc", a.nproc) for c in sel}):  # one launch per world size (hybrid: 4)
        cases = [c for c in sel if c.get("nproc", a.nproc) == nproc]
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
        lc = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"acc-{uuid.uuid4().hex[:6]}",
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, start_method="spawn")
        out = os.path.join(tempfile.mkdtemp(), "rows.json")
        elastic_launch(lc, sys.executable)(os.path.abspath(__file__), "--worker", out, json.dumps(cases))
        with open(out) as fh:
            rows += json.load(fh)
        if a.json:
            write_json(a.json, rows)
    return rows


# ----------------------------------------------------------------------------- GPU: one rank, in process


def run_gpu(a) -> list[dict]:
    import torch
    import torch.utils.checkpoint

    sel = CASE_SETS[a.cases](a.gpu_quick)
    cpu = a.device == "cpu"
    if cpu:
        sel = [shrink(c) for c in sel]
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    sel = select(sel, a)
    if a.dry_run:
        for i, c in enumerate(sel):
            sp = plan_case(c, 1, "cpu" if cpu else "cuda")
            m = sp.memory
            print(f"[{i + 1}/{len(sel)}] {label(c)}: predicted {m.peak_tensors / GiB:.2f} GiB tensors, "
                  f"{m.total / GiB:.2f} GiB total, {sp.timing.step_s:.3f} s a step on an H200", flush=True)
        return []
    if not cpu and not torch.cuda.is_available():
        raise SystemExit("--gpu needs CUDA (or pass --device cpu for the smoke test)")
    # a one-rank group, as torchrun's agent would set it up (NCCL on cuda:0)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import free_port  # benchmarks/common.py

    os.environ.setdefault("MASTER_PORT", str(free_port()))
    from shardwise.train import dist as sdist

    env = sdist.init_distributed(600.0)
    try:
        import deepspeed  # noqa: F401

        ds_error = None
    except Exception as e:  # the GPU machine's DeepSpeed comes from carried wheels
        ds_error = f"deepspeed not importable: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    quiet()
    meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0) if not cpu else "cpu",
            "date": time.strftime("%Y-%m-%d %H:%M"), "cases": a.cases, "steps": a.steps,
            "warmup_steps": WARMUP_STEPS, "commit": os.environ.get("PLAN_ACCURACY_COMMIT", "")}
    for mod in ("peft", "bitsandbytes"):
        try:
            meta[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001
            meta[mod] = f"not importable: {type(e).__name__}"
    try:
        import transformers

        meta["transformers"] = transformers.__version__
    except Exception:
        pass
    if ds_error is None:
        meta["deepspeed"] = sys.modules["deepspeed"].__version__
    print(f"plan_accuracy --gpu: {len(sel)} cases on {meta['device']}; torch {meta['torch']}"
          + (f"; {ds_error}" if ds_error else ""), flush=True)
    t_start = time.time()
    rows = []
    for i, c in enumerate(sel):
        row = {**c, "world": 1, "device": "cpu" if cpu else "cuda", "meta": meta}
        elapsed = time.time() - t_start
        if elapsed > a.budget_s:
            row["error"] = f"skipped: budget of {a.budget_s:g} s spent"
        elif c["strategy"].startswith("zero") and ds_error:
            row["error"] = "skipped: " + ds_error
        elif c.get("tuner") == "qlora" and not cpu and not str(meta.get("bitsandbytes", "")[:1]).isdigit():
            row["error"] = "skipped: bitsandbytes " + str(meta.get("bitsandbytes"))
        else:
            t = time.time()
            snap = a.snapshot and not cpu
            if snap:  # allocation history with Python stacks of the allocations, for peak_breakdown
                record_history()
            try:
                try:
                    r = measure_case(c, env, use_tracker=cpu, snapshot=snap)
                except SystemError:
                    # torch 2.11 with history recording fails in checkpointed recomputation (pytorch#179536: a custom
                    # autograd Function stopped early by checkpoint's early stop); once more without the early stop
                    if not (snap and c["ckpt"]):
                        raise
                    traceback.print_exc()
                    cleanup(True)
                    record_history()
                    row["checkpoint_early_stop"] = False
                    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
                        r = measure_case(c, env, use_tracker=cpu, snapshot=snap)
                row.update(measured=r["peak_bytes"], **{k: v for k, v in r.items() if k != "peak_bytes"})
                row["error"] = None
            except torch.OutOfMemoryError as e:
                row["error"] = "OOM: " + str(e).splitlines()[0][:200]
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                traceback.print_exc()
            if a.snapshot and not cpu:
                row["peak_breakdown"] = peak_breakdown(torch.cuda.memory._snapshot())
                torch.cuda.memory._record_memory_history(enabled=None)
                print("  live at the peak: " + "; ".join(f"{x['bytes'] / GiB:.2f} GiB {x['where']}"
                                                         for x in row["peak_breakdown"]["top"][:8]), flush=True)
            cleanup(not cpu)
            if not cpu:  # what this case left behind (the next case subtracts it as its allocated_at_start)
                row["allocated_after"] = torch.cuda.memory_allocated()
            row["seconds"] = round(time.time() - t, 1)
        try:
            sp = plan_case(c, 1, "cpu" if cpu else "cuda")
            m = sp.memory
            row["predicted"] = m.peak_tensors + (m.host if cpu else 0.0)
            row["predicted_total"] = m.total
            row["predicted_phase"] = m.phase
            row["predicted_step_s"] = round(sp.timing.step_s, 5)
        except Exception as e:  # a planner error must not lose the measured row
            row["predict_error"] = f"{type(e).__name__}: {e}"[:300]
            traceback.print_exc()
        rows.append(row)
        msg = (f"measured {row['measured'] / GiB:.2f} GiB, predicted {row['predicted'] / GiB:.2f} GiB "
               f"({100 * (row['predicted'] / row['measured'] - 1):+.1f}%); step {row['measured_step_s']:.3f} s, "
               f"predicted {row['predicted_step_s']:.3f} s ({100 * (row['predicted_step_s'] / row['measured_step_s'] - 1):+.1f}%)"
               if row["error"] is None and "predicted" in row else str(row["error"]))
        print(f"[{i + 1}/{len(sel)} {time.time() - t_start:.0f}s] {label(c)}: {msg} ({row.get('seconds', 0)} s)",
              flush=True)
        if a.json:
            write_json(a.json, rows)
    return rows


def record_history() -> None:
    """CUDA allocation history from here on (earlier cases' events dropped), Python stacks of the allocations."""
    import torch

    torch.cuda.memory._record_memory_history(enabled=None)
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, context="alloc", stacks="python")


def quiet() -> None:
    """Keep the per-case output to one progress line: no FutureWarnings, no DeepSpeed INFO logs."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    for name in ("DeepSpeed", "deepspeed", "torch._dynamo", "torch._inductor"):
        logging.getLogger(name).setLevel(logging.WARNING)


# ----------------------------------------------------------------------------- output


def label(c: dict) -> str:
    return (f"{c['model']} {c['strategy']} {c['micro_batch']}x{c['seq_len']} ckpt={'on' if c['ckpt'] else 'off'} "
            f"{c['compute']}{' accum=' + str(c['grad_accum']) if c['grad_accum'] > 1 else ''}"
            f"{' fused' if c['fused_loss'] else ''}{' compile' if c['compile'] else ''}"
            f"{' ' + c['tuner'] + ' r' + str(c.get('lora_r', LORA_R)) if c.get('tuner', 'full') != 'full' else ''}")


def write_json(path: str, rows) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(rows, fh, indent=1)
    os.replace(tmp, path)


def ran_with_ds_linear(rows: list[dict]) -> list[bool]:
    """Per row (in run order, one process): whether it ran with DeepSpeed's linear, i.e. after a ZeRO-3 case
    that got as far as building its engine, in a run that did not restore torch's (no `linear_restored`)."""
    out, installed = [], False
    for r in rows:
        out.append(installed and not r.get("linear_restored"))
        started = not str(r.get("error") or "").startswith("skipped")
        if r["strategy"].startswith("zero3") and started and not r.get("linear_restored"):
            installed = True
    return out


def freed_leak(rows: list[dict]) -> list[float]:
    """GPU rows: bytes of an earlier case's leak that were freed during this case. The harness subtracts
    `allocated_at_start` from the peak; when leaked memory is freed mid-case, that under-counts the peak by the
    freed bytes. Seen in the state before the second step: cases of one model and strategy hold the same state
    there, so a row whose (allocated_before_step2 - allocated_at_start) is lower than its twin's lost the
    difference. (From the measurements alone, no planner.)"""
    at_rest: dict = {}
    for r in rows:  # (not the process's first case: it also allocates the persistent cuBLAS workspace)
        if r.get("allocated_before_step2") is not None and r.get("allocated_at_start"):
            k = (r["model"], r["strategy"], r.get("compile"))
            at_rest[k] = max(at_rest.get(k, 0), r["allocated_before_step2"] - r["allocated_at_start"])
    out = []
    for r in rows:
        if r.get("allocated_before_step2") is None:
            out.append(0.0)
            continue
        d = at_rest.get((r["model"], r["strategy"], r.get("compile")), 0) \
            - (r["allocated_before_step2"] - r["allocated_at_start"])
        out.append(float(d) if d > MiB else 0.0)
    return out


def table(rows: list[dict]) -> str:
    """Markdown rows, with predictions from the planner as it is now. ᵈ: the case ran with DeepSpeed's linear
    (installed by an earlier ZeRO-3 case of the same process; the planner models today's engine, which restores
    torch's, so the row is not comparable). ᶠ: measured corrected
    for an earlier case's leak that was freed during this case (`freed_leak`)."""
    if any(r.get("measured_step_s") is not None or r.get("tuner") for r in rows):
        return table_steps(rows)
    lines = []
    gpu = any(r.get("device") == "cuda" for r in rows)
    unit, div = ("GiB", GiB) if gpu else ("MiB", MiB)
    lines.append(f"| device | model | strategy | micro-batch × seq | ckpt | compute | accum | loss head | compile | "
                 f"predicted {unit} | measured {unit} | error |" + (" tokens/s |" if gpu else ""))
    lines.append("|---" * (13 if gpu else 12) + "|")
    errs = []
    dsl = ran_with_ds_linear(rows)
    freed = freed_leak(rows) if gpu else [0.0] * len(rows)
    for r, ds, fr in zip(rows, dsl, freed):
        dev = "H200 (cuda)" if r.get("device") == "cuda" else f"cpu (gloo) ×{r['world']}"
        if r["world"] == 1 and r.get("device") == "cpu":
            dev = "cpu ×1"
        try:
            pred = predicted_bytes(r, r["world"], "cuda" if r.get("device") == "cuda" else "cpu")
        except Exception as e:  # a case the config refuses (e.g. hybrid on one node)
            lines.append(f"| {dev} | {r['model']} | {r['strategy']} | — | — | — | — | — | — | — | — | "
                         f"{type(e).__name__} |" + (" |" if gpu else ""))
            continue
        head = f"| {dev} | {r['model']} | {r['strategy']}{' ᵈ' if ds and not r['strategy'].startswith('zero3') else ''} | {r['micro_batch']} × {r['seq_len']} | " \
               f"{'on' if r['ckpt'] else 'off'} | {r['compute']} | {r['grad_accum']} | " \
               f"{'fused' if r['fused_loss'] else 'plain'} | {'on' if r['compile'] else 'off'} | {pred / div:.2f} | "
        if r.get("error"):
            lines.append(head + f"— | {r['error'][:60]} |" + (" |" if gpu else ""))
            continue
        measured = r["measured"] + fr
        e = 100 * (pred / measured - 1)
        errs.append(abs(e))
        lines.append(head + f"{measured / div:.2f}{' ᶠ' if fr else ''} | {e:+.1f}% |"
                     + (f" {r.get('tokens_per_s', 0) / 1e3:.1f}k |" if gpu else ""))
    if errs:
        lines.append(f"\n{len(errs)} cases measured ({len(rows) - len(errs)} not): mean |error| "
                     f"{sum(errs) / len(errs):.1f}%, max {max(errs):.1f}%; within 10%: "
                     f"{sum(e <= 10 for e in errs)}/{len(errs)}")
    return "\n".join(lines)


MEM_GOAL, STEP_GOAL = 10.0, 20.0  # issue 16: peak memory within 10%, step time within 20% on every row


def table_steps(rows: list[dict]) -> str:
    """Markdown rows with the tuner and the step time (rows measured with `measured_step_s`), predicted by the planner
    as it is now: the tensor peak against the measured peak, the step time against the CUDA-event median after the
    warm-up. Error = predicted / measured - 1; a row is within goal when both are (memory 10%, step time 20%)."""
    gpu = any(r.get("device") == "cuda" for r in rows)
    unit, div = ("GiB", GiB) if gpu else ("MiB", MiB)
    lines = [f"| model | strategy | tuner | micro-batch × seq | ckpt | compile | predicted {unit} | measured {unit} | "
             f"error | predicted step s | measured step s | error | tokens/s | goal |",
             "|---" * 14 + "|"]
    mem_errs, step_errs, ok = [], [], 0
    for r in rows:
        tuner = r.get("tuner", "full") + (f" r{r.get('lora_r', LORA_R)}" if r.get("tuner", "full") != "full" else "")
        head = (f"| {r['model']} | {r['strategy']} | {tuner} | {r['micro_batch']} × {r['seq_len']} | "
                f"{'on' if r['ckpt'] else 'off'} | {'on' if r['compile'] else 'off'} | ")
        try:
            sp = plan_case(r, r["world"], "cuda" if r.get("device") == "cuda" else "cpu")
        except Exception as e:  # a case the config refuses
            lines.append(head + f"— | — | {type(e).__name__}: {str(e)[:80]} | — | — | — | — | — |")
            continue
        pred = sp.memory.peak_tensors + (sp.memory.host if r.get("device") == "cpu" else 0.0)
        pstep = sp.timing.step_s
        if r.get("error"):
            lines.append(head + f"{pred / div:.2f} | — | {r['error'][:70]} | {pstep:.3f} | — | — | — | — |")
            continue
        me = 100 * (pred / r["measured"] - 1)
        mstep = r.get("measured_step_s") or r["step_s"][-1]
        se = 100 * (pstep / mstep - 1)
        good = abs(me) <= MEM_GOAL and abs(se) <= STEP_GOAL
        ok += good
        mem_errs.append(abs(me))
        step_errs.append(abs(se))
        again = "".join(f" (again: {o['measured_step_s']:.3f}, {100 * (pstep / o['measured_step_s'] - 1):+.0f}%)"
                        for o in r.get("other_runs", []) if o.get("measured_step_s") and (o.get("steps") or 0) > 3)
        lines.append(head + f"{pred / div:.2f} | {r['measured'] / div:.2f} | {me:+.1f}% | {pstep:.3f} | {mstep:.3f}{again} | "
                     f"{se:+.1f}% | {r.get('tokens_per_s', 0) / 1e3:.1f}k | {'yes' if good else 'NO'} |")
    if mem_errs:
        lines.append(f"\n{len(mem_errs)} rows measured ({len(rows) - len(mem_errs)} not): memory mean |error| "
                     f"{statistics.mean(mem_errs):.1f}%, max {max(mem_errs):.1f}%, within 10%: "
                     f"{sum(e <= MEM_GOAL for e in mem_errs)}/{len(mem_errs)}; step time mean |error| "
                     f"{statistics.mean(step_errs):.1f}%, max {max(step_errs):.1f}%, within 20%: "
                     f"{sum(e <= STEP_GOAL for e in step_errs)}/{len(step_errs)}; both: {ok}/{len(mem_errs)}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- docs/planner.md's accuracy tables
# Each set of measured rows that calibration.json's measured_sets names is printed with today's predictions, its
# bounds and whether each row is within them. The rows and their selection are the ones the measured-row tests read
# (the results files, the archive, tests/unit/test_plan_measured.py's ROWS), so the page shows what the tests check.

ROOT = os.path.dirname(HERE)
ARCHIVE = os.path.join(HERE, "results", "plan_measured_archived.json")
# the row fields that name a row in an archived group's keys (a set's wider bounds: its `row_key`)
ARCHIVED_KEYS = {"h200_head_two_chunks": ("model", "strategy", "tuner", "ckpt", "compile"),
                 "h200_zero3_torch_linear": ("model", "tuner", "ckpt", "compile", "torch_linear")}
RESULT_SETS = ("cpu_presets", "h200_presets_one_rank", "h200_presets_tuners_checkpointing", "h200_zero3_whole_blocks",
               "h200_fused_head_one_chunk")


def _field(r: dict, f: str):
    return r.get(f, "full") if f == "tuner" else r.get(f)


def _archive() -> dict:
    with open(ARCHIVE) as fh:
        return json.load(fh)


def _result_rows(m: dict) -> list[dict]:
    """A set's measured rows, as the planner predicts them: zero3 rows that record no fetch unit ran with the set's
    `zero3_fetch` where it names one (rows measured before whole-block fetch: DeepSpeed's per-submodule fetch). Where
    the set says so (`freed_leak`: its rows ran in one process, in file order), a leak freed during a case is added
    back to its measured peak."""
    with open(os.path.join(ROOT, m["source"])) as fh:
        rows = json.load(fh)
    if m.get("freed_leak"):
        rows = [{**r, "measured": r["measured"] + f, "freed_leak": f} if f else r for r, f in zip(rows, freed_leak(rows))]
    fetch = {"ds_fetch": m["zero3_fetch"]} if m.get("zero3_fetch") else {}
    return [{**fetch, **r} if r["strategy"].startswith("zero3") else r for r in rows if not r.get("error")]


def set_rows(name: str) -> tuple[list[dict], list[dict]]:
    """(checked, archived) rows of a results-file set of calibration.json's measured_sets."""
    from shardwise.plan import calibration

    m = calibration.measured_set(name)
    rows = _result_rows(m)
    if not m["archived"]:
        return rows, []
    fields = ARCHIVED_KEYS[m["archived"]]
    keys = {tuple(k) for k in _archive()[m["archived"]]["keys"]}
    out = [r for r in rows if tuple(_field(r, f) for f in fields) in keys]
    return [r for r in rows if r not in out], out


def _test_module(name: str):
    """tests/unit/NAME.py, whose rows (and, for the CLI rows, whose `predict`) the tables use."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    import importlib

    return importlib.import_module(f"tests.unit.{name}")


def _train_rows():
    """tests/unit/test_plan_measured.py: its ROWS (the `shardwise train` rows) and its `predict` (the CLI's plan)."""
    return _test_module("test_plan_measured")


def _float8_cells(m: dict) -> list[list]:
    """tests/unit/test_plan_float8.py's runs: each results file's bf16 variants beside their float8 ones (and the
    anchor under selective checkpointing), planned as that test plans them."""
    t = _test_module("test_plan_float8")
    runs = [(*run, "") for run in t.RUNS] + [("float8_runs_h200_2026-12-01-anchor-sac.json", "llama-1.1B", 8, 2048,
                                              "selective", "+sac")]
    cells = []
    for name, model, mb, seq, ckpt, sac in runs:
        measured = t._measured(name)
        for strategy in ("single", "fsdp"):
            for f8 in (False, True):
                variant = f"{strategy}{sac}{'+float8' if f8 else ''}"
                if variant not in measured or f"{strategy}{sac}+float8" not in measured:
                    continue
                c = case(model, strategy, mb, seq, ckpt is True, "bf16", 1, True, True)
                sp = plan_case(c, 1, "cuda", float8=f8, **({"selective_checkpointing": True} if sac else {}))
                step_s, peak = measured[variant]
                ck = ckpt if isinstance(ckpt, str) else ("on" if ckpt else "off")
                cells.append([f"`{name}`", model, strategy, f"{mb} × {seq}", ck, "on" if f8 else "off"]
                             + _checked((peak, sp.memory.peak_tensors / GiB), (f"{step_s:.4f}", f"{sp.timing.step_s:.4f}"),
                                        sp.timing.step_s / step_s - 1, m, None))
    return cells


FLOAT8_HEAD = ["results file", "model", "strategy", "micro-batch × seq", "ckpt", "float8", "measured GiB", "planned GiB",
               "error", "measured step s", "planned step s", "error"]


def _code(text: str) -> str:
    """A path as code; a sentence (a page and its section) as it is."""
    return f"`{text}`" if " " not in text else text


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def _checked(mem: tuple, step: tuple | None, step_err: float, m: dict, wide: float | None) -> list:
    """The numeric cells of one row: peak measured, planned, error; step measured, planned, error (sets that bound the
    step time); within bounds."""
    mem_err = mem[1] / mem[0] - 1
    cells = [f"{mem[0]:.2f}", f"{mem[1]:.2f}", _pct(mem_err)]
    ok = abs(mem_err) <= m["mem_tol"]
    if m["step_tol"] is not None:
        bound = wide if wide is not None else m["step_tol"]
        ok = ok and abs(step_err) <= bound
        cells += [step[0], step[1], _pct(step_err)]
    within = ("yes" if ok else "**NO**") + (f" (step time held to {wide:.0%})" if wide is not None else "")
    return cells + [within]


def _markdown(head: list[str], rows: list[list]) -> str:
    lines = [head, ["---"] * len(head), *rows]
    return "\n".join("| " + " | ".join(map(str, cells)) + " |" for cells in lines)


def _summary(cells: list[list], steps: bool) -> str:
    def stats(i):
        e = [abs(float(c[i].rstrip("%"))) for c in cells]
        return f"mean |error| {statistics.mean(e):.1f}%, max {max(e):.1f}%"

    ok = sum(c[-1].startswith("yes") for c in cells)
    return (f"{len(cells)} rows: peak {stats(-5 if steps else -2)}"
            f"{'; step time ' + stats(-2) if steps else ''}; within bounds: {ok}/{len(cells)}.")


# a results row's label columns: (header, its cell); a column whose cell is the same on every row of a table is said
# once above the table instead
CASE_COLUMNS = [
    ("model", lambda r: r["model"]),
    ("strategy", lambda r: r["strategy"] + (" (per-submodule fetch)" if r.get("ds_fetch") == "module" else "")),
    ("tuner", lambda r: r.get("tuner", "full") + (f" r{r.get('lora_r', LORA_R)}" if r.get("tuner", "full") != "full"
                                                  else "") + (" (ran torch's linear)" if r.get("torch_linear") else "")),
    ("ranks", lambda r: f"{r['world']} ({r.get('device', 'cpu')})"),
    ("micro-batch × seq", lambda r: f"{r['micro_batch']} × {r['seq_len']}"),
    ("ckpt", lambda r: "on" if r["ckpt"] else "off"),
    ("compute", lambda r: r["compute"]),
    ("accum", lambda r: r["grad_accum"]),
    ("loss head", lambda r: "fused" if r["fused_loss"] else "plain"),
    ("compile", lambda r: "on" if r["compile"] else "off"),
]


def _case_table(rows: list[dict], name: str) -> tuple[str, list[list]]:
    """(the line of what every row shares + the table, its rows' cells), predicted with today's planner."""
    from shardwise.plan import calibration

    m = calibration.measured_set(name)
    same = [(h, f(rows[0])) for h, f in CASE_COLUMNS if len({str(f(r)) for r in rows}) == 1]
    cols = [(h, f) for h, f in CASE_COLUMNS if h not in dict(same)]
    cpu = all(r.get("device", "cpu") == "cpu" for r in rows)
    unit, div = ("MiB", MiB) if cpu else ("GiB", GiB)
    head = [h for h, _ in cols] + [f"measured {unit}", f"planned {unit}", "error"]
    if m["step_tol"] is not None:
        head += ["measured step s", "planned step s", "error"]
    cells = []
    for r in rows:
        sp = plan_case(r, r["world"], "cuda" if r.get("device") == "cuda" else "cpu")
        # on CPU ranks offloaded state stays in the measured memory (host = device)
        pred = sp.memory.peak_tensors + (sp.memory.host if r.get("device", "cpu") == "cpu" else 0.0)
        wide = calibration.wide_bounds(name).get(tuple(_field(r, f) for f in m.get("row_key", ())))
        step = None if m["step_tol"] is None else (f"{r['measured_step_s']:.3f}", f"{sp.timing.step_s:.3f}")
        err = 0.0 if step is None else sp.timing.step_s / r["measured_step_s"] - 1
        cells.append([str(f(r)) for _, f in cols] + _checked((r["measured"] / div, pred / div), step, err, m, wide))
        if r.get("freed_leak"):
            cells[-1][len(cols)] += " ᶠ"
    shared = "Every row: " + ", ".join(f"{h} {v}" for h, v in same) + "." if same else ""
    notes = m.get("freed_leak", "") if any(r.get("freed_leak") for r in rows) else ""
    return "\n\n".join(x for x in (shared, _markdown(head + ["within bounds"], cells), notes) if x), cells


TRAIN_HEAD = ["job", "strategy", "measured GiB", "planned GiB", "error", "measured tokens/s", "planned tokens/s",
              "step-time error"]


def _train_row(label: str, argv: list, strategy: str, tps: float, peak: float, tmp: str, m: dict,
               gpu: list | None = None) -> list:
    """One row of test_plan_measured.py's tables against its plan (on `gpu`'s flags; default the test's H200)."""
    from pathlib import Path

    t = _train_rows()
    p_tps, p_peak = t.predict(argv, strategy, Path(tmp), gpu or t.H200)
    # the same tokens per step on both sides: the step-time error is measured / planned tokens/s - 1
    return [label, strategy] + _checked((peak, p_peak), (f"{tps / 1e3:.1f}k", f"{p_tps / 1e3:.1f}k"), tps / p_tps - 1,
                                        m, None)


def _meta_line(rows: list[dict], m: dict) -> str:
    """The hardware, dates and versions the rows record (their `meta`; else the set's own in calibration.json)."""
    metas = [r.get("meta") or {} for r in rows]
    if not any(metas):
        return f"{m['hardware']}, {m['date']}"
    devices = sorted({f"{m.get('device', '?')} × {r['world']}" for m, r in zip(metas, rows)})
    days = sorted({m["date"][:10] for m in metas if m.get("date")})
    versions = sorted({", ".join(f"{k} {m[k]}" for k in ("torch", "transformers", "deepspeed", "peft") if m.get(k))
                       for m in metas})
    return f"{'; '.join(devices)}, {' and '.join(days) or 'date not recorded'} ({'; '.join(versions)})"


def _set_heading(name: str, m: dict, hardware: str, source: str) -> str:
    from shardwise.plan import calibration

    wide = "; ".join(f"{calibration.row_name(m, w['row'])} to {w['step_tol']:.0%} ({w['why']})" for w in m["wide"]
                     if w["step_tol"] is not None)
    outside = "; ".join(f"{calibration.row_name(m, w['row'])}: {w['why']}" for w in m["wide"] if w["step_tol"] is None)
    step = (f"step time within {m['step_tol']:.0%}{' (wider: ' + wide + ')' if wide else ''}"
            f"{' (not held yet: ' + outside + ')' if outside else ''}"
            if m["step_tol"] is not None else "step time not bounded")
    return (f"**`{name}`**: {hardware}; rows {_code(source)}; checked by {_code(m['test'])}. Bounds: peak within "
            f"{m['mem_tol']:.0%}, {step}."
            f"{' Archived rows: `' + m['archived'] + '` (below).' if m['archived'] else ''}")


def accuracy_blocks() -> dict[str, str]:
    """docs/planner.md's generated accuracy blocks, by name: one per measured set, and the archived rows."""
    from shardwise.plan import calibration

    blocks = {}
    for name in RESULT_SETS:
        m = calibration.measured_set(name)
        rows, _ = set_rows(name)
        table_, cells = _case_table(rows, name)
        blocks[f"accuracy {name}"] = "\n\n".join([_set_heading(name, m, _meta_line(rows, m), m["source"]), table_,
                                                  _summary(cells, m["step_tol"] is not None)])
    name = "shardwise_train_h200"
    m = calibration.measured_set(name)
    old = os.environ.get("SHARDWISE_CACHE_DIR")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["SHARDWISE_CACHE_DIR"] = os.path.join(tmp, "cache")  # no doctor.json: the flags' hardware only
        try:
            cells = [_train_row(*row, tmp, m) for row in _train_rows().ROWS]
            h100 = calibration.measured_set("h100_one_gpu")
            h100_cells = [_train_row(*row, tmp, h100, _train_rows().H100) for row in _train_rows().H100_ROWS]
            archived = _archived_block(tmp)
            grid = calibration.measured_set("h100_rehearsed_grid")
            grid_cells = _grid_cells(grid, tmp)
        finally:
            os.environ.pop("SHARDWISE_CACHE_DIR") if old is None else os.environ.update(SHARDWISE_CACHE_DIR=old)
    blocks[f"accuracy {name}"] = "\n\n".join([_set_heading(name, m, f"{m['hardware']}, {m['date']}", m["source"]),
                                              _markdown(TRAIN_HEAD + ["within bounds"], cells), _summary(cells, True)])
    blocks["accuracy h100_one_gpu"] = "\n\n".join([
        _set_heading("h100_one_gpu", h100, f"{h100['hardware']}, {h100['date']}", h100["source"]),
        _markdown(TRAIN_HEAD + ["within bounds"], h100_cells), _summary(h100_cells, True)])
    blocks["accuracy archived"] = archived
    blocks["accuracy h100_rehearsed_grid"] = "\n\n".join([
        _set_heading("h100_rehearsed_grid", grid, f"{grid['hardware']}, {grid['date']}", grid["source"])
        + " Memory: the plan's tensor peak against the rank's peak allocated bytes; compute: the plan's step "
        "without its exposed communication against the rank's compute-only step.",
        _markdown(GRID_HEAD + ["within bounds"], grid_cells), _summary(grid_cells, True)])
    name = "h200_float8"
    m = calibration.measured_set(name)
    cells = _float8_cells(m)
    blocks[f"accuracy {name}"] = "\n\n".join([
        _set_heading(name, m, f"{m['hardware']}, {m['date']}", m["source"]) + " Every row: compiled blocks, bf16 "
        "autocast over fp32 weights, the fused head, one rank.",
        _markdown(FLOAT8_HEAD + ["within bounds"], cells), _summary(cells, True)])
    return blocks


GRID_HEAD = ["row", "ranks", "layout", "allocated GiB", "planned tensors GiB", "error", "measured compute s",
             "planned s without comm", "error"]


def _grid_cells(m: dict, tmp: str) -> list[list]:
    """tests/unit/test_plan_rehearsed_grid.py's rows (rehearsed ranks of the issue-41 grid), planned as it plans
    them (the caller supplies the cache-free environment and a folder for the shapes made for a run)."""
    from pathlib import Path

    t = _test_module("test_plan_rehearsed_grid")
    cells = []
    for r in t.ROWS:
        p, h = t._plan(r, Path(tmp)), r["rehearsed"]
        planned = t.planned_compute(p)
        row = [r["name"], str(h["world"]), h["dims"]] + _checked(
            (h["peak_allocated_gib"], p["mem_gib"]["peak_tensors"]),
            (f"{h['compute_s']:.3f}", f"{planned:.3f}"), planned / h["compute_s"] - 1, m, None)
        if r["name"] in t.COMPUTE_GAPS:
            row[-1] = "**NO** (the step time: see the set's rows outside the bound)"
        cells.append(row)
    return cells


def _archived_block(tmp: str) -> str:
    """Every archived row with why it is archived, its measurement and what today's planner predicts for it."""
    from shardwise.plan import calibration

    owner = {calibration.measured_set(n)["archived"]: n for n in (*RESULT_SETS, "shardwise_train_h200")}
    parts = []
    for group, a in _archive().items():
        if group.startswith("_"):
            continue
        parts.append(f"**`{group}`** (from `{owner[group]}`, rows {_code(a['source'])}): archived because {a['why']}.")
        if "rows" in a:
            m = calibration.measured_set(owner[group])
            cells = [_train_row(r["label"], r["argv"], r["strategy"], r["tokens_per_s"], r["peak_gib"], tmp, m)
                     for r in a["rows"]]
            parts.append(_markdown(TRAIN_HEAD + ["within the set's bounds"], cells))
        else:
            parts.append(_case_table(set_rows(owner[group])[1], owner[group])[0])
    return "\n\n".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="CPU: a few cases only.")
    ap.add_argument("--nproc", type=int, default=2, help="CPU: ranks.")
    ap.add_argument("--gpu", action="store_true", help="The GPU case list, one rank in this process.")
    ap.add_argument("--gpu-quick", action="store_true", help="--gpu: the anchor's strategies + 3 other rows.")
    ap.add_argument("--cases", choices=sorted(CASE_SETS), default="default", help="--gpu: which case list (issue16: "
                    "presets x full/LoRA/QLoRA x checkpointing on two new shapes, with step time).")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="--gpu: cpu runs the GPU list at tiny sizes on the CPU (smoke test).")
    ap.add_argument("--dry-run", action="store_true", help="--gpu: list the cases and predictions, run nothing.")
    ap.add_argument("--budget-s", type=float, default=220.0, help="--gpu: start no case after this many seconds.")
    ap.add_argument("--limit", type=int, default=0, help="Run only the first N cases.")
    ap.add_argument("--models", help="Comma-separated model names to keep (e.g. m-27M).")
    ap.add_argument("--compute", help="Comma-separated compute dtypes to keep (fp32, bf16).")
    ap.add_argument("--snapshot", action="store_true", help="--gpu: record allocations and keep what was alive at "
                    "each case's peak, grouped by the allocating frame (row key peak_breakdown; slows the case).")
    ap.add_argument("--pick", default="", help="Comma-separated 1-based case numbers (as --dry-run lists them).")
    ap.add_argument("--steps", type=int, default=2, help="Optimizer steps per case (>= 2); measured: the largest "
                    "peak after the first step.")
    ap.add_argument("--only", default="", help="Comma-separated strategies to keep.")
    ap.add_argument("--json", help="Write the rows here (after every case).")
    ap.add_argument("--table", metavar="ROWS.json", help="Print the Markdown table of saved rows and exit.")
    a = ap.parse_args()
    if a.table:
        with open(a.table) as fh:
            print(table(json.load(fh)))
        return
    rows = run_gpu(a) if a.gpu else run_cpu(a)
    if not rows:
        return
    import torch

    print()
    print(table(rows))
    print(f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    if a.json:
        write_json(a.json, rows)
        with open(os.path.splitext(a.json)[0] + ".md", "w") as fh:
            fh.write(table(rows) + "\n")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        cpu_worker(sys.argv[2], sys.argv[3])
    else:
        main()
