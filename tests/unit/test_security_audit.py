"""What a one-rank run listens on, where this machine's host name resolves to a network address (as on many
servers, whose /etc/hosts maps the host name to their LAN address): a real gloo group made by
train/dist.init_distributed in a fresh process, in a mount namespace whose /etc/hosts says so."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

# one rank in this process (no MASTER_ADDR: the in-process path of `--nproc-per-node 1`), a gloo collective, then
# every TCP socket of this process that listens
CHILD = r"""
import json, os, socket
import psutil
import torch
from shardwise.train.dist import init_distributed
import torch.distributed as dist

env = init_distributed(60.0)
t = torch.ones(3)
dist.all_reduce(t)
found = [c.laddr.ip for c in psutil.Process().net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]
print(json.dumps({"resolved": socket.gethostbyname(socket.gethostname()), "world": env.world_size,
                  "listening": found}))
"""


def _network_address() -> str | None:
    import psutil

    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return None


def _in_namespace(hosts: str, *argv: str) -> list[str]:
    """argv run with `hosts` bind-mounted on /etc/hosts, in a user + mount namespace of its own."""
    return ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$@"',
            hosts, *argv]


def test_a_one_rank_group_listens_on_loopback_only_when_the_host_name_is_a_network_address(tmp_path):
    address = _network_address()
    if address is None:
        pytest.skip("this machine has no network address (only loopback): nothing to resolve the host name to")
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1): cannot give the child an /etc/hosts of its own")
    host = socket.gethostname()
    hosts = tmp_path / "hosts"
    hosts.write_text(f"127.0.0.1 localhost\n{address} {host}\n")
    probe = subprocess.run(_in_namespace(str(hosts), "getent", "hosts", host), capture_output=True, text=True)
    if probe.returncode != 0 or address not in probe.stdout:
        pytest.skip(f"user and mount namespaces are not available here ({probe.stderr.strip()[:200]})")
    env = {k: v for k, v in __import__("os").environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                        "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    p = subprocess.run(_in_namespace(str(hosts), sys.executable, "-c", CHILD), capture_output=True, text=True,
                       env=env, timeout=100)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["resolved"] == address and got["world"] == 1, got  # the host name is a network address in there
    assert got["listening"], "gloo's listening socket was not found"
    assert all(a.startswith("127.") for a in got["listening"]), got["listening"]
