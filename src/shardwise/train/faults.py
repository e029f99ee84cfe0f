"""Fault injection through the real code paths, for tests and fire drills.

SHARDWISE_FAULT="KIND@STEP[:rankR][,...]" makes rank R (all ranks when omitted) suffer
KIND when it starts optimizer step STEP (1-based), on the first attempt only (a group
restarted by the elastic agent runs clean):
  kill   SIGKILL itself (a real `kill -9`)      oom   raise torch.OutOfMemoryError
  nan    make that step's loss NaN              hang  stop before the step's first collective
  term   send itself SIGTERM (a preemption)
  killsave  SIGKILL itself while saving the checkpoint of step STEP (shards written,
            checkpoint not yet committed)
"""

from __future__ import annotations

import os
import signal
import time

import torch

KINDS = ("kill", "oom", "nan", "hang", "term", "killsave")


def parse(spec: str) -> list[tuple[str, int, int | None]]:
    out = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        kind, _, rest = part.partition("@")
        step, _, rank = rest.partition(":rank")
        if kind not in KINDS or not step.isdigit() or (rank and not rank.isdigit()):
            raise ValueError(f"SHARDWISE_FAULT: cannot parse {part!r}; expected KIND@STEP[:rankR], KIND in {KINDS}")
        out.append((kind, int(step), int(rank) if rank else None))
    return out


class Faults:
    def __init__(self, rank: int):
        first_attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) == 0
        self.rank = rank
        self.plan = parse(os.environ.get("SHARDWISE_FAULT", "")) if first_attempt else []

    def _due(self, step: int) -> list[str]:
        return [k for k, s, r in self.plan if s == step and r in (None, self.rank)]

    def before_step(self, step: int) -> None:
        for kind in self._due(step):
            if kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif kind == "term":
                os.kill(os.getpid(), signal.SIGTERM)
            elif kind == "oom":
                raise torch.OutOfMemoryError(f"injected out-of-memory at step {step} (SHARDWISE_FAULT)")
            elif kind == "hang":
                # like a process stuck in native code: no Python signal handler will run
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                while True:
                    time.sleep(3600)

    def during_save(self, step: int) -> None:
        if "killsave" in self._due(step):
            os.kill(os.getpid(), signal.SIGKILL)

    def poison_loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        return loss * float("nan") if "nan" in self._due(step) else loss
