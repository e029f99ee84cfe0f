"""What the tiny CPU job's training step cannot go below with eager torch (issue 17 item 3): two probes.

  python benchmarks/tiny_step_floor.py step        # a plain transformers loop on the job's model, one thread
  python benchmarks/tiny_step_floor.py allreduce   # gloo all-reduce of the job's gradient size, 2 processes

`step` trains the time_to_first_step.py model (3.9M Qwen2 shape; built there first) with nothing of shardwise's: one
micro-batch of 4 x 88 tokens (the job's median width), two rows padded, SDPA, transformers' loss, torch's clip and the
fused AdamW, on one thread as each of the job's two ranks runs. It prints the step's milliseconds: the floor that
shardwise's one-rank step (`step_time_s` of a `--strategy single` run with OMP_NUM_THREADS=1) is compared with.
`--profile` adds torch.profiler's operator table (where the step's time goes).

`allreduce` starts 2 gloo processes (torch.multiprocessing, loopback) and times all-reducing one fp32 tensor of the
job's 3.95M parameters on one thread each: wall and process CPU per call, with both cores otherwise idle. In the job
the same bytes are reduced while the other rank computes on the second core.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

MODEL = "/tmp/shardwise-ttfs/qwen2-3.9m"


def step(profile: bool, steps: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    if not os.path.isdir(MODEL):
        sys.exit(f"{MODEL} not found: run `python benchmarks/time_to_first_step.py --setup-only` first")
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (4, 88), generator=g)
    mask = torch.ones(4, 88, dtype=torch.long)
    mask[1, 60:] = 0
    mask[2, 40:] = 0
    labels = ids.masked_fill(mask == 0, -100)

    def one():
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        one()
    t = time.perf_counter()
    for _ in range(steps):
        one()
    print(f"plain transformers step, 1 thread, 4 x 88: {(time.perf_counter() - t) / steps * 1e3:.1f} ms")
    if profile:
        from torch.profiler import profile as prof

        with prof() as p:
            for _ in range(5):
                one()
        print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


def _reduce(rank: int, numel: int, port: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    x = torch.randn(numel)
    for _ in range(3):
        dist.all_reduce(x)
    dist.barrier()
    t, c = time.perf_counter(), time.process_time()
    for _ in range(20):
        dist.all_reduce(x)
    if rank == 0:
        print(f"gloo all-reduce of {numel * 4 / 1e6:.1f} MB, 2 processes: wall {(time.perf_counter() - t) / 20 * 1e3:.1f} ms, "
              f"process CPU {(time.process_time() - c) / 20 * 1e3:.1f} ms a call")
    dist.destroy_process_group()


def allreduce(numel: int) -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_reduce, args=(numel, port), nprocs=2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("probe", choices=["step", "allreduce"])
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--numel", type=int, default=3_950_000)
    a = ap.parse_args()
    step(a.profile, a.steps) if a.probe == "step" else allreduce(a.numel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
