"""FSDP's CPU offload on a GPU: its gradients' shards live on the host, and NCCL takes no host tensor.

- The clip's norm reduces its host partial sums on the mesh's device: on an NCCL-only group (what a job of two
  or more GPUs had before it got gloo beside NCCL) the step runs and clips like torch's clip on the full
  gradients. On two or more GPUs torch's DTensor norm sent a host tensor to NCCL there (pytorch/pytorch#148532);
  on one GPU DTensor skips that collective, so this test cannot show torch's failure. It shows ours does not
  happen: host_grad_norm always reduces, and every collective of the step is checked to get a device tensor.
- `init_distributed(host_collectives=True)` (what a fsdp-offload job starts) makes one group that takes host and
  device tensors alike.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_offloaded_fsdp_clip_runs_on_an_nccl_only_group_and_equals_clipping_the_full_gradients(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from shardwise import config
    from shardwise.strategies.base import DistEnv, Strategy

    dist.init_process_group("nccl", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    try:
        with pytest.raises(RuntimeError, match="(?i)backend"):  # the premise: this group takes no host tensor
            dist.all_reduce(torch.ones(1))
        mesh = init_device_mesh("cuda", (1,))
        cfg = config.load_config(None, {"mixed_precision": ("no", "test"), "max_grad_norm": (0.05, "test")}).cfg
        strategy = Strategy(cfg, DistEnv(0, 1, 0, 1, torch.device("cuda", 0), "nccl"))
        torch.manual_seed(0)
        ref = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Linear(300, 64)).cuda()
        model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Linear(300, 64)).cuda()
        model.load_state_dict(ref.state_dict())
        fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=True))
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1, fused=True)
        x = torch.randn(16, 64, device="cuda")
        seen = []
        real_all_reduce = dist.all_reduce

        def all_reduce(tensor, *args, **kwargs):  # the real collective, with a record of what it was handed
            seen.append(tensor.device.type)
            return real_all_reduce(tensor, *args, **kwargs)

        dist.all_reduce = all_reduce
        try:
            for m in (model, ref):
                (m(x) ** 2).sum().backward()
            strategy.step(model, opt)
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, foreach=True)
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
        finally:
            dist.all_reduce = real_all_reduce
        assert seen and set(seen) == {"cuda"}, seen
        for step in range(1, 3):
            for m in (model, ref):
                (m(x * (step + 1)) ** 2).sum().backward()
            assert all(p.grad.to_local().device.type == "cpu" for p in model.parameters())
            norm = strategy.step(model, opt)
            want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, foreach=True)
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            assert norm.device.type == "cpu" and float(norm) > 1.0  # the clip fires
            torch.testing.assert_close(norm, want.cpu(), rtol=1e-5, atol=0)
            for a, b in zip(model.parameters(), ref.parameters()):
                torch.testing.assert_close(a.to_local(), b.detach().cpu(), rtol=1e-4, atol=1e-4)
    finally:
        dist.destroy_process_group()


def test_a_host_collectives_group_takes_host_and_device_tensors(monkeypatch):
    from shardwise.train.dist import init_distributed

    for k in ("MASTER_ADDR", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    env = init_distributed(60.0, host_collectives=True)
    try:
        assert env.backend == "cpu:gloo,cuda:nccl"
        host, device = torch.ones(2), torch.ones(2, device="cuda")
        dist.all_reduce(host)
        dist.all_reduce(device)
        assert host.tolist() == device.tolist() == [1.0, 1.0]
    finally:
        dist.destroy_process_group()
