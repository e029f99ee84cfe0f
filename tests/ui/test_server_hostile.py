"""`shardwise ui` against hostile or broken input: a real server, real HTTP (urllib), a runs
directory holding what a broken, copied or planted run leaves, and Chromium for what the page renders."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from tests.ui.conftest import UIServer

pytestmark = pytest.mark.timeout(120)

XSS = '<img src=x onerror="window.__pwned=1">'


def _call(url: str, body=None, raw: bytes | None = None, headers: dict | None = None, timeout: float = 30):
    """(status, parsed JSON or text) of a GET, or a POST of `body` as JSON / `raw` bytes."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    h = {"Content-Type": "application/json"} if data is not None else {}
    h.update(headers or {})
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=h), timeout=timeout) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def _write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        fh.write(text)


@pytest.fixture(scope="module")
def outside(tmp_path_factory):
    """A file outside the runs directory that nothing may show."""
    p = tmp_path_factory.mktemp("outside") / "secret.txt"
    p.write_text("TOP-SECRET-LINE\n")
    return str(p)


@pytest.fixture(scope="module")
def hostile(tmp_path_factory, outside):
    """A runs directory with one good run and runs whose files are malformed, planted or not files at all."""
    root = str(tmp_path_factory.mktemp("hostile-runs"))
    _write(f"{root}/good/config.yaml", "strategy: ddp\nnproc_per_node: 2\n")
    _write(f"{root}/good/summary.json", "{}")
    _write(f"{root}/list-record/ui-launch.json", "[1, 2]")
    _write(f"{root}/list-config/config.yaml", "- a\n- b\n")
    _write(f"{root}/list-marker/.prep/interrupted.json", "[7]")
    _write(f"{root}/list-marker/config.yaml", "strategy: ddp\n")
    os.makedirs(f"{root}/dir-error/.prep/errors/rank0")
    _write(f"{root}/dir-error/metrics.jsonl", "")
    _write(f"{root}/bad-pid/ui-launch.json", json.dumps({"pid": -1, "create_time": 0, "started": 0}))
    _write(f"{root}/leak/summary.json", "{}")
    _write(f"{root}/leak/ui-launch.json", json.dumps({"pid": 2 ** 22 + 17, "create_time": 0, "started": 0}))
    os.symlink(outside, f"{root}/leak/ui-launch.log")
    os.symlink(outside, f"{root}/leak/config.yaml")
    elsewhere = str(tmp_path_factory.mktemp("elsewhere"))  # a directory outside, shaped like a run's .prep
    _write(f"{elsewhere}/errors/rank0.txt", open(outside).read())
    _write(f"{elsewhere}/interrupted.json", json.dumps({"step": "TOP-SECRET", "checkpoint": "c"}))
    _write(f"{root}/linked-prep/metrics.jsonl", "")
    os.symlink(elsewhere, f"{root}/linked-prep/.prep")
    _write(f"{root}/linked-errors/metrics.jsonl", "")
    os.makedirs(f"{root}/linked-errors/.prep")
    os.symlink(f"{elsewhere}/errors", f"{root}/linked-errors/.prep/errors")
    _write(f"{root}/fifo/config.yaml", "strategy: ddp\n")
    _write(f"{root}/fifo/ui-launch.json", json.dumps({"pid": 2 ** 22 + 17, "create_time": 0, "started": 0}))
    os.mkfifo(f"{root}/fifo/ui-launch.log")
    os.symlink("/nonexistent/report.json", f"{root}/dangling.json")
    _write(f"{root}/html/config.yaml", f"nproc_per_node: '{XSS}'\nstrategy: ddp\n")
    return root


@pytest.fixture(scope="module")
def srv(hostile):
    s = UIServer(hostile).start()
    yield s
    s.stop()


def test_malformed_and_oversized_bodies_answer_4xx(srv):
    """A body nested past Python's recursion limit and a body far larger than any form get a
    4xx with a one-line message; the server goes on answering."""
    deep = b"[" * 100_000 + b"]" * 100_000
    status, d = _call(srv.base + "/api/plan", raw=deep)
    assert status == 400 and "JSON" in d["error"], (status, d)
    status, d = _call(srv.base + "/api/plan", raw=b'{"model": "' + b"x" * (8 << 20) + b'"}')
    assert status == 413 and "too large" in d["error"], (status, d)
    status, d = _call(srv.base + "/api/run/stop", raw=b"[" + b"0," * (4 << 20) + b"0]")
    assert status == 413, (status, d)
    assert _call(srv.base + "/api/runs")[0] == 200


def test_broken_and_planted_run_files_do_not_break_the_pages(srv, hostile):
    """JSON and YAML of the wrong shape, a directory where a file belongs, a FIFO, a dangling
    symlink: the run list, each run and the bench list still answer (and quickly); a log or
    config symlinked to a file outside the runs directory is not shown."""
    t0 = time.monotonic()
    status, d = _call(srv.base + "/api/runs", timeout=10)
    assert status == 200, d
    names = {r["name"]: r for r in d["runs"]}
    assert {"good", "list-record", "list-config", "list-marker", "dir-error", "leak", "fifo", "linked-prep",
            "linked-errors"} <= set(names)
    assert names["good"]["world"] == 2 and names["html"]["world"] is None
    for name in names:
        status, r = _call(srv.base + "/api/run?run=" + name, timeout=10)
        assert status == 200, (name, r)
        assert "TOP-SECRET" not in json.dumps(r), (name, r)
    status, b = _call(srv.base + "/api/bench", timeout=10)
    assert status == 200 and b["reports"] == [], b
    assert time.monotonic() - t0 < 30


def test_stop_refuses_a_process_the_page_did_not_start(srv, hostile):
    """A ui-launch.json naming another process (its real pid and start time: copied, planted,
    or the id of a run long gone) does not let Stop signal that process."""
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        run = os.path.join(hostile, "planted")
        _write(f"{run}/config.yaml", "strategy: ddp\n")
        _write(f"{run}/ui-launch.json", json.dumps({
            "pid": victim.pid, "create_time": psutil.Process(victim.pid).create_time(), "started": time.time(),
            "argv": ["shardwise", "train", f"--output-dir={run}"]}))
        status, d = _call(srv.base + "/api/run/stop", {"run": "planted"})
        assert status == 400 and "not running" in d["error"], (status, d)
        time.sleep(0.5)
        assert victim.poll() is None, "the server signalled a process it did not start"
        status, d = _call(srv.base + "/api/run/stop", {"run": "bad-pid"})
        assert status == 400, (status, d)
    finally:
        victim.kill()
        victim.wait()


def test_unknown_run_action_is_not_a_resume(srv, hostile):
    status, d = _call(srv.base + "/api/run/delete", {"run": "list-marker"})
    assert status == 404, (status, d)
    assert not os.path.exists(os.path.join(hostile, "list-marker", "ui-launch.log"))


def test_control_characters_in_a_field_are_refused_by_name(srv, hostile):
    """A NUL (which no command line can carry) or a newline in a field: a 400 naming the
    field, and nothing is written into the runs directory."""
    before = sorted(os.listdir(hostile))
    for value in ("demo\x00", "demo\nshardwise: interrupted by signal 15"):
        status, d = _call(srv.base + "/api/launch", {"data": value, "run_name": "ctl"})
        assert status == 400 and d["field"] == "data" and "control character" in d["error"], (status, d)
    status, d = _call(srv.base + "/api/plan", {"model": "tiny\x00"})
    assert status == 400 and d["field"] == "model", (status, d)
    assert sorted(os.listdir(hostile)) == before


def test_concurrent_launches_into_one_run_name_start_one_run(tmp_path):
    """Two launches with the same run name at once: one starts, the other is told the name is
    taken; one launcher writes into the directory."""
    s = UIServer(str(tmp_path)).start()
    pids = []
    try:
        form = {"gpus": "1", "strategy": "single", "max_steps": "1", "save_final": False, "run_name": "same",
                "gpu_memory": ""}
        with ThreadPoolExecutor(max_workers=3) as pool:
            got = list(pool.map(lambda _: _call(s.base + "/api/launch", form, timeout=90), range(3)))
        ok = [d for status, d in got if status == 200]
        pids = [d["pid"] for d in ok]
        assert len(ok) == 1, got
        assert all(status == 400 and d["field"] == "run_name" for status, d in got if status != 200), got
        with open(tmp_path / "same" / "ui-launch.log") as fh:
            assert fh.read().count("=== shardwise ui started") == 1
    finally:
        for pid in pids:
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
        s.stop()


def test_a_non_ascii_token_is_refused_not_an_error(tmp_path):
    s = UIServer(str(tmp_path), "--host", "127.0.0.2").start()
    try:
        assert _call(s.base + "/api/runs?token=%C3%A9")[0] == 401
        assert _call(s.base + "/api/runs", headers={"Cookie": f"shardwise_token_{s.port}=\u00e9"})[0] == 401
    finally:
        s.stop()


def test_run_and_bench_pages_show_planted_markup_as_text(tmp_path, browser):
    """A config.yaml or bench report holding HTML: the pages show it as text, never run it."""
    _write(f"{tmp_path}/html/config.yaml", f"nproc_per_node: '{XSS}'\nstrategy: ddp\n")
    _write(f"{tmp_path}/bench/report.json", json.dumps({
        "schema": "shardwise-bench/1", "created": "2026-12-01", "command": "shardwise bench", "verdict": [],
        "results": [{"strategy": "ddp", "result": "skipped", "status": "skipped", "world_size": XSS}]}))
    srv = UIServer(str(tmp_path)).start()
    ctx = browser.new_context()
    page = ctx.new_page()
    page.set_default_timeout(30_000)
    try:
        page.goto(srv.base + "/runs")
        page.wait_for_selector("tr[data-run='html']")
        page.goto(srv.base + "/bench")
        page.wait_for_selector("#results tbody tr")
        assert XSS in page.locator("#results tbody").inner_text()
        page.wait_for_timeout(300)  # an injected <img src=x> has failed to load by now
        assert page.evaluate("window.__pwned") is None
        page.goto(srv.base + "/runs?run=html")
        page.wait_for_selector("tr[data-run='html']")
        page.wait_for_function("() => document.getElementById('run-state').textContent !== ''")
        page.wait_for_timeout(300)  # an injected <img src=x> has failed to load by now
        assert page.evaluate("window.__pwned") is None
    finally:
        ctx.close()
        srv.stop()


def test_names_outside_or_unreadable_are_404(srv):
    """A run or report name that leaves the runs directory, or holds a NUL: a 404 with the one line."""
    for path in ("/api/run?run=%00", "/api/run?run=..", "/api/run?run=/etc", "/api/diff?a=good&b=%00",
                 "/api/bench/report?report=%00.json", "/api/bench/report?report=../../etc/x.json"):
        status, d = _call(srv.base + path)
        assert status == 404 and "error" in d, (path, status, d)


def test_bad_runs_dir_and_host_are_one_line_naming_the_flag(tmp_path):
    """A --runs-dir that is a file, and a --host that is not this machine's: the CLI's one line
    naming the flag at fault (not a traceback, not --port)."""
    from tests.helpers import run_cli

    afile = tmp_path / "afile"
    afile.write_text("")
    p = run_cli("ui", "--runs-dir", str(afile), "--port", "0", check=False, timeout=60)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip().splitlines() == [p.stderr.strip()] and "--runs-dir" in p.stderr, p.stderr
    p = run_cli("ui", "--runs-dir", str(tmp_path), "--host", "no-such-host.invalid", "--port", "0", check=False,
                timeout=60)
    assert p.returncode == 2 and p.stderr.startswith("shardwise: error: --host no-such-host.invalid"), p.stderr


def test_a_hand_edited_config_predicts_or_says_the_cli_line(srv, hostile):
    """The planner's prediction for a run: from a config.yaml as `shardwise train` writes it, the
    numbers; from a hand-edited one, the line the CLI prints for that file (not a Python TypeError)."""
    from shardwise import config
    from tests.helpers import run_cli

    _write(f"{hostile}/written/config.yaml", config.to_yaml(config.load_config(None, {}).cfg))
    _write(f"{hostile}/edited/config.yaml", "strategy: [1]\n")
    status, d = _call(srv.base + "/api/run?run=written")
    assert status == 200 and d["predicted"]["peak_mem_gib"] > 0, d
    status, d = _call(srv.base + "/api/run?run=edited")
    p = run_cli("train", os.path.join(hostile, "edited", "config.yaml"), check=False, timeout=60)
    assert p.returncode == 2
    assert status == 200 and d["predicted"] == {"error": p.stderr.strip()[len("shardwise: error: "):]}, (d, p.stderr)


def test_two_tokened_servers_on_one_host_keep_their_sessions(tmp_path, browser):
    """Two `shardwise ui --host` on one machine (two ports): opening the second one's URL does
    not log the browser out of the first (a cookie is per host, not per port)."""
    a = UIServer(str(tmp_path / "a"), "--host", "127.0.0.2").start()
    b = UIServer(str(tmp_path / "b"), "--host", "127.0.0.2").start()
    ctx = browser.new_context()
    try:
        pa, pb = ctx.new_page(), ctx.new_page()
        pa.goto(a.url)
        pb.goto(b.url)
        fetch = "async () => (await fetch('/api/runs')).status"
        assert pa.evaluate(fetch) == 200
        assert pb.evaluate(fetch) == 200
    finally:
        ctx.close()
        a.stop()
        b.stop()


def test_resume_does_not_write_through_a_planted_log_link(srv, hostile, outside):
    """A run directory whose ui-launch.log links to a file elsewhere: Resume refuses with a line
    naming the link, and that file is not written."""
    from shardwise import config

    run = os.path.join(hostile, "linked-log")
    _write(f"{run}/config.yaml", config.to_yaml(config.load_config(None, {}).cfg))
    _write(f"{run}/ui-launch.json", json.dumps({"pid": 2 ** 22 + 17, "create_time": 0, "started": 0}))
    os.symlink(outside, f"{run}/ui-launch.log")
    before = open(outside).read()
    status, d = _call(srv.base + "/api/run/resume", {"run": "linked-log"})
    if status == 200:
        os.killpg(d["pid"], signal.SIGKILL)
    assert status == 400 and "ui-launch.log" in d["error"], (status, d)
    assert open(outside).read() == before


def test_launch_record_is_not_written_through_a_planted_link(srv, hostile, outside):
    """A planted ui-launch.json.tmp linking elsewhere: Resume's record goes into the run
    directory, and the linked file is left as it was."""
    from shardwise import config

    run = os.path.join(hostile, "linked-record")
    _write(f"{run}/config.yaml", config.to_yaml(config.load_config(None, {}).cfg))
    os.symlink(outside, f"{run}/ui-launch.json.tmp")
    before = open(outside).read()
    status, d = _call(srv.base + "/api/run/resume", {"run": "linked-record"})
    try:
        assert status == 200, (status, d)
        assert open(outside).read() == before
        with open(f"{run}/ui-launch.json") as fh:
            assert json.load(fh)["pid"] == d["pid"]
    finally:
        if status == 200:
            os.killpg(d["pid"], signal.SIGKILL)


def test_resume_refuses_a_run_live_from_a_terminal(srv, hostile):
    """A run whose launcher (started from a terminal: no ui-launch.json) holds the run
    directory's lock: Resume says it is in use and starts nothing, so the page does not then
    call the live run failed."""
    import fcntl

    from shardwise import config, rundir

    run = os.path.join(hostile, "live")
    _write(f"{run}/config.yaml", config.to_yaml(config.load_config(None, {}).cfg))
    _write(f"{run}/.prep/interrupted.json", json.dumps({"step": 3, "checkpoint": "c"}))
    fd = os.open(os.path.join(run, rundir.LOCK), os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, f"{os.getpid()}\n".encode())
        status, d = _call(srv.base + "/api/run/resume", {"run": "live"})
        if status == 200:
            os.killpg(d["pid"], signal.SIGKILL)
        assert status == 400 and "in use" in d["error"] and str(os.getpid()) in d["error"], (status, d)
        assert not os.path.exists(os.path.join(run, "ui-launch.json"))
    finally:
        os.close(fd)


def test_resume_refuses_a_linked_run_lock(srv, hostile, tmp_path):
    """A run directory whose .shardwise-lock links to a file elsewhere: the launcher would
    truncate that file to write its PID there; Resume refuses and the file keeps its text."""
    from shardwise import config, rundir

    run = os.path.join(hostile, "linked-lock")
    _write(f"{run}/config.yaml", config.to_yaml(config.load_config(None, {}).cfg))
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me\n")
    os.symlink(precious, os.path.join(run, rundir.LOCK))
    status, d = _call(srv.base + "/api/run/resume", {"run": "linked-lock"})
    try:
        assert status == 400 and rundir.LOCK in d["error"], (status, d)
    finally:
        if status == 200:
            os.killpg(d["pid"], signal.SIGKILL)
    time.sleep(0.5)
    assert precious.read_text() == "keep me\n"


def test_resume_refuses_a_linked_config(srv, hostile, outside):
    """A run whose config.yaml links to a file elsewhere: Resume names the link and neither reads nor runs it."""
    status, d = _call(srv.base + "/api/run/resume", {"run": "leak"})
    if status == 200:
        os.killpg(d["pid"], signal.SIGKILL)
    assert status == 400 and "config.yaml is a symbolic link" in d["error"], (status, d)
    assert "TOP-SECRET" not in json.dumps(d)


def test_launch_after_the_runs_dir_was_removed_or_replaced(tmp_path):
    """The runs directory removed while the page runs: a launch makes it again and starts; replaced by a file: one
    line naming the directory, and no traceback."""
    import shutil

    runs_dir = tmp_path / "runs"
    runs_dir.mkdir()
    s = UIServer(str(runs_dir)).start()
    pid = None
    try:
        form = {"gpus": "1", "strategy": "single", "max_steps": "1", "save_final": False, "run_name": "again",
                "gpu_memory": ""}
        shutil.rmtree(runs_dir)
        status, d = _call(s.base + "/api/launch", form, timeout=90)
        assert status == 200, (status, d)
        pid = d["pid"]
        assert (runs_dir / "again" / "ui-launch.json").is_file()
        os.killpg(pid, signal.SIGKILL)
        pid = None
        shutil.rmtree(runs_dir)
        runs_dir.write_text("not a directory\n")
        status, d = _call(s.base + "/api/launch", {**form, "run_name": "third"}, timeout=90)
        assert status == 400 and "cannot create the run directory" in d["error"] and str(runs_dir) in d["error"], d
        assert "\n" not in d["error"]
        assert _call(s.base + "/api/runs")[0] == 200 and _call(s.base + "/api/bench")[0] == 200
    finally:
        if pid:
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
        s.stop()
