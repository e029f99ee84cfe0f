"""The optimizer's state in a checkpoint is keyed by parameter name, not by parameter group (Strategy.state_dict's
flat form): it loads into an optimizer that groups the same parameters differently (tensor parallelism makes one
group per mesh), which is what lets a TP 2 checkpoint resume with TP 1 (tests/dist/test_tensor_parallel.py runs
that through the CLI). Checkpoints written before, in the grouped form, are recognised and still load."""

import pytest
import torch

from shardwise import config
from shardwise.strategies.base import DistEnv, Strategy
from shardwise.train import checkpoint as ckpt


def _trained(groups: int):
    """A model and AdamW after one step; `groups` 2: decay / no-decay (one mesh), 4: each split again (as by mesh)."""
    cfg = config.load_config(None, {"mixed_precision": ("no", "test")}).cfg
    strategy = Strategy(cfg, DistEnv(0, 1, 0, 1, torch.device("cpu"), "gloo"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 3))
    ps = list(model.parameters())
    if groups == 2:
        opt = strategy.build_optimizer(model)
    else:
        opt = torch.optim.AdamW([{"params": ps[0:1]}, {"params": ps[4:5]}, {"params": ps[1:4], "weight_decay": 0.0},
                                 {"params": ps[5:], "weight_decay": 0.0}], lr=0.1, foreach=True)
    model(torch.ones(2, 4)).square().sum().backward()
    opt.step()
    return strategy, model, opt


def _save(tmp_path, strategy, model, opt, flat: bool) -> str:
    return ckpt.save(str(tmp_path), 1, strategy.state_dict(model, opt, flat=flat), {"step": 1}, 0, keep=2)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_flat_checkpoint_loads_into_another_grouping_and_a_grouped_one_is_recognised(tmp_path):
    strategy, model, opt = _trained(groups=4)
    path = _save(tmp_path / "flat", strategy, model, opt, flat=True)
    assert ckpt.optimizer_is_flat(path)
    s2, m2, o2 = _trained(groups=2)
    with torch.no_grad():
        for p in m2.parameters():
            p.zero_()
    state = s2.state_dict(m2, o2, flat=ckpt.optimizer_is_flat(path))
    ckpt.load(path, state)
    s2.load_state_dict(m2, o2, state)
    assert len(o2.param_groups) == 2
    for (name, p), q in zip(model.named_parameters(), m2.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=name)
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(o2.state[q][k], opt.state[p][k], rtol=0, atol=0, msg=f"{name} {k}")
        # the hyper-parameters follow the parameter, whichever group it is in now
        assert [g["weight_decay"] for g in o2.param_groups if any(x is q for x in g["params"])] == \
               [g["weight_decay"] for g in opt.param_groups if any(x is p for x in g["params"])]

    grouped = _save(tmp_path / "grouped", strategy, model, opt, flat=False)
    assert not ckpt.optimizer_is_flat(grouped)
    s3, m3, o3 = _trained(groups=4)
    with torch.no_grad():
        for p in m3.parameters():
            p.zero_()
    state = s3.state_dict(m3, o3, flat=ckpt.optimizer_is_flat(grouped))
    ckpt.load(grouped, state)
    s3.load_state_dict(m3, o3, state)
    for (name, p), q in zip(model.named_parameters(), m3.parameters()):
        torch.testing.assert_close(o3.state[q]["exp_avg"], opt.state[p]["exp_avg"], rtol=0, atol=0, msg=name)
