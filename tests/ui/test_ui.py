"""`shardwise ui` driven as a person would: a real server, a real headless Chromium, real
`shardwise train` runs on 2 CPU ranks, a real `shardwise bench` report."""

from __future__ import annotations

import glob
import json
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from tests.e2e.test_security_audit import planted, wait_ended  # noqa: F401 - planted: a copied run whose model has code
from tests.helpers import run_cli
from tests.ui.conftest import UIServer

pytestmark = pytest.mark.timeout(400)

BAD_INPUTS = {  # form field -> (value typed, the same input as `shardwise train` flags)
    # the form's data field defaults to the demo set; train refuses a model directory without --data
    "model": ("/nonexistent/model-dir", ["--model", "/nonexistent/model-dir", "--data", "demo"]),
    "seq_len": ("100000", ["--seq-len", "100000"]),
    "micro_batch_size": ("eight", ["--micro-batch-size", "eight"]),
}


@pytest.fixture(scope="module")
def background(runs_dir):
    """Started by the first test, used by later ones: a real bench report (ddp, 2 ranks, 2
    steps) in the runs directory, and the CLI's own messages for the bad inputs."""
    pool = ThreadPoolExecutor(max_workers=2)
    bench = pool.submit(run_cli, "bench", "--strategies", "ddp", "--nproc-per-node", "2", "--steps", "2",
                        "--warmup", "0", "--profile-steps", "0", "--report-dir", os.path.join(runs_dir, "bench"),
                        "--timeout", "300", cwd=runs_dir)
    cli = {f: pool.submit(run_cli, "train", *flags, "--max-steps", "1", check=False, cwd=runs_dir)
           for f, (_, flags) in BAD_INPUTS.items()}
    yield {"bench": bench, "cli": cli}
    pool.shutdown(wait=True)


def _own_entries(runs_dir: str) -> list[str]:
    """The runs directory's entries, less the report directory the background bench may create at any moment."""
    return sorted(set(os.listdir(runs_dir)) - {"bench"})


def _get(url: str, headers: dict | None = None) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_server_binds_loopback_only(server, background):
    """Without --host: every listening socket of the server is on 127.0.0.1, the machine's
    other addresses refuse the port, and a foreign Host header (DNS rebinding) is refused."""
    listening = [c for c in psutil.Process(server.proc.pid).net_connections("inet") if c.status == psutil.CONN_LISTEN]
    assert listening and all(c.laddr.ip == "127.0.0.1" for c in listening), listening
    others = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
              if a.family == socket.AF_INET and not a.address.startswith("127.")]
    for ip in others:
        with pytest.raises(OSError):
            socket.create_connection((ip, int(server.port)), timeout=3).close()
    assert _get(server.base + "/api/runs") == 200
    assert _get(server.base + "/api/runs", {"Host": "evil.example:80"}) == 400


def test_host_flag_requires_the_printed_token(runs_dir):
    """--host (here another loopback address, so nothing is exposed): the URL printed at
    start carries a token; without it every request is refused, with it (query or header) served."""
    s = UIServer(runs_dir, "--host", "127.0.0.2").start()
    try:
        token = s.url.split("token=", 1)[1]
        assert len(token) >= 20
        assert _get(s.base + "/api/runs") == 401
        assert _get(s.base + "/api/runs?token=wrong") == 401
        assert _get(s.base + "/api/runs?token=" + token) == 200
        assert _get(s.base + "/api/runs", {"X-Shardwise-Token": token}) == 200
    finally:
        s.stop()


def test_loopback_needs_the_token_too_unless_no_token(runs_dir):
    """On 127.0.0.1 (the default) every user of the machine can connect, and the page starts runs as you: the
    printed URL carries a token there too; --no-token serves without one, and is refused with --host."""
    s = UIServer(runs_dir, token=True).start()
    try:
        assert s.base.startswith("http://127.0.0.1:")
        token = s.url.split("token=", 1)[1]
        assert len(token) >= 20
        assert _get(s.base + "/api/runs") == 401
        assert _get(s.base + "/api/runs?token=" + token) == 200
        assert _get(s.base + "/api/runs", {"X-Shardwise-Token": token, "Host": "evil.example"}) == 400  # rebinding
    finally:
        s.stop()
    s = UIServer(runs_dir).start()  # --no-token
    try:
        assert "token=" not in s.url and _get(s.base + "/api/runs") == 200
    finally:
        s.stop()
    p = subprocess.run([sys.executable, "-m", "shardwise", "ui", "--runs-dir", runs_dir, "--host", "127.0.0.2",
                        "--no-token", "--port", "0"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "shardwise: error: --no-token: only on 127.0.0.1; --host 127.0.0.2 can be reached from other machines, so "
        "every request needs the token; drop --no-token or --host"], p.stderr


def _fill(page, field: str, value: str) -> None:
    page.fill(f"#f-{field}", value)


def test_plan_answers_as_you_type(server, page, shots):
    """A 7B model on 8 GPUs: at 80 GiB the planner recommends fsdp and the article's tree
    takes its DDP branch; at 40 GiB both change (fsdp-offload, the CPU-offload branch); the
    command to copy follows the form."""
    page.goto(server.base + "/")
    page.wait_for_selector("#f-model")
    _fill(page, "model", "7B")
    _fill(page, "gpus", "8")
    _fill(page, "seq_len", "2048")
    _fill(page, "micro_batch_size", "4")
    _fill(page, "gpu_memory", "80")
    rec = page.locator("#recommended")
    leaf = page.locator(".tree .leaf.taken")
    answered = ("m => { const p = window.shardwise.plan; return p && p.job.seq_len === 2048 && p.job.micro_batch === 4 "
                "&& p.hardware.world_size === 8 && p.hardware.device_mem_gib === m; }")
    page.wait_for_function(answered, arg=80)
    at80 = rec.inner_text()
    assert at80 == page.evaluate("window.shardwise.plan.recommended") == "fsdp"
    assert "DDP" in leaf.inner_text()
    # the stacked bar: one bar per strategy, the device memory line at 80 GiB
    chart = page.evaluate("(() => { const c = window.shardwise.memChart; return {labels: c.data.labels, "
                          "line: c.data.datasets.at(-1).data[0], parts: c.data.datasets.map(d => d.label)}; })()")
    assert "zero3" in chart["labels"] and chart["line"] == 80
    assert chart["parts"][:5] == ["parameters", "gradients", "optimizer", "activations", "buffers"]
    page.screenshot(path=os.path.join(shots, "plan.png"), full_page=True)

    _fill(page, "gpu_memory", "40")
    page.wait_for_function(answered, arg=40)
    assert rec.inner_text() == "fsdp-offload" != at80
    assert "offload" in leaf.inner_text()
    cmd = page.locator("#command").inner_text()
    assert cmd.startswith("shardwise train ") and "--model=7B" in cmd and "--nproc-per-node=8" in cmd
    assert "seq_len: 2048" in page.locator("#yaml").inner_text()


@pytest.mark.parametrize("field", list(BAD_INPUTS))
def test_bad_input_shows_the_cli_message_and_starts_nothing(server, page, runs_dir, background, shots, field):
    """A missing model directory, a sequence length the model cannot take, a malformed
    number: Launch shows `shardwise train`'s own one-line message next to the field and
    writes nothing into the runs directory."""
    p = background["cli"][field].result()
    assert p.returncode == 2, p.stderr
    cli_line = p.stderr.strip().splitlines()[-1]
    assert cli_line.startswith("shardwise: error: ")
    before = _own_entries(runs_dir)
    page.goto(server.base + "/")
    page.wait_for_selector("#f-model")
    _fill(page, "run_name", f"bad-{field}")
    _fill(page, field, BAD_INPUTS[field][0])
    page.click("#launch")
    err = page.locator(f"#e-{field}")
    page.wait_for_function("id => document.getElementById(id).textContent.startsWith('flag ') || "
                           "document.getElementById(id).textContent.startsWith('--')", arg=f"e-{field}",
                           timeout=60_000)
    page.wait_for_function("() => document.getElementById('launch-note').textContent === ''")
    assert err.inner_text() == cli_line[len("shardwise: error: "):]
    if field == "micro_batch_size":
        page.screenshot(path=os.path.join(shots, "plan-bad-input.png"), full_page=False)
    assert _own_entries(runs_dir) == before
    assert page.url.rstrip("/") == server.base


def _wait_state(page, runs_dir: str, run: str, state: str, timeout_s: float) -> None:
    """Wait for the page to show a run's state; on a timeout say what the page and the launcher showed."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.wait_for_function("s => document.getElementById('run-state').textContent === s", arg=state,
                               timeout=timeout_s * 1000)
    except PlaywrightTimeout:
        try:
            with open(os.path.join(runs_dir, run, "ui-launch.log"), errors="replace") as fh:
                log = "".join(fh.readlines()[-20:])
        except OSError as e:
            log = str(e)
        raise AssertionError(f"{run} not {state} after {timeout_s:.0f}s: the page shows "
                             f"{page.locator('#run-state').inner_text()!r} ({page.locator('#run-why').inner_text()}); "
                             f"ui-launch.log ends:\n{log}") from None


def _points(page) -> int:
    return int(page.locator("#points").inner_text())


@pytest.mark.timeout(600)
def test_launch_watch_stop_resume(server, page, runs_dir, shots):
    """Launch the demo on 2 CPU ranks from the Plan page; its loss curve gains points while
    it trains; Stop (SIGTERM) marks it interrupted with the launcher's own line; Resume
    (--resume auto) runs it to the end while the UI server that started it is replaced by
    a new one, which finds it again in the runs directory."""
    page.goto(server.base + "/")
    page.wait_for_selector("#f-model")
    _fill(page, "gpu_memory", "")
    page.select_option("#f-strategy", "ddp")
    _fill(page, "max_steps", "200")
    _fill(page, "log_every", "1")
    _fill(page, "run_name", "demo")
    page.uncheck("#f-save_final")  # no final Hugging Face directory: the test watches the loop, not the export
    page.wait_for_function("() => document.getElementById('command').textContent.includes('--max-steps=200') && document.getElementById('command').textContent.includes('--no-save-final')")
    page.click("#launch")
    page.wait_for_url("**/runs?run=demo", timeout=180_000)  # the first check builds the tiny model
    state = page.locator("#run-state")
    page.wait_for_function("() => Number(document.getElementById('points').textContent) >= 2", timeout=180_000)
    n1 = _points(page)
    page.wait_for_function("n => Number(document.getElementById('points').textContent) > n", arg=n1, timeout=60_000)
    assert state.inner_text() == "running"
    losses = page.evaluate("window.shardwise.charts.loss.data.datasets[0].data")
    assert all(isinstance(x, float) for x in losses)
    page.screenshot(path=os.path.join(shots, "runs-running.png"), full_page=True)

    page.click("#stop")
    _wait_state(page, runs_dir, "demo", "interrupted", 120)
    why = page.locator("#run-why").inner_text()
    assert why.startswith("interrupted by signal 15") and "--resume auto" in why, why
    stopped_at = page.evaluate("window.shardwise.charts.loss.data.labels.at(-1)")
    assert stopped_at < 200, "the run ended before Stop took effect"
    assert os.path.isdir(os.path.join(runs_dir, "demo", "checkpoints"))
    page.screenshot(path=os.path.join(shots, "runs-interrupted.png"), full_page=True)

    page.click("#resume")
    _wait_state(page, runs_dir, "demo", "running", 60)
    server.stop()  # the run is not the server's: it goes on without it
    server.start()
    page.goto(server.base + "/runs?run=demo")
    _wait_state(page, runs_dir, "demo", "finished", 300)
    page.wait_for_function("() => window.shardwise.charts.loss.data.labels.at(-1) === 200")
    labels = page.evaluate("window.shardwise.charts.loss.data.labels")
    assert labels[-1] == 200 and stopped_at in labels
    with open(os.path.join(runs_dir, "demo", "summary.json")) as fh:
        assert json.load(fh)["steps"] == 200
    assert "shardwise train " in page.locator("#cmds").inner_text()
    pvm = page.locator("#pvm").inner_text()
    assert "peak memory per rank" in pvm and "step time" in pvm
    page.screenshot(path=os.path.join(shots, "runs-finished.png"), full_page=True)


def test_bench_report_as_charts(server, page, background, shots):
    """A real `shardwise bench` report in the runs directory: the Bench page lists it and
    charts measured against predicted tokens/s from its JSON."""
    try:
        background["bench"].result()
    except AssertionError as e:  # the end of the run's own log says where it stopped
        tails = []
        for log in sorted(glob.glob(os.path.join(server.runs_dir, "bench", "runs", "*", "bench.log"))):
            with open(log, errors="replace") as fh:
                tails.append(f"--- {log}\n" + "".join(fh.readlines()[-40:]))
        raise AssertionError(f"{e}\n" + "\n".join(tails)) from None
    with open(os.path.join(server.runs_dir, "bench", "report.json")) as fh:
        report = json.load(fh)
    page.goto(server.base + "/bench")
    page.wait_for_function("() => window.shardwise.charts.tps")
    got = page.evaluate("(() => { const c = window.shardwise.charts.tps; "
                        "return {labels: c.data.labels, measured: c.data.datasets[0].data}; })()")
    ddp = next(r for r in report["results"] if r["strategy"] == "ddp")
    assert got["labels"] == ["ddp"] and got["measured"] == [ddp["measured"]["tokens_per_s"]["median"]]
    assert "ddp" in page.locator("#results").inner_text()
    page.screenshot(path=os.path.join(shots, "bench.png"), full_page=True)


def test_runs_page_diffs_two_configs(server, page, runs_dir, shots):
    """Two runs ticked: the page lists exactly the config keys that differ."""
    page.goto(server.base + "/runs")
    page.wait_for_selector("input.tick[value='demo']")
    page.check("input.tick[value='demo']")
    page.check("input.tick[value='bench/runs/ddp']")
    page.click("#diff-btn")
    page.wait_for_selector("#diff:not([hidden])")
    keys = page.locator("#diff tbody td:first-child").all_inner_texts()
    assert "max_steps" in keys and "strategy" not in keys
    page.screenshot(path=os.path.join(shots, "runs-diff.png"), full_page=True)


def test_resume_asks_before_it_runs_a_copied_runs_remote_code(planted, page):  # noqa: F811 - the fixture
    """A run directory copied into the runs directory, whose config.yaml turns trust_remote_code on: Resume shows
    the server's question in a confirm dialog. Declined, nothing starts and the message stays on the page;
    accepted, the same click resumes with the user's word and the model's code runs."""
    runs, name, marker = planted
    os.makedirs(os.path.join(runs, name, ".prep"))
    with open(os.path.join(runs, name, ".prep", "interrupted.json"), "w") as fh:  # shown as interrupted: Resume on
        json.dump({"step": 1, "checkpoint": None}, fh)
    s = UIServer(runs).start()
    try:
        asked = []
        page.once("dialog", lambda d: (asked.append(d.message), d.dismiss()))
        page.goto(f"{s.base}/runs?run={name}")
        page.wait_for_function("() => !document.getElementById('resume').disabled")
        page.click("#resume")
        page.wait_for_function("() => document.getElementById('action-msg').textContent.includes('trust_remote_code')")
        assert len(asked) == 1 and "turns on trust_remote_code" in asked[0], asked
        assert not os.path.exists(os.path.join(runs, name, "ui-launch.json")) and not marker.exists()

        page.once("dialog", lambda d: d.accept())
        page.click("#resume")
        page.wait_for_function("() => document.getElementById('run-state').textContent !== 'interrupted'",
                               timeout=60_000)
        with open(os.path.join(runs, name, "ui-launch.json")) as fh:
            wait_ended(json.load(fh)["pid"])
        assert marker.exists(), open(os.path.join(runs, name, "ui-launch.log")).read()[-3000:]
    finally:
        s.stop()
