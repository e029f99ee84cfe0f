"""Config -> prepared run -> workers.

Everything a user can get wrong is checked here, in the launching process, before any
worker starts and before anything is written: config, hardware fit, model directory, every
data record. Then the run directory is written (config.yaml, the tokenized data, the job)
and the workers start: in this process for a one-process `single` run, otherwise through
torchrun's elastic agent (`torch.distributed.launcher.api.elastic_launch`) with c10d
rendezvous, so the same command works on one machine, across machines and under Slurm.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time
import uuid

from shardwise import presets
from shardwise.config import Config, Resolved, to_yaml
from shardwise.errors import ShardwiseError

RUN_MARKERS = ("config.yaml", "metrics.jsonl", "summary.json", "checkpoints")


@dataclasses.dataclass
class Prepared:
    cfg: Config
    output_dir: str
    job_path: str
    world_size: int


def quiet_libraries() -> None:
    """Progress bars and accelerator banners of the libraries we drive are noise here."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    try:
        import torch

        if not torch.cuda.is_available():
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
    except ImportError:
        pass
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:
        pass


def say(msg: str) -> None:
    print(f"shardwise: {msg}", flush=True)


def resolve_runtime(res: Resolved) -> Config:
    """Fill the 'auto' values from the hardware at hand; refuse what it cannot run."""
    import torch

    from shardwise.hardware import bf16_supported

    cfg = dataclasses.replace(res.cfg)
    cuda = torch.cuda.is_available()
    n_gpu = torch.cuda.device_count() if cuda else 0
    if cfg.mixed_precision == "auto":
        cfg.mixed_precision = "bf16" if bf16_supported() else "no"
    if cfg.nproc_per_node == 0:
        cfg.nproc_per_node = 1 if cfg.strategy == "single" else (n_gpu if cuda else 2)
    if cuda and cfg.nproc_per_node > n_gpu:
        raise ShardwiseError(f"{res.where('nproc_per_node')}: {cfg.nproc_per_node} processes per node but this "
                             f"node has {n_gpu} GPU(s); one GPU per rank")
    if cfg.tuner == "qlora" and not cuda:
        raise ShardwiseError(f"{res.where('tuner')}: QLoRA needs a CUDA GPU (4-bit bitsandbytes kernels); "
                             "use --tuner lora on the CPU")
    if cfg.mixed_precision == "bf16" and cuda and not bf16_supported():
        raise ShardwiseError(f"{res.where('mixed_precision')}: this GPU has no bf16; use --mixed-precision fp16")
    if not cfg.output_dir:
        cfg.output_dir = os.path.join("runs", f"{cfg.strategy}-{time.strftime('%Y%m%d-%H%M%S')}")
    cfg.output_dir = os.path.abspath(cfg.output_dir)
    return cfg


def check_output_dir(cfg: Config, res: Resolved) -> None:
    out = cfg.output_dir
    if not os.path.isdir(out):
        if os.path.exists(out):
            raise ShardwiseError(f"{res.where('output_dir')}: {out} exists and is not a directory")
        return
    holds_run = any(os.path.exists(os.path.join(out, m)) for m in RUN_MARKERS)
    if holds_run and cfg.resume == "none" and not cfg.overwrite:
        raise ShardwiseError(f"{res.where('output_dir')}: {out} holds another run; pass --resume auto to continue "
                             "it, --overwrite to replace it, or choose another --output-dir")


def prepare(res: Resolved, force: bool = False) -> Prepared:
    """Validate everything, then write the run directory. Returns what to launch."""
    from safetensors.torch import save_file

    from shardwise.data.encode import encode
    from shardwise.data.formats import demo_dataset, read_records
    from shardwise.models.load import load_tokenizer
    from shardwise.train import checkpoint as ckpt

    quiet_libraries()
    cfg = resolve_runtime(res)
    if cfg.strategy == "auto":
        cfg = choose_strategy(cfg, res)
    node0 = cfg.node_rank == 0
    if node0:
        check_output_dir(cfg, res)
    resume_from = None
    if cfg.resume not in ("auto", "none"):
        cfg.resume = os.path.abspath(cfg.resume)
        if not os.path.isfile(os.path.join(cfg.resume, ckpt.META)):
            raise ShardwiseError(f"{res.where('resume')}: {cfg.resume} is not a complete shardwise checkpoint "
                                 "(no meta.json); give a checkpoints/step_N directory or use --resume auto")
        resume_from = cfg.resume
    elif cfg.resume == "auto":
        resume_from = ckpt.latest(cfg.output_dir)  # the workers choose the same one
        skipped = ckpt.skipped_newer(cfg.output_dir)
        if skipped:
            say("--resume auto: skipped " + "; ".join(f"{p} ({why})" for p, why in skipped)
                + f"; resuming from {resume_from or 'the start (no complete checkpoint left)'}")
    if resume_from:
        ckpt.verify(resume_from)  # complete, and nothing in it can run code when loaded
    world = cfg.nproc_per_node * cfg.nnodes
    if presets.base_strategy(cfg.strategy) == "single" and world > 1:
        raise ShardwiseError(f"{res.where('strategy')}: strategy 'single' runs one process, not {world}; "
                             "use --strategy ddp")
    from shardwise import strategies

    strategies.get(cfg.strategy)  # unknown / not installed -> one clear line now, not in N workers

    model_dir = check_model(cfg, res)
    resume_notes = ckpt.check_resume(resume_from, cfg, model_dir) if resume_from else []
    check_fit(cfg, res, world, force)
    tokenizer = load_tokenizer(model_dir, cfg.trust_remote_code)
    if cfg.data == "demo":
        records, stats = demo_dataset(), None
    else:
        records, stats = read_records(cfg.data, cfg.data_format, cfg.skip_bad_records)
    encoded = encode(records, tokenizer, cfg.seq_len, cfg.packing)
    global_batch = cfg.micro_batch_size * cfg.grad_accum * world
    if len(encoded) < global_batch:
        raise ShardwiseError(f"the dataset has {len(encoded)} sequences, fewer than one global batch of "
                             f"{global_batch}; lower --micro-batch-size or --grad-accum, or add data")

    # -- nothing has been written until here ---------------------------------------------
    out = cfg.output_dir
    if node0 and cfg.overwrite and cfg.resume == "none" and os.path.isdir(out):
        for m in RUN_MARKERS + ("final", "tensorboard", ".prep"):
            p = os.path.join(out, m)
            shutil.rmtree(p, ignore_errors=True) if os.path.isdir(p) else (os.path.exists(p) and os.remove(p))
    prep = os.path.join(out, ".prep", f"node{cfg.node_rank}")
    os.makedirs(prep, exist_ok=True)
    data_file = os.path.join(prep, "data.safetensors")
    save_file(encoded.to_tensors(), data_file + ".tmp")
    os.replace(data_file + ".tmp", data_file)
    _atomic_write(os.path.join(prep, "sources.json"), json.dumps(encoded.sources))
    st = encoded.stats
    src = "the built-in demo set" if stats is None else ", ".join(stats.files[:3]) + (" ..." if len(stats.files) > 3 else "")
    msg = (f"data: {st['records']} records from {src}; {st['sequences']} sequences, {st['tokens']:,} tokens, "
           f"{st['loss_tokens']:,} loss tokens; {st['truncated']} truncated to seq_len {cfg.seq_len}")
    if st["dropped_no_loss_tokens"]:
        msg += f"; {st['dropped_no_loss_tokens']} dropped (no loss token left after truncation)"
    if stats and stats.skipped:
        msg += f"; {stats.skipped} bad records skipped (first: {stats.first_skipped})"
    say(msg)
    for note in resume_notes:
        say(note)
    if node0:
        if resume_from and os.path.isfile(os.path.join(out, "config.yaml")):
            # the run's config.yaml stays as it was written; each resume is recorded beside it
            record = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "checkpoint": resume_from,
                      "step": ckpt.read_meta(resume_from).get("step"), "notes": resume_notes,
                      "config": dataclasses.asdict(cfg)}
            with open(os.path.join(out, "resumes.jsonl"), "a") as fh:
                fh.write(json.dumps(record) + "\n")
        else:
            _atomic_write(os.path.join(out, "config.yaml"), to_yaml(cfg, out))
    job = {"config": dataclasses.asdict(cfg), "model_dir": model_dir, "data_file": data_file,
           "output_dir": out, "resume": cfg.resume}
    job_path = os.path.join(prep, "job.json")
    _atomic_write(job_path, json.dumps(job, indent=1))
    return Prepared(cfg, out, job_path, world)


def check_model(cfg: Config, res: Resolved) -> str:
    """The model directory, checked: usable, weights complete, seq_len within its positions.
    Also used by `shardwise ui` before it starts a run."""
    from shardwise.models.load import check_weights, max_positions, resolve_model_dir

    model_dir = resolve_model_dir(cfg.model, cfg.seed)
    check_weights(model_dir)
    limit = max_positions(model_dir)
    if limit and cfg.seq_len > limit:
        raise ShardwiseError(f"{res.where('seq_len')}: seq_len {cfg.seq_len} is larger than the model supports "
                             f"(max_position_embeddings {limit}); lower --seq-len")
    return model_dir


def check_fit(cfg: Config, res: Resolved, world: int, force: bool) -> None:
    """Refuse a run the planner says cannot fit the GPUs, unless --force."""
    try:
        from shardwise.plan import fit_advice, plan_run
    except ImportError:
        return
    import torch

    if not torch.cuda.is_available():
        return  # host RAM is not the planner's business on a CPU box
    plan = plan_run(cfg, None, world)
    sp = plan.for_strategy(cfg.strategy)
    if not sp.fits and not force:
        raise ShardwiseError(fit_advice(plan, cfg.strategy) + " (pass --force to launch anyway)")


def choose_strategy(cfg: Config, res: Resolved) -> Config:
    try:
        from shardwise.plan import plan_run
    except ImportError:
        raise ShardwiseError(f"{res.where('strategy')}: --strategy auto needs the planner, which this build lacks")
    world = cfg.nproc_per_node * cfg.nnodes
    plan = plan_run(dataclasses.replace(cfg, strategy="ddp"), None, world)
    say(f"--strategy auto chose '{plan.recommended}': " + "; ".join(plan.reasons))
    return dataclasses.replace(cfg, strategy=plan.recommended)


class Interrupted(Exception):
    def __init__(self, signum: int):
        self.signum = signum


def launch(p: Prepared) -> dict | None:
    cfg = p.cfg
    quiet_libraries()
    if presets.trains_in_process(cfg.strategy, p.world_size):
        import signal

        from shardwise.train.loop import Preempted
        from shardwise.train.worker import run_job

        try:
            return run_job(p.job_path)
        except Preempted:
            interrupted = os.path.join(p.output_dir, ".prep", "interrupted.json")
            if os.path.isfile(interrupted):
                os.remove(interrupted)
            raise Interrupted(signal.SIGTERM) from None
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # With the agent's rendezvous store shared into the workers (torch's default), a group
    # restarted by --max-restarts reads the previous attempt's unprefixed keys and its gloo
    # mesh hangs or is refused; a fresh store per rendezvous round avoids that.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // cfg.nproc_per_node))
    multi = cfg.nnodes > 1
    os.environ["SHARDWISE_LAUNCHER_PID"] = str(os.getpid())  # workers die with this process
    if multi:
        register_rendezvous()
        where = dict(rdzv_backend=RDZV_BACKEND, rdzv_endpoint=cfg.rdzv_endpoint,
                     rdzv_configs={"is_host": cfg.node_rank == 0, "join_timeout": 300})
    else:
        where = loopback_only(int(cfg.rdzv_endpoint.rpartition(":")[2] or 0))
    lc = LaunchConfig(
        min_nodes=cfg.nnodes, max_nodes=cfg.nnodes, nproc_per_node=cfg.nproc_per_node,
        run_id=f"shardwise-{cfg.rdzv_endpoint}" if multi else f"shardwise-{uuid.uuid4().hex[:8]}",
        max_restarts=cfg.max_restarts, monitor_interval=0.5, start_method="spawn", **where,
    )
    import logging

    from shardwise.train.worker import error_dir

    if not os.environ.get("SHARDWISE_DEBUG"):
        # the agent's own warnings repeat what our one line says; SHARDWISE_DEBUG=1 keeps them
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    shutil.rmtree(error_dir(p.output_dir), ignore_errors=True)
    interrupted = os.path.join(p.output_dir, ".prep", "interrupted.json")
    if os.path.isfile(interrupted):  # left by an attempt stopped through the agent (SignalException below)
        os.remove(interrupted)
    try:
        elastic_launch(lc, sys.executable)("-u", "-m", "shardwise.train.worker", p.job_path)
    except ChildFailedError as e:
        raise ShardwiseError(_worker_error(p.output_dir) or _failure_line(e)) from None
    except SignalException as e:
        raise Interrupted(int(e.sigval)) from None
    if os.path.isfile(interrupted):  # a worker received the signal; the agent did not
        import signal

        os.remove(interrupted)
        raise Interrupted(signal.SIGTERM)
    summary = os.path.join(p.output_dir, "summary.json")
    if cfg.node_rank == 0 and os.path.isfile(summary):
        with open(summary) as fh:
            return json.load(fh)
    return None


RDZV_BACKEND = "shardwise-c10d"


def register_rendezvous() -> None:
    """torchrun's c10d rendezvous, with its store listening on the rendezvous endpoint's
    address only (torch's own binds every interface): 127.0.0.1 on one node, the given
    --rdzv-endpoint host on several (a network the user must trust, as with torchrun)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as registry

    if RDZV_BACKEND not in getattr(registry, "_registry", {}):
        registry.register(RDZV_BACKEND, _rendezvous_handler)


def loopback_only(port: int = 0) -> dict:
    """LaunchConfig arguments (and the environment) for a one-machine group that listens
    on 127.0.0.1 only: the rendezvous store, the workers' store (MASTER_ADDR) and gloo's or
    NCCL's own sockets."""
    register_rendezvous()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    return dict(rdzv_backend=RDZV_BACKEND, rdzv_endpoint=f"127.0.0.1:{port}", rdzv_configs={"is_host": True},
                local_addr="127.0.0.1")


def _rendezvous_handler(params):
    from datetime import timedelta

    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    from shardwise.train.dist import tcp_store

    class Backend(C10dRendezvousBackend):
        name = RDZV_BACKEND

    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=29400)
    store = tcp_store(host, port, is_master=bool(params.get_as_bool("is_host", True)), multi_tenant=True,
                      timeout=timedelta(seconds=params.get_as_int("read_timeout", 60)))
    return create_handler(store, Backend(store, params.run_id), params)


def _worker_error(output_dir: str) -> str | None:
    """The one-line ShardwiseError a worker left (lowest rank first)."""
    from shardwise.train.worker import error_dir

    d = error_dir(output_dir)
    if not os.path.isdir(d):
        return None
    files = sorted(os.listdir(d), key=lambda f: int("".join(c for c in f if c.isdigit()) or 0))
    for f in files:
        with open(os.path.join(d, f)) as fh:
            text = fh.read().strip()
        if text:
            return text
    return None


def _failure_line(e) -> str:
    """One line for a rank that died without a ShardwiseError."""
    rank, f = sorted(e.failures.items())[0]
    msg = f.message
    if isinstance(msg, str) and msg.startswith("{"):
        try:
            msg = json.loads(msg)
        except ValueError:
            pass
    if isinstance(msg, dict):
        msg = msg.get("message", "")
    detail = str(msg or "").strip().splitlines()[0][:300] if msg else ""
    if f.exitcode is not None and f.exitcode < 0:
        detail = f"killed by signal {-f.exitcode}"
    if "OutOfMemoryError" in detail or "out of memory" in detail.lower():
        return (f"out of memory on rank {rank} ({detail}); lower --micro-batch-size or --seq-len, enable "
                "--gradient-checkpointing, or shard more (--strategy fsdp / zero3); `shardwise plan` estimates it")
    return (f"training failed: rank {rank} exited with code {f.exitcode} ({detail or 'no message'}); "
            "its output above says more")


def _atomic_write(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


def train(res: Resolved, force: bool = False) -> int:
    p = prepare(res, force)
    say(f"run directory: {p.output_dir} ({p.cfg.strategy}, {p.world_size} process(es), "
        f"mixed precision {p.cfg.mixed_precision})")
    try:
        summary = launch(p)
    except Interrupted as e:
        from shardwise.train import checkpoint as ckpt

        last = ckpt.latest(p.output_dir)
        print(f"shardwise: interrupted by signal {e.signum}; newest checkpoint: {last or 'none'}; resume with: "
              f"shardwise train {p.output_dir}/config.yaml --output-dir {p.output_dir} --resume auto",
              file=sys.stderr, flush=True)
        return 128 + e.signum
    if summary:
        final = ", final/ (Hugging Face directory)" if summary.get("final_model") else ""
        say(f"outputs: {p.output_dir}/metrics.jsonl, summary.json{final}; "
            f"repeat with: shardwise train {p.output_dir}/config.yaml")
    return 0
