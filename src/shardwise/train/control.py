"""Decisions every rank takes at the same step (stop on a signal, save on a timer), agreed
through the rendezvous store."""

from __future__ import annotations

import hashlib
import hmac
import os
import signal
import sys
import time

import torch.distributed as dist

from shardwise.train import dist as sdist


class Control:
    """Decisions every rank must take at the same step: stop (SIGTERM/SIGINT reached some
    rank) and save (save_every_minutes elapsed on rank 0's clock). A request names a step
    two ahead of the requester's, through the rendezvous store; ranks are never more than
    one step apart (every step has collectives), so all of them see it in time. No GPU
    sync, no extra communicator: two store reads per step."""

    MARGIN = 2

    def __init__(self, env, save_every_minutes: float, store=None):
        self.signal: int | None = None
        self.rank = env.rank
        self.interval = save_every_minutes * 60
        self.last_save = time.monotonic()
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.keys = (f"shardwise/control/{attempt}/stop_at", f"shardwise/control/{attempt}/save_at")
        if store is None and env.world_size > 1:
            store = dist.distributed_c10d._get_default_store()
        self.store = store
        # With SHARDWISE_CONTROL_SECRET set (the same on every node), a request is signed and
        # one without a valid signature is ignored: on a network that is not fully trusted,
        # whoever reaches the store cannot stop the run or force saves through these keys.
        secret = os.environ.get("SHARDWISE_CONTROL_SECRET", "")
        self.secret = secret.encode() if secret else None
        self.warned = False
        self.local = {k: 0 for k in self.keys}
        if self.store is not None and self.rank == 0:
            for k in self.keys:
                self.store.set(k, "0")
        sdist.barrier()
        self.proposed_stop = False
        from shardwise.train.signals import Further

        self.further = Further(f"rank {self.rank}: " if env.world_size > 1 else "")
        self.before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if self.signal is None:
            self.signal = signum
        else:  # already stopping: the checkpoint is being written or is about to be (train/signals.py)
            self.further(signum, frame)

    def _sign(self, key: str, step: int) -> str:
        if self.secret is None:
            return str(step)
        mac = hmac.new(self.secret, f"{key}={step}".encode(), hashlib.sha256).hexdigest()
        return f"{step}:{mac}"

    def _verify(self, key: str, value: bytes) -> int:
        """The step a stored request names; 0 (no request) for a missing, malformed or,
        with a secret, unsigned or wrongly signed value."""
        text = value.decode("ascii", "replace")
        step_text, _, mac = text.partition(":")
        try:
            step = int(step_text)
        except ValueError:
            step = -1
        if step == 0:
            return 0
        if step < 0 or (self.secret is not None and not hmac.compare_digest(self._sign(key, step), text)):
            if not self.warned:
                print(f"shardwise: ignored a control request without a valid signature ({key})",
                      file=sys.stderr, flush=True)
                self.warned = True
            return 0
        return step

    def _propose(self, key: str, step: int) -> None:
        if self.store is None:
            self.local[key] = step
        elif key == self.keys[0]:
            self.store.compare_set(key, "0", self._sign(key, step))  # the first request wins
        else:
            # only rank 0 proposes saves. TCPStore.set sends without waiting for the server,
            # so a read on another connection could still see the old value: the get on
            # this connection returns only once the server has applied the set.
            self.store.set(key, self._sign(key, step))
            self.store.get(key)

    def _read(self, key: str) -> int:
        return self._verify(key, self.store.get(key)) if self.store is not None else self.local[key]

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
        """The handlers the process had before; once stopping on a signal, further ones stay ignored (with their
        line) while the process leaves: the checkpoint is written, and what follows says how to resume."""
        for sig, before in self.before.items():
            signal.signal(sig, self.further if self.signal is not None else
                          (before if before is not None else signal.SIG_DFL))
