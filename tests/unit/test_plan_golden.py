"""`shardwise plan --json` gives the same numbers as before a refactor, for a fixed set of configs.

The expected values in plan_golden.json were produced by the planner's code before the
strategy registry / planner split (issue 13), and are only regenerated for a deliberate change
of a number or a text, said so in the commit message:

    PYTHONPATH=src python tests/unit/test_plan_golden.py --write
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from shardwise.plan import command as plan_cmd

FIXTURE = Path(__file__).with_name("plan_golden.json")

# a small Llama-style model directory (only config.json is read by the planner)
TINY_DIR_CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 1024,
                   "hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 4,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
                   "tie_word_embeddings": True}

# name -> (argv, YAML config text or None); {model_dir} is the tiny model directory
CASES: dict[str, tuple[list[str], str | None]] = {
    "llama8b-8gpu": (["--model", "llama-3.1-8b", "--gpus", "8", "--gpu-memory", "80"], None),
    "7b-2nodes": (["--model", "7B", "--gpus", "8", "--gpu-memory", "80", "--nodes", "2"], None),
    "qwen1.5b-1gpu-h200": (["--model", "qwen2.5-1.5b", "--gpus", "1", "--gpu-memory", "141", "--gpu-type", "H200",
                            "--seq-len", "4096", "--micro-batch-size", "2"], None),
    "qwen7b-lora-24g-ckpt": (["--model", "qwen2.5-7b", "--gpus", "1", "--gpu-memory", "24", "--tuner", "lora",
                              "--gradient-checkpointing", "--param-dtype", "bf16", "--micro-batch-size", "1",
                              "--seq-len", "512"], None),
    "tiny-2gpu": (["--model", "tiny", "--gpus", "2", "--gpu-memory", "16"], None),
    "tiny-dir-lora-2gpu": (["--model", "{model_dir}", "--gpus", "2", "--gpu-memory", "8", "--tuner", "lora",
                            "--compile", "off", "--no-fused-loss"], None),
    "llama70b-64gpu-ckpt-slow-net": (["--model", "llama-3.1-70b", "--gpus", "8", "--nodes", "8", "--gpu-memory", "80",
                                      "--gradient-checkpointing", "--inter-node-gbps", "25", "--grad-accum", "4"],
                                     None),
    "llama3b-qlora-2gpu": (["--model", "llama-3.2-3b", "--gpus", "2", "--gpu-memory", "24", "--tuner", "qlora",
                            "--mixed-precision", "bf16", "--packing"], None),
    "350m-a100-fp16": (["--model", "350M", "--gpus", "1", "--gpu-memory", "40", "--gpu-type", "A100",
                        "--mixed-precision", "fp16", "--compile", "off"], None),
    "config-hybrid-2nodes": (["--gpus", "4", "--gpu-memory", "80"], """
        model: qwen2.5-3b
        strategy: hybrid
        nnodes: 2
        rdzv_endpoint: 127.0.0.1:29500
        seq_len: 2048
        micro_batch_size: 2
        gradient_checkpointing: true
        """),
    "config-zero3-offload": (["--gpus", "8", "--gpu-memory", "40"], """
        model: qwen2.5-14b
        strategy: zero3-offload
        seq_len: 1024
        micro_batch_size: 1
        grad_accum: 2
        """),
    "config-fsdp-offload-mistral": (["--gpus", "4", "--gpu-memory", "24", "--intra-node-gbps", "64"], """
        model: mistral-7b
        strategy: fsdp-offload
        seq_len: 2048
        micro_batch_size: 1
        fsdp:
          prefetch: false
        """),
    "config-zero2-lora-8gpu": (["--gpus", "8", "--gpu-memory", "80"], """
        model: llama-3.1-8b
        strategy: zero2
        tuner: lora
        seq_len: 8192
        micro_batch_size: 1
        """),
}

# the parts of the JSON compared (everything but what names the machine or the temp dir)
STRATEGY_KEYS = ("strategy", "base", "fits", "mem_gib", "headroom_gib", "peak_phase", "comm_gb_per_step",
                 "step_time_s", "tokens_per_s", "compute_s", "exposed_comm_s", "other_s", "collectives", "notes")


def _plan_json(name: str, tmp: Path) -> dict:
    argv, yaml_text = CASES[name]
    model_dir = tmp / "tiny-model"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(TINY_DIR_CONFIG))
    argv = [a.replace("{model_dir}", str(model_dir)) for a in argv]
    if yaml_text is not None:
        cfg = tmp / f"{name}.yaml"
        cfg.write_text(textwrap.dedent(yaml_text))
        argv = [str(cfg), *argv]
    p = argparse.ArgumentParser()
    plan_cmd.add_parser(p.add_subparsers())
    plan, _ = plan_cmd.build(p.parse_args(["plan", *argv]))
    d = plan.to_json()
    model = dict(d["model"])
    model.pop("source")  # names the temp directory for a model dir
    model.pop("name")
    return {"model": model, "job": {k: v for k, v in d["job"].items() if k != "host_mem_gib"},
            "hardware": {k: d["hardware"][k] for k in ("world_size", "peak_tflops", "mfu", "intra_node_gbps",
                                                         "inter_node_gbps", "device_mem_gib")},
            "strategies": [{k: s[k] for k in STRATEGY_KEYS} for s in d["strategies"]],
            "recommended": d["recommended"], "reasons": d["reasons"], "configured": d["configured"],
            "decision_tree": d["decision_tree"], "lint": sorted(f["check"] for f in d["lint"]),
            "assumptions": d["assumptions"]}


def _same(got, want, where: str) -> None:
    if isinstance(want, float) or isinstance(got, float):
        assert isinstance(got, (int, float)) and math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12), \
            f"{where}: {got!r} != {want!r}"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), f"{where}: keys {sorted(got)} != {sorted(want)}"
        for k in want:
            _same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{where}: {got!r} != {want!r}"
        for i, (g, w) in enumerate(zip(got, want)):
            _same(g, w, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


@pytest.fixture(autouse=True)
def _no_doctor_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDWISE_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("name", sorted(CASES))
def test_plan_json_numbers_unchanged(name, tmp_path):
    want = json.loads(FIXTURE.read_text())[name]
    _same(json.loads(json.dumps(_plan_json(name, tmp_path))), want, name)


def test_fixture_covers_every_case():
    assert sorted(json.loads(FIXTURE.read_text())) == sorted(CASES)


if __name__ == "__main__" and "--write" in sys.argv:
    os.environ["SHARDWISE_CACHE_DIR"] = tempfile.mkdtemp(prefix="shardwise-golden-")
    with tempfile.TemporaryDirectory() as d:
        out = {n: _plan_json(n, Path(d)) for n in sorted(CASES)}
    FIXTURE.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"wrote {FIXTURE} ({len(out)} cases)")
