"""Time to first step (issue 17 item 3): each run reports where its time went, in
summary.json (`phases_s`) and on one line of the run log. Consistency only, no thresholds:
the session's reference runs (2-rank DDP through the agent, one in-process run) are read."""

import json

import pytest

from shardwise.phases import PHASES


PHASE_NAMES = [name for name, _, _ in PHASES]


def _phases(run) -> dict:
    return json.loads((run.out / "summary.json").read_text())["phases_s"]


@pytest.mark.parametrize("ref", ["ddp_ref", "single_ref"])
def test_summary_holds_every_phase_and_they_add_up(ref, request):
    run = request.getfixturevalue(ref)
    summary = json.loads((run.out / "summary.json").read_text())
    ph = summary["phases_s"]
    assert list(k for k in ph if k in PHASE_NAMES) == PHASE_NAMES  # every phase, in order
    assert all(v >= 0 for v in ph.values()), ph
    # the phases are contiguous: they add up to the whole (rounding of each to 1 ms aside)
    assert sum(ph[k] for k in PHASE_NAMES) == pytest.approx(ph["total"], abs=0.02)
    before_first = PHASE_NAMES[: PHASE_NAMES.index("first_step") + 1]
    assert sum(ph[k] for k in before_first) == pytest.approx(ph["time_to_first_step"], abs=0.02)
    assert ph["time_to_first_step"] <= ph["total"]
    # the worker's own clock: training wall time covers the first step, the others and the save
    assert ph["first_step"] + ph["training"] + ph["save"] <= summary["wall_time_this_launch_s"] + 0.01
    # one line of the run log says the same
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("shardwise: phases: ")]
    assert len(lines) == 1 and f"total {ph['total']:.2f}s" in lines[0]


def test_the_agent_starts_the_workers_while_the_launcher_prepares(ddp_ref, single_ref):
    # under the agent each rank is a new interpreter: the agent is started (and the workers import torch,
    # transformers and the model's classes) while the launcher still checks and tokenizes; how much of that is
    # hidden depends on the machine's cores. In one process the worker starts where the launcher hands over
    marks = json.loads((ddp_ref.out / ".prep" / "timeline.json").read_text())
    assert marks["prepare_start"] < marks["agent_start"] < marks["prepared"], marks
    assert marks["worker_start"] == max(marks["worker_process_start"], marks["prepared"])
    single = json.loads((single_ref.out / ".prep" / "timeline.json").read_text())
    assert "agent_start" not in single and single["worker_process_start"] < single["prepare_start"]
