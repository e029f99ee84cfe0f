"""Rendezvous misconfiguration is one line each: a port out of range (torch aborted in C++, exit 134), a port
another program holds, and node 0 unreachable from a worker node (a minute's wait, then a C++ frame dump). The
handler is the launcher's real c10d rendezvous handler, on real loopback sockets."""

from __future__ import annotations

import socket

import pytest

from shardwise import config
from shardwise.errors import ShardwiseError
from tests.helpers import free_port


def _load(*argv):
    import argparse

    p = argparse.ArgumentParser()
    config.add_flags(p)
    return config.load_config(None, config.flags_from_namespace(p.parse_args(list(argv))))


@pytest.mark.parametrize("argv, message", [
    (("--rdzv-endpoint", "127.0.0.1:99999"), r"rdzv_endpoint port must be in 0\.\.65535, got 99999"),
    (("--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:0"), r"rdzv_endpoint port must be in 1\.\.65535, got 0"),
    (("--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "node0:70000"), r"port must be in 1\.\.65535"),
])
def test_a_port_out_of_range_is_refused_by_the_config(argv, message):
    with pytest.raises(ShardwiseError, match=message):
        _load(*argv)


def test_ports_in_range_pass():
    assert _load("--rdzv-endpoint", "127.0.0.1:0").cfg.rdzv_endpoint == "127.0.0.1:0"
    assert _load("--nnodes", "2", "--rdzv-endpoint", "node0:65535").cfg.nnodes == 2


def _handler(endpoint: str, is_host: bool):
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from shardwise.launch import agent

    params = RendezvousParameters(backend=agent.RDZV_BACKEND, endpoint=endpoint, run_id="t", min_nodes=2,
                                  max_nodes=2, is_host=is_host, read_timeout=1)
    return agent._rendezvous_handler(params)



def test_node_0_on_a_port_in_use_says_choose_another():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ShardwiseError, match=rf"^--rdzv-endpoint 127\.0\.0\.1:{port}: port {port} on 127\.0\.0\.1 "
                                                 r"is in use by another program: choose another port"):
            _handler(f"127.0.0.1:{port}", is_host=True)


def test_a_worker_node_without_node_0_says_start_node_0_first():
    port = free_port()
    with pytest.raises(ShardwiseError, match=rf"^cannot reach node 0 at 127\.0\.0\.1:{port} \(--rdzv-endpoint; "
                                             r"nothing answered .* within 1 s\): start node 0 first, or check the "
                                             r"address$"):
        _handler(f"127.0.0.1:{port}", is_host=False)
