"""Rank-0 reporting: terminal (progress bar on a TTY, plain lines otherwise),
metrics.jsonl (one object per logged step), and the trackers named by `report_to`
(TensorBoard events by default; Weights & Biases and MLflow as optional extras, both
offline/file-based unless the user points them at a server)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import resource
import sys
import time

import torch

from shardwise.errors import ShardwiseError
from shardwise.preflight.flags import parse_report_to

# tracker name -> (module to import, what installs it)
TRACKERS = {"tensorboard": ("tensorboard", "pip install tensorboard"), "wandb": ("wandb", "pip install 'shardwise[wandb]'"),
            "mlflow": ("mlflow", "pip install 'shardwise[mlflow]'")}


def check_trackers(value: str, where: str) -> None:
    """Before launch: every named tracker's package is importable, else one line naming the extra."""
    for name in parse_report_to(value):
        module, install = TRACKERS[name]
        if importlib.util.find_spec(module) is None:
            raise ShardwiseError(f"{where}: report_to {name} needs the '{module}' package; install it with: "
                                 f"{install} (or drop {name} from --report-to)")


class _TensorBoard:
    def __init__(self, out: str, config: dict, append: bool):
        from torch.utils.tensorboard import SummaryWriter

        self.w = SummaryWriter(os.path.join(out, "tensorboard"))

    def log(self, scalars: dict, step: int) -> None:
        for k, v in scalars.items():
            self.w.add_scalar(k, v, step)

    def close(self) -> None:
        self.w.close()


class _WandB:
    """Offline unless WANDB_MODE says otherwise (no network at run time by default; `wandb
    sync OUT/wandb/offline-run-*` uploads later). The run id follows from the output
    directory, so a resumed run continues the same W&B run."""

    def __init__(self, out: str, config: dict, append: bool):
        os.environ.setdefault("WANDB_MODE", "offline")
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        run_id = "sw-" + hashlib.sha1(os.path.abspath(out).encode()).hexdigest()[:12]
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "shardwise"), dir=out, id=run_id,
                              name=os.path.basename(out.rstrip("/")), config=config, resume="allow")

    def log(self, scalars: dict, step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class _MLflow:
    """MLFLOW_TRACKING_URI when set (a server the user runs), else a file store in OUT/mlruns.
    A resumed run continues the MLflow run tagged with the same output directory."""

    def __init__(self, out: str, config: dict, append: bool):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # the file store needs no server or database
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or "file:" + os.path.join(os.path.abspath(out), "mlruns")
        self.client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "shardwise")
        exp = self.client.get_experiment_by_name(name)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(name)
        tag = os.path.abspath(out).replace("'", "")
        found = self.client.search_runs([exp_id], f"tags.`shardwise.output_dir` = '{tag}'", max_results=1) \
            if append else []
        if found:
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, "RUNNING")
        else:
            run = self.client.create_run(exp_id, run_name=os.path.basename(out.rstrip("/")),
                                         tags={"shardwise.output_dir": tag})
            self.run_id = run.info.run_id
            from mlflow.entities import Param

            params = [Param(k, str(v)[:500]) for k, v in _flatten(config).items()]
            for i in range(0, len(params), 100):
                self.client.log_batch(self.run_id, params=params[i:i + 100])

    def log(self, scalars: dict, step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in scalars.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


_CLASSES = {"tensorboard": _TensorBoard, "wandb": _WandB, "mlflow": _MLflow}


def peak_memory_gib(device: torch.device) -> float:
    """CUDA peak allocated on a GPU; the process's own peak RSS on the CPU (VmHWM: unlike
    ru_maxrss it does not inherit the parent's peak across fork+exec)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**20  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def flops_per_token(n_params: int, n_layers: int, hidden: int, seq_len: float) -> float:
    """Training FLOPs per token: 6N for the matmuls + 12*L*H*T for attention (PaLM, App. B)."""
    return 6 * n_params + 12 * n_layers * hidden * seq_len


def keep_steps_up_to(path: str, step: int) -> None:
    """Drop the records of steps after `step` (a resume from an older checkpoint runs them
    again), so metrics.jsonl holds each step once. Rewritten atomically."""
    from shardwise.rundir import atomic_write

    try:
        with open(path) as fh:
            lines = fh.readlines()
    except FileNotFoundError:
        return
    kept = []
    for line in lines:
        try:
            if json.loads(line).get("step", 0) > step:
                continue
        except (ValueError, AttributeError):
            continue  # a line torn by a kill mid-write
        kept.append(line if line.endswith("\n") else line + "\n")
    if len(kept) != len(lines):
        atomic_write(path, "".join(kept))


class Reporter:
    def __init__(self, output_dir: str, is_main: bool, total_steps: int, start_step: int, append: bool,
                 report_to: str = "tensorboard", config: dict | None = None):
        self.is_main, self.total = is_main, total_steps
        self.bar = None
        self.trackers = []
        self.fh = None
        if not is_main:
            return
        path = os.path.join(output_dir, "metrics.jsonl")
        if append:
            keep_steps_up_to(path, start_step)
        self.fh = open(path, "a" if append else "w")
        for name in parse_report_to(report_to):  # the launcher checked that each is installed
            self.trackers.append(_CLASSES[name](output_dir, config or {}, append))
        if sys.stdout.isatty():  # a bar with the rate and ETA; the plain step lines elsewhere (a log file, a pipe)
            from tqdm import tqdm

            # on stdout, which the test above is about; a terminal that reports no size (a pty of `script`, some CI
            # consoles) gets a fixed one: tqdm, which asks the terminal (not $COLUMNS), draws nothing in 0 columns
            try:
                sized = min(os.get_terminal_size(sys.stdout.fileno())) > 0
            except (OSError, ValueError):
                sized = False
            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", file=sys.stdout, dynamic_ncols=sized,
                            ncols=None if sized else 120, nrows=None if sized else 24)
    
    def log(self, rec: dict) -> None:
        if not self.is_main:
            return
        self.fh.write(json.dumps(rec) + "\n")
        self.fh.flush()
        scalars = {(k if k.startswith("val_") else f"train/{k}").replace("val_", "eval/", 1): v
                   for k, v in rec.items() if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        for t in self.trackers:
            t.log(scalars, rec["step"])
        line = (f"loss {rec['loss']:.4f} | lr {rec['lr']:.2e} | {rec['tokens_per_s']:,.0f} tok/s | "
                f"{rec['peak_mem_gib']:.2f} GiB" + (f" | mfu {rec['mfu']:.1%}" if "mfu" in rec else "")
                + (f" | val_loss {rec['val_loss']:.4f}" if "val_loss" in rec else "")
                + (f" | margin {rec['rewards/margins']:.3f} | acc {rec['rewards/accuracies']:.2f}"
                   if "rewards/margins" in rec else ""))
        if self.bar:
            self.bar.n = rec["step"]
            self.bar.set_postfix_str(line, refresh=True)
        else:
            print(f"step {rec['step']}/{self.total} | {line}", flush=True)

    def say(self, msg: str) -> None:
        if not self.is_main:
            return
        if self.bar:
            self.bar.write(msg)
        else:
            print(msg, flush=True)

    def close(self) -> None:
        if self.bar:
            self.bar.close()
        if self.fh:
            self.fh.close()
        for t in self.trackers:
            t.close()


class Window:
    """Throughput over the steps since the last log (the log's .item() is the sync point)."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.steps = 0
        self.tokens = 0

    def add(self, tokens: int) -> None:
        self.steps += 1
        self.tokens += tokens

    def read(self) -> tuple[float, float]:
        dt = time.perf_counter() - self.t0
        return dt / max(self.steps, 1), self.tokens / dt if dt > 0 else 0.0
