"""What `shardwise ui` reads of a run, bounded: a config.yaml of a few hundred bytes of aliases, a summary.json of
megabytes and a metrics.jsonl of hundreds of thousands of records are each read no more than a page needs."""

from __future__ import annotations

import json
import os

import pytest

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
