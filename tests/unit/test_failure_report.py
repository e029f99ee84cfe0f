"""The launcher's one line for a failed worker group (launch.failures._failure_report): which rank it blames, from the
agent's failures (torch's own ChildFailedError), the ranks' one-line errors and the life marks they leave
(train/worker.life_marker)."""

import os
import signal

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from shardwise import phases, rundir
from shardwise.config import Config
from shardwise.launch.failures import _failure_report
from shardwise.train.worker import life_marker

LOST = "rank 1: a collective lost its peer during step 3: another rank is hung or dead (Connection closed by peer)"
TIMED_OUT = ("rank 1: a collective did not complete within --collective-timeout 4s during step 3: another rank is "
             "hung or dead (Timed out)")


def failed(tmp_path, rank: int, exitcode: int) -> ChildFailedError:
    f = ProcessFailure(local_rank=rank, pid=4242, exitcode=exitcode, error_file=str(tmp_path / "no-error-file"))
    return ChildFailedError("shardwise.train.worker", {rank: f})


def leave(out, rank: int, error: str | None = None, alive: bool = False, exc: str | None = None) -> None:
    d = rundir.error_dir(str(out))
    os.makedirs(d, exist_ok=True)
    if error is not None:
        (open(os.path.join(d, f"rank{rank}.txt"), "w")).write(error)
    if exc is not None:
        (open(os.path.join(d, f"rank{rank}.exc"), "w")).write(exc)
    if alive:
        (open(os.path.join(d, f"rank{rank}.alive"), "w")).write("4243")


SAVE_LOST = ("rank 0: failed while saving checkpoint /o/checkpoints/step_00000011 (RuntimeError: [../gloo/transport/"
             "tcp/pair.cc:534] Connection reset by peer); the previous checkpoint is intact")


def test_a_rank_that_left_only_its_life_mark_is_blamed_not_the_one_whose_collective_then_failed(tmp_path):
    # the agent found rank 1 first (its error: a peer died); rank 0 ended without a word (SIGKILL leaves the mark)
    leave(tmp_path, 1, LOST, alive=False)
    leave(tmp_path, 0, alive=True)
    line = _failure_report(str(tmp_path), failed(tmp_path, 1, 2), Config())
    assert line.startswith("training failed: rank 0 ended without an error of its own: killed by a signal"), line
    assert line.endswith("; rank(s) 1 stopped after it"), line


def test_a_hung_rank_is_not_taken_for_a_dead_one(tmp_path):
    # a collective that timed out: the peer hung (the agent then stopped it, and its mark stayed): the error stands
    leave(tmp_path, 1, TIMED_OUT)
    leave(tmp_path, 0, alive=True)
    assert _failure_report(str(tmp_path), failed(tmp_path, 1, 2), Config()) == TIMED_OUT


def test_a_rank_with_an_error_of_its_own_is_not_silent(tmp_path):
    leave(tmp_path, 1, LOST)
    leave(tmp_path, 0, "rank 0: the data file is gone", alive=True)
    assert _failure_report(str(tmp_path), failed(tmp_path, 1, 2), Config()) == "rank 0: the data file is gone"


def test_the_agents_signal_is_named_where_it_reported_the_dead_rank(tmp_path):
    leave(tmp_path, 1, LOST)
    leave(tmp_path, 0, alive=True)
    line = _failure_report(str(tmp_path), failed(tmp_path, 0, -signal.SIGKILL), Config())
    assert line.startswith("training failed: rank 0 was killed by signal 9 (SIGKILL)"), line


@pytest.fixture
def no_exit_hooks():
    saved = list(phases.before_exit)
    yield
    phases.before_exit[:] = saved


def test_the_life_mark_lasts_from_the_start_to_any_way_out(tmp_path, no_exit_hooks):
    remove = life_marker(str(tmp_path), "3")
    mark = os.path.join(rundir.error_dir(str(tmp_path)), "rank3.alive")
    assert open(mark).read() == str(os.getpid())
    phases.before_exit[-1]()  # the way out of exit_deadline's os._exit
    assert not os.path.exists(mark)
    remove()  # and main's finally, after it: nothing left to remove, no error
    assert not os.path.exists(mark)


def test_a_rank_that_raised_is_blamed_whichever_rank_the_agent_reported(tmp_path):
    # rank 1 raised (its traceback in the output); the agent found rank 0 first, whose collective lost its peer
    leave(tmp_path, 0, LOST.replace("rank 1", "rank 0"))
    leave(tmp_path, 1, exc="OutOfMemoryError: injected out-of-memory at step 3 (SHARDWISE_FAULT)")
    line = _failure_report(str(tmp_path), failed(tmp_path, 0, 2), Config())
    assert line.startswith("out of memory on rank 1 (OutOfMemoryError: injected"), line
    assert line.endswith("; rank(s) 0 stopped after it"), line
    leave(tmp_path, 1, exc="KeyError: 'input_ids'")
    line = _failure_report(str(tmp_path), failed(tmp_path, 0, 2), Config())
    assert line.startswith("training failed: rank 1 raised an exception (KeyError: 'input_ids')"), line


def test_a_save_that_lost_its_peer_is_a_consequence_too(tmp_path):
    # rank 1 was killed while both saved: rank 0's error is the save's, with the connection reset in it
    leave(tmp_path, 0, SAVE_LOST)
    leave(tmp_path, 1, alive=True)
    line = _failure_report(str(tmp_path), failed(tmp_path, 0, 2), Config(max_restarts=1))
    assert line.startswith("training failed: rank 1 ended without an error of its own"), line
    assert line.endswith("; rank(s) 0 stopped after it (after 1 restart(s), the --max-restarts limit)"), line


def test_a_rank_starting_again_clears_its_earlier_attempts_errors(tmp_path, no_exit_hooks):
    """After --max-restarts, an error left by the first attempt must not decide the blame for the last one."""
    leave(tmp_path, 0, LOST.replace("rank 1", "rank 0"), exc="ValueError: old")
    life_marker(str(tmp_path), "0")
    d = rundir.error_dir(str(tmp_path))
    assert sorted(os.listdir(d)) == ["rank0.alive"]
