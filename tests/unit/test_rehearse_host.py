"""A rehearsal row whose one rank plans to keep more in host RAM than this machine has free is one line, and no
worker is started for it (it would take the machine's memory rather than measure the job)."""

from __future__ import annotations

import json

from shardwise.hardware import host_available_gib
from tests.helpers import run_cli


def test_a_rank_whose_host_state_exceeds_this_machines_ram_is_not_rehearsed(tmp_path):
    # 70B under FSDP with CPU offload on 8 GPUs: each rank keeps its fp32 shards, gradients and AdamW states on the
    # host, about 131 GiB, beyond this machine's RAM
    free = host_available_gib()
    job = ["--model", "llama-3.1-70b", "--gpus", "8", "--strategy", "fsdp-offload", "--seq-len", "8192",
           "--gradient-checkpointing", "--gpu-type", "H100", "--gpu-memory", "80", "--rehearse"]
    p = run_cli("plan", *job, "--json", cwd=str(tmp_path), timeout=120)
    d = json.loads(p.stdout)
    (row,) = d["rehearsed"]["rows"]
    planned = d["strategies"][[s["strategy"] for s in d["strategies"]].index("fsdp-offload")]["mem_gib"]
    assert planned["host_per_rank"] > free, (planned, free)  # the premise: this machine cannot hold the rank
    assert not row["ok"] and row["host"]
    assert row["error"].startswith(f"not rehearsed: one rank keeps {planned['host_per_rank']:.1f} GiB in host RAM")
    assert "available; rehearse it on a host with more RAM" in row["error"]
    assert d["rehearsed"]["device"] == "this machine (no row ran)"
    assert list(tmp_path.iterdir()) == []
    text = run_cli("plan", *job, cwd=str(tmp_path), timeout=120).stdout
    assert any(ln.split()[:1] == ["fsdp-offload"] and "not rehearsed: one rank keeps" in ln
               for ln in text.splitlines()), text
