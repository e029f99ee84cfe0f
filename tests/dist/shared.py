"""Flags and reference runs shared by the multi-rank test modules (fixtures in conftest.py).

Every launch costs seconds of process start-up on a 2-core CPU while its 12 training steps
take well under one, so the runs every module compares against are made once per session:
one process (`single`), 2-rank DDP (`ddp`) and one-process LoRA (`lora_single`), all on the
same data and global batch. Tests only read their output directories.
"""

from __future__ import annotations

from dataclasses import dataclass

from tests.helpers import read_metrics

COMMON = ("--model", "tiny", "--seq-len", "64", "--log-every", "1", "--lr", "1e-3", "--warmup-steps", "2",
          "--max-grad-norm", "0.5", "--mixed-precision", "no", "--seed", "0")
RTOL = 2e-5  # fp32: only the order of floating-point reductions differs
MAX_GRAD_NORM = 0.5  # COMMON's --max-grad-norm; the reference runs' norms exceed it
STEPS = 12
# the same global batch of 8 sequences: 1 rank x 2 x 4 accumulation, or 2 ranks x 2 x 2
SINGLE = ("--strategy", "single", "--nproc-per-node", "1", "--micro-batch-size", "2", "--grad-accum", "4")
TWO = ("--nproc-per-node", "2", "--micro-batch-size", "2", "--grad-accum", "2")
DDP = ("--strategy", "ddp", *TWO)
LORA = ("--tuner", "lora", "--lora-r", "4", "--lora-dropout", "0", "--lr", "3e-3")  # no dropout: RNG per rank


def train_args(out, data, *extra) -> tuple:
    """`shardwise train` arguments: COMMON, STEPS steps (unless extra says otherwise)."""
    return ("train", *COMMON, "--data", str(data), "--output-dir", str(out), "--max-steps", str(STEPS), *extra)


@dataclass
class Run:
    out: object  # pathlib.Path of the run directory
    stdout: str = ""
    stderr: str = ""

    @property
    def metrics(self) -> list[dict]:
        return read_metrics(str(self.out))

    @property
    def losses(self) -> list[float]:
        return [r["loss"] for r in self.metrics]

    def ckpt(self, step: int):
        return self.out / "checkpoints" / f"step_{step:08d}"


# name -> extra flags of the runs made once per session (tests/dist/conftest.py)
SESSION_RUNS = {
    # 2-rank DDP with checkpoints at 4, 8 and 12 (all kept) and the final HF directory
    "ddp": (*DDP, "--save-every", "4", "--keep-checkpoints", "3"),
    # one process on the same global batch; its step-4 checkpoint resumes on 2 ranks
    "single": (*SINGLE, "--save-every", "4", "--keep-checkpoints", "3", "--no-save-final"),
    # one-process LoRA; its last step's checkpoint exports merged, final/merged to compare with
    "lora_single": (*SINGLE, *LORA, "--save-every", "6", "--merge-lora"),
    # 2-rank DDP with gradient checkpointing that also saves on a (tiny) time interval: the
    # losses must still equal `single`'s, and every time-based checkpoint must be complete
    "ddp_gc_timed": (*DDP, "--gradient-checkpointing", "--save-every-minutes", "0.0001",
                     "--keep-checkpoints", "100", "--no-save-final"),
}
