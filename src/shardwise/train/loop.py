"""The training loop: one readable recipe for every strategy.

It asks the strategy for everything backend-specific (wrap, autocast, no-sync, backward,
step, state) and never branches on which strategy it has.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardwise import strategies
from shardwise.config import Config, from_dict
from shardwise.data.batches import DataPosition, StepBatch, StepSampler
from shardwise.data.encode import IGNORE, Encoded
from shardwise.hardware import peak_flops
from shardwise.models.load import load_model, load_tokenizer
from shardwise.strategies.base import DTYPES
from shardwise.train import checkpoint as ckpt
from shardwise.train import dist as sdist
from shardwise.train.metrics import Reporter, Window, flops_per_token, peak_memory_gib


@dataclass
class Job:
    """What the launcher hands each worker (written as JSON next to the prepared data)."""

    config: dict
    model_dir: str
    data_file: str
    output_dir: str
    resume: str  # "none", "auto" or a checkpoint path


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
    return model


def run(job: Job) -> dict:
    cfg = from_dict(job.config)
    env = sdist.init_distributed()
    torch.manual_seed(cfg.seed)
    out = job.output_dir
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0

    tokenizer = load_tokenizer(job.model_dir, cfg.trust_remote_code)
    model = build_model(cfg, job.model_dir)
    hf_config = model.config
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
    if resume_from:
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
    rep.say(f"shardwise: {cfg.strategy} on {env.world_size} rank(s) ({env.backend}, {env.device.type}), "
            f"{n_params / 1e6:.2f}M params ({n_trainable / 1e6:.2f}M trainable), {len(data)} sequences, "
            f"global batch {sampler.global_batch}, {total} steps")
    for n in notes:
        rep.say("shardwise: " + n)

    peak = peak_flops(torch.cuda.get_device_name(env.device), cfg.mixed_precision if cfg.mixed_precision != "no" else "fp32") \
        if env.device.type == "cuda" else None
    world = env.world_size
    window, loss_acc = Window(), torch.zeros((), device=env.device)
    seq_acc = 0
    t_start = time.time()
    last_rec, first_loss = {}, None
    model.train()
    while step < total:
        batch, pos = sampler.next(pos)
        for g in optimizer.param_groups:
            g["lr"] = lr_at(cfg, step, total)
        step_loss = train_step(model, strategy, batch, world, env.device)
        grad_norm = strategy.step(model, optimizer)
        step += 1
        tokens_seen += batch.tokens
        loss_acc += step_loss
        window.add(batch.tokens)
        seq_acc += batch.tokens / len(batch.rows)
        if step % cfg.log_every == 0 or step == total:
            sdist.all_reduce(loss_acc)
            mem = torch.tensor([peak_memory_gib(env.device)], device=env.device)
            sdist.all_reduce(mem, dist.ReduceOp.MAX)
            step_time, tps = window.read()
            rec = {"step": step, "loss": loss_acc.item() / window.steps, "lr": lr_at(cfg, step - 1, total),
                   "grad_norm": float(grad_norm), "tokens_per_s": tps, "step_time_s": step_time,
                   "peak_mem_gib": mem.item(), "epoch": pos.epoch, "tokens_seen": tokens_seen}
            if peak:
                fpt = flops_per_token(n_params, hf_config.num_hidden_layers, hf_config.hidden_size,
                                      seq_acc / window.steps)
                rec["mfu"] = fpt * tps / (peak * world)
            rep.log(rec)
            first_loss = rec["loss"] if first_loss is None else first_loss
            last_rec = rec
            window, loss_acc, seq_acc = Window(), torch.zeros((), device=env.device), 0
        if cfg.save_every and step % cfg.save_every == 0 and step < total:
            save_checkpoint(cfg, env, strategy, model, optimizer, out, step, pos, tokens_seen)
    if cfg.save_every and not (ckpt.latest(out) or "").endswith(f"step_{step:08d}"):
        save_checkpoint(cfg, env, strategy, model, optimizer, out, step, pos, tokens_seen)

    final_dir = None
    if cfg.save_final:
        final_dir = save_final(cfg, env, strategy, model, tokenizer, out)
    wall = time.time() - t_start
    summary = {"strategy": cfg.strategy, "world_size": world, "steps": step, "first_loss": first_loss,
               "final_loss": last_rec.get("loss"),
               "mean_tokens_per_s": tokens_seen / wall if wall > 0 else None,
               "peak_mem_gib": last_rec.get("peak_mem_gib"), "wall_time_s": wall, "params": n_params,
               "trainable_params": n_trainable, "final_model": final_dir}
    if env.is_main:
        _write_json(os.path.join(out, "summary.json"), summary)
    rep.say(f"shardwise: done: {step} steps, loss {first_loss:.4f} (first logged) -> {summary['final_loss']:.4f} (last)"
            if first_loss is not None else f"shardwise: done: {step} steps")
    rep.close()
    sdist.barrier()
    if dist.is_initialized():
        dist.destroy_process_group()
    return summary


def train_step(model, strategy, batch: StepBatch, world: int, device) -> torch.Tensor:
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
            logits = model(input_ids=ids, position_ids=pos).logits
            loss = loss_sum(logits, tg) * scale
        strategy.backward(loss)
        total += loss.detach() / world
    return total


def save_checkpoint(cfg, env, strategy, model, optimizer, out, step, pos, tokens_seen) -> str:
    meta = {"step": step, "data_position": pos.to_dict(), "tokens_seen": tokens_seen,
            "world_size": env.world_size, "strategy": cfg.strategy, "config": dataclasses.asdict(cfg)}
    return ckpt.save(out, step, strategy.state_dict(model, optimizer), meta, env.rank, cfg.keep_checkpoints)


def save_final(cfg, env, strategy, model, tokenizer, out) -> str:
    """A Hugging Face directory (safetensors + config + tokenizer), written atomically."""
    import shutil

    full = strategy.full_model_state_dict(model)
    final = os.path.join(out, "final")
    if env.is_main:
        tmp = final + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        hf = strategy.unwrap(model)
        hf.save_pretrained(tmp, state_dict=full)
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
    sdist.barrier()
    return final


def _write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=1)
    os.replace(tmp, path)

