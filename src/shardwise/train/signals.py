"""What a second Ctrl-C (or SIGTERM) does while a run stops: it is ignored, with one line, until the stopping
checkpoint is written.

The first SIGINT/SIGTERM asks every rank to stop at one agreed step and write a checkpoint (train/control.py). Left to
itself, a further signal while that checkpoint is written ends the launcher, and the workers die with their launcher
(train/worker.die_with_launcher): the checkpoint would be lost without a word. A scheduler's preemption commonly signals
more than once (`scancel` signals every process of the step, the elastic agent forwards its own, a user presses
Ctrl-C twice), and torchrun already gives the workers 30 s after its own signal before SIGKILL; so further signals
are ignored and said to be, and kill -9 (or that 30 s bound) remains the way to stop at once."""

from __future__ import annotations

import contextlib
import os
import signal

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def further_line(where: str = "") -> str:
    return (f"shardwise: {where}saving a checkpoint before stopping; a further Ctrl-C or SIGTERM is ignored until it "
            f"is written (kill -9 {os.getpid()} stops at once, without it)\n")


class Further:
    """A signal handler for further stop signals: says so once (os.write: a handler may run while the process
    itself is printing), then does nothing."""

    def __init__(self, where: str = ""):
        self.where, self.said = where, False

    def __call__(self, signum, frame) -> None:
        if not self.said:
            self.said = True
            with contextlib.suppress(OSError):
                os.write(2, further_line(self.where).encode())


@contextlib.contextmanager
def hold_further_signals():
    """Around the elastic agent in the launcher: its handler for SIGINT/SIGTERM raises SignalException, and the agent
    then signals the workers and waits for them (their stopping checkpoint) inside its `except` clause. A further
    signal raised there too, out of that wait: the launcher exited and its workers died mid-save. With this, the
    first signal reaches the agent as before, and the handlers then become Further's until the agent returns."""
    import torch.distributed.elastic.multiprocessing.api as mp_api

    agents = mp_api._terminate_process_handler  # looked up when the agent installs its handlers (PContext.start)
    before = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    further = Further()

    def first(signum, frame):
        for s in STOP_SIGNALS:
            signal.signal(s, further)
        agents(signum, frame)  # raises SignalException: the agent shuts the workers down and waits for them

    mp_api._terminate_process_handler = first
    try:
        yield
    finally:
        mp_api._terminate_process_handler = agents
        for s, h in before.items():
            if h is not None:
                signal.signal(s, h)
