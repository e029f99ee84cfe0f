"""`--strategy auto` choosing tensor and sequence parallelism together (issue 20): where no data-parallel preset fits
without offload and neither sequence parallelism alone nor tensor parallelism alone fits at any degree, the
smallest tp x sp that does (fsdp presets, full fine-tuning, tp inside a node, tp x sp dividing the ranks); the
reasons say why, `parallel` carries both degrees, the tree names both paths, and `train --strategy auto` runs with
both. Where one alone fits, the pair is not chosen."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from shardwise import config
from shardwise.plan import plan_model, resolve_model
from shardwise.plan.decide import TREE_SP, TREE_TP, offloads, sp_degrees, tp_sp_pairs
from shardwise.plan.inputs import job_from_config, make_setup
from shardwise.plan.memory import tp_degrees
from tests.unit.test_plan import parse, plan_cmd


@pytest.fixture(autouse=True)
def _no_doctor_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDWISE_CACHE_DIR", str(tmp_path / "cache"))


# Llama-3.1-70B at 64k tokens with checkpointing on 2 nodes of 4 x H100 80 GB: FSDP over 8 ranks keeps 8 bytes per
# parameter / 8 plus the gathered root (embedding + head) whole, so sequence parallelism alone stays at ~88 GiB
# whatever its degree; tensor parallelism stops at 4 (the node), where the 64k-token activations still need ~84 GiB;
# TP 4 x SP 2 divides both: ~78 GiB.
ARGV = ["--model", "llama-3.1-70b", "--gpus", "4", "--nodes", "2", "--gpu-memory", "80", "--gpu-type", "H100",
        "--param-dtype", "bf16", "--seq-len", "65536", "--micro-batch-size", "1", "--gradient-checkpointing"]


def _json(capsys, *argv) -> dict:
    assert plan_cmd.run(parse(*argv, "--json")) == 0
    return json.loads(capsys.readouterr().out)


def _plain_fits(spec, job, setup, tp: int) -> list:
    """The presets without offload that fit at job's degrees (fsdp only under TP, as auto takes them)."""
    sub = plan_model(spec, job, setup, escalate=False)
    return [s for s in sub.strategies if s.fits and not offloads(s.opts) and (tp == 1 or s.base == "fsdp")]


def test_auto_picks_tp_times_sp_where_neither_alone_fits_and_says_why(capsys):
    d = _json(capsys, *ARGV)
    par = d["parallel"]
    assert par["chosen"] and (par["tensor_parallel"], par["sequence_parallel"], par["sp_mode"]) == (4, 2, "auto")
    assert d["recommended"] == par["strategy"] == "fsdp" and par["mem_gib"] <= 80

    # independently of choose_parallel: no degree of either alone fits, no smaller product fits, this one does
    spec = resolve_model("llama-3.1-70b")
    setup = make_setup(gpus=4, nodes=2, gpu_memory=80.0, gpu_type="H100", use_doctor=False)
    res = config.load_config(None, {"seq_len": (65536, "flag"), "micro_batch_size": (1, "flag"),
                                    "param_dtype": ("bf16", "flag"), "gradient_checkpointing": (True, "flag")})
    job = job_from_config(res.cfg, setup)
    assert not _plain_fits(spec, job, setup, 1)
    assert sp_degrees(spec, job, 8) == [2, 4, 8] and tp_degrees(spec, 4) == [2, 4]  # TP stays in a node of 4
    for s in sp_degrees(spec, job, 8):
        assert not _plain_fits(spec, replace(job, sp=s), setup, 1), f"sp {s} alone fits"
    for t in tp_degrees(spec, 4):
        assert not _plain_fits(spec, replace(job, tp=t), setup, t), f"tp {t} alone fits"
    pairs = tp_sp_pairs(spec, job, setup)
    assert pairs == [(2, 2), (2, 4), (4, 2)]  # tp 4 x sp 4 would not divide 8 ranks
    assert not _plain_fits(spec, replace(job, tp=2, sp=2), setup, 2)
    at_8 = {p: _plain_fits(spec, replace(job, tp=p[0], sp=p[1]), setup, p[0]) for p in pairs if p[0] * p[1] == 8}
    assert not at_8[(2, 4)] and [s.strategy for s in at_8[(4, 2)]] == ["fsdp"]
    assert par["mem_gib"] == pytest.approx(at_8[(4, 2)][0].memory.total / 2**30, abs=1e-3)

    # the reasons: why neither alone, what the pair divides, both paths of the tree
    r = d["reasons"]
    assert "data parallelism alone does not fit in 80.0 GiB" in r[0]
    assert ("but neither sequence parallelism alone (the leanest, sequence parallel 8, needs " in r[0]
            and "nor tensor parallelism alone (the leanest, tensor parallel 4, needs " in r[0]
            and "so both together: tensor parallelism divides the weights and sequence parallelism the tokens" in r[0])
    assert "fsdp + tensor parallel 4 x sequence parallel 2 (ulysses) fits: " in r[1] and "no smaller product fits" in r[1]
    assert ("tensor parallel 4 splits every weight" in r[2] and "32768 of the 65536 tokens" in r[2]
            and "4 x 2 = 8 ranks hold one copy of the model and its sequence, data-parallel degree 1" in r[2]
            and "GB of attention exchanges" in r[2])
    tree = d["decision_tree"]["parallel"]
    assert tree["paths"] == [TREE_TP, TREE_SP] and TREE_TP in tree["path"] and TREE_SP in tree["path"]
    assert tree["planner"] == "fsdp + tensor parallel 4 x sequence parallel 2 (ulysses)" and tree["agree"]

    # the text names both degrees and both paths; a configured fsdp gets the pair as its advice
    assert plan_cmd.run(parse(*ARGV, "--explain")) == 0  # the tree's paragraph
    text = capsys.readouterr().out
    assert "recommended: fsdp with --tensor-parallel 4 --sequence-parallel 2 (--sp-mode auto)" in text
    assert f"and further down: {TREE_TP}, and {TREE_SP} (says tensor parallel + sequence parallel)" in text
    assert plan_cmd.run(parse(*ARGV, "--strategy", "fsdp")) == 0
    assert "Cheapest change that fits: --tensor-parallel 4 --sequence-parallel 2 " in capsys.readouterr().out


def test_where_sequence_parallelism_alone_fits_the_pair_is_not_chosen(capsys):
    # the same job on 141 GB GPUs: SP 2 alone fits (the activations are what does not), so no TP
    d = _json(capsys, *[("141" if a == "80" else a) for a in ARGV])
    par = d["parallel"]
    assert par["chosen"] and (par["tensor_parallel"], par["sequence_parallel"]) == (1, 2)
    assert d["decision_tree"]["parallel"]["path"] == TREE_SP and "paths" not in d["decision_tree"]["parallel"]
    assert not any("both together" in r for r in d["reasons"])
    # LoRA: TP is refused with adapters, so auto never offers the pair (nor TP) whatever fits
    d = _json(capsys, *ARGV, "--tuner", "lora")
    assert d["parallel"]["tensor_parallel"] == 1


def test_train_auto_runs_with_both_degrees(monkeypatch, tmp_path):
    """launch.preflight.choose_strategy puts tensor_parallel, sequence_parallel and sp_mode into the run's config, and the
    engine's own checks (fit, single, TP, SP against a 70B-shaped config.json) accept what it chose."""
    import torch

    from shardwise import hardware
    from shardwise.launch import preflight

    monkeypatch.setattr(hardware, "detect_light", lambda: hardware.Hardware("cuda", "H100", 4, 80.0, 2048.0))
    flags = {"model": ("llama-3.1-70b", "flag"), "strategy": ("auto", "flag"), "nproc_per_node": (4, "flag"),
             "nnodes": (2, "flag"), "rdzv_endpoint": ("127.0.0.1:29500", "flag"), "param_dtype": ("bf16", "flag"),
             "seq_len": (65536, "flag"), "micro_batch_size": (1, "flag"), "gradient_checkpointing": (True, "flag"),
             "mixed_precision": ("bf16", "flag"), "sp_mode": ("ring", "flag")}
    res = config.load_config(None, flags)
    cfg = preflight.choose_strategy(res.cfg, res)
    assert (cfg.strategy, cfg.tensor_parallel, cfg.sequence_parallel, cfg.sp_mode) == ("fsdp", 4, 2, "ring")
    model_dir = tmp_path / "llama70b"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 8192,
        "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8}))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # check_fit plans only for GPUs
    preflight.check_fit(cfg, res, 8, force=False)
    preflight.check_ranks(cfg, res, 8)
    preflight.check_tensor_parallel(cfg, res, 8, str(model_dir))
    preflight.check_sequence_parallel(cfg, res, 8, str(model_dir))
