"""Workers started early: the fork server (train/zygote.py) started before this process imports torch, and the
workers the agent starts while this process still checks and tokenizes (_Early), which wait for their job."""

from __future__ import annotations

import json
import os
import shutil

from shardwise import phases, presets, rundir
from shardwise.config import Config, Resolved
from shardwise.launch.preflight import check_model, check_ranks, check_sequence_parallel, check_tensor_parallel
from shardwise.launch.prep import Prepared, _Cancelled, _prepare, _say_run_dir, _WriteGate, read_data


def first_checks(cfg: Config, res: Resolved) -> tuple[list, object, list]:
    """Before early workers start (_Early): what users most often get wrong and that needs neither a model class
    nor the tokenizer (the ranks for `single`, the model directory and its weights' headers, seq_len, the tensor-
    and sequence-parallel degrees against its heads, every data record), so such a run is refused without
    starting a worker. Returns read_data's records for _prepare, which checks everything else."""
    world = cfg.nproc_per_node * cfg.nnodes
    check_ranks(cfg, res, world)
    model_dir = check_model(cfg, res, shapes=False)
    check_tensor_parallel(cfg, res, world, model_dir)
    check_sequence_parallel(cfg, res, world, model_dir)
    return read_data(cfg, res)


def early_workers(cfg: Config) -> bool:
    """Whether the workers start while this process still checks and tokenizes (_Early): every run through the
    agent on one node. Several nodes keep the order (checked, then started): a node whose checks fail must not
    leave the others' workers waiting in a group it never joins. SHARDWISE_EARLY_WORKERS=0 turns it off."""
    return (not presets.trains_in_process(cfg.strategy, cfg.nproc_per_node * cfg.nnodes) and cfg.nnodes == 1
            and os.environ.get("SHARDWISE_EARLY_WORKERS", "1") != "0")


def early_preload(cfg: Config) -> tuple[str, bool]:
    """What a worker imports before its job is known (train/worker.preload): the model family's module, as the
    absolute model directory or "tiny" (_model_arg), and, for compiled blocks, inductor's."""
    from shardwise.strategies.parallelize import compile_enabled

    return _model_arg(cfg), compile_enabled(cfg)


def _model_arg(cfg: Config) -> str:
    return os.path.abspath(os.path.expanduser(cfg.model)) if cfg.model != "tiny" else "tiny"


class _Early:
    """`_prepare` on a thread while the agent starts the workers, to shorten the time to first step: each worker
    imports torch, transformers and the model's classes while this process checks the model and the data. The
    workers wait for `pointer`, a file in a directory of this launcher's own, which names the job once the run
    directory is written, or holds null when the checks failed (they leave; this process reports the one line;
    nothing was written). The agent keeps the main thread (it installs signal handlers)."""

    def __init__(self, res: Resolved, cfg: Config, lock, force: bool, t0: float, loaded: tuple):
        import tempfile
        import threading

        self.res, self.cfg, self.lock, self.force, self.t0, self.loaded = res, cfg, lock, force, t0, loaded
        self.dir = tempfile.mkdtemp(prefix="shardwise-job-")
        self.pointer = os.path.join(self.dir, "job")
        self.prepared: Prepared | None = None
        self.error: BaseException | None = None
        self.gate = _WriteGate()
        self.marks: dict[str, float] = {}  # the job's timeline: agent_start (the agent called, the workers to come)
        self.thread = threading.Thread(target=self._run, name="shardwise-prepare", daemon=True)

    def _run(self) -> None:
        job = None
        try:
            p = _prepare(self.res, self.cfg, self.lock, self.force, self.t0, gate=self.gate, loaded=self.loaded,
                         marks=self.marks)
            shutil.rmtree(rundir.error_dir(p.output_dir), ignore_errors=True)
            _say_run_dir(p)
            self.prepared, job = p, p.job_path
        except BaseException as e:  # noqa: BLE001 - re-raised by finish() in the main thread
            self.error = e
        finally:
            phases.release_full_gc()  # prepared: this process only runs the agent from here (phases.py)
            try:
                rundir.atomic_write(self.pointer, json.dumps({"job": job}))
            except OSError:
                pass  # the launch ended without waiting for this prepare (finish(failed=True)); nobody reads it

    def worker_args(self) -> list[str]:
        model, compile_blocks = early_preload(self.cfg)
        return ["--wait", self.pointer, model] + (["--compile"] if compile_blocks else [])

    def finish(self, failed: bool = False) -> Prepared:
        """Wait for the prepare; its error (a ShardwiseError: one line) is the run's. With `failed` (the group
        ended in a failure or a signal) the prepare is cancelled: if it is writing the run directory, that ends
        first; if not, it writes nothing and is not waited for."""
        if not failed or self.gate.cancel():
            self.thread.join()
        shutil.rmtree(self.dir, ignore_errors=True)
        if self.error is not None and not isinstance(self.error, _Cancelled):
            raise self.error
        return self.prepared


def _start_zygote_early(cfg: Config) -> bool:
    """The fork server the workers come from (train/zygote.py), started as the launcher begins where the run will
    clearly have early workers (early_workers: one node, through the agent), judged from the config before torch
    is imported: --nproc-per-node given, or a machine without NVIDIA devices (2 ranks). Its imports (3-4 CPU-s on
    the tiny CPU job) then overlap everything this process does before the workers run. Where it cannot be
    judged yet, the agent starts the server later (launch.agent._agent). Returns whether it started."""
    from shardwise.train import zygote

    nvidia = os.path.exists("/dev/nvidiactl")
    nproc = cfg.nproc_per_node or (0 if nvidia else 2)
    if (not nproc or cfg.nnodes != 1 or os.environ.get("SHARDWISE_EARLY_WORKERS", "1") == "0"
            or cfg.strategy not in presets.PRESETS or presets.trains_in_process(cfg.strategy, nproc)
            or not zygote.enabled()):
        return False
    # as early_preload, judged without torch (compile_enabled imports it)
    return zygote.start(_model_arg(cfg), cfg.compile == "on" or (cfg.compile == "auto" and nvidia))


def _stop_zygote(started: bool) -> None:
    if started:
        from shardwise.train import zygote

        zygote.stop()  # mid-import perhaps: nothing of the run's is in it
