"""The control keys (stop / save requests agreed through the rendezvous store) with and
without SHARDWISE_CONTROL_SECRET, on a real TCPStore on loopback with a second client
playing someone else on the network."""

from __future__ import annotations

import signal
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from shardwise.train.control import Control


@pytest.fixture
def stores():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    other = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))
    yield server, other


def _put(store, key, value):
    """Someone else writes a key. TCPStore.set does not wait for the server; a get on the same
    connection does, so the value is in place before any rank reads it (without it the test
    raced the server on a loaded machine: CI saw the old "0")."""
    store.set(key, value)
    assert store.get(key) == value.encode()


def _controls(store, monkeypatch, secret):
    if secret:
        monkeypatch.setenv("SHARDWISE_CONTROL_SECRET", secret)
    else:
        monkeypatch.delenv("SHARDWISE_CONTROL_SECRET", raising=False)
    ranks = [Control(SimpleNamespace(rank=r, world_size=1), 0.0, store=store) for r in (0, 1)]
    for k in ranks[0].keys:  # rank 0 wrote "0" to each key through this connection; a get waits for those writes,
        store.get(k)         # so a later write by another client cannot be overtaken by them (CI saw "0" after "5")
    return ranks


def test_without_a_secret_anyone_reaching_the_store_can_stop_the_run(stores, monkeypatch):
    server, other = stores
    ranks = _controls(server, monkeypatch, "")
    try:
        _put(other, ranks[0].keys[0], "5")
        assert [c.poll(5) for c in ranks] == [(True, False), (True, False)]
    finally:
        for c in ranks:
            c.close()


def test_with_a_secret_an_unsigned_request_is_ignored_and_a_signed_one_is_kept(stores, monkeypatch, capsys):
    server, other = stores
    ranks = _controls(server, monkeypatch, "s3cret")
    try:
        _put(other, ranks[0].keys[0], "5")
        _put(other, ranks[0].keys[1], "5:" + "0" * 64)  # a forged signature
        assert [c.poll(5) for c in ranks] == [(False, False), (False, False)]
        assert "without a valid signature" in capsys.readouterr().err
        _put(other, ranks[0].keys[0], "0")  # clear the forged request (as a fresh attempt's keys would be)
        ranks[1]._on_signal(signal.SIGTERM, None)  # a real signal on rank 1: both stop two steps later
        assert [c.poll(7) for c in ranks] == [(False, False), (False, False)]
        assert [c.poll(9) for c in ranks] == [(True, False), (True, False)]
        assert ranks[0]._read(ranks[0].keys[0]) == 9 and b":" in server.get(ranks[0].keys[0])
    finally:
        for c in ranks:
            c.close()
