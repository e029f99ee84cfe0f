"""Remote code only with its flag, through `shardwise ui`: a run directory copied or planted into the runs
directory whose config.yaml turns trust_remote_code on, and a model directory whose custom code leaves a marker
when it runs. A real server, real HTTP, the real run it starts."""

from __future__ import annotations

import json
import os
import shutil
import time

import psutil
import pytest

from shardwise import config, rundir
from tests.helpers import listening
from tests.ui.conftest import UIServer

pytestmark = pytest.mark.timeout(300)

CODE = """import os
with open({marker!r}, "a") as fh:
    fh.write("ran in %d\\n" % os.getpid())
from transformers import LlamaConfig


class MarkedConfig(LlamaConfig):
    pass
"""


@pytest.fixture
def planted(tmp_path, tiny_dir):
    """(runs dir, run name, marker): a run directory whose config.yaml names a model with custom code and
    trust_remote_code: true, as a shardwise run directory copied from elsewhere would hold it."""
    pytest.importorskip("starlette", reason="the 'ui' extra is not installed")
    marker = tmp_path / "CODE_RAN"
    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "configuration_marked.MarkedConfig"}
    (model / "config.json").write_text(json.dumps(cfg))
    (model / "configuration_marked.py").write_text(CODE.format(marker=str(marker)))
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"say {i}"},
                                                     {"role": "assistant", "content": f"{i}"}]}) + "\n"
                            for i in range(16)))
    runs = tmp_path / "runs"
    run = runs / "copied"
    run.mkdir(parents=True)
    res = config.load_config(None, {"model": (str(model), "test"), "data": (str(data), "test"),
                                    "trust_remote_code": (True, "test"), "strategy": ("single", "test"),
                                    "nproc_per_node": (1, "test"), "max_steps": (1, "test"),
                                    "micro_batch_size": (2, "test"), "save_final": (False, "test"),
                                    "report_to": ("none", "test")})
    (run / "config.yaml").write_text(config.to_yaml(res.cfg))
    rundir.mark(str(run))
    return str(runs), "copied", marker


def wait_ended(pid: int, timeout: float = 200) -> None:
    """Until the UI server's child `pid` has exited (gone, or a zombie its parent has yet to reap)."""
    deadline = time.monotonic() + timeout
    try:
        proc = psutil.Process(pid)
        while proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the resumed run did not end"
            time.sleep(0.5)
    except psutil.NoSuchProcess:
        pass


def _post(url: str, body: dict) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_resume_from_the_page_runs_a_config_s_remote_code_only_when_the_request_says_so(planted):
    runs, name, marker = planted
    s = UIServer(runs).start()
    try:
        status, d = _post(s.base + "/api/run/resume", {"run": name})
        assert status == 400 and d["field"] == "trust_remote_code" and "trust_remote_code" in d["error"], (status, d)
        for junk in ("true", 1, "yes"):  # only a JSON true is the user's word
            status, d = _post(s.base + "/api/run/resume", {"run": name, "trust_remote_code": junk})
            assert status == 400 and d["field"] == "trust_remote_code", (junk, status, d)
        assert not os.path.exists(os.path.join(runs, name, "ui-launch.json")), "a launcher was started"
        assert not marker.exists(), marker.read_text()

        status, d = _post(s.base + "/api/run/resume", {"run": name, "trust_remote_code": True})
        assert status == 200, (status, d)
        wait_ended(d["pid"])
        log = open(os.path.join(runs, name, "ui-launch.log")).read()
        assert marker.exists(), log  # asked for: the model's code ran (the refusals above were not vacuous)
    finally:
        s.stop()


def test_a_resume_without_the_users_word_holds_remote_code_off_whatever_the_file_says_later(planted):
    """The server reads config.yaml to decide whether to ask; the resumed launcher reads it again a moment later.
    Without the user's word the server passes --no-trust-remote-code and --nnodes=1, which override the file: a
    planted run's owner who turns trust_remote_code (or several nodes) on between the two reads gets neither."""
    runs, name, marker = planted
    cfg_path = os.path.join(runs, name, "config.yaml")
    res = config.load_config(cfg_path, {"trust_remote_code": (False, "test")})
    with open(cfg_path, "w") as fh:  # the file as the server sees it: remote code off, nothing to ask
        fh.write(config.to_yaml(res.cfg))
    s = UIServer(runs).start()
    try:
        status, d = _post(s.base + "/api/run/resume", {"run": name})
        assert status == 200, (status, d)
        with open(cfg_path, "w") as fh:  # flipped once the server has decided
            fh.write(config.to_yaml(res.cfg).replace("trust_remote_code: false", "trust_remote_code: true"))
        wait_ended(d["pid"])
        log = open(os.path.join(runs, name, "ui-launch.log")).read()
        assert "--no-trust-remote-code" in log.splitlines()[0], log[:500]
        assert "--nnodes=1" in log.splitlines()[0], log[:500]  # nor may the file turn on listening for other nodes
        assert not marker.exists(), log[-3000:]
    finally:
        s.stop()


def test_a_resume_that_would_listen_for_other_nodes_asks_first(planted):
    """A copied run whose config.yaml spans 2 nodes: resuming it would listen on its rendezvous endpoint for the
    other node. The page's Resume asks first; declined, no launcher starts; confirmed, it starts (and is stopped:
    the second node never comes)."""
    import socket

    runs, name, marker = planted
    cfg_path = os.path.join(runs, name, "config.yaml")
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    res = config.load_config(cfg_path, {"trust_remote_code": (False, "test"), "nnodes": (2, "test"),
                                        "nproc_per_node": (1, "test"), "strategy": ("ddp", "test"),
                                        "rdzv_endpoint": (f"127.0.0.1:{port}", "test")})
    with open(cfg_path, "w") as fh:
        fh.write(config.to_yaml(res.cfg))
    s = UIServer(runs).start()
    try:
        status, d = _post(s.base + "/api/run/resume", {"run": name})
        assert status == 400 and d["field"] == "listen_beyond_loopback", (status, d)
        assert f"127.0.0.1:{port}" in d["error"] and "spans 2 nodes" in d["error"], d
        assert not os.path.exists(os.path.join(runs, name, "ui-launch.json")), "a launcher was started"

        status, d = _post(s.base + "/api/run/resume", {"run": name, "listen_beyond_loopback": True})
        assert status == 200, (status, d)
        status, _ = _post(s.base + "/api/run/stop", {"run": name})
        assert status == 200
        wait_ended(d["pid"], 120)
    finally:
        s.stop()


def test_doctor_listens_on_loopback_only_even_when_the_environment_asks_torch_to_share_its_store(tmp_path):
    """torch's elastic agent shares its rendezvous store into the workers unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE
    is 1, and makes that shared store with a plain TCPStore server, which listens on every interface. `shardwise
    doctor` (and `train`, through the same rendezvous) never share it, whatever the environment says: every socket
    of the launcher and its ranks listens on loopback, polled while the real command runs."""
    import subprocess
    import sys

    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"}
    p = subprocess.Popen([sys.executable, "-m", "shardwise", "doctor", "--nproc", "2", "--sizes", "4096",
                          "--iters", "2", "--no-save"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                         cwd=str(tmp_path))
    seen = set()
    deadline = time.monotonic() + 240
    while p.poll() is None and time.monotonic() < deadline:
        seen |= {a.rsplit(":", 1)[0] for a in listening([p.pid], descendants=True)}
        time.sleep(0.02)
    if p.poll() is None:  # past the deadline: stop it before reading what it printed
        p.kill()
    out = p.communicate(timeout=60)[0].decode(errors="replace")
    assert p.returncode == 0, out[-3000:]
    assert seen, "no listening socket was seen while doctor ran"  # the rendezvous store and the ranks' store at least
    assert all(ip.startswith("127.") or ip == "::1" for ip in seen), (seen, out[-2000:])
