"""`single` under tensor x sequence parallelism in the planner (issue 20): the engine runs single on the tp x sp
ranks of one replica, averaging its gradients over the sequence ranks (strategies/single.py, launch.preflight.check_ranks);
the planner's TP rows offer single exactly there, and count what it does: states / tp, activations / (tp x sp),
the TP collectives and attention exchanges, and the gradient all-reduce over the sp ranks in its step."""

from __future__ import annotations

import json

import pytest

from shardwise import config
from shardwise.errors import ShardwiseError
from shardwise.launch import preflight
from shardwise.plan import plan_model, plan_run, resolve_model
from shardwise.plan.comm import coll_time
from shardwise.plan.decide import preset_names, tensor_parallel_rows
from shardwise.plan.inputs import make_setup
from shardwise.plan.memory import Job, Opts, activations, local_params, tp_degrees
from tests.unit.test_plan import parse, plan_cmd


@pytest.fixture(autouse=True)
def _no_doctor_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDWISE_CACHE_DIR", str(tmp_path / "cache"))


SPEC = "llama-3.1-8b"  # 32 heads, 8 KV heads, MLP 14336: TP 2, 4, 8 on a node of 8
LLAMA8B_CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256,
                  "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": 8}


def _job(world: int, **kw) -> Job:
    base = dict(micro_batch=1, seq_len=65536, device_mem_gib=141.0, compute="bf16", param_dtype="bf16",
                fused_loss=True, checkpointing=True)
    return Job(world=world, **{**base, **kw})


def _setup(gpus: int):
    return make_setup(gpus=gpus, gpu_memory=141.0, gpu_type="H200", use_doctor=False)


def _engine_accepts(tmp_path, gpus: int, tp: int, sp: int, sp_mode: str) -> bool:
    """launch's own checks for `single` at these degrees on `gpus` ranks, against a config.json of the shape."""
    model_dir = tmp_path / "llama8b"
    if not model_dir.exists():
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(LLAMA8B_CONFIG))
    try:  # the config's own validation, then the launcher's
        res = config.load_config(None, {"strategy": ("single", "flag"), "tensor_parallel": (tp, "flag"),
                                        "sequence_parallel": (sp, "flag"), "sp_mode": (sp_mode, "flag"),
                                        "nproc_per_node": (gpus, "flag")})
        preflight.check_ranks(res.cfg, res, gpus)
        preflight.check_tensor_parallel(res.cfg, res, gpus, str(model_dir))
        preflight.check_sequence_parallel(res.cfg, res, gpus, str(model_dir))
    except ShardwiseError:
        return False
    return True


@pytest.mark.parametrize("sp_mode", ["auto", "ulysses"])
def test_single_rows_exist_exactly_where_the_engine_runs_single(tmp_path, sp_mode):
    spec = resolve_model(SPEC)
    seen = 0
    for gpus in (2, 4, 8):
        setup = _setup(gpus)
        for sp in (1, 2, 4, 8):
            job = _job(gpus, sp=sp, sp_mode=sp_mode)
            if gpus % sp or (sp_mode == "ulysses" and spec.num_heads % sp):
                continue  # `plan` refuses this job before any row
            planned = {r["tp"] for r in tensor_parallel_rows(spec, job, setup) if r["strategy"] == "single"}
            engine = {t for t in tp_degrees(spec, gpus) if _engine_accepts(tmp_path, gpus, t, sp, sp_mode)}
            assert planned == engine, (gpus, sp, planned, engine)
            seen += len(planned)
            assert planned <= {gpus // sp}  # tp x sp is every rank, never fewer
    assert seen >= 6  # pure TP (2, 4, 8 GPUs) and TP x SP (4 = 2 x 2, 8 = 4 x 2, 8 = 2 x 4)


def test_single_under_tp_times_sp_counts_its_states_activations_and_exchanges():
    spec = resolve_model(SPEC)
    tp_alone = plan_model(spec, _job(2, tp=2), _setup(2), escalate=False).for_strategy("single")  # 2 ranks
    pair_job = _job(4, tp=2, sp=2)
    pair = plan_model(spec, pair_job, _setup(4), escalate=False).for_strategy("single")  # 4 ranks, one replica
    a, b = tp_alone.memory, pair.memory
    # every state is the tp-local shard, unchanged by SP (single shards nothing over the sequence ranks)
    w = 2  # bf16
    for key, per_param in (("params", w), ("grads", w), ("optimizer", 2 * w)):
        assert getattr(b, key) == getattr(a, key) == pytest.approx(per_param * local_params(spec, 2)), key
    # a block's activations halve with the tokens of each rank; the fused head's chunk does not: the peak drops
    per_block = [activations(spec, j, Opts("single"))[1] for j in (_job(2, tp=2), pair_job)]
    assert per_block[1] == pytest.approx(per_block[0] / 2, rel=1e-9)
    for key in ("act.layers_kept", "act.head.inputs", "act.head.final_norm", "act.head.loss_grad_hidden"):
        assert b.detail[key] == pytest.approx(a.detail[key] / 2, rel=1e-9), key  # per token
    for key in ("act.head.loss_grad_head", "act.head.loss_transient"):  # the head weight's grad, one 4096 chunk
        assert b.detail[key] == a.detail[key], key
    assert b.activations < a.activations and b.total < a.total
    # TP's all-gathers / reduce-scatters carry half the tokens; SP adds its attention exchanges; single adds the
    # all-reduce of every local gradient over the 2 sequence ranks, once per step
    kinds = {k: [c for c in pair.timing.collectives if c.kind == k] for k in ("", "tp", "sp")}
    assert sum(c.bytes for c in kinds["tp"]) == pytest.approx(
        sum(c.bytes for c in tp_alone.timing.collectives if c.kind == "tp") / 2)
    assert kinds["sp"] and all(c.ranks == 2 and c.bytes > 0 for c in kinds["sp"])
    (ar,) = kinds[""]
    assert (ar.op, ar.ranks, ar.per_step, ar.phase, ar.where) == ("all_reduce", 2, 1, "step", "intra")
    assert ar.bytes == pytest.approx(w * local_params(spec, 2)) and ar.wire() == pytest.approx(ar.bytes)
    assert not [c for c in tp_alone.timing.collectives if not c.kind]  # pure TP: no gradient averaging
    # nothing of single's is overlapped (Ulysses here: 16 heads per tp rank, gcd(16, 2) = 2): every collective is
    # exposed, the all-reduce among them
    links = _setup(4).links()
    assert pair.timing.exposed_comm_s == pytest.approx(
        sum(coll_time(c, links) * c.per_step for c in pair.timing.collectives), rel=1e-9)
    assert coll_time(ar, links) > 0.01  # ~16 GB of bf16 gradients... over NVLink: tens of ms
    # one replica: the 4 ranks train one sequence per micro-batch
    assert pair.timing.tokens_per_s == pytest.approx(pair_job.seq_len / pair.timing.step_s)


def test_plan_takes_single_on_its_tp_times_sp_ranks_and_refuses_more(capsys):
    argv = ["--model", SPEC, "--gpu-memory", "141", "--gpu-type", "H200", "--seq-len", "65536",
            "--strategy", "single", "--tensor-parallel", "2", "--sequence-parallel", "2"]
    assert plan_cmd.run(parse(*argv, "--gpus", "4", "--json")) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["hardware"]["world_size"] == 4 and d["configured"] == "single"
    assert [r["tp"] for r in d["tensor_parallel"] if r["strategy"] == "single"] == [2]
    row = next(r for r in d["tensor_parallel"] if r["strategy"] == "single")
    assert row["exchange_gb_per_step"] > 0 and row["tp_comm_gb_per_step"] > 0
    assert plan_cmd.run(parse(*argv, "--json")) == 0  # no --gpus: the 4 ranks single runs on
    assert json.loads(capsys.readouterr().out)["hardware"]["world_size"] == 4
    with pytest.raises(ShardwiseError) as e:
        plan_cmd.run(parse(*argv, "--gpus", "8"))
    assert "\n" not in str(e.value) and "use --gpus 4 --nodes 1" in str(e.value), str(e.value)
    # plan_run (check_fit before a launch) plans single on those ranks too, not on one
    res = config.load_config(None, {"model": (SPEC, "flag"), "strategy": ("single", "flag"),
                                    "tensor_parallel": (2, "flag"), "sequence_parallel": (2, "flag")})
    from shardwise import hardware

    plan = plan_run(res.cfg, hardware.Hardware("cuda", "H200", 4, 141.0, 2048.0), 4)
    assert plan.setup.world == 4 and "single" in preset_names(plan.setup, 2, 2)
    assert plan.for_strategy("single").timing.tokens_per_s > 0
