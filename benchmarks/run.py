"""The benchmarks' one entry point: `python benchmarks/run.py SUITE [ARGS...]` (or `python -m benchmarks SUITE`).

    python benchmarks/run.py --list              # the suites, what each measures, on which machine
    python benchmarks/run.py strategies          # one suite; results under $OUT (default /tmp/out)
    python benchmarks/run.py gpu-tests tests/gpu/test_cuda.py -k tied   # ARGS go to the suite's last command

A suite is a named list of commands over the scripts in benchmarks/ (each script's docstring says what it
measures and how). ARGS are appended to the suite's last command; a repeated option there overrides the suite's
own (argparse keeps the last), e.g. `vs-hf-trainer --variants hf-trainer,sw-single`. Each command runs under a
timeout that fits one 10-minute device call. Each command's output streams to the terminal and is kept in
$OUT/logs-SUITE.txt. Dated results the scripts write go to $OUT; the ones worth keeping are copied to
benchmarks/results/ and listed in benchmarks/results/README.md.

On a GPU machine, every suite first runs `setup` (also a suite of its own). The device machines have torch and
transformers but not DeepSpeed, bitsandbytes, torchao or pytest-xdist; carry their wheels in the git-ignored
.whl/ folder (48 MB for the first group), built on a CPU machine with network:

    pip wheel --no-deps -w .whl deepspeed==0.19.8
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
      --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \\
      --platform manylinux2014_x86_64 -d .whl hjson pydantic==2.14.4 pydantic-core==2.50.5 annotated-types \\
      typing-inspection typing_extensions bitsandbytes==0.50.2
    pip download --no-deps -d .whl pytest-xdist==3.8.0 execnet      # pyproject's pytest addopts use -n 2
    pip download --no-deps -d .whl torchao==0.17.0                  # the float8 suites
    pip download --no-deps -d .whl/opt accelerate                   # installed only where the machine lacks it
    pip download --no-deps -d .whl/opt py-spy                       # profiles (optional)

`setup` installs .whl/*.whl into /tmp/site (no index, no dependencies), .whl/opt/accelerate-*.whl there where the
machine has no accelerate, and runs every command with PYTHONPATH=/tmp/site:src:. and the environment the devices
need: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 (no NVLink multicast),
SHARDWISE_CACHE_DIR=/tmp/swcache, PYTHONUNBUFFERED=1. It prints the torch, transformers, DeepSpeed and
bitsandbytes versions and the GPU.

A/B runs against an older commit: put that commit's src/ in .whl/base_src
(`git archive COMMIT src | tar -x -C .whl/base_src --strip-components=1`) and pass `--base-src .whl/base_src` to
time-to-first-step (ttfs_h200.py runs base-single, base-ddp from it), or run a suite with
BASE_SRC=.whl/base_src, which puts it first on PYTHONPATH for every command.

The device's Python writes no bytecode (PYTHONDONTWRITEBYTECODE=1), so each process there compiles every module
it imports; time-to-first-step caches bytecode in /tmp/pycache first, as a user's machine does.
"""

import argparse
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
OUT = "$OUT"  # replaced by the output folder when a command runs


@dataclass(frozen=True)
class Step:
    argv: tuple[str, ...]
    timeout_s: int = 580
    env: dict = field(default_factory=dict)
    unset: tuple[str, ...] = ()  # environment variables removed for this command


@dataclass(frozen=True)
class Suite:
    purpose: str
    machine: str  # the device kind it is meant for
    steps: tuple[Step, ...]


def script(name: str, *args: str, timeout_s: int = 580, **kw) -> Step:
    return Step((PY, f"benchmarks/{name}", *args), timeout_s, **kw)


def pytest(*args: str, timeout_s: int = 480, **kw) -> Step:
    return Step((PY, "-m", "pytest", "-n", "0", "-v", "-rs", "-p", "no:cacheprovider", *args), timeout_s, **kw)


# Bytecode cached as on a user's machine (see the module docstring): one import fills the cache first.
_PYC = {"PYTHONPYCACHEPREFIX": "/tmp/pycache"}
_FILL_PYC = Step((PY, "-c", "import torch, transformers.trainer, torch._inductor.compile_fx, shardwise.train.loop"),
                 300, env=_PYC, unset=("PYTHONDONTWRITEBYTECODE",))
_ANCHOR_RUN = ("--model", "/tmp/shardwise-bench-gpu/llama-16l", "--data", "/tmp/shardwise-bench-gpu/data.jsonl",
               "--data-format", "text", "--nproc-per-node", "1", "--seq-len", "2048", "--micro-batch-size", "8",
               "--log-every", "1", "--lr", "1e-5", "--warmup-steps", "0", "--mixed-precision", "bf16",
               "--param-dtype", "fp32", "--no-save-final", "--overwrite", "--force")

SUITES: dict[str, Suite] = {
    "setup": Suite("install the carried wheels (.whl/) and print the versions and the GPU", "any", ()),
    "gpu-tests": Suite(
        "the GPU test suite (tests/gpu); ARGS narrow it, e.g. tests/gpu/test_cuda.py -k tied", "nvidia-h200",
        (pytest("tests/gpu", timeout_s=590),)),
    "vs-hf-trainer": Suite(
        "shardwise single and fsdp against the HF Trainer on the anchor job, one GPU, Trainer first and last "
        "(add --variants ...,hf-trainer-gc,sw-single-gc for gradient checkpointing)", "nvidia-h200",
        (script("vs_hf_trainer.py", "--out", f"{OUT}/vs-hf-trainer", "--steps", "24", "--warmup", "8",
                "--variants", "hf-trainer,sw-single,sw-fsdp,hf-trainer", timeout_s=450),)),
    "zero3-vs-hf": Suite(
        "shardwise zero3 (its own config and the Trainer's DeepSpeed JSON) against the HF Trainer with DeepSpeed "
        "ZeRO-3 on the anchor job; --gpus 2 on a two-GPU machine (add sw-fsdp-all there)", "nvidia-h200",
        (script("vs_hf_trainer.py", "--out", f"{OUT}/zero3-vs-hf", "--gpus", "1", "--steps", "24", "--warmup", "8",
                "--variants", "hf-trainer-zero3,sw-zero3,sw-zero3-hfjson,hf-trainer-zero3", timeout_s=480),)),
    "dpo-vs-trl": Suite(
        "task dpo (full and LoRA) against TRL's DPOTrainer on the Qwen2.5-1.5B shape, 2,048 tokens a pair, one GPU, "
        "beside the plan (TRL's wheels carried in .whl/trl, installed where missing)",
        "nvidia-h100-x1",
        (script("dpo_vs_trl.py", "--install-missing", ".whl/trl", "--out", f"{OUT}/dpo-vs-trl-full", "--steps", "20",
                "--warmup", "6", "--pairs", "128", "--variants", "trl-full,sw-full", timeout_s=590),
         script("dpo_vs_trl.py", "--install-missing", ".whl/trl", "--out", f"{OUT}/dpo-vs-trl-lora", "--steps", "20",
                "--warmup", "6", "--pairs", "128", "--variants", "trl-lora,sw-lora", timeout_s=590))),
    "strategies": Suite(
        "single, ddp and fsdp through `shardwise train` on the anchor job, one GPU", "nvidia-h200",
        (script("strategies_gpu.py", "--strategies", "single,ddp,fsdp", "--steps", "20", "--tag", "strategies",
                "--out", OUT),)),
    "offload": Suite(
        "the host AdamW kernels (foreach against fused), then the offload presets on the anchor job", "nvidia-h200",
        (script("host_adamw.py", "--json", f"{OUT}/host_adamw.json", timeout_s=300),
         script("strategies_gpu.py", "--strategies", "fsdp-offload,zero2-offload,zero3-offload", "--steps", "6",
                "--log-every", "2", "--timeout", "170", "--tag", "offload", "--out", OUT))),
    "offload-profile": Suite(
        "one profiled step of each offload preset on the anchor (operator table and trace); after `offload`, "
        "which builds the model", "nvidia-h200",
        tuple(Step((PY, "-m", "shardwise", "train", *_ANCHOR_RUN, "--strategy", s, "--max-steps", "7",
                    "--profile-steps", "1", "--profile-start", "6", "--output-dir", f"{OUT}/profile-{s}"), 280)
              for s in ("fsdp-offload", "zero2-offload"))),
    "qlora": Suite(
        "QLoRA (r 16, NF4 base) through `shardwise train` on the anchor job", "nvidia-h200",
        (script("strategies_gpu.py", "--strategies", "single", "--steps", "15", "--tag", "qlora", "--out", OUT,
                "--", "--tuner", "qlora", "--lora-r", "16"),)),
    "plan-accuracy": Suite(
        "the planner's predicted peak memory and step time against the engine's, case by case (ARGS: --cases, "
        "--pick, --snapshot)", "nvidia-h200",
        (script("plan_accuracy.py", "--gpu", "--steps", "3", "--budget-s", "480", "--json",
                f"{OUT}/plan_accuracy.json"),)),
    "bench-3b": Suite(
        "`shardwise bench` on the Llama-3.2-3B shape, one GPU (the report in docs/benchmarks/)", "nvidia-h200",
        (script("bench_gpu.py", "--shape", "llama3.2-3b", "--strategies", "single,fsdp,zero3,ddp,zero2", "--steps",
                "6", "--warmup", "2", "--micro-batch-size", "4", "--timeout", "110", "--report-dir", OUT),)),
    "bench-2gpu": Suite(
        "NCCL bandwidth (`shardwise doctor`), then `shardwise bench` of ddp, fsdp, zero2, zero3 round-robin on two "
        "GPUs", "nvidia-h200-x2",
        (Step((PY, "-m", "shardwise", "doctor", "--json"), 200),
         Step((PY, "-m", "shardwise", "bench", "--strategies", "ddp,fsdp,zero2,zero3", "--repeat", "2",
               "--report-dir", OUT, "--report-name", "bench-2gpu", "--runs-dir", "/tmp/bench-runs"), 590))),
    "time-to-first-step": Suite(
        "time to first step of single and ddp (one rank, forked worker) beside the HF Trainer on the anchor job, "
        "bytecode cached (ARGS: --base-src .whl/base_src --shardwise base-ddp,ddp for an A/B)", "nvidia-h200",
        (_FILL_PYC,
         script("ttfs_h200.py", "--out", OUT, "--steps", "6", "--runs", "3", "--shardwise", "single,ddp",
                timeout_s=500, env=_PYC, unset=("PYTHONDONTWRITEBYTECODE",)))),
    "time-to-first-step-cpu": Suite(
        "the tiny 2-rank CPU job end to end (ARGS: --swift benchmarks/swift_tiny_job.sh beside ms-swift, "
        "--base-src DIR for an A/B)", "cpu",
        (script("time_to_first_step.py", "--runs", "4", "--json", f"{OUT}/time_to_first_step_cpu.json"),)),
    "levers": Suite(
        "each one-GPU lever alone on the anchor, interleaved in one process: fsdp, ddp, float8, selective and "
        "full activation checkpointing (float8 needs torchao)", "nvidia-h200",
        (script("one_gpu_levers.py", "--variants", "single,ddp,fsdp,single+float8,fsdp+float8,single+sac,"
                "single+fullac", "--repeat", "2", "--steps", "8", "--warmup", "2", "--json", f"{OUT}/levers.json",
                timeout_s=560),)),
    "float8": Suite(
        "float8 in one block over four shapes, whole runs on the Qwen2.5-1.5B and Llama-3B shapes, the loss curve "
        "against bf16, and the anchor through the CLI (needs torchao)", "nvidia-h200",
        (script("float8_probe.py", "--shapes", "llama-0.3B,llama-1.1B,llama-8B,qwen2.5-1.5B", "--warmup", "2",
                "--iters", "5", "--json", f"{OUT}/float8_probe.json", timeout_s=400),
         script("one_gpu_levers.py", "--model", "qwen2.5-1.5B", "--micro-batch-size", "3", "--seq-len", "3072",
                "--variants", "single,single+float8,fsdp,fsdp+float8", "--repeat", "2", "--steps", "6", "--warmup",
                "2", "--json", f"{OUT}/float8_runs_qwen.json", timeout_s=300),
         script("one_gpu_levers.py", "--model", "llama-3B", "--micro-batch-size", "4", "--variants",
                "single,single+float8,fsdp,fsdp+float8", "--repeat", "2", "--steps", "6", "--warmup", "2",
                "--json", f"{OUT}/float8_runs_3b.json", timeout_s=400),
         script("one_gpu_levers.py", "--variants", "", "--repeat", "0", "--curve", "single,single+float8",
                "--curve-steps", "300", "--curve-micro-batch", "4", "--curve-json", f"{OUT}/float8_curve.json",
                timeout_s=170),
         script("strategies_gpu.py", "--strategies", "single,fsdp", "--steps", "20", "--tag", "float8", "--out", OUT,
                "--", "--float8", timeout_s=400))),
    "sequence-parallel": Suite(
        "the sequence-parallel GPU tests on two GPUs, then the two-GPU case outside pytest with every process's "
        "stacks after 110 s (a hang shows where each rank waits)", "nvidia-h200-x2",
        (pytest("-x", "-s", "-p", "no:logging", "--timeout", "400", "tests/gpu/test_sequence_parallel.py",
                timeout_s=420),
         script("sp_probe.py", "--timeout", "150", "--", "--collective-timeout", "130", timeout_s=170,
                env={"SW_STACKS_AFTER": "110"}))),
    "long-context": Suite(
        "the Llama-3.1-8B shape at 64k and 128k tokens with sequence parallelism 2, then without (the non-SP "
        "limit), on two GPUs", "nvidia-h200-x2",
        (script("long_context.py", "--lengths", "65536,131072", "--sp", "2,1", "--steps", "3", "--stop-after-oom",
                "--timeout", "240", "--tag", "min", "--out", OUT),)),
    "long-context-1gpu": Suite(
        "one GPU past 128K tokens: offloaded checkpointing and MLP tiles on the Llama-3.1-8B shape (LoRA at 256K, "
        "then the 64K cost against plain checkpointing), the plan beside every row; ARGS --rows ... for others "
        "(benchmarks/long_context_one_gpu.py; --gpu-gib 80: an H200 runs what an 80 GiB card would)", "nvidia-h100-x1",
        (script("long_context_one_gpu.py", "--gpu-gib", "80", "--budget-s", "470", "--out", OUT, timeout_s=500),)),
    "long-context-probe": Suite(
        "where one block's peak departs from the plan past 64K tokens: the Llama-3.1-8B shape with 2 blocks, LoRA "
        "without adapter dropout, offload + 16 MLP tiles, at 128K, 192K and 256K, each run's allocator history of its "
        "first step replayed to what was alive at the peak (--memory-snapshot); eager blocks, beside the eager plan: "
        "torch 2.11 and later fail compiled checkpointed blocks while recording (pytorch/pytorch#179536)",
        "nvidia-h100-x1",
        (script("long_context_one_gpu.py", "--layers", "2", "--rows", "lora-256k-nodrop",
                "--flags=--mlp-tiles 16 --compile off",
                "--lengths", "131072,196608,262144", "--snapshot", "--gpu-gib", "80", "--budget-s", "470",
                "--tag", "probe", "--out", OUT, timeout_s=500),)),
    "tensor-parallel": Suite(
        "the Llama-3.1-8B shape at 8k tokens: tensor parallel 2 against fsdp on two GPUs, the same global batch",
        "nvidia-h200-x2",
        (script("long_context.py", "--lengths", "8192", "--sp", "1", "--steps", "4", "--timeout", "260", "--tag",
                "tp2", "--out", OUT, "--", "--tensor-parallel", "2", "--grad-accum", "2", timeout_s=290),
         script("long_context.py", "--lengths", "8192", "--sp", "1", "--steps", "4", "--timeout", "260", "--tag",
                "fsdp", "--out", OUT, timeout_s=290))),
    "scaling": Suite(
        "weak scaling of the anchor job over 1, 2, 4, 8 GPUs with the planner and auto's pick beside each row "
        "(ARGS --gpus 1,2 on two GPUs)", "nvidia-h200-x8",
        (script("scaling.py", "--gpus", "1,2,4,8", "--jobs", "anchor", "--timeout", "150", "--tag", "anchor",
                "--out", OUT),)),
    "rehearse-grid": Suite(
        "issue 41's planner grid by `plan --rehearse` (rank 0 of 8- and 64-GPU jobs of the 8B/70B/Qwen/MoE shapes on "
        "one GPU), most important rows first, as many as the budget allows (ARGS: --rows NAMES, --compile)",
        "nvidia-h200",
        (script("rehearse_grid.py", "--out", OUT, "--budget-s", "420", timeout_s=450),)),
    "auto-sweep": Suite(
        "`--strategy auto` against every fitting preset measured, on two GPUs", "nvidia-h200-x2",
        (script("auto_sweep.py", "--quick", "--out", OUT, timeout_s=590),)),
}


def scripts_named(suite: Suite) -> list[str]:
    """The repository paths a suite's commands run: benchmarks/*.py scripts, pytest's test paths, and shardwise's
    own entry point for a `python -m shardwise` command."""
    out = []
    for step in suite.steps:
        out += [a for a in step.argv if a.startswith(("benchmarks/", "tests/"))]
        if step.argv[1:3] == ("-m", "shardwise"):
            out.append("src/shardwise/__main__.py")
    return out


def setup_env(env: dict) -> None:
    """Install the carried wheels into /tmp/site and set the device environment in `env` (the module docstring)."""
    whl = ROOT / ".whl"
    pip = [PY, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
           "--target", "/tmp/site"]
    wheels = sorted(str(p) for p in whl.glob("*.whl"))
    if wheels:
        subprocess.run([*pip, "--upgrade", *wheels], check=False)
    accelerate = sorted(str(p) for p in (whl / "opt").glob("accelerate-*.whl"))
    if accelerate and subprocess.run([PY, "-c", "import accelerate"], capture_output=True).returncode != 0:
        subprocess.run([*pip, *accelerate], check=False)
    paths = ["/tmp/site", str(ROOT / "src"), str(ROOT)]
    if env.get("BASE_SRC"):
        paths.insert(0, str(Path(env["BASE_SRC"]).resolve()))
    env.update(PYTHONPATH=":".join(paths), NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
               NVSHMEM_DISABLE_NVLS="1", SHARDWISE_CACHE_DIR=env.get("SHARDWISE_CACHE_DIR", "/tmp/swcache"),
               PYTHONUNBUFFERED="1")
    env.setdefault("NCCL_DEBUG", "WARN")
    for code in ("import torch, transformers; print('torch', torch.__version__, 'transformers', "
                 "transformers.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')",
                 "import deepspeed, bitsandbytes; print('deepspeed', deepspeed.__version__, 'bitsandbytes', "
                 "bitsandbytes.__version__)"):
        r = subprocess.run([PY, "-c", code], env=env, capture_output=True, text=True)
        lines = (r.stdout if r.returncode == 0 else r.stderr).strip().splitlines()
        print(lines[-1] if lines else "", flush=True)


def _stop(proc: subprocess.Popen, name: str, timeout_s: int) -> None:
    """A command past its timeout: its whole process group goes (a launcher's workers with it)."""
    print(f"=== {name}: past {timeout_s} s, stopped", flush=True)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_suite(name: str, extra: list[str], out: str) -> int:
    suite = SUITES[name]
    env = dict(os.environ)
    setup_env(env)
    Path(out).mkdir(parents=True, exist_ok=True)
    log = Path(out) / f"logs-{name}.txt"
    rc = 0
    for i, step in enumerate(suite.steps):
        argv = [out if a == OUT else a.replace(OUT, out) for a in step.argv]
        if i == len(suite.steps) - 1:
            argv += extra
        cmd_env = {k: v for k, v in env.items() if k not in step.unset} | step.env
        print(f"=== {name} [{i + 1}/{len(suite.steps)}] {time.strftime('%H:%M:%S')}: {' '.join(argv)}", flush=True)
        with open(log, "a") as f:
            f.write(f"=== {' '.join(argv)}\n")
            f.flush()
            proc = subprocess.Popen(argv, cwd=ROOT, env=cmd_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, start_new_session=True)
            timer = threading.Timer(step.timeout_s, _stop, (proc, name, step.timeout_s))
            timer.start()
            assert proc.stdout is not None
            for line in proc.stdout:
                sys.stdout.write(line)
                f.write(line)
            code = proc.wait()
            timer.cancel()
        print(f"=== {name} [{i + 1}] exit {code}", flush=True)
        rc = rc or code
    return rc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/run.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("suite", nargs="?", help="a suite name (--list shows them)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="appended to the suite's last command")
    p.add_argument("--list", action="store_true", help="list the suites and exit")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"), help="results folder (default $OUT or /tmp/out)")
    a = p.parse_args(argv)
    if a.list or not a.suite:
        width = max(map(len, SUITES))
        for name, s in SUITES.items():
            print(f"{name:<{width}}  [{s.machine}] {s.purpose}")
        return 0 if a.list else 2
    if a.suite not in SUITES:
        print(f"benchmarks/run.py: no suite {a.suite!r}; the suites: {', '.join(SUITES)}", file=sys.stderr)
        return 2
    if shutil.which("nvidia-smi") is None and SUITES[a.suite].machine not in ("cpu", "any"):
        print(f"benchmarks/run.py: {a.suite} is meant for a GPU machine ({SUITES[a.suite].machine})", file=sys.stderr)
    return run_suite(a.suite, a.args, a.out)


if __name__ == "__main__":
    sys.exit(main())
