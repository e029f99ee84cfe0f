"""The training loop: one readable recipe for every strategy.

It asks the strategy for everything backend-specific (wrap, autocast, no-sync, backward,
step, state) and never branches on which strategy it has.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import signal
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardwise import strategies
from shardwise.config import Config, from_dict
from shardwise.data.batches import DataPosition, StepBatch, StepSampler
from shardwise.data.encode import IGNORE, Encoded
from shardwise.errors import ShardwiseError
from shardwise.hardware import peak_flops
from shardwise.models.load import load_model, load_tokenizer
from shardwise.models.speed import compile_blocks, install_fused_loss
from shardwise.strategies.base import DTYPES
from shardwise.train import checkpoint as ckpt
from shardwise.train import dist as sdist
from shardwise.train.faults import Faults
from shardwise.train.metrics import Reporter, Window, flops_per_token, peak_memory_gib
from shardwise.train.profile import StepProfiler


@dataclass
class Job:
    """What the launcher hands each worker (written as JSON next to the prepared data)."""

    config: dict
    model_dir: str
    data_file: str
    output_dir: str
    resume: str  # "none", "auto" or a checkpoint path


class Preempted(Exception):
    """SIGTERM/SIGINT arrived; a checkpoint was written (the launcher says how to resume)."""


def lr_at(cfg: Config, step: int, total: int) -> float:
    """Linear warm-up to lr, then cosine decay to min_lr_ratio * lr at the last step."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(total - cfg.warmup_steps, 1)
    progress = min(max(step - cfg.warmup_steps, 0) / span, 1.0)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy in fp32 (targets are already shifted; IGNORE = no loss)."""
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1),
                           ignore_index=IGNORE, reduction="sum")


def build_model(cfg: Config, model_dir: str):
    """The HF model on the CPU, before any strategy touches it: storage dtype,
    gradient checkpointing and adapters are the same for every strategy."""
    model = load_model(model_dir, DTYPES[cfg.param_dtype], cfg.trust_remote_code)
    if cfg.tuner != "full":
        from shardwise.models.lora import apply_lora

        model = apply_lora(model, cfg)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.fused_loss:
        install_fused_loss(model)
    if cfg.compile == "on" or (cfg.compile == "auto" and torch.cuda.is_available()):
        compile_blocks(model)
    return model


class Control:
    """Decisions every rank must take at the same step: stop (SIGTERM/SIGINT reached some
    rank) and save (save_every_minutes elapsed on rank 0's clock). A request names a step
    two ahead of the requester's, through the rendezvous store; ranks are never more than
    one step apart (every step has collectives), so all of them see it in time. No GPU
    sync, no extra communicator: two store reads per step."""

    MARGIN = 2

    def __init__(self, env, save_every_minutes: float):
        self.signal: int | None = None
        self.rank = env.rank
        self.interval = save_every_minutes * 60
        self.last_save = time.monotonic()
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.keys = (f"shardwise/control/{attempt}/stop_at", f"shardwise/control/{attempt}/save_at")
        self.store = dist.distributed_c10d._get_default_store() if env.world_size > 1 else None
        self.local = {k: 0 for k in self.keys}
        if self.store is not None and self.rank == 0:
            for k in self.keys:
                self.store.set(k, "0")
        sdist.barrier()
        self.proposed_stop = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.signal = signum

    def _propose(self, key: str, step: int) -> None:
        if self.store is None:
            self.local[key] = step
        elif key == self.keys[0]:
            self.store.compare_set(key, "0", str(step))  # the first request wins
        else:
            self.store.set(key, str(step))  # only rank 0 proposes saves

    def _read(self, key: str) -> int:
        return int(self.store.get(key)) if self.store is not None else self.local[key]

    def poll(self, step: int) -> tuple[bool, bool]:
        """After `step` finished: (stop, save) as every rank decides it at this step."""
        stop_key, save_key = self.keys
        if self.signal is not None and not self.proposed_stop:
            self._propose(stop_key, step + (self.MARGIN if self.store is not None else 0))
            self.proposed_stop = True
        save_at = self._read(save_key)
        due = save_at == step
        # rank 0 proposes the next save only once the agreed one has passed (never moves a
        # pending one, which another rank may already have read)
        if (self.rank == 0 and not due and save_at < step and self.interval > 0
                and time.monotonic() - self.last_save >= self.interval):
            self._propose(save_key, step + (self.MARGIN if self.store is not None else 0))
            if self.store is None:
                due = True
        stop_at = self._read(stop_key)
        return (stop_at != 0 and stop_at <= step), due

    def saved(self) -> None:
        self.last_save = time.monotonic()

    def close(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)


def run(job: Job) -> dict:
    cfg = from_dict(job.config)
    env = sdist.init_distributed(cfg.collective_timeout)
    torch.manual_seed(cfg.seed)
    out = job.output_dir
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0
    faults = Faults(env.rank)

    tokenizer = load_tokenizer(job.model_dir, cfg.trust_remote_code)
    model = build_model(cfg, job.model_dir)
    hf_config = model.config
    head = model.get_output_embeddings()
    fused_head = head if getattr(head, "loss_targets", "absent") is None else None
    n_params = sum(p.numel() for p in model.parameters())
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    broadcasted = sdist.ensure_same_weights(model, env)

    strategy = strategies.get(cfg.strategy)(cfg, env)
    model, optimizer = strategy.setup(model)

    from safetensors.torch import load_file

    data = Encoded.from_tensors(load_file(job.data_file))
    sampler = StepSampler(data, cfg.micro_batch_size, cfg.grad_accum, env.world_size, env.rank, cfg.seed,
                          tokenizer.pad_token_id)
    total = cfg.max_steps if cfg.max_steps > 0 else cfg.epochs * sampler.steps_per_epoch

    # -- resume ------------------------------------------------------------------------
    step, pos, tokens_seen, resume_from = 0, DataPosition(), 0, None
    resume = "auto" if restarted and job.resume == "none" else job.resume
    if resume == "auto":
        resume_from = ckpt.latest(out)
    elif resume != "none":
        resume_from = resume
    notes = []
    if broadcasted:
        notes.append("ranks held different initial weights; rank 0's were broadcast to all")
    if restarted:
        notes.append(f"restart {os.environ.get('TORCHELASTIC_RESTART_COUNT')} after a worker failure")
    if resume_from:
        if env.is_main:
            ckpt.remove_partial(out)
        meta = ckpt.read_meta(resume_from)
        state = strategy.state_dict(model, optimizer)
        ckpt.load(resume_from, state)
        strategy.load_state_dict(model, optimizer, state)
        step, tokens_seen = meta["step"], meta.get("tokens_seen", 0)
        pos = DataPosition(**meta["data_position"])
        same_world = meta.get("world_size") == env.world_size
        if same_world:
            ckpt.restore_rng(resume_from, env.rank)
        notes.append(f"resumed from {resume_from} at step {step} (saved by {meta.get('strategy')} on "
                     f"{meta.get('world_size')} ranks; now {cfg.strategy} on {env.world_size})"
                     + ("" if same_world else f"; data continues at row {pos.offset} of epoch {pos.epoch}, "
                        "so no row of the epoch is repeated or skipped; RNG streams restart"))

    rep = Reporter(out, env.is_main, total, step, append=resume_from is not None)
    rep.say(f"shardwise: {strategy.describe()} on {env.world_size} rank(s) ({env.backend}, {env.device.type}), "
            f"{n_params / 1e6:.2f}M params ({n_trainable / 1e6:.2f}M trainable), {len(data)} sequences, "
            f"global batch {sampler.global_batch}, {total} steps")
    for n in notes:
        rep.say("shardwise: " + n)

    peak = None
    if env.device.type == "cuda":
        peak = peak_flops(torch.cuda.get_device_name(env.device),
                          cfg.mixed_precision if cfg.mixed_precision != "no" else "fp32")
    world = env.world_size
    control = Control(env, cfg.save_every_minutes)
    profiler = StepProfiler.from_config(cfg, env.device, total)
    save = lambda: save_checkpoint(cfg, env, strategy, model, optimizer, out, step, pos, tokens_seen,  # noqa: E731
                                   job.model_dir, tokenizer)
    window, loss_acc, seq_acc = Window(), torch.zeros((), device=env.device), 0.0
    t_start = time.time()
    last_rec, first_loss, skipped, loss_n, tokens_run = {}, None, 0, 0, 0
    # Steps whose non-finite flag has not been read: the loop reads it one step late, once the next step's
    # forward/backward is queued (so the GPU never idles waiting for the host), or at a log step, a checkpoint or
    # the end, whichever is first. A skipped update was never applied, so --on-nan stop still stops before any
    # later update; their losses stay out of the logged mean.
    unread: list[tuple[int, StepBatch, torch.Tensor]] = []

    def settle() -> None:
        nonlocal skipped, loss_acc, loss_n
        for (s, b, loss), bad in zip(unread, strategy.take_nonfinite()):
            if bad:
                skipped += 1
                on_nonfinite(cfg, env, rep, s, b, job, out)
            else:
                loss_acc += loss
                loss_n += 1
        unread.clear()

    model.train()
    phase = "setup"
    try:
        while step < total:
            phase = f"step {step + 1}: forward/backward (gradient reduction)"
            faults.before_step(step + 1)
            batch, next_pos = sampler.next(pos)
            for g in optimizer.param_groups:
                g["lr"] = lr_at(cfg, step, total)
            with profiler.step(step + 1):  # a null context unless this step is profiled
                step_loss = train_step(model, strategy, batch, world, env.device, faults, step + 1, fused_head)
                settle()  # the previous step's flag
                phase = f"step {step + 1}: optimizer step (gradient-norm reduction)"
                grad_norm = strategy.step(model, optimizer)
            step, pos = step + 1, next_pos
            unread.append((step, batch, step_loss))
            tokens_seen += batch.tokens
            tokens_run += batch.tokens
            window.add(batch.tokens)
            seq_acc += batch.tokens / len(batch.rows)
            # a profiled step is logged on its own: the step before it closes the window
            if step % cfg.log_every == 0 or step == total or profiler.wants(step) or profiler.wants(step + 1):
                phase = f"step {step}: metrics reduction"
                settle()
                rec = log_record(env, cfg, window, loss_acc, loss_n, seq_acc, step, total, grad_norm, pos, tokens_seen,
                                 skipped, peak, n_params, hf_config, profiler.take())
                rep.log(rec)
                if rec.get("profiled"):
                    rep.say(f"shardwise: step {step} profiled: communication {rec['comm_total_s'] * 1e3:.1f} ms, "
                            f"exposed {rec['comm_exposed_s'] * 1e3:.1f} ms (max over ranks; {rec['comm_method']})")
                first_loss = rec["loss"] if first_loss is None else first_loss
                last_rec = rec
                window, loss_acc, seq_acc, loss_n = Window(), torch.zeros((), device=env.device), 0.0, 0
            stop, due = control.poll(step)
            save_due = step < total and ((cfg.save_every and step % cfg.save_every == 0) or due)
            if stop or save_due:
                settle()  # a checkpoint follows a step whose update is known
            if stop:
                phase = "checkpoint save"
                path = save()
                rep.say(f"shardwise: stopped by a signal after step {step}; checkpoint written to {path}")
                if env.is_main:
                    _write_json(os.path.join(out, ".prep", "interrupted.json"), {"step": step, "checkpoint": path})
                raise Preempted(path)
            if save_due:
                phase = f"step {step}: checkpoint save"
                save()
                control.saved()
        settle()
        if cfg.save_every and not (ckpt.latest(out) or "").endswith(f"step_{step:08d}"):
            phase = "final checkpoint save"
            save()
    except (RuntimeError, dist.DistBackendError) as e:
        if is_collective_timeout(e):
            raise ShardwiseError(
                f"rank {env.rank}: a collective did not complete within --collective-timeout "
                f"{cfg.collective_timeout:g}s during {phase}: another rank is hung or dead "
                f"({str(e).strip().splitlines()[0][:160]})") from e
        raise
    finally:
        control.close()

    final_dir = save_final(cfg, env, strategy, model, tokenizer, out) if cfg.save_final else None
    wall = time.time() - t_start
    summary = {"strategy": cfg.strategy, "world_size": world, "steps": step, "first_loss": first_loss,
               "final_loss": last_rec.get("loss"), "mean_tokens_per_s": tokens_run / wall if wall > 0 else None,
               "peak_mem_gib": last_rec.get("peak_mem_gib"), "wall_time_s": wall, "params": n_params,
               "trainable_params": n_trainable, "skipped_nonfinite_steps": skipped, "final_model": final_dir}
    if env.is_main:
        _write_json(os.path.join(out, "summary.json"), summary)
    rep.say(f"shardwise: done: {step} steps, loss {first_loss:.4f} (first logged) -> {summary['final_loss']:.4f} (last)"
            if first_loss is not None else f"shardwise: done: {step} steps")
    rep.close()
    sdist.barrier()
    if dist.is_initialized():
        dist.destroy_process_group()
    return summary


def is_collective_timeout(e: BaseException) -> bool:
    text = str(e).lower()
    return any(k in text for k in ("timed out", "timeout", "watchdog", "connection closed by peer",
                                   "connection reset by peer"))


def train_step(model, strategy, batch: StepBatch, world: int, device, faults: Faults, step: int,
               fused_head=None) -> torch.Tensor:
    """Forward/backward over the rank's micro-batches; returns this rank's share of the
    global mean loss (a tensor, so no host sync). Each micro-batch's summed loss is divided
    by the global batch's loss-token count and scaled by the world size, because every
    strategy averages gradients over ranks: the result equals one process on the whole
    global batch."""
    scale = world / batch.loss_tokens
    total = torch.zeros((), device=device)
    last = len(batch.micro) - 1
    for i, mb in enumerate(batch.micro):
        ids = mb.input_ids.to(device, non_blocking=True)
        pos = mb.position_ids.to(device, non_blocking=True)
        tg = mb.targets.to(device, non_blocking=True)
        with strategy.sync(model, i == last), strategy.autocast():
            if fused_head is not None:  # the head returns the summed loss (models/speed.py)
                fused_head.loss_targets = tg
                summed = model(input_ids=ids, position_ids=pos).logits
                fused_head.loss_targets = None
            else:
                summed = loss_sum(model(input_ids=ids, position_ids=pos).logits, tg)
            loss = faults.poison_loss(step, summed * scale)
        strategy.backward(loss)
        total += loss.detach() / world
    return total


def log_record(env, cfg, window, loss_acc, loss_n, seq_acc, step, total, grad_norm, pos, tokens_seen, skipped, peak,
               n_params, hf_config, comm: dict | None = None) -> dict:
    """The logged metrics; the only host syncs of the loop (besides the non-finite check and
    a profiled step's). `comm`: this rank's times of a profiled step (train/profile.py)."""
    sdist.all_reduce(loss_acc)
    peak_here = peak_memory_gib(env.device)
    # max and min over ranks in one reduction (and a profiled step's communication times, max over ranks)
    mem = torch.tensor([peak_here, -peak_here] + ([comm["comm_total_s"], comm["comm_exposed_s"]] if comm else []),
                       dtype=torch.float64, device=env.device)
    sdist.all_reduce(mem, dist.ReduceOp.MAX)
    step_time, tps = window.read()
    rec = {"step": step, "loss": loss_acc.item() / loss_n if loss_n else float("nan"), "lr": lr_at(cfg, step - 1, total),
           "grad_norm": float(grad_norm), "tokens_per_s": tps, "step_time_s": step_time,
           "peak_mem_gib": mem[0].item(), "peak_mem_gib_min": -mem[1].item(), "epoch": pos.epoch, "tokens_seen": tokens_seen}
    if skipped:
        rec["skipped_nonfinite_steps"] = skipped
    if comm:
        rec.update(comm_total_s=mem[2].item(), comm_exposed_s=mem[3].item(), comm_method=comm["comm_method"],
                   profiled=True)
    if peak:
        fpt = flops_per_token(n_params, hf_config.num_hidden_layers, hf_config.hidden_size, seq_acc / window.steps)
        rec["mfu"] = fpt * tps / (peak * env.world_size)
    return rec


def on_nonfinite(cfg, env, rep, step, batch: StepBatch, job: Job, out: str) -> None:
    """The update of `step` was skipped (non-finite gradients). Count it, or stop."""
    sources = ckpt_sources(job.data_file, batch.rows)
    last_good = ckpt.latest(out) or "none yet"
    where = ", ".join(sources[:4]) + (" ..." if len(sources) > 4 else "")
    if cfg.on_nan == "stop":
        raise ShardwiseError(f"non-finite loss or gradients at step {step} (batch records: {where}); the update "
                             f"was not applied; last good checkpoint: {last_good}; lower --lr, check these records, "
                             "or pass --on-nan skip")
    rep.say(f"shardwise: step {step}: non-finite loss or gradients, update skipped (batch records: {where})")


def ckpt_sources(data_file: str, rows: list[int]) -> list[str]:
    path = os.path.join(os.path.dirname(data_file), "sources.json")
    try:
        with open(path) as fh:
            src = json.load(fh)
        return [src[r] for r in rows]
    except (OSError, IndexError, json.JSONDecodeError):
        return [f"row {r}" for r in rows]


def save_checkpoint(cfg, env, strategy, model, optimizer, out, step, pos, tokens_seen, model_dir, tokenizer) -> str:
    meta = {"step": step, "data_position": pos.to_dict(), "tokens_seen": tokens_seen,
            "world_size": env.world_size, "strategy": cfg.strategy, "config": dataclasses.asdict(cfg)}
    return ckpt.save(out, step, strategy.state_dict(model, optimizer), meta, env.rank, cfg.keep_checkpoints,
                     model_dir=model_dir)


def save_final(cfg, env, strategy, model, tokenizer, out) -> str:
    """A Hugging Face directory (safetensors + config + tokenizer), written atomically."""
    full = strategy.full_model_state_dict(model)
    final = os.path.join(out, "final")
    if env.is_main:
        tmp = final + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        hf = strategy.unwrap(model)
        if cfg.tuner != "full":  # a PEFT adapter directory (+ final/merged with merge_lora)
            from shardwise.models.lora import save_final as save_adapter

            save_adapter(hf, full, tokenizer, tmp, cfg)
        else:
            hf.save_pretrained(tmp, state_dict=full)
        tokenizer.save_pretrained(tmp)
        ckpt.apply_umask(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
    sdist.barrier()
    return final


def _write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=1)
    os.replace(tmp, path)
