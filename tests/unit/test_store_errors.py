"""The rendezvous and workers' stores (train/dist.tcp_store) on real loopback sockets: a port taken by another
program, and a store that nobody serves, are one ShardwiseError line each instead of an OSError traceback or
torch's C++ stack dump after a minute."""

from __future__ import annotations

import socket
import time
from datetime import timedelta

import pytest

from shardwise.errors import ShardwiseError
from shardwise.train import dist
from tests.helpers import free_port


def test_a_port_in_use_is_one_line_naming_it():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ShardwiseError, match=rf"^port {port} on 127\.0\.0\.1 is in use by another program: "
                                                 r"choose another port$"):
            dist.tcp_store("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=5))


def test_a_client_waits_for_a_store_that_comes_later_then_uses_it():
    import threading

    port = free_port()
    served = {}

    def serve_later():
        time.sleep(1.0)
        served["store"] = dist.tcp_store("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10))

    t = threading.Thread(target=serve_later)
    t.start()
    client = dist.tcp_store("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    t.join()
    client.set("k", "v")
    assert served["store"].get("k") == b"v"


def test_a_store_nobody_serves_is_one_line_after_the_timeout():
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(ShardwiseError, match=rf"^nothing answered at 127\.0\.0\.1:{port} within 1 s$"):
        dist.tcp_store("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=1))
    assert time.monotonic() - t0 < 30  # the probe's own timeout, not torch's default minutes


def test_a_host_name_that_does_not_resolve_is_one_line():
    with pytest.raises(ShardwiseError, match=r"cannot resolve the host name 'no-such-host\.invalid'"):
        dist.tcp_store("no-such-host.invalid", 29500, is_master=False, timeout=timedelta(seconds=1))
