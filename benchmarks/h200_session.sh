#!/usr/bin/env bash
# The H200 runs of one session, in the order they were made (device tool: one H200, torch
# 2.11, transformers 5.17, no DeepSpeed/bitsandbytes installed: their wheels are carried in
# the git-ignored .whl/, built on the CPU machine with
#   pip wheel --no-deps -w .whl deepspeed==0.19.8
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl hjson pydantic==2.14.4 pydantic-core==2.50.5 annotated-types \
#     typing-inspection typing_extensions bitsandbytes==0.50.2
#   pip download --no-deps -d .whl pytest-xdist==3.8.0 execnet   (pyproject's pytest addopts use -n 2)
# and carried to the device, 48 MB in all). Usage on the GPU machine, from the repo root:
#   bash benchmarks/h200_session.sh setup PART...     PART: tests strategies offload qlora accuracy bench3b
#                                                    accuracy3 levers fsdp1 proftest accuracy4 levers2 defaults (third session)
#                                                    accuracy5 levers3 accuracy6 vshf (fourth session)
#                                                    vshf5 (fifth session)
#                                                    accuracy16 accuracy16b ttfs (seventh session)
#                                                    levers17 curve17 (issue 17 item 2; carries .whl/torchao 0.17.0)
#                                                    twogpu (fourth session, on the nvidia-h200-x2 kind)
#                                                    sptest long1 long2 long3 long4 longqwen (issue 15, x2 kind)
#                                                    spflex spplain sppacked spprobe longmin (sixth session, x2;
#                                                    not run: the device budget was spent)
#                                                    scale2 (x2) scale8a scale8b long8 (x8; issue 21, not run yet)
#                                                    f8probe f8runs1 f8runs2 f8diag f8diag2 f8runs3 f8qprof f8cli (tenth session; carries torchao)
#                                                    f8sel (eleventh session; carries torchao)
#                                                    zero3hf tp2 autosweep (eleventh session, prepared for x2, not run)
#                                                    ttfs13 (thirteenth session; carries .whl/base_src)
#                                                    ttfs14 (fourteenth session; carries .whl/opt/py_spy-*.whl; ran an experiment
#                                                    since reverted: inductor imported on a thread, SHARDWISE_IMPORT_AHEAD)
#                                                    ttfs14b ttfs14c (fourteenth session; carry .whl/base_src = b7c4d15's src;
#                                                    14b ran with scikit-learn skipped only, 14c with SciPy too)
#                                                    ttfs15 (run in the fifteenth session: carry .whl/base_src = 1912748's src,
#                                                    lean imports without the full-collection hold; results
#                                                    time_to_first_step_h200_2026-12-02-gc.md)
#                                                    ttfs16 (fifteenth session: carry .whl/base_src = b021912's src)
#                                                    host16 offload16 offload16base (sixteenth session: carry .whl/base_src = 567f1bb's src)
#                                                    spy16 (sixteenth session: carries .whl/opt/py_spy-*.whl)
#                                                    fold16 (sixteenth session: carry .whl/base_src = 8d5afb2's src)
#                                                    gputests18 (eighteenth session)
#                                                    gputests19 ttfs19 (nineteenth session; ttfs19 carries .whl/base_src = aadd66e's src)
#                                                    gputests20 ttfs20 (twentieth session; ttfs20 carries .whl/base_src = 1d73dd3's src)
#                                                    z3hf21 gputests21 (twenty-first session; carries .whl/opt/accelerate)
#                                                    vshf22 gputests22 ttfs22 (twenty-second session)
#                                                    prof17 z3mod17 norm17 gputests17 (seventeenth session; prof17 after
#                                                    fold16 or norm17; norm17 carries .whl/base_src = 3d31060's src)
#                                                    z3one z3prof z3acc z3two z3prof2 z3acc2 z3acc3 cudatests z3eager (twelfth session, one GPU: ZeRO-3 fetching whole blocks;
#                                                    carries DeepSpeed's wheels and .whl/opt/accelerate, installed only
#                                                    where the machine lacks accelerate)
# Results go to $OUT (default /tmp/out); each part's log to /tmp/logs/PART.log, their tails
# to $OUT/logs-TIME.txt (the device returns at most 8 files per call).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
setup() {
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  fi
  if ls .whl/opt/accelerate-*.whl >/dev/null 2>&1 && ! python3 -c "import accelerate" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/opt/accelerate-*.whl
  fi
  export PYTHONPATH=/tmp/site:$PWD/src:$PWD NCCL_NVLS_ENABLE=0 SHARDWISE_CACHE_DIR=/tmp/swcache PYTHONUNBUFFERED=1 \
    TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name(0))"
  python3 -c "import deepspeed, bitsandbytes; print('deepspeed', deepspeed.__version__, 'bitsandbytes', bitsandbytes.__version__)" 2>&1 | tail -1
}
tests() { python3 -m pytest -n 0 -q -rs tests/gpu; }
strategies() { python3 benchmarks/strategies_gpu.py --strategies single,ddp,fsdp --steps 15 --tag ddpfix --out "$OUT"; }
offload() {
  python3 benchmarks/strategies_gpu.py --strategies fsdp-offload,zero2-offload,zero3-offload --steps 6 --log-every 2 \
    --timeout 200 --tag offload --out "$OUT"
}
qlora() {
  python3 benchmarks/strategies_gpu.py --strategies single --steps 15 --tag qlora --out "$OUT" -- --tuner qlora --lora-r 16
}
accuracy() { python3 benchmarks/plan_accuracy.py --gpu --json "$OUT/acc_gpu.json"; }  # + acc_gpu.md
bench3b() {
  python3 benchmarks/bench_gpu.py --shape llama3.2-3b --strategies single,fsdp,zero3,ddp,zero2 --steps 6 --warmup 2 \
    --micro-batch-size 4 --timeout 110 --report-dir "$OUT"
}
# third session: the GPU table again with the leak-free harness, per-step peaks over 3 steps
accuracy3() { python3 benchmarks/plan_accuracy.py --gpu --steps 3 --budget-s 480 --json "$OUT/acc_gpu.json"; }
levers() {  # as run at 757fe6f (the +nosync lever is the engine's step since e45764c and gone from the script)
  python3 benchmarks/one_gpu_levers.py --variants single,fsdp,fsdp-grad-op,fsdp+bf16reduce,fsdp+nosync,single+nosync,fsdp-grad-op+bf16reduce+nosync \
    --repeat 2 --steps 10 --warmup 3 --profile single,fsdp --json "$OUT/levers.json"
}
fsdp1() { python3 benchmarks/strategies_gpu.py --strategies single,fsdp,fsdp-grad-op --steps 20 --tag fsdp1 --out "$OUT"; }
proftest() { python3 -m pytest -n 0 -q -rs -x tests/gpu/test_profile_cuda.py; }
# after e45764c (one-rank fsdp keeps gathered weights; no host sync in the step): the fsdp rows again + the presets
# the table lacked (zero1, the offload presets); before/after of both changes in one process; the CLI numbers
accuracy4() {
  python3 benchmarks/plan_accuracy.py --gpu --steps 3 --budget-s 400 --pick 3,4,15,16,23,24,25,26,31,32,33,34,40,42,43,44,45,46,47,48,49 \
    --json "$OUT/acc_gpu4.json"
}
levers2() {
  python3 benchmarks/one_gpu_levers.py --variants single+sync,single,fsdp+sync+reshard,fsdp --repeat 3 --steps 10 --warmup 3 \
    --json "$OUT/levers2.json"
}
defaults() { python3 benchmarks/strategies_gpu.py --strategies single,fsdp,ddp --steps 20 --tag defaults --out "$OUT"; }
# prepared for the next session (not run yet): the fsdp-offload rows again (one rank reshards again since 9b86ecf)
# and zero3-offload with what was alive at each peak; the one-GPU goals with the loop's flag read (ead413d)
accuracy5() { python3 benchmarks/plan_accuracy.py --gpu --steps 3 --pick 44,45,48,49 --snapshot --json "$OUT/acc_gpu5.json"; }
levers3() {
  python3 benchmarks/one_gpu_levers.py --variants single+sync,single,ddp,fsdp --repeat 3 --steps 10 --warmup 3 \
    --json "$OUT/levers3.json"
}
# fourth session (after 639b242: the snapshot's window opens at the second step, allocation stacks only)
accuracy6() { python3 benchmarks/plan_accuracy.py --gpu --steps 3 --pick 45,49 --snapshot --json "$OUT/acc_gpu6.json"; }
vshf() {  # the issue-6 goals with the final code, Trainer first
  python3 benchmarks/vs_hf_trainer.py --out "$OUT" --steps 24 --warmup 8 \
    --variants hf-trainer,sw-single,sw-fsdp,hf-trainer-gc,sw-single-gc
}
twogpu() {  # two GPUs: NCCL bandwidth, then every strategy of the demo round-robin (the report needs > 400 s;
  # keep --runs-dir out of $OUT: the device returns at most 8 files)
  python3 -m shardwise doctor --json > "$OUT/doctor2gpu.json"
  python3 -m shardwise bench --strategies ddp,fsdp,zero2,zero3 --repeat 2 --report-dir "$OUT" --report-name bench-2gpu \
    --runs-dir /tmp/bench-runs
}
# fifth session (after the mesh refactor: ParallelDims + the strategy's parallelize pipeline): issue 13's check
vshf5() {
  python3 benchmarks/vs_hf_trainer.py --out "$OUT" --steps 24 --warmup 8 --variants hf-trainer,sw-single,sw-fsdp
}
# seventh session (2026-12-01, issue 16 item 1 / issue 17 item 3, one H200; run as plain commands, these parts repeat
# them): presets x full/LoRA/QLoRA x checkpointing on two shapes with step time, then the time to first step pair
accuracy16() { python3 benchmarks/plan_accuracy.py --gpu --cases issue16 --steps 5 --budget-s 290 --json "$OUT/acc16.json"; }
accuracy16b() {  # the compiled Llama rows the budget cut, the eager zero3 rows again, the checkpointed LoRA snapshots
  python3 benchmarks/plan_accuracy.py --gpu --cases issue16 --steps 3 --pick 28,36 --snapshot --json "$OUT/acc16snap.json"
  python3 benchmarks/plan_accuracy.py --gpu --cases issue16 --steps 8 --pick 7,8,15,16,25,26,33,34 --budget-s 85 \
    --json "$OUT/acc16z3.json"
  python3 benchmarks/plan_accuracy.py --gpu --cases issue16 --steps 5 --pick 43,44,45,46,47,48 --json "$OUT/acc16comp.json"
}
ttfs() { python3 benchmarks/ttfs_h200.py --out "$OUT" --steps 6; }
# prepared for the issue-15 session (not run yet), on the nvidia-h200-x2 kind; each part fits one 10-minute call
# (the model directories stay under /tmp/shardwise-long-context while the machine is warm)
# (sixth session) every GPU pytest with -x -s -p no:logging, pytest's --timeout and an outer timeout:
# a hang in the fifth session's first call burned 9.5 minutes of device time
export NCCL_DEBUG=${NCCL_DEBUG:-WARN} SHARDWISE_DEBUG=${SHARDWISE_DEBUG:-1}
gpytest() { local t=$1; shift; timeout -k 10 $((t + 20)) python3 -m pytest -n 0 -x -s -p no:logging --timeout "$t" "$@"; }
sptest() { gpytest 400 -q -rs tests/gpu/test_sequence_parallel.py; }
spflex() { gpytest 300 -q -rs tests/gpu/test_sequence_parallel.py -k never_attends; }
spplain() { gpytest 240 -q -rs tests/gpu/test_sequence_parallel.py -k plain; }   # compile off (see the test)
sppacked() { gpytest 560 -q -rs tests/gpu/test_sequence_parallel.py -k packed; }
# the two-GPU case outside pytest with the CUDA default compile on, output streamed, every process's
# Python stacks after 110 s (a hang shows where each rank waits; a hung collective errors after 130 s)
spprobe() { SW_STACKS_AFTER=110 timeout -k 10 170 python3 benchmarks/sp_probe.py --timeout 150 -- --collective-timeout 130; }
# the smallest long-context table that answers goals 1-2 (8B shape): SP 2 at 64k and 128k, then SP 1 at 64k
# and 128k (the latter expected to run out of memory: the non-SP limit); each run loads 8B in fp32
longmin() {
  python3 benchmarks/long_context.py --lengths 65536,131072 --sp 2,1 --steps 3 --stop-after-oom --timeout 240 \
    --tag min --out "$OUT"
}
long1() { python3 benchmarks/long_context.py --lengths 32768,65536 --sp 1,2 --steps 4 --tag a --out "$OUT"; }
long2() { python3 benchmarks/long_context.py --lengths 131072 --sp 2 --steps 4 --tag b --out "$OUT"; }
long3() {  # the non-SP limit (above 64k), then SP 2 at twice it
  python3 benchmarks/long_context.py --lengths 98304,131072 --sp 1 --steps 3 --stop-after-oom --tag limit1 --out "$OUT"
}
long4() { python3 benchmarks/long_context.py --lengths 196608,262144 --sp 2 --steps 3 --stop-after-oom --tag limit2 --out "$OUT"; }
longqwen() {
  python3 benchmarks/long_context.py --shape qwen2.5-7b --lengths 131072 --sp 2 --steps 4 --packing --tag qwen-lora \
    --out "$OUT" -- --tuner lora --lora-r 16
}
# prepared for issue 21 (not run yet): benchmarks/scaling.py on the x2 kind (the script's GPU check: the anchor
# job on 1 and 2 GPUs), then on the x8 kind (weak scaling 1-8 GPUs; each part fits one 10-minute call) and the
# long-context rows at 8 GPUs (SP 8: Ulysses 8 for the 32 heads)
scale2() { python3 benchmarks/scaling.py --gpus 1,2 --jobs anchor --strategies single,ddp,fsdp,zero3 --timeout 150 --tag x2 --out "$OUT"; }
scale8a() { python3 benchmarks/scaling.py --gpus 1,2,4,8 --jobs anchor --timeout 150 --tag x8-anchor --out "$OUT"; }
scale8b() { python3 benchmarks/scaling.py --gpus 2,4,8 --jobs llama8b --strategies fsdp,hybrid2,hybrid4,zero3 --timeout 200 --tag x8-8b --out "$OUT"; }
long8() { python3 benchmarks/long_context.py --gpus 8 --lengths 131072,262144 --sp 8 --steps 3 --tag x8 --out "$OUT"; }
# the fused head holding one chunk of logits (7ed8f6c): the Qwen rows whose peak is the head's, measured again
# time to first step again with a re-run's warm caches (inductor's FX graph cache, the data cache): two pairs
ttfs2() { python3 benchmarks/ttfs_h200.py --out "$OUT" --steps 6 --runs 2; }
# the head's log-sum-exp in place (no chunk-sized fp32 temporary beside the logits): memory of the head-bound rows
# and the anchor's speed (single) after the change
headlse() {
  python3 benchmarks/plan_accuracy.py --gpu --cases issue16 --steps 3 --pick 2,10 --json "$OUT/acc16lse.json"
  timeout -k 10 150 python3 benchmarks/one_gpu_levers.py --variants single --repeat 1 --steps 8 --warmup 2 \
    --json "$OUT/levers_lse.json"
}
headchunk() { python3 benchmarks/plan_accuracy.py --gpu --cases issue16 --steps 3 --pick 2,4,10,12 --json "$OUT/acc16head.json"; }
# issue 17 item 2 (the mfu helper, 2026-12-01): each lever alone on the anchor (selective and full activation
# checkpointing, float8 linears through the carried torchao 0.17.0 wheel), then float8 vs bf16 over 300 steps
levers17() {
  timeout -k 10 340 python3 benchmarks/one_gpu_levers.py --variants single,single+float8,fsdp,fsdp+float8,single+sac,single+fullac \
    --repeat 2 --steps 8 --warmup 2 --json "$OUT/levers17.json"
}
curve17() {
  timeout -k 10 170 python3 benchmarks/one_gpu_levers.py --variants "" --repeat 0 --curve single,single+float8 \
    --curve-steps 300 --curve-micro-batch 4 --curve-json "$OUT/curve17.json"
}
setup
LOGF="$OUT/logs-$(date +%H%M%S).txt"
# ninth session (2026-12-01, issue 17 item 3): the workers start while the launcher prepares (launch._Early); the
# time to first step of one rank through the agent with it (ddp) and without (ddp-serial), beside single and the
# HF Trainer, two rounds (the first pays the cold compile)
ttfs9() { python3 benchmarks/ttfs_h200.py --out "$OUT" --steps 6 --runs 2 --shardwise single,ddp,ddp-serial; }
# where the single run's time goes on the H200 beside the phases (wrap ~4 s, ~6 s after the run's last mark before the
# process is gone): a py-spy profile of a warm run (py-spy's wheel carried in .whl/), then the exit with inductor's
# compile workers off (TORCHINDUCTOR_COMPILE_THREADS=1) and on
probe9() {
  python3 benchmarks/ttfs_h200.py --out /tmp/probe-warm --steps 6 --runs 1 --shardwise single > /dev/null
  local args="train --model /tmp/ttfs-h200/anchor-1.1b --data /tmp/ttfs-h200/text-6.jsonl --strategy single
    --nproc-per-node 1 --seq-len 2048 --micro-batch-size 8 --max-steps 6 --log-every 1 --mixed-precision bf16
    --overwrite --no-save-final --seed 0"
  /tmp/site/bin/py-spy record -r 200 --subprocesses -f speedscope -o "$OUT/single-warm.speedscope.json" -- \
    python3 -m shardwise $args --output-dir /tmp/probe-spy | grep phases
  for threads in 1 16 1 16; do
    local t0; t0=$(date +%s.%N)
    TORCHINDUCTOR_COMPILE_THREADS=$threads python3 -m shardwise $args --output-dir /tmp/probe-$threads | grep phases
    echo "compile_threads $threads: wall $(python3 -c "import time; print(round(time.time() - $t0, 2))") s"
  done
}
# probe9's profile: 14 of the 37 s of a warm single run were Python compiling source to bytecode (SourceLoader.
# source_to_code): this machine's site-packages come without .pyc files and every process compiles them again, the
# HF Trainer's imports too. A user's machine caches them after the first import; PYTHONPYCACHEPREFIX gives this one
# a cache, so rounds 1-2 measure what a user's re-run sees (round 0 fills the caches). After the compile-worker kill.
ttfs9b() {
  PYTHONPYCACHEPREFIX=/tmp/pycache python3 benchmarks/ttfs_h200.py --out "$OUT" --steps 6 --runs 3 \
    --shardwise single,ddp,ddp-serial
}
# ttfs9b's bytecode cache changed nothing (HF imports still 15 s): is writing bytecode switched off here? Print the
# flags, time one import twice with writing forced on into a cache of our own, then single and the Trainer so
pyc9() {
  env | grep -i -E "PYTHON(DONTWRITE|PYCACHE|OPTIM)" || echo "no PYTHON* bytecode variables"
  python3 -c "import sys; print('dont_write_bytecode', sys.dont_write_bytecode, 'pycache_prefix', sys.pycache_prefix)"
  python3 -c "import torch, transformers, os; print(os.path.dirname(torch.__file__), os.access(os.path.dirname(torch.__file__), os.W_OK))"
  for i in 1 2; do
    env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX=/tmp/pycache2 python3 -X importtime -c "import torch, transformers.trainer" 2>&1 \
      | tail -1
  done
  env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX=/tmp/pycache2 python3 benchmarks/ttfs_h200.py --out "$OUT" --steps 6 \
    --runs 2 --shardwise single
}
# after 3eff932 (first checks before the agent; waiting workers import inductor): with bytecode cached as on a
# user's machine, ddp on one rank with and without early workers, single, the Trainer
ttfs9c() {
  export PYTHONPYCACHEPREFIX=/tmp/pycache3
  env -u PYTHONDONTWRITEBYTECODE python3 -c "import torch, transformers.trainer, torch._inductor.compile_fx, shardwise.train.loop"
  env -u PYTHONDONTWRITEBYTECODE python3 benchmarks/ttfs_h200.py --out "$OUT" --steps 6 --runs 2 \
    --shardwise ddp,ddp-serial,single
}
# tenth session (issue 17: the planner's float8 terms; carries .whl/torchao 0.17.0): what float8 changes in one block
# (saved activations, autocast's weight cache, forward + backward time) over four block shapes, then whole runs on
# shapes and settings the planner's float8 terms were not fitted on (its out-of-sample check)
f8probe() {
  timeout -k 10 400 python3 benchmarks/float8_probe.py --shapes llama-0.3B,llama-1.1B,llama-8B,qwen2.5-1.5B \
    --warmup 2 --iters 5 --json "$OUT/f8probe.json"
}
f8runs1() {
  timeout -k 10 200 python3 benchmarks/one_gpu_levers.py --model qwen2.5-1.5B --micro-batch-size 3 --seq-len 3072 \
    --variants single,single+float8,fsdp,fsdp+float8 --repeat 1 --steps 6 --warmup 2 --json "$OUT/f8runs_qwen.json"
  timeout -k 10 200 python3 benchmarks/one_gpu_levers.py --model llama-3B --micro-batch-size 4 \
    --variants single,single+float8,fsdp,fsdp+float8 --repeat 1 --steps 6 --warmup 2 --json "$OUT/f8runs_3b.json"
}
f8runs2() {
  timeout -k 10 150 python3 benchmarks/one_gpu_levers.py --model llama-0.3B --micro-batch-size 16 \
    --variants single,single+float8 --repeat 1 --steps 6 --warmup 2 --json "$OUT/f8runs_03b.json"
  timeout -k 10 150 python3 benchmarks/one_gpu_levers.py --model llama-1.1B --micro-batch-size 8 --ckpt \
    --variants single,single+float8 --repeat 1 --steps 6 --warmup 2 --json "$OUT/f8runs_ckpt.json"
}
f8diag() {  # fsdp + float8 on the 28-block 3B shape ran slower than fsdp (343.9 vs 320.4 ms): recompiles? the kernels?
  TORCH_LOGS=recompiles timeout -k 10 300 python3 benchmarks/one_gpu_levers.py --model llama-3B --micro-batch-size 4 \
    --variants fsdp+float8,fsdp,single+float8 --repeat 1 --steps 6 --warmup 2 --profile fsdp+float8,single+float8 \
    --json "$OUT/f8diag.json"
}
f8diag2() {  # f8diag's fsdp+float8 was 268.8 ms when run first: f8runs1's order again, twice, recompiles logged
  TORCH_LOGS=recompiles timeout -k 10 400 python3 benchmarks/one_gpu_levers.py --model llama-3B --micro-batch-size 4 \
    --variants single,single+float8,fsdp,fsdp+float8 --repeat 2 --steps 6 --warmup 2 --json "$OUT/f8diag2.json"
}
f8runs3() {  # f8runs1's Qwen rows again on a warm machine (f8runs1 ran on a fresh one, its fsdp + float8 rows cold)
  timeout -k 10 300 python3 benchmarks/one_gpu_levers.py --model qwen2.5-1.5B --micro-batch-size 3 --seq-len 3072 \
    --variants single,single+float8,fsdp,fsdp+float8 --repeat 2 --steps 6 --warmup 2 --json "$OUT/f8runs3_qwen.json"
}
f8qprof() {  # why fsdp + float8 gains 1-3% on the Qwen shape where single + float8 gains 9%: the kernels of both
  timeout -k 10 300 python3 benchmarks/one_gpu_levers.py --model qwen2.5-1.5B --micro-batch-size 3 --seq-len 3072 \
    --variants single+float8,fsdp+float8,fsdp --repeat 1 --steps 6 --warmup 2 --profile single+float8,fsdp+float8,fsdp \
    --json "$OUT/f8qprof.json"
}
f8cli() {  # float8 through the `shardwise train` CLI (the anchor, single and fsdp), for test_plan_measured's rows
  timeout -k 10 400 python3 benchmarks/strategies_gpu.py --strategies single,fsdp --steps 20 --tag f8cli --out "$OUT" \
    -- --float8
}
# eleventh session: float8 where the planner's terms stand unmeasured, on the anchor: with selective checkpointing
# (compiled; float8_block_bytes counts no saving there) and eager (no compiled graph to drop the inputs)
f8sel() {
  timeout -k 10 200 python3 benchmarks/one_gpu_levers.py --variants single+sac,single+sac+float8 --repeat 1 --steps 6 \
    --warmup 2 --json "$OUT/f8sel.json"
  timeout -k 10 110 python3 benchmarks/one_gpu_levers.py --eager --variants single,single+float8 --repeat 1 --steps 6 \
    --warmup 2 --json "$OUT/f8eager.json"
}
# prepared in the eleventh session for the nvidia-h200-x2 kind (not run: only one GPU was lent). Carry the DeepSpeed
# wheels of the header (and accelerate's: `pip download --no-deps -d .whl accelerate` if the device lacks it).
# issue 17 item 1: the HF Trainer with DeepSpeed ZeRO-3 (torchrun, 2 ranks) before and after shardwise's zero3 and
# fsdp on both GPUs, the anchor job per GPU (the harness checked on the CPU: vs_hf_trainer.py --smoke --gpus 2)
zero3hf() {
  timeout -k 10 580 python3 benchmarks/vs_hf_trainer.py --out "$OUT/zero3hf" --gpus 2 --steps 24 --warmup 8 \
    --variants hf-trainer-zero3,sw-zero3,sw-zero3-hfjson,sw-fsdp-all,hf-trainer-zero3
}
# twelfth session (one GPU): ZeRO-3 fetching whole blocks (deepspeed.fetch block, compiled blocks one graph) against
# DeepSpeed's per-submodule fetch, eager, fsdp, and the HF Trainer with the same DeepSpeed ZeRO-3 on one GPU
z3one() {
  timeout -k 10 575 python3 benchmarks/vs_hf_trainer.py --out "$OUT/z3one" --gpus 1 --steps 24 --warmup 8 \
    --variants hf-trainer-zero3,sw-zero3,sw-zero3-module,sw-fsdp-all,sw-zero3-eager,hf-trainer-zero3
}
# where zero3's step still goes (one process, the engine's path): block vs module fetch vs fsdp, profiled
z3prof() {
  timeout -k 10 290 python3 benchmarks/one_gpu_levers.py --variants zero3,zero3+module,fsdp --repeat 1 --steps 10 \
    --warmup 4 --profile zero3,fsdp --json "$OUT/z3prof.json"
}
# the planner's zero3 rows (issue16 list) under the new default: compiled rows first
z3acc() {
  timeout -k 10 280 python3 benchmarks/plan_accuracy.py --gpu --cases issue16 --pick 45,39,48,42,25,7,26,33 \
    --budget-s 220 --json "$OUT/z3acc.json"
}
# after memory_efficient_linear off under whole-block fetch (every block compiled) and the LoRA fix: the same again
z3two() {
  timeout -k 10 300 python3 benchmarks/vs_hf_trainer.py --out "$OUT/z3two" --gpus 1 --steps 24 --warmup 8 \
    --variants hf-trainer-zero3,sw-zero3,sw-fsdp-all,sw-zero3-eager,hf-trainer-zero3
}
z3prof2() {
  timeout -k 10 100 python3 benchmarks/one_gpu_levers.py --variants zero3 --repeat 1 --steps 10 --warmup 4 \
    --profile zero3 --json "$OUT/z3prof2.json"
}
z3acc2() {
  timeout -k 10 180 python3 benchmarks/plan_accuracy.py --gpu --cases issue16 --pick 45,48,33,39,42 --budget-s 130 \
    --json "$OUT/z3acc2.json"
}
# out of sample for the planner's whole-block ZeRO-3 terms: the eager and checkpointed rows, and the anchor's
z3acc3() {
  timeout -k 10 280 python3 benchmarks/plan_accuracy.py --gpu --cases issue16 --pick 25,7,26,8,34,16 --budget-s 200 \
    --json "$OUT/z3acc3.json"
  timeout -k 10 150 python3 benchmarks/plan_accuracy.py --gpu --pick 41,12 --budget-s 100 --json "$OUT/z3acc3b.json"
}
# after the review: eager blocks keep DeepSpeed's linear, the LoRA hook on the first block (eager LoRA and full rows)
z3eager() {
  timeout -k 5 150 python3 benchmarks/plan_accuracy.py --gpu --cases issue16 --pick 33,25 --budget-s 60 \
    --json "$OUT/z3eager.json"
}
# the CUDA tests with whole-block ZeRO-3 (zero3 compiled on tied embeddings, QLoRA, the defaults)
cudatests() { timeout -k 10 450 python3 -m pytest -n 0 -q -rs -p no:cacheprovider tests/gpu/test_cuda.py; }
# bytecode written and cached as on a user's machine (the device sets PYTHONDONTWRITEBYTECODE), filled by one import
# of this tree and of .whl/base_src first; then ttfs_h200.py: ttfs_ab PYCACHE TIMEOUT RUNS VARIANTS
ttfs_ab() {
  export PYTHONPYCACHEPREFIX=$1
  env -u PYTHONDONTWRITEBYTECODE python3 -c "import torch, transformers.trainer, torch._inductor.compile_fx, shardwise.train.loop"
  env -u PYTHONDONTWRITEBYTECODE PYTHONPATH="$PWD/.whl/base_src:/tmp/site" python3 -c "import shardwise.train.loop"
  env -u PYTHONDONTWRITEBYTECODE timeout -k 10 "$2" python3 benchmarks/ttfs_h200.py --out "$OUT" --steps 6 --runs "$3" \
    --shardwise "$4" --base-src .whl/base_src
}
# thirteenth session (issue 17.3): the launcher's model checks remembered across runs and DCP imported only when a
# checkpoint is read or written (39f2b09, b735191), against abbcc08's src/ (carried as .whl/base_src, made with
# `git archive abbcc08 src | tar -x -C .whl/base_src --strip-components=1`), with bytecode cached as on a user's
# machine: base single, single, the HF Trainer; round 0 fills the inductor, data and check caches
ttfs13() { ttfs_ab /tmp/pycache13 480 3 base-single,single; }
# fourteenth session: inductor imported on a thread from the start of the worker's setup (single) against
# SHARDWISE_IMPORT_AHEAD=0, beside the HF Trainer; then py-spy timelines of one warm run of each (all threads, idle
# included; and the GIL holder only)
ttfs14() {
  export PYTHONPYCACHEPREFIX=/tmp/pycache14
  env -u PYTHONDONTWRITEBYTECODE python3 -c "import torch, transformers.trainer, torch._inductor.compile_fx, shardwise.train.loop"
  env -u PYTHONDONTWRITEBYTECODE timeout -k 10 420 python3 benchmarks/ttfs_h200.py --out "$OUT" --steps 6 --runs 4 \
    --shardwise single-noahead,single
  python3 -m pip install -q --no-index --no-deps --target /tmp/spy .whl/opt/py_spy-*.whl
  local job="--model /tmp/ttfs-h200/anchor-1.1b --data /tmp/ttfs-h200/text-6.jsonl --strategy single --seq-len 2048
    --micro-batch-size 8 --max-steps 6 --log-every 1 --mixed-precision bf16 --overwrite --no-save-final --seed 0"
  for v in idle1 gil1 idle0; do
    env -u PYTHONDONTWRITEBYTECODE SHARDWISE_IMPORT_AHEAD="${v: -1}" timeout -k 5 120 /tmp/spy/bin/py-spy record \
      "--${v%?}" --threads --rate 200 -f speedscope -o "$OUT/spy-$v.json" -- \
      python3 -m shardwise train $job --output-dir "/tmp/ttfs-h200/spy-$v"
    python3 -c "import json, sys; print(json.dumps({'variant': sys.argv[1], **json.load(open(sys.argv[2]))}))" \
      "$v" "/tmp/ttfs-h200/spy-$v/summary.json" >> "$OUT/spy-summaries.jsonl"
  done
}
# fourteenth session: scikit-learn kept out of shardwise's processes (models/load.py lean_transformers) against the
# commit before it, single and ddp (one rank, early worker), beside the HF Trainer; what importing scikit-learn costs
ttfs14b() {
  export PYTHONPYCACHEPREFIX=/tmp/pycache14  # the importtime runs below as ttfs_ab's imports see it
  grep -n "sklearn" "$(python3 -c 'import transformers, os; print(os.path.dirname(transformers.__file__))')/generation/candidate_generator.py" | head -3
  for i in 1 2 3; do env -u PYTHONDONTWRITEBYTECODE python3 -X importtime -c "import torch, sklearn.metrics" 2>&1 \
    | grep -E "\| (sklearn|sklearn.metrics|scipy.stats|pandas)$"; done
  ttfs_ab /tmp/pycache14 540 4 base-single,single,base-ddp,ddp
}
ttfs14c() { ttfs_ab /tmp/pycache14 250 7 base-single,single; }  # more rounds (±2 s round to round there)
# the full-collection hold (phases.hold_full_gc, df1fdca) against 1912748 (lean imports, no hold), single and ddp
ttfs15() { ttfs_ab /tmp/pycache15 540 6 base-single,single,base-ddp,ddp; }
# fifteenth session: a repeat launch finds its tokenized data without loading the tokenizer (data/cache.py source_key,
# 11d5690) against b021912 (carried as .whl/base_src), single and ddp (one rank, early worker), beside the
# HF Trainer; the data cache is warm from round 0 on
ttfs16() { ttfs_ab /tmp/pycache16 480 5 base-single,single,base-ddp,ddp; }
# fifteenth session: what an early ddp worker imports before it waits for its job (about 9 s there, the critical path
# of a one-node launch since the launcher's prepare shrank), bytecode cached as on a user's machine: -X importtime of
# the worker's own sequence (worker.wait_for_job without the wait), twice, and CUDA's initialisation after it
wimports() {
  export PYTHONPYCACHEPREFIX=/tmp/pycache-wi
  local code="import time; t0 = time.time()
import shardwise.train.worker as w; w.set_up_process(); import shardwise.train.loop
t1 = time.time(); w.preload_model_classes('/tmp/wi-model'); t2 = time.time()
import torch._inductor.compile_fx; t3 = time.time(); import torch; torch.cuda.init(); torch.zeros(1, device='cuda')
t4 = time.time(); print(f'loop {t1 - t0:.2f} model classes {t2 - t1:.2f} inductor {t3 - t2:.2f} cuda {t4 - t3:.2f}')"
  mkdir -p /tmp/wi-model && echo '{"model_type": "llama"}' > /tmp/wi-model/config.json
  env -u PYTHONDONTWRITEBYTECODE python3 -c "$code"  # fills the bytecode cache
  for i in 1 2; do env -u PYTHONDONTWRITEBYTECODE python3 -X importtime -c "$code" 2> "$OUT/wimports$i.txt"; done
  python3 - "$OUT/wimports2.txt" <<'PY'
import sys
rows = []
for ln in open(sys.argv[1]):
    if ln.startswith("import time:") and "self" not in ln:
        p = ln.split("|")
        name = p[2].rstrip()
        rows.append((int(p[1]), int(p[0].split(":")[1]), (len(name) - len(name.lstrip())) // 2, name.strip()))
print("self total", sum(r[1] for r in rows) / 1e6)
for cum, _, depth, name in rows:
    if depth <= 2 and cum > 150000:
        print(f"{cum / 1e6:6.2f} {'  ' * depth}{name}")
PY
}
# sixteenth session: the offloaded optimizer step with torch's fused AdamW on the host instead of foreach. First the
# two kernels alone on the host (the anchor's 1.14B fp32 tensors, every core), then the offload presets on the anchor
# job with this tree (fused) and with 567f1bb's src/ (foreach; carried as .whl/base_src), as in the part `offload`
host16() { python3 benchmarks/host_adamw.py --json "$OUT/host_adamw.json"; }
offload16() {
  python3 benchmarks/strategies_gpu.py --strategies fsdp-offload,zero2-offload,zero3-offload --steps 6 --log-every 2 \
    --timeout 170 --tag offload16 --out "$OUT"
}
offload16base() {
  PYTHONPATH="$PWD/.whl/base_src:/tmp/site:$PWD" python3 benchmarks/strategies_gpu.py \
    --strategies fsdp-offload,zero2-offload --steps 6 --log-every 2 --timeout 170 --tag offload16-base --out "$OUT"
}
# sixteenth session: where fsdp-offload's step goes with the fused host AdamW (1.22 s, of which the kernel is ~0.3 s):
# a py-spy profile of the main thread, idle included (the model directory comes from strategies_gpu.py)
spy16() {
  python3 -m pip install -q --no-index --no-deps --target /tmp/spy .whl/opt/py_spy-*.whl
  [ -d /tmp/shardwise-bench-gpu/llama-16l ] || python3 benchmarks/strategies_gpu.py --strategies fsdp-offload --steps 2 \
    --log-every 1 --timeout 150 --tag spyprep --out /tmp/spyprep
  timeout -k 5 240 /tmp/spy/bin/py-spy record --subprocesses --idle --rate 100 -f raw -o "$OUT/spy-fsdp-offload.txt" -- \
    python3 -m shardwise train --model /tmp/shardwise-bench-gpu/llama-16l --data /tmp/shardwise-bench-gpu/data.jsonl \
    --data-format text --strategy fsdp-offload --nproc-per-node 1 --seq-len 2048 --micro-batch-size 8 --max-steps 12 \
    --log-every 2 --lr 1e-5 --warmup-steps 0 --mixed-precision bf16 --param-dtype fp32 --no-save-final \
    --output-dir /tmp/spy-fo --overwrite --force
  cp /tmp/spy-fo/metrics.jsonl "$OUT/spy-fo-metrics.jsonl"
}
# sixteenth session: the clip folded into the fused AdamW (its grad_scale) against clipping first (8d5afb2's src/,
# carried as .whl/base_src), fsdp-offload on the anchor, base first
fold16() {
  PYTHONPATH="$PWD/.whl/base_src:/tmp/site:$PWD" python3 benchmarks/strategies_gpu.py --strategies fsdp-offload \
    --steps 8 --log-every 2 --timeout 150 --tag fold16-base --out "$OUT"
  python3 benchmarks/strategies_gpu.py --strategies fsdp-offload --steps 8 --log-every 2 --timeout 150 --tag fold16 \
    --out "$OUT"
}
# seventeenth session: one profiled step of each offload preset on the anchor (--profile-steps writes the operator
# table and the Chrome trace to the run's profile/), after fold16 built the anchor model
prof17() {
  for s in ${PROF_STRATEGIES:-fsdp-offload zero2-offload}; do
    python3 -m shardwise train --model /tmp/shardwise-bench-gpu/llama-16l --data /tmp/shardwise-bench-gpu/data.jsonl \
      --data-format text --strategy $s --nproc-per-node 1 --seq-len 2048 --micro-batch-size 8 --max-steps 7 \
      --log-every 1 --lr 1e-5 --warmup-steps 0 --mixed-precision bf16 --param-dtype fp32 --no-save-final \
      --profile-steps 1 --profile-start 6 --output-dir /tmp/prof-$s --overwrite --force
    cp /tmp/prof-$s/profile/step-6-rank0.txt "$OUT/prof17-$s.txt"
    cp /tmp/prof-$s/profile/step-6-rank0.json.gz "$OUT/prof17-$s.json.gz"
    cp /tmp/prof-$s/metrics.jsonl "$OUT/prof17-$s-metrics.jsonl"
  done
}
# seventeenth session: the host gradient norm (strategies/gradnorm.py) against torch's (3d31060's src/, carried as
# .whl/base_src), fsdp-offload on the anchor, alternating, base first; then the GPU tests it touches
norm17() {
  python3 benchmarks/host_adamw.py --norm --rounds 5 --json "$OUT/host_norm_h200_2026-12-02.json"
  for i in 1 2; do
    PYTHONPATH="$PWD/.whl/base_src:/tmp/site:$PWD" python3 benchmarks/strategies_gpu.py --strategies fsdp-offload \
      --steps 10 --log-every 2 --timeout 150 --tag norm17-base$i --out "$OUT"
    python3 benchmarks/strategies_gpu.py --strategies fsdp-offload --steps 10 --log-every 2 --timeout 150 \
      --tag norm17-new$i --out "$OUT"
  done
}
gputests17() {
  python3 -m pytest -n 0 -q -rs -p no:cacheprovider tests/gpu/test_offload_clip.py tests/gpu/test_profile_cuda.py \
    tests/dist/test_gradnorm.py tests/unit/test_nonfinite_step.py tests/unit/test_profile.py
}
# seventeenth session: zero3-offload with DeepSpeed's own per-submodule fetch, with the fused host AdamW (the anchor
# test's lost figure)
z3mod17() {
  python3 benchmarks/strategies_gpu.py --strategies zero3-offload --steps 6 --log-every 2 --timeout 240 --tag z3mod17 \
    --out "$OUT" -- --deepspeed-fetch module
}
# eighteenth session: a hybrid model's compiled blocks on CUDA (new test), then the whole GPU suite on torch 2.11 (the
# seventeenth session's last host-norm threshold and test sizes never ran there)
gputests18() {
  timeout -k 10 280 python3 -m pytest -n 0 -v -rs -p no:cacheprovider tests/gpu/test_hybrid_compile.py
  timeout -k 10 290 python3 -m pytest -n 0 -v -rs -p no:cacheprovider tests/gpu/test_offload_clip.py \
    tests/gpu/test_profile_cuda.py tests/dist/test_gradnorm.py tests/gpu/test_cuda.py
}
# (first call: chat rows of many lengths made the hybrid test recompile past 250 s; test_cuda first ran out of time)
# nineteenth session (ran): workers forked from a preloaded server (train/zygote.py, opt-in) on CUDA: the GPU tests whose ranks run
# through the agent (tied-head ddp/fsdp/zero3, QLoRA ddp: the server must not leave CUDA unusable in its forks)
gputests19() {
  SHARDWISE_FORKSERVER=1 timeout -k 10 330 python3 -m pytest -n 0 -v -rs -p no:cacheprovider tests/gpu/test_cuda.py -k "tied or qlora"
}
# and ddp's time to first step (one rank, early worker) against aadd66e (carried as .whl/base_src), beside the Trainer
ttfs19() { SHARDWISE_FORKSERVER=1 ttfs_ab /tmp/pycache19 420 4 base-ddp,ddp; }
# twentieth session: the fork server is the default (its review defects fixed) and a step's rows are dealt by
# length. Every CUDA test through the default start (the ranks of ddp/fsdp/zero3/QLoRA forked from the server), and
# the compile cache the launcher picks must reach the forked workers (the server's inductor import no longer hides
# it): the cache folder is listed after the run
gputests20() {
  timeout -k 10 470 python3 -m pytest -n 0 -v -rs -p no:cacheprovider tests/gpu/test_cuda.py
  echo "compile cache:"; ls -la "${SHARDWISE_CACHE_DIR:-$HOME/.cache/shardwise}/compile/"*/ 2>&1 | head -8
}
# ddp's time to first step, forked by default, against 1d73dd3 (carried as .whl/base_src: each worker its own
# interpreter, the default there), beside the Trainer; single too (unchanged: it trains in the launcher)
ttfs20() { ttfs_ab /tmp/pycache20 560 4 base-ddp,ddp; }
# twenty-first session: `--deepspeed-config` now reads an HF / ms-swift file as the Trainer does ("auto" filled, the
# bucket sizes from the hidden size). The anchor job on one GPU: the HF Trainer with its ZeRO-3 JSON, shardwise's zero3
# (generated config: DeepSpeed's default bucket sizes) and shardwise's zero3 fed the Trainer's very JSON
# (sw-zero3-hfjson), Trainer first and last; then every CUDA test on this tree
z3hf21() {
  timeout -k 10 480 python3 benchmarks/vs_hf_trainer.py --out "$OUT/z3hf21" --gpus 1 --steps 24 --warmup 8 \
    --variants hf-trainer-zero3,sw-zero3,sw-zero3-hfjson,hf-trainer-zero3
}
gputests21() { timeout -k 10 500 python3 -m pytest -n 0 -v -rs -p no:cacheprovider tests/gpu/test_cuda.py; }
# twenty-second session (issue 17 item 4, no regression): the anchor job on one GPU on this tree, the HF Trainer
# first and last, shardwise single and fsdp between; then every CUDA test on this tree
vshf22() {
  timeout -k 10 450 python3 benchmarks/vs_hf_trainer.py --out "$OUT/vshf22" --steps 24 --warmup 8 \
    --variants hf-trainer,sw-single,sw-fsdp,hf-trainer
}
gputests22() { timeout -k 10 480 python3 -m pytest -n 0 -v -rs -p no:cacheprovider tests/gpu/test_cuda.py; }
# time to first step on this tree (single, ddp) beside the Trainer, bytecode cached as on a user's machine (no A/B)
ttfs22() {
  export PYTHONPYCACHEPREFIX=/tmp/pycache22
  env -u PYTHONDONTWRITEBYTECODE python3 -c "import torch, transformers.trainer, torch._inductor.compile_fx, shardwise.train.loop"
  env -u PYTHONDONTWRITEBYTECODE timeout -k 10 400 python3 benchmarks/ttfs_h200.py --out "$OUT" --steps 6 --runs 3 \
    --shardwise single,ddp
}
# issue 20: the Llama-3.1-8B shape, TP 2 against fsdp on 2 GPUs, same global batch (TP 2 is one replica: grad-accum 2)
tp2() {
  python3 benchmarks/long_context.py --lengths 8192 --sp 1 --steps 4 --timeout 260 --tag tp2 --out "$OUT" -- \
    --tensor-parallel 2 --grad-accum 2
  python3 benchmarks/long_context.py --lengths 8192 --sp 1 --steps 4 --timeout 260 --tag fsdp --out "$OUT"
}
# issue 16 item 2 (and its two-GPU accuracy rows: every fitting preset measured beside its prediction)
autosweep() { timeout -k 10 590 python3 benchmarks/auto_sweep.py --quick --out "$OUT"; }
for part in "$@"; do
  [ "$part" = setup ] && continue
  echo "=== $part $(date +%T)"
  mkdir -p /tmp/logs
  "$part" > "/tmp/logs/$part.log" 2>&1
  echo "=== $part exit $? $(date +%T)"
  grep -v "Writing model shards" "/tmp/logs/$part.log" | tail -25
  { echo "=== $part"; grep -v "Writing model shards" "/tmp/logs/$part.log" | tail -150; } >> "$LOGF"
  [ -n "${KEEP_LOGS:-}" ] && tail -c 4000000 "/tmp/logs/$part.log" > "$OUT/$part.log"  # whole logs back (8 files at most)
done
echo "=== done $(date +%T)"
