"""One run of tests/gpu/test_sequence_parallel.py's two-GPU case outside pytest, with its
output streamed (pytest's run_cli captures it, so a run that hangs shows nothing): the
tiny model with room for 64k positions, the same text documents, `shardwise train` fsdp
with --sequence-parallel 2 on 2 GPUs (or --strategy single with --sp 1). Extra train flags
after --. With SW_STACKS_AFTER=SECONDS every process of the run prints its Python stacks
after that many seconds (faulthandler, through a sitecustomize placed first on the path),
so a hang shows where each rank waits.

    python benchmarks/sp_probe.py --packing -- --compile off
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STACKS = '''import os
if os.environ.get("SW_STACKS_AFTER"):
    import faulthandler
    faulthandler.dump_traceback_later(float(os.environ["SW_STACKS_AFTER"]), exit=False)
'''


def prepare(work: str, long: int) -> tuple[str, str]:
    sys.path.insert(0, os.path.join(ROOT, "src"))
    from shardwise.models.tiny import tiny_dir

    model = os.path.join(work, "model")
    if not os.path.isdir(model):
        shutil.copytree(tiny_dir(42), model)
        with open(os.path.join(model, "config.json")) as fh:
            cfg = json.load(fh)
        cfg["max_position_embeddings"] = 4 * long
        with open(os.path.join(model, "config.json"), "w") as fh:
            json.dump(cfg, fh)
    rng = random.Random(0)  # as the test's long_data fixture
    words = ["apple", "river", "stone", "cloud", "green", "quiet", "music", "north", "paper", "light"]
    data = os.path.join(work, "long.jsonl")
    with open(data, "w") as fh:
        for _ in range(160):
            fh.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randrange(500, 6000)))}) + "\n")
    return model, data


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sp", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--packing", action="store_true")
    ap.add_argument("--timeout", type=float, default=150)
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "sp-probe"))
    ap.add_argument("extra", nargs="*")
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    model, data = prepare(a.work, a.seq_len)
    hook = os.path.join(a.work, "hook")
    os.makedirs(hook, exist_ok=True)
    with open(os.path.join(hook, "sitecustomize.py"), "w") as fh:
        fh.write(STACKS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([hook, os.environ.get("PYTHONPATH", "")])}
    where = (["--strategy", "fsdp", "--nproc-per-node", "2", "--sequence-parallel", str(a.sp)] if a.sp > 1
             else ["--strategy", "single"])
    cmd = [sys.executable, "-m", "shardwise", "train", "--model", model, "--data", data, "--data-format", "text",
           "--output-dir", os.path.join(a.work, f"out-sp{a.sp}"), "--overwrite", "--max-steps", "6", "--log-every", "1",
           "--lr", "1e-3", "--warmup-steps", "0", "--mixed-precision", "no", "--micro-batch-size", "1",
           "--no-save-final", *where, "--grad-accum", "2", "--gradient-checkpointing", "--seq-len", str(a.seq_len),
           *(["--packing"] if a.packing else []), *a.extra]
    print("sp_probe:", " ".join(cmd[1:]), flush=True)
    t0 = time.time()
    p = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        rc = p.wait(timeout=a.timeout)
    except subprocess.TimeoutExpired:
        import signal

        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        rc = "timeout"
    print(f"sp_probe: exit {rc} after {time.time() - t0:.0f} s", flush=True)
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
