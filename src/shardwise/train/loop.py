"""The training loop: one readable recipe for every strategy.

It asks the strategy for everything backend-specific (wrap, autocast, no-sync, backward,
step, state) and never branches on which strategy it has.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardwise import phases, rundir, strategies
from shardwise.config import Config, from_dict
from shardwise.data.batches import DataPosition, StepBatch, StepSampler, padding_free
from shardwise.data.encode import Encoded
from shardwise.data.templates import use_chat_template
from shardwise.errors import ShardwiseError
from shardwise.hardware import peak_flops
from shardwise.models.load import load_model, load_tokenizer, model_family
from shardwise.models.moe import aux_loss_weight
from shardwise.models.save import save_pretrained
from shardwise.models.sequence_parallel import model_heads
from shardwise.models.speed import token_loss_sum
from shardwise.rundir import atomic_write_json, record_interrupted
from shardwise.strategies.base import DTYPES
from shardwise.train import checkpoint as ckpt
from shardwise.train import dist as sdist
from shardwise.train import objective, peers
from shardwise.train.control import Control
from shardwise.train.evaluate import Evaluator
from shardwise.train.faults import Faults
from shardwise.train.memsnap import MemorySnapshot
from shardwise.train.metrics import Reporter, Window, flops_per_token, peak_memory_gib
from shardwise.train.objective import SFT
from shardwise.train.profile import StepProfiler
from shardwise.train.schedule import Schedule, lr_at, resumed


@dataclass
class Job:
    """What the launcher hands each worker (written as JSON next to the prepared data)."""

    config: dict
    model_dir: str
    data_file: str
    output_dir: str
    resume: str  # "none", "auto" or a checkpoint path
    val_file: str = ""  # the tokenized validation set, if any
    timeline: dict = dataclasses.field(default_factory=dict)  # the launcher's marks (shardwise.phases)
    resume_record: dict = dataclasses.field(default_factory=dict)  # for resumes.jsonl, once the checkpoint loaded


class Preempted(Exception):
    """SIGTERM/SIGINT arrived; a checkpoint was written (the launcher says how to resume). `signum`: the first
    signal's number, for the exit code 128 + signum."""

    def __init__(self, path: str, signum: int | None = None):
        super().__init__(path)
        self.signum = signum


loss_sum = token_loss_sum  # summed token cross-entropy in fp32 (models/speed.py; vocabulary-sharded logits too)
_SFT = SFT()


def build_model(cfg: Config, model_dir: str):
    """The HF model on the CPU, before any strategy touches it: loaded in its storage dtype, with the run's
    adapters. Everything else that happens to it (the loss head, float8, the attention, tensor parallelism,
    checkpointing, compile, the data-parallel wrap) is the strategy's parallelize pipeline (Strategy.parallelize)."""
    model = load_model(model_dir, DTYPES[cfg.param_dtype], cfg.trust_remote_code)
    if cfg.tuner != "full":
        from shardwise.models.lora import apply_lora

        model = apply_lora(model, cfg)
    return model


FINISH_GRACE_S = 120.0  # a finished worker's teardown (trackers closed, barrier, process group, atexit): ~1 s


_kept: list = []  # an agent worker's Trainer, never torn down (run)


def run(job: Job) -> dict:
    """One training run on this rank: set up, train, write the final model and summary.

    A worker of the agent ends with os._exit once its run is complete (worker.py, zygote.py), so its Trainer is kept
    rather than freed on the way out: freeing it runs C++ destructors (the DDP reducer, the process group's
    threads), and one of them can hang holding the GIL after a finished 2-rank run (seen in CI), where
    exit_deadline's timer cannot run and only its backstop ended the process, with exit code 1."""
    trainer = Trainer(job)
    if os.environ.get("SHARDWISE_LAUNCHER_PID", str(os.getpid())) != str(os.getpid()):
        _kept.append(trainer)
    return trainer.train()


class Trainer:
    """The run's state on this rank. `setup` builds it (torchtitan's Trainer.__init__),
    `train_step` is one optimizer step, `train` the loop around it and the end of the run."""

    def __init__(self, job: Job):
        self.job, self.cfg, self.out = job, from_dict(job.config), job.output_dir
        self.phase = "setup"
        self.setup()

    # -- setup ------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg, job = self.cfg, self.job
        # where the time goes before the first step (summary.json phases_s); in one process the
        # worker starts where the launcher hands over
        marks = self.marks = dict(job.timeline)
        # a worker the agent started while the launcher prepared (launch.early._Early) began before `prepared`; its phase
        # then counts from there, and worker_process_start keeps when the process really started
        marks["worker_process_start"] = phases.process_start()
        marks["worker_start"] = max(marks["worker_process_start"], marks.get("prepared", 0.0))
        marks["setup_start"] = time.time()
        strategy_cls = strategies.get(cfg.strategy)
        env = self.env = sdist.init_distributed(cfg.collective_timeout,
                                                host_collectives=strategy_cls.host_collectives(cfg))
        marks["initialized"] = time.time()
        # the run's parallel degrees and its one device mesh: everything below reads them from here
        env.dims = self.dims = strategy_cls.parallel_dims(cfg, env, model_heads(job.model_dir))
        # a micro-batch's rows in one sequence (data/batches.py); decided before the model loads, so
        # --padding-free on with a model family that cannot take it stops here
        self.padding_free = padding_free(cfg, model_family(job.model_dir, cfg.trust_remote_code), self.dims.sp,
                                         self.dims.tp, env.device.type == "cuda")
        torch.manual_seed(cfg.seed)
        self.restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0
        self.faults = Faults(env.rank)

        self.tokenizer = load_tokenizer(job.model_dir, cfg.trust_remote_code)
        use_chat_template(self.tokenizer, cfg.chat_template)  # final/ carries the template the run trained with
        model = build_model(cfg, job.model_dir)
        self.hf_config = model.config
        self.aux_weight = aux_loss_weight(model)
        self.n_params = sum(p.numel() for p in model.parameters())
        self.n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        broadcasted = sdist.ensure_same_weights(model, env)
        marks["model_loaded"] = time.time()
        self.strategy = strategy_cls(cfg, env)
        self.model, self.optimizer = self.strategy.setup(model)  # the strategy's parallelize pipeline
        head = model.get_output_embeddings()  # the module the loss head step made fused, where it could
        self.fused_head = head if getattr(head, "loss_targets", "absent") is None else None
        # what a step optimises (SFT, or a preference loss with its reference model wrapped like the policy)
        self.objective = objective.build(cfg, job.model_dir, self.strategy, self.model)
        marks["wrapped"] = time.time()

        from safetensors.torch import load_file

        self.data = Encoded.from_tensors(load_file(job.data_file))
        # each data-parallel rank reads its own share (sequence/tensor-parallel peers read the same one);
        # the sequence-parallel ranks of a group each take their slice of every sequence
        self.sampler = StepSampler(self.data, cfg.micro_batch_size, cfg.grad_accum, self.dims.dp_size,
                                   self.dims.dp_rank, cfg.seed, self.tokenizer.pad_token_id,
                                   sp_degree=self.dims.sp, sp_rank=self.dims.sp_rank, padding_free=self.padding_free,
                                   flat_when_it_pays=cfg.padding_free == "auto", pairs=cfg.task == "dpo")
        self.total = cfg.max_steps if cfg.max_steps > 0 else cfg.epochs * self.sampler.steps_per_epoch
        self.schedule = Schedule(self.sampler.global_batch, self.total, self.sampler.global_batch)
        notes = ["ranks held different initial weights; rank 0's were broadcast to all"] if broadcasted else []
        if self.restarted:
            notes.append(f"restart {os.environ.get('TORCHELASTIC_RESTART_COUNT')} after a worker failure")
        self.resume(notes)
        self.announce(notes)
        if cfg.precompute_ref and getattr(self.objective, "reference", None) is not None:
            self.precompute_reference()

        self.peak = None
        if env.device.type == "cuda":
            self.peak = peak_flops(torch.cuda.get_device_name(env.device),
                                   cfg.mixed_precision if cfg.mixed_precision != "no" else "fp32")
        self.control = Control(env, cfg.save_every_minutes)
        self.profiler = StepProfiler.from_config(cfg, env.device, self.total, self.out, env.rank)
        self.snapshot = MemorySnapshot(cfg.memory_snapshot, self.out, env.rank, env.device)
        self.evaluator = Evaluator(cfg, env, job.val_file, self.tokenizer.pad_token_id, self.total, self.out)
        self.new_window()
        self.skipped, self.tokens_run, self.first_loss, self.last_rec = 0, 0, self.earlier["first_loss"], {}
        # Steps whose non-finite flag has not been read: the loop reads it one step late, once the next step's
        # forward/backward is queued (so the GPU never idles waiting for the host), or at a log step, a checkpoint or
        # the end, whichever is first. A skipped update was never applied, so --on-nan stop still stops before any
        # later update; their losses stay out of the logged mean.
        self.unread: list[tuple[int, StepBatch, torch.Tensor]] = []

    def resume(self, notes: list[str]) -> None:
        """The step, data position and state to start from: a checkpoint's, or the beginning."""
        cfg, env, out = self.cfg, self.env, self.out
        self.step, self.pos, self.tokens_seen, self.resume_from = 0, DataPosition(), 0, None
        self.earlier = {"first_loss": None, "wall_time_s": 0.0}  # the run before a resume, from the checkpoint
        resume = "auto" if self.restarted and self.job.resume == "none" else self.job.resume
        if resume == "auto":
            self.resume_from = ckpt.latest(out)
        elif resume != "none":
            self.resume_from = resume
        if not self.resume_from:
            return
        resume_from = self.resume_from
        if env.is_main:
            ckpt.remove_partial(out)
        meta = ckpt.read_meta(resume_from)
        # a checkpoint written before the optimizer's state was keyed by parameter name loads in its own form
        state = self.strategy.state_dict(self.model, self.optimizer, flat=ckpt.optimizer_is_flat(resume_from))
        ckpt.load(resume_from, state)
        self.strategy.load_state_dict(self.model, self.optimizer, state)
        self.step, self.tokens_seen = meta["step"], meta.get("tokens_seen", 0)
        self.earlier = {k: meta.get(k, v) for k, v in self.earlier.items()}
        pos = self.pos = DataPosition(**meta["data_position"])
        self.resume_schedule(meta, notes)
        same_world = meta.get("world_size") == env.world_size
        if same_world:
            ckpt.restore_rng(resume_from, env.rank)
        if env.is_main and self.job.resume_record:  # the launcher's record of this resume, now that it happened
            record = {**self.job.resume_record, "checkpoint": resume_from, "step": self.step}
            with open(os.path.join(out, rundir.RESUMES), "a") as fh:
                fh.write(json.dumps({k: record[k] for k in ("time", "checkpoint", "step", "notes", "config")
                                     if k in record}) + "\n")
        notes.append(f"resumed from {resume_from} at step {self.step} (saved by {meta.get('strategy')} on "
                     f"{meta.get('world_size')} ranks; now {cfg.strategy} on {env.world_size})"
                     + ("" if same_world else f"; data continues at row {pos.offset} of epoch {pos.epoch}, "
                        "so no row of the epoch is repeated or skipped; RNG streams restart"))

    def resume_schedule(self, meta: dict, notes: list[str]) -> None:
        """The schedule where the checkpoint left it (train/schedule.py): with another global batch, kept in
        sequences, and a note saying exactly what changed."""
        gb, naive = self.sampler.global_batch, self.total
        self.schedule, self.total = resumed(self.cfg, meta, len(self.data) // self.sampler.group, gb)
        s, step = self.schedule, self.step
        if s.batch == gb and self.total == naive:
            return
        notes.append(f"global batch {s.batch} -> {gb} sequences a step: the schedule is kept as saved, in sequences "
                     f"({s.sequences(step):,} of {s.steps * s.batch:,} trained): the run ends at step {self.total} "
                     f"(not {naive}), {self.total - step} steps of {gb} left, and the learning rate goes on from "
                     f"{s.lr(self.cfg, step):.3g} where the saved run would be after as many sequences")

    def precompute_reference(self) -> None:
        """--precompute-ref: the reference log-probabilities of every row in one pass, then the reference freed."""
        t0, ref = time.time(), self.objective.reference
        self.phase = "reference log-probabilities (--precompute-ref)"
        self.model.eval()
        self.objective.reference = objective.precompute(ref, self.model, self.sampler, self.dims.dp_size,
                                                        self.dims.dp_rank, self.env.device, self.strategy.autocast,
                                                        self.fused_head, sdist.all_reduce)
        self.model.train()
        ref.free()
        self.rep.say(f"shardwise: reference log-probabilities of {len(self.data)} rows precomputed in "
                     f"{time.time() - t0:.1f}s; the reference model is freed")

    def announce(self, notes: list[str]) -> None:
        env = self.env
        self.rep = Reporter(self.out, env.is_main, self.total, self.step, append=self.resume_from is not None,
                            report_to=self.cfg.report_to, config=dataclasses.asdict(self.cfg))
        sp = ""
        if self.dims.sp > 1:
            u, r = self.dims.sp_ulysses, self.dims.sp_ring
            how = "Ulysses" if r == 1 else "ring" if u == 1 else f"Ulysses {u} x ring {r}"
            sp = f" + {how} sequence parallel over groups of {self.dims.sp}"
        sp += f" + tensor parallel over groups of {self.dims.tp}" if self.dims.tp > 1 else ""
        self.rep.say(f"shardwise: {self.strategy.describe()}{sp} on {env.world_size} rank(s) ({env.backend}, "
                     f"{env.device.type}), {self.n_params / 1e6:.2f}M params ({self.n_trainable / 1e6:.2f}M "
                     f"trainable), {len(self.data)} sequences, global batch {self.sampler.global_batch}"
                     f"{' preference pairs' if self.sampler.group == 2 else ''}, "
                     f"{self.total} steps")
        flat = "padding-free: a micro-batch's rows in one sequence" + (
            " where that saves compute" if self.cfg.padding_free == "auto" else "")
        task = objective.describe(self.objective, self.cfg, self.strategy)
        applied = self.strategy.applied + ([flat] if self.padding_free else []) + ([task] if task else [])
        if applied:
            self.rep.say("shardwise: " + "; ".join(applied))
        for n in notes:
            self.rep.say("shardwise: " + n)

    # -- one step -----------------------------------------------------------------------------
    def train_step(self) -> torch.Tensor:
        """One optimizer step: the next batch, forward/backward over its micro-batches, the update.
        Returns the pre-clip gradient norm (a tensor: no host sync)."""
        cfg, step = self.cfg, self.step
        self.phase = f"step {step + 1}: forward/backward (gradient reduction)"
        self.faults.before_step(step + 1)
        batch, next_pos = self.sampler.next(self.pos)
        for g in self.optimizer.param_groups:
            g["lr"] = self.schedule.lr(cfg, step)
        with self.profiler.step(step + 1):  # a null context unless this step is profiled
            step_loss = forward_backward_step(self.model, self.strategy, batch, self.dims.grad_size, self.env.device,
                                              self.faults, step + 1, self.fused_head, loss_replicas=self.dims.tp,
                                              aux_weight=self.aux_weight, objective=self.objective)
            self.settle()  # the previous step's flag
            self.phase = f"step {step + 1}: optimizer step (gradient-norm reduction)"
            grad_norm = self.strategy.step(self.model, self.optimizer)
        self.step, self.pos = step + 1, next_pos
        self.unread.append((self.step, batch, step_loss))
        self.tokens_seen += batch.tokens
        self.tokens_run += batch.tokens
        self.window.add(batch.tokens)
        self.seq_acc += batch.tokens / len(batch.rows)
        return grad_norm

    def settle(self) -> None:
        """Read the non-finite flags of the steps not read yet: count (or stop on) skipped updates,
        add the others' losses to the logged mean."""
        for (s, b, loss), bad in zip(self.unread, self.strategy.take_nonfinite()):
            if bad:
                self.skipped += 1
                on_nonfinite(self.cfg, self.env, self.rep, s, b, self.job, self.out)
            else:
                self.loss_acc += loss
                self.loss_n += 1
        self.unread.clear()

    def new_window(self) -> None:
        self.window, self.seq_acc, self.loss_n = Window(), 0.0, 0
        self.loss_acc = torch.zeros(len(self.objective.names), device=self.env.device)

    def log(self, grad_norm) -> None:
        step = self.step
        self.phase = f"step {step}: metrics reduction"
        self.settle()
        comm = self.profiler.take()
        rec = log_record(self.env, self.cfg, self.window, self.loss_acc, self.loss_n, self.seq_acc, step, self.total,
                         grad_norm, self.pos, self.tokens_seen, self.skipped, self.peak, self.n_params, self.hf_config,
                         comm, self.objective.names, lr=self.schedule.lr(self.cfg, step - 1))
        self.phase = f"step {step}: validation"
        rec.update(self.evaluator.run(self.model, self.strategy, step, self.fused_head))
        self.rep.log(rec)
        if rec.get("profiled"):
            self.rep.say(f"shardwise: step {step} profiled: communication {rec['comm_total_s'] * 1e3:.1f} ms, "
                         f"exposed {rec['comm_exposed_s'] * 1e3:.1f} ms (max over ranks; {rec['comm_method']})")
            files = comm.get("profile_files") if comm else None
            if isinstance(files, list):
                self.rep.say(f"shardwise: step {step}'s operators and trace: {files[0]}, {files[1]} (each rank its own)")
            elif files:
                self.rep.say(f"shardwise: step {step}'s operators and trace were not written: {files}")
        self.first_loss = rec["loss"] if self.first_loss is None else self.first_loss
        self.last_rec = rec
        self.new_window()

    def save(self) -> str:
        return self.evaluator.keeping_best(self._save)()

    def _save(self) -> str:
        return save_checkpoint(self.cfg, self.env, self.strategy, self.model, self.optimizer, self.out, self.step,
                               self.pos, self.tokens_seen, self.job.model_dir, self.tokenizer,
                               first_loss=self.first_loss,
                               wall_time_s=self.earlier["wall_time_s"] + time.time() - self.t_start,
                               schedule=self.schedule.record(self.step))

    # -- the loop -----------------------------------------------------------------------------
    def train(self) -> dict:
        cfg, env, out, total = self.cfg, self.env, self.out, self.total
        self.t_start = self.marks["ready"] = time.time()
        self.model.train()
        try:
            while self.step < total:
                grad_norm = self.train_step()
                if "first_step" not in self.marks:
                    if env.device.type == "cuda":
                        torch.cuda.synchronize(env.device)  # once: the first step's time, compile included
                    self.marks["first_step"] = time.time()
                    phases.release_full_gc()  # started: collect as usual from here (phases.py)
                self.snapshot.after_step()
                step, profiler = self.step, self.profiler
                # a profiled step is logged on its own: the step before it closes the window
                if (step % cfg.log_every == 0 or step == total or profiler.wants(step) or profiler.wants(step + 1)
                        or self.evaluator.due(step)):
                    self.log(grad_norm)
                stop, due = self.control.poll(step)
                save_due = step < total and ((cfg.save_every and step % cfg.save_every == 0) or due)
                if stop or save_due:
                    self.settle()  # a checkpoint follows a step whose update is known
                if stop:
                    self.phase = "checkpoint save"
                    path = self.save()
                    self.rep.say(f"shardwise: stopped by a signal after step {step}; checkpoint written to {path}")
                    if env.is_main:
                        record_interrupted(out, step, path)
                    raise Preempted(path, self.control.signal)
                if save_due:
                    self.phase = f"step {step}: checkpoint save"
                    self.save()
                    self.control.saved()
            self.settle()
            self.marks["trained"] = time.time()
            if cfg.save_every and not (ckpt.latest(out) or "").endswith(f"step_{self.step:08d}"):
                self.phase = "final checkpoint save"
                self.save()
        except (RuntimeError, dist.DistBackendError) as e:
            if is_collective_timeout(e):
                raise ShardwiseError(self.collective_failure(e)) from e
            raise
        finally:
            self.snapshot.close()
            self.control.close()
        return self.finish()

    def collective_failure(self, e: BaseException) -> str:
        """The line for a collective that timed out or lost its peer: the phase, the ranks that never reached it
        (train/peers.py), and the newest checkpoint with the command that resumes from it."""
        cfg, env = self.cfg, self.env
        timed_out = any(k in str(e).lower() for k in ("timed out", "timeout", "watchdog"))
        missing = peers.not_arrived(self.out, env.rank, env.world_size, self.phase) if env.world_size > 1 else []
        return (f"rank {env.rank}: a collective " + (f"did not complete within --collective-timeout "
                f"{cfg.collective_timeout:g}s" if timed_out else "lost its peer") + f" during {self.phase}: "
                f"another rank is hung or dead{peers.named(missing)} ({str(e).strip().splitlines()[0][:160]})"
                + peers.resume_hint(self.out, ckpt.latest(self.out)))

    def keep_trained_state(self, why: str) -> str:
        """final/ was not written: the line saying where the trained state is kept. A checkpoint of this step is
        written where none is (a full disk may still hold one: final/'s temporary files are gone), so that a resume
        writes final/ without training again."""
        newest = ckpt.latest(self.out)
        if not (newest or "").endswith(f"step_{self.step:08d}"):
            try:
                self.phase = "checkpoint save of the trained state"
                newest = self.save()
            except ShardwiseError as e:
                return (f"{why}; no checkpoint of the trained state could be written either ({e.args[0].split(';')[0]})"
                        f": the steps trained since {newest or 'the start'} are lost; free space, then "
                        + (f"resume from {newest}: `{peers.resume_command(self.out)}`" if newest else
                           "train again (--save-every N keeps checkpoints along the way)"))
        return (f"{why}; the trained state (step {self.step}) is kept in checkpoint {newest}: free space, then "
                f"`{peers.resume_command(self.out)}` writes final/ without training again (or "
                f"`shardwise export {newest} --out DIR` writes the model elsewhere)")

    def write_summary(self, summary: dict) -> None:
        """summary.json and the timeline (rank 0); a full disk here is one line: the model is already written."""
        out = self.out
        for path, obj in ((os.path.join(out, ".prep", "timeline.json"), self.marks),  # the launcher adds the exit
                          (os.path.join(out, "summary.json"), summary)):
            try:
                _write_json(path, obj)
            except OSError as e:
                final = summary["final_model"]
                raise ShardwiseError(f"{'disk full' if ckpt.disk_full(e, out) else 'failed'} while writing {path} "
                                     f"({e.strerror or e}); " + (f"the final model is written ({final})" if final
                                     else "no final model was asked for (--no-save-final)")
                                     + "; the run's metrics are in metrics.jsonl") from None

    def finish(self) -> dict:
        """The final model, summary.json, the last line; the process group is closed."""
        cfg, env, out = self.cfg, self.env, self.out
        try:
            final_dir = save_final(cfg, env, self.strategy, self.model, self.tokenizer, out) if cfg.save_final else None
        except FinalNotWritten as e:
            raise ShardwiseError(self.keep_trained_state(str(e))) from None
        wall = time.time() - self.t_start
        self.marks["saved"] = time.time()
        first_loss, step = self.first_loss, self.step
        if not self.last_rec:  # no step in this launch (resumed at the last step): the run's last logged record
            self.last_rec = _last_logged(os.path.join(out, "metrics.jsonl"))
        # first_loss and wall_time_s cover the whole run, resumes included; final_loss (kept for older readers)
        # is the same value as final_loss_window_mean: the mean over the last logged window, not the last step's
        summary = {"strategy": cfg.strategy, "world_size": env.world_size, "steps": step, "first_loss": first_loss,
                   "final_loss": self.last_rec.get("loss"), "final_loss_window_mean": self.last_rec.get("loss"),
                   # None where this launch trained nothing (resumed at the last step to write the final model)
                   "mean_tokens_per_s": self.tokens_run / wall if wall > 0 and self.tokens_run else None,
                   "peak_mem_gib": self.last_rec.get("peak_mem_gib"), "wall_time_s": self.earlier["wall_time_s"] + wall,
                   "wall_time_this_launch_s": wall, "params": self.n_params,
                   "trainable_params": self.n_trainable, "skipped_nonfinite_steps": self.skipped,
                   "padding_free": self.padding_free,
                   "final_model": final_dir, **self.evaluator.summary(), "phases_s": phases.durations(self.marks)}
        if env.is_main:
            self.write_summary(summary)
        last = summary["final_loss"]
        self.rep.say(f"shardwise: done: {step} steps, loss {first_loss:.4f} (first logged) -> {last:.4f} (last)"
                     if first_loss is not None and last is not None else f"shardwise: done: {step} steps")
        if os.environ.get("SHARDWISE_LAUNCHER_PID", str(os.getpid())) != str(os.getpid()):  # a worker of the agent's
            phases.exit_deadline(FINISH_GRACE_S, f"rank {env.rank}")
        self.rep.close()
        sdist.barrier()
        if dist.is_initialized():
            dist.destroy_process_group()
        return summary


def _last_logged(path: str) -> dict:
    """The last training record (one with a loss) of a run's metrics.jsonl, or {}."""
    last: dict = {}
    try:
        with open(path) as fh:
            for line in fh:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if isinstance(rec, dict) and isinstance(rec.get("loss"), (int, float)):
                    last = rec
    except OSError:
        pass
    return last


def is_collective_timeout(e: BaseException) -> bool:
    text = str(e).lower()
    return any(k in text for k in ("timed out", "timeout", "watchdog", "connection closed by peer",
                                   "connection reset by peer"))


def forward_backward_step(model, strategy, batch: StepBatch, dp_size: int, device, faults: Faults, step: int,
                          fused_head=None, loss_replicas: int = 1, aux_weight: float = 0.0,
                          objective=None) -> torch.Tensor:
    """Forward/backward over the rank's micro-batches; returns this rank's share of the global mean loss and of the
    objective's other logged values (a tensor of len(objective.names), so no host sync). `objective`
    (train/objective.py; SFT by default) gives each micro-batch's summed loss; it is divided by the global batch's
    denominator (SFT: its loss tokens; preference pairs: its pairs) and scaled by `dp_size`, the ranks gradients are
    averaged over (dims.grad_size: the data-parallel degree, times the sequence-parallel degree, whose ranks sum the
    losses of their slices of the same rows): the result equals one process on the whole global batch.
    `loss_replicas`: the ranks that compute the same loss (the tensor-parallel ranks, dims.tp), so the returned
    shares still sum to the global mean over the world (the gradients are not scaled by it: each tp rank's backward
    is one part of one computation). `aux_weight`: a mixture-of-experts model's router load-balancing loss weight
    (models/moe.py aux_loss_weight; 0: none): each micro-batch adds weight x aux_loss / micro-batches to what it
    back-propagates, so after the strategy's mean over ranks the gradient is that of the weighted mean aux loss; the
    returned (logged) loss is the objective's."""
    objective = objective or _SFT
    scale = dp_size / objective.denominator(batch)
    total = torch.zeros(len(objective.names), device=device)
    last = len(batch.micro) - 1
    for i, mb in enumerate(batch.micro):
        mb = dataclasses.replace(mb, input_ids=mb.input_ids.to(device, non_blocking=True),
                                 position_ids=mb.position_ids.to(device, non_blocking=True),
                                 targets=mb.targets.to(device, non_blocking=True))
        with strategy.sync(model, i == last), strategy.autocast(), strategy.loss_parallel():
            summed, extras, aux = objective.micro(model, mb, fused_head, want_aux=bool(aux_weight))
            loss = faults.poison_loss(step, summed * scale)
        shares = loss.detach()[None] if extras is None else torch.cat([loss.detach()[None], extras * scale])
        total += shares / (dp_size * loss_replicas)
        if aux_weight:  # MoE router balance (models/moe.py): the mean over every rank's micro-batches, not logged
            loss = loss + aux * (aux_weight / len(batch.micro))
        strategy.backward(loss)
    return total


def log_record(env, cfg, window, loss_acc, loss_n, seq_acc, step, total, grad_norm, pos, tokens_seen, skipped, peak,
               n_params, hf_config, comm: dict | None = None, names: tuple = ("loss",), lr: float | None = None) -> dict:
    """The logged metrics; the only host syncs of the loop (besides the non-finite check and
    a profiled step's). `comm`: this rank's times of a profiled step (train/profile.py). `loss_acc`: the summed
    shares of the objective's `names` (loss first)."""
    sdist.all_reduce(loss_acc)
    peak_here = peak_memory_gib(env.device)
    # max and min over ranks in one reduction (and a profiled step's communication times, max over ranks)
    mem = torch.tensor([peak_here, -peak_here] + ([comm["comm_total_s"], comm["comm_exposed_s"]] if comm else []),
                       dtype=torch.float64, device=env.device)
    sdist.all_reduce(mem, dist.ReduceOp.MAX)
    step_time, tps = window.read()
    means = (loss_acc / loss_n).tolist() if loss_n else [float("nan")] * loss_acc.numel()
    rec = {"step": step, "loss": means[0], "lr": lr_at(cfg, step - 1, total) if lr is None else lr,
           "grad_norm": float(grad_norm), "tokens_per_s": tps, "step_time_s": step_time,
           "peak_mem_gib": mem[0].item(), "peak_mem_gib_min": -mem[1].item(), "epoch": pos.epoch, "tokens_seen": tokens_seen}
    rec.update(zip(names[1:], means[1:]))  # the objective's other values (task dpo: the rewards)
    if skipped:
        rec["skipped_nonfinite_steps"] = skipped
    if comm:
        rec.update(comm_total_s=mem[2].item(), comm_exposed_s=mem[3].item(), comm_method=comm["comm_method"],
                   profiled=True)
    if peak:
        fpt = flops_per_token(n_params, hf_config.num_hidden_layers, hf_config.hidden_size, seq_acc / window.steps)
        rec["mfu"] = fpt * tps / (peak * env.dims.world_size)  # every rank's hardware, whatever its role
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


def save_checkpoint(cfg, env, strategy, model, optimizer, out, step, pos, tokens_seen, model_dir, tokenizer,
                    first_loss=None, wall_time_s=0.0, schedule: dict | None = None) -> str:
    meta = {"step": step, "data_position": pos.to_dict(), "tokens_seen": tokens_seen,
            "world_size": env.world_size, "strategy": cfg.strategy, "config": dataclasses.asdict(cfg),
            "first_loss": first_loss, "wall_time_s": wall_time_s}
    if schedule is not None:  # the batch the schedule counts in, its length and the sequences trained
        meta["schedule"] = schedule
    return ckpt.save(out, step, strategy.state_dict(model, optimizer), meta, env.rank, cfg.keep_checkpoints,
                     model_dir=model_dir,
                     chat_template=(tokenizer.chat_template or "") if cfg.chat_template and tokenizer else "")


class FinalNotWritten(ShardwiseError):
    """final/ could not be written (a full disk, ...); every rank raises it, so that they can keep the trained state."""


def save_final(cfg, env, strategy, model, tokenizer, out) -> str:
    """A Hugging Face directory (safetensors + config + tokenizer), written atomically. Collective: where rank 0
    cannot write it, every rank raises FinalNotWritten (and the previous final/, if any, is left as it was)."""
    full = strategy.full_model_state_dict(model)
    final = os.path.join(out, "final")
    why = ""
    if env.is_main:
        try:
            _write_final(cfg, strategy, model, full, tokenizer, out, final)
        except Exception as e:  # noqa: BLE001 - a full disk raises OSError or safetensors' own error
            why = _final_failure(e, out, final)
    failed = torch.tensor([1.0 if why else 0.0], device=env.device)
    sdist.all_reduce(failed, dist.ReduceOp.MAX)  # every rank learns whether rank 0 wrote it (and waits for it)
    if failed.item():
        raise FinalNotWritten(why or f"rank 0 could not write the final model to {final}")
    return final


def _write_final(cfg, strategy, model, full: dict, tokenizer, out: str, final: str) -> None:
    import tempfile

    tmp = tempfile.mkdtemp(prefix=".final-", dir=out)  # a fresh name: never a directory we did not make
    try:
        hf = strategy.unwrap(model)
        if cfg.tuner != "full":  # a PEFT adapter directory (+ final/merged with merge_lora)
            from shardwise.models.lora import save_final as save_adapter

            save_adapter(hf, full, tokenizer, tmp, cfg)
        else:
            save_pretrained(hf, tmp, state_dict=full)
        tokenizer.save_pretrained(tmp)
        ckpt.apply_umask(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(final, ignore_errors=True)  # the run directory's own final/ (the run dir is marked and locked)
    os.rename(tmp, final)


def _final_failure(e: BaseException, out: str, final: str) -> str:
    """Why final/ was not written, in a few words; an unexpected failure's traceback goes to the output first."""
    full = ckpt.disk_full(e, out)
    if not full:
        import traceback

        traceback.print_exc()
    return (f"{'disk full' if full else 'failed'} while writing the final model to {final} "
            f"({ckpt.first_line(e)})")


_write_json = atomic_write_json
