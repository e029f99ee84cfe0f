"""A real `shardwise ui` server (a subprocess) and a real headless Chromium (Debian's
/usr/bin/chromium driven by Playwright; never a downloaded browser)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import pytest

CHROMIUM = os.environ.get("SHARDWISE_CHROMIUM", "/usr/bin/chromium")
# As root in a sandbox with no network: no sandbox, no GPU, none of Chromium's own traffic.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage"]


class UIServer:
    """`python -m shardwise ui` in a subprocess; restartable on the same port. On 127.0.0.1 it runs with --no-token
    (the pages' own tests; test_ui.py checks the default, a token on 127.0.0.1 too) unless `token` is set."""

    def __init__(self, runs_dir: str, *extra: str, token: bool = False):
        if not token and "--host" not in extra:
            extra = (*extra, "--no-token")
        self.runs_dir, self.extra, self.port, self.proc, self.url = runs_dir, extra, "0", None, None

    def start(self) -> UIServer:
        self.proc = subprocess.Popen([sys.executable, "-m", "shardwise", "ui", "--runs-dir", self.runs_dir,
                                      "--port", self.port, *self.extra],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        line = self.proc.stdout.readline()
        if " at http" not in line:
            self.proc.kill()
            raise AssertionError(f"shardwise ui did not start: {line}{self.proc.stdout.read()}")
        self.url = line.split(" at ", 1)[1].strip()
        self.port = self.url.split(":")[2].split("/")[0]
        self.base = self.url.split("?")[0].rstrip("/")
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def runs_dir():
    d = tempfile.mkdtemp(prefix="shardwise-ui-runs-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def server(runs_dir):
    s = UIServer(runs_dir).start()
    yield s
    s.stop()


@pytest.fixture(scope="session")
def browser():
    """One Chromium for every UI module this process runs (each launch is seconds of the suite's 2 cores); each test
    gets a context of its own (`page`), so no cookie, storage or page is shared between tests."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="the 'ui' extra (playwright) is not installed")
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} missing: apt-get install chromium (.ci/run does)")
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


@pytest.fixture
def page(browser):
    ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
    p = ctx.new_page()
    p.set_default_timeout(30_000)
    yield p
    ctx.close()


@pytest.fixture(scope="module")
def shots():
    """Where screenshots go: SHARDWISE_UI_SCREENSHOTS (docs/ui to refresh the docs), else a temp dir."""
    d = os.environ.get("SHARDWISE_UI_SCREENSHOTS") or tempfile.mkdtemp(prefix="shardwise-ui-shots-")
    os.makedirs(d, exist_ok=True)
    return d
