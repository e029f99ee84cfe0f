import time

from shardwise import phases


def test_durations_are_the_gaps_between_marks_and_skip_missing_ones():
    marks = {"process_start": 100.0, "prepare_start": 100.5, "prepared": 102.0, "worker_start": 102.25}
    d = phases.durations(marks)
    assert d == {"imports": 0.5, "prepare": 1.5, "worker_start": 0.25}
    marks.update(setup_start=103.0, initialized=103.0, model_loaded=104.0, wrapped=104.5, ready=104.5,
                 first_step=105.0, trained=110.0, saved=111.0, exited=111.5)
    d = phases.durations(marks)
    assert d["time_to_first_step"] == 5.0 and d["total"] == 11.5 and d["exit"] == 0.5
    assert "total 11.50s" in phases.line(d) and phases.line(d).startswith("phases: imports 0.50s")


def test_process_start_is_in_the_past():
    assert phases.process_start() <= time.time()
