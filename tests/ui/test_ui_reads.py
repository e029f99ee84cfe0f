"""What `shardwise ui` reads of a run, bounded: a config.yaml of a few hundred bytes of aliases, a summary.json of
megabytes and a metrics.jsonl of hundreds of thousands of records are each read no more than a page needs."""

from __future__ import annotations

import json
import os

import pytest

from shardwise.ui import runs
from tests.ui.conftest import UIServer
from tests.ui.test_server_hostile import _call

pytestmark = pytest.mark.timeout(120)


def _alias_bomb() -> str:
    """A config.yaml whose `strategy` expands, through aliases, to 9**8 (43 million) strings."""
    lines = ['a: &a ["x","x","x","x","x","x","x","x","x"]']
    for prev, name in zip("abcdefg", "bcdefgh"):
        lines.append(f"{name}: &{name} [" + ",".join([f"*{prev}"] * 9) + "]")
    lines.append("strategy: *h")
    return "\n".join(lines) + "\n"


def _write(path, text) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        fh.write(text)


def _metrics(path, n: int, pad: int = 0) -> None:
    with open(os.path.join(path, "metrics.jsonl"), "w") as fh:
        for s in range(1, n + 1):
            fh.write(json.dumps({"step": s, "loss": 1.0 / s, "pad": "x" * pad}) + "\n")


def test_an_alias_bomb_config_is_listed_as_unreadable(tmp_path):
    """A few hundred bytes of YAML aliases in a run's config.yaml expanded to 43 million values in every listing of
    /api/runs (the page's event stream recomputes it every second): the listing took seconds and hundreds of MB of
    JSON. Read with the CLI's bound, the run is listed with its config unreadable, and the other runs as they are."""
    bomb = _alias_bomb()
    assert len(bomb.encode()) < 400
    _write(f"{tmp_path}/bomb/config.yaml", bomb)
    _write(f"{tmp_path}/bomb/summary.json", "{}")
    _write(f"{tmp_path}/good/config.yaml", "strategy: ddp\nnproc_per_node: 2\n")
    srv = UIServer(str(tmp_path)).start()
    try:
        status, d = _call(srv.base + "/api/runs", timeout=60)
        assert status == 200, d
        listed = {r["name"]: r for r in d["runs"]}
        assert listed["bomb"]["strategy"] is None and listed["bomb"]["state"] == "finished"
        assert "more than 10,000 values" in listed["bomb"]["config_error"], listed["bomb"]
        assert listed["good"]["strategy"] == "ddp" and listed["good"]["world"] == 2
        assert listed["good"]["config_error"] is None
        status, r = _call(srv.base + "/api/run?run=bomb", timeout=60)
        assert status == 200 and r["config"] == {} and r["predicted"] is None, r
        status, r = _call(srv.base + "/api/diff?a=bomb&b=good", timeout=60)
        assert status == 200 and {x["key"] for x in r["diff"]} == {"strategy", "nproc_per_node"}, r
    finally:
        srv.stop()


def test_a_summary_over_the_cap_is_not_read_and_says_so(tmp_path):
    """A summary.json of megabytes (a copied or planted run) was read and parsed whole at every listing; now one over
    MAX_JSON_BYTES is not read, and the listing says why there is no summary. The run is still finished."""
    run = tmp_path / "big"
    _write(f"{run}/config.yaml", "strategy: ddp\n")
    _write(f"{run}/summary.json", json.dumps({"final_loss": 1.5, "pad": "x" * (runs.MAX_JSON_BYTES + 1)}))
    _write(f"{tmp_path}/small/summary.json", json.dumps({"final_loss": 2.5}))
    d = runs.info(str(tmp_path), str(run))
    assert d["summary"] is None and d["state"] == "finished"
    assert d["summary_error"] == f"summary.json: larger than {runs.MAX_JSON_BYTES:,} bytes; not read"
    d = runs.info(str(tmp_path), str(tmp_path / "small"))
    assert d["summary"] == {"final_loss": 2.5} and d["summary_error"] is None


@pytest.mark.parametrize("n,pad", [(50_000, 0), (60_000, 150)], ids=["read-whole", "sampled"])
def test_metrics_are_decimated_to_first_last_and_an_even_sample(tmp_path, n, pad):
    """A long run's metrics.jsonl went whole into each detail view (and the event stream's first answer). Now at most
    METRICS_POINTS records: the first, the last, and the rest spread evenly over the run; a file past METRICS_WHOLE
    bytes is read only where it is sampled. The next offset is the file's end, from which new records come whole."""
    _metrics(str(tmp_path), n, pad)
    assert (os.path.getsize(tmp_path / "metrics.jsonl") > runs.METRICS_WHOLE) == (pad > 0)
    recs, offset = runs.metrics(str(tmp_path))
    steps = [r["step"] for r in recs]
    assert runs.METRICS_POINTS - 5 <= len(steps) <= runs.METRICS_POINTS
    assert steps[0] == 1 and steps[-1] == n and steps == sorted(set(steps))
    gaps = [b - a for a, b in zip(steps, steps[1:])]
    mean = (n - 1) / (len(steps) - 1)
    assert max(gaps) <= 1.5 * mean and min(gaps) >= 0.5 * mean, (min(gaps), max(gaps), mean)
    assert offset == os.path.getsize(tmp_path / "metrics.jsonl")
    with open(tmp_path / "metrics.jsonl", "a") as fh:  # the run goes on: two records and half of a third
        fh.write(json.dumps({"step": n + 1}) + "\n" + json.dumps({"step": n + 2}) + "\n" + '{"step": ')
    recs, offset2 = runs.metrics(str(tmp_path), offset)
    assert [r["step"] for r in recs] == [n + 1, n + 2]
    assert runs.metrics(str(tmp_path), offset2) == ([], offset2)


def test_the_detail_view_gets_the_decimated_metrics(tmp_path):
    run = tmp_path / "long"
    _write(f"{run}/config.yaml", "strategy: ddp\n")
    _metrics(str(run), 30_000)
    srv = UIServer(str(tmp_path)).start()
    try:
        status, d = _call(srv.base + "/api/run?run=long", timeout=60)
    finally:
        srv.stop()
    assert status == 200, d
    steps = [r["step"] for r in d["metrics"]]
    assert len(steps) == runs.METRICS_POINTS and steps[0] == 1 and steps[-1] == 30_000


def test_a_failed_run_shows_a_ranks_error_not_its_life_mark_or_waiting_report(tmp_path):
    """A run whose rank 0 hung leaves rank0.alive (its PID: killed without a word), and rank 1 leaves rank1.waiting
    (the phase it waited in) beside its one-line error rank1.txt: the page shows the error."""
    errs = tmp_path / "hung" / ".prep" / "errors"
    errs.mkdir(parents=True)
    (tmp_path / "hung" / "metrics.jsonl").write_text("")
    (errs / "rank0.alive").write_text("12345")
    (errs / "rank1.waiting").write_text("step 5: forward/backward (gradient reduction)")
    (errs / "rank1.txt").write_text("rank 1: a collective did not complete within --collective-timeout 4s\n")
    assert runs.state(str(tmp_path / "hung")) == ("failed", "rank 1: a collective did not complete within "
                                                           "--collective-timeout 4s")
    (errs / "rank1.txt").unlink()
    (errs / "rank2.exc").write_text("RuntimeError: boom")
    assert runs.state(str(tmp_path / "hung")) == ("failed", "RuntimeError: boom")


def test_a_bench_report_larger_than_a_summary_is_still_listed(tmp_path):
    """Bench reports hold every strategy's per-step records: they keep their own 20 MB bound, not a summary's."""
    rep = {"schema": "shardwise-bench/1", "created": "2026-01-01T00:00:00", "command": "shardwise bench",
           "results": [{"steps": "x" * (2 * runs.MAX_JSON_BYTES)}]}
    _write(f"{tmp_path}/bench/r.json", json.dumps(rep))
    assert [r["name"] for r in runs.bench_reports(str(tmp_path))] == ["bench/r.json"]
    assert runs.bench_report(str(tmp_path), "bench/r.json")["command"] == "shardwise bench"
