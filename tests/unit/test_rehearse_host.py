"""A rehearsal row whose one rank plans to keep more in host RAM than this machine has free is one line, and no
worker is started for it (it would take the machine's memory rather than measure the job)."""

from __future__ import annotations

import json

import pytest

from shardwise.hardware import host_available_gib
from tests.helpers import run_cli


def test_a_rank_whose_host_state_exceeds_this_machines_ram_is_not_rehearsed(tmp_path):
    # 70B under FSDP with CPU offload on 8 GPUs: each rank keeps its fp32 shards, gradients and AdamW states on the
    # host, about 131 GiB, beyond this machine's RAM
    job = ["--model", "llama-3.1-70b", "--gpus", "8", "--strategy", "fsdp-offload", "--seq-len", "8192",
           "--gradient-checkpointing", "--gpu-type", "H100", "--gpu-memory", "80"]
    planned = json.loads(run_cli("plan", *job, "--json", cwd=str(tmp_path), timeout=120).stdout)
    host = next(s for s in planned["strategies"] if s["strategy"] == "fsdp-offload")["mem_gib"]["host_per_rank"]
    if host <= 0.9 * host_available_gib():  # the premise: this machine cannot hold the rank (it would start it)
        pytest.skip(f"this machine has room for the rank's {host:.0f} GiB of host state")
    d = json.loads(run_cli("plan", *job, "--rehearse", "--json", cwd=str(tmp_path), timeout=120).stdout)
    (row,) = d["rehearsed"]["rows"]
    assert not row["ok"] and row["host"]
    assert row["error"].startswith(f"not rehearsed: one rank keeps {host:.1f} GiB in host RAM by the plan, over 90%")
    assert "available; rehearse it on a host with more RAM" in row["error"]
    assert d["rehearsed"]["device"] == "this machine (no row ran)"
    assert list(tmp_path.iterdir()) == []
    text = run_cli("plan", *job, "--rehearse", cwd=str(tmp_path), timeout=120).stdout
    assert any(ln.split()[:1] == ["fsdp-offload"] and "not rehearsed: one rank keeps" in ln
               for ln in text.splitlines()), text
