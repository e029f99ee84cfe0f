#!/usr/bin/env bash
# ms-swift yardstick for shardwise's "tiny CPU job" (issue #17): the same job as
#   python -m shardwise train --model /tmp/shardwise-ttfs/qwen2-3.9m \
#     --data /tmp/shardwise-ttfs/chat-2000.jsonl --strategy ddp --nproc-per-node 2 \
#     --micro-batch-size 4 --seq-len 256 --max-steps 50 --mixed-precision no ...
# run with ms-swift's `swift sft`, so both can be timed end to end on this 2-core CPU box.
#
# Usage: benchmarks/swift_tiny_job.sh OUTPUT_DIR
#   Build the model and data first (they live under /tmp/shardwise-ttfs):
#   python benchmarks/time_to_first_step.py --setup-only
#
# Versions this was made to work with (venv /work/swiftvenv, kept apart from the project venv):
#   ms-swift 4.6.0, torch 2.13.0+cpu, transformers 5.19.0 (what ms-swift 4.6.0 pulled in),
#   accelerate 1.15.0, trl 0.29.1, peft 0.20.0, modelscope 1.40.2, datasets 4.8.4, Python 3.11.7.
#   Install: python3 -m venv /work/swiftvenv && /work/swiftvenv/bin/pip install torch==2.13.0 \
#            && /work/swiftvenv/bin/pip install ms-swift==4.6.0
#
# Workarounds (each one needed for the job to be the same job, not a speed trick):
#   --use_cpu true     without it transformers' TrainingArguments sees no accelerator and sets
#                      parallel_mode NOT_PARALLEL: the model is NOT wrapped in DDP (gradients
#                      never all-reduced) and the logged loss is doubled (12.67 instead of 6.30).
#   --check_model false ms-swift otherwise asks the ModelScope hub whether the local model is the
#                      latest, and with no network spends ~7 s in retries (1+2+4 s) before step 1.
#   --gradient_checkpointing false  ms-swift defaults it to true; shardwise's job has it off.
#   --ddp_find_unused_parameters false  ms-swift/HF otherwise pass find_unused_parameters=True
#                      (DDP warns it found none); shardwise's DDP has no such extra graph walk.
set -euo pipefail

if [[ $# -ne 1 ]]; then
    echo "usage: $0 OUTPUT_DIR  (where ms-swift writes its run; must not exist yet)" >&2
    exit 2
fi
OUT_DIR=$1
MODEL=/tmp/shardwise-ttfs/qwen2-3.9m
DATA=/tmp/shardwise-ttfs/chat-2000.jsonl
SWIFT=/work/swiftvenv/bin/swift

for p in "$MODEL" "$DATA" "$SWIFT"; do
    if [[ ! -e $p ]]; then
        echo "swift_tiny_job.sh: $p is missing; build the job with" \
            "'python benchmarks/time_to_first_step.py --setup-only' and the venv as in this file's header" >&2
        exit 2
    fi
done
if [[ -e $OUT_DIR ]]; then
    echo "swift_tiny_job.sh: $OUT_DIR already exists; pass a new output dir (nothing was deleted)" >&2
    exit 2
fi

# Offline: the model and data are local dirs/files; nothing may be fetched from a hub.
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 MODELSCOPE_OFFLINE=1
# USE_HF=1: resolve names the Hugging Face way (a local dir stays a local dir).
export USE_HF=1
# shardwise: --nproc-per-node 2 (one node). ms-swift launches torchrun itself when this is set.
export NPROC_PER_NODE=2
# CPU only: no CUDA device is visible.
export CUDA_VISIBLE_DEVICES=
# shardwise sets OMP_NUM_THREADS = cpu_count // nproc = 1 on this 2-core box; torchrun's default is 1 too.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

args=(
    # model: the local Qwen2 dir (3.9M params), fp32 weights; shardwise: --model ..., param_dtype fp32
    --model "$MODEL"
    --model_type qwen2
    --torch_dtype float32
    # chat template: ms-swift's `qwen` template renders <|im_start|>ROLE\nTEXT<|im_end|>\n, the same
    # text as the model's own chat_template.jinja; --system '' drops the template's default system
    # turn ("You are a helpful assistant."), which shardwise's records don't have (system: '').
    # Labels: only the assistant turn (+ <|im_end|>\n), as shardwise's train_on_prompt: false.
    --template qwen
    --system ''
    # full fine-tune; shardwise: tuner: full
    --tuner_type full
    # data: the local jsonl of {"messages": [user, assistant]} (ms-swift's native format)
    --dataset "$DATA"
    # no eval split / no eval; shardwise: val_split 0, eval_every 0
    --split_dataset_ratio 0
    --eval_strategy no
    # shardwise: --seq-len 256, packing: false
    --max_length 256
    --packing false
    # tokenize the whole dataset up front (ms-swift's default for text models), as shardwise does
    --lazy_tokenize false
    # shardwise: --micro-batch-size 4 per rank, grad_accum 1, --max-steps 50
    --per_device_train_batch_size 4
    --gradient_accumulation_steps 1
    --max_steps 50
    # optimizer/schedule as shardwise's resolved config: lr 2e-5, warmup 0, cosine to 0.1*lr,
    # weight_decay 0, max_grad_norm 1.0, seed 42 (AdamW in both)
    --learning_rate 2e-5
    --warmup_ratio 0
    --lr_scheduler_type cosine_with_min_lr
    --lr_scheduler_kwargs '{"min_lr_rate": 0.1}'
    --weight_decay 0
    --max_grad_norm 1.0
    --seed 42
    # shardwise: --strategy ddp on CPU (gloo); see the header for why --use_cpu true is needed
    --use_cpu true
    --ddp_backend gloo
    --ddp_find_unused_parameters false
    # shardwise: gradient_checkpointing false (ms-swift's default is true)
    --gradient_checkpointing false
    # shardwise: save_every 0, save_final true -> exactly one save, of the model only, after step 50
    --save_strategy steps
    --save_steps 50
    --save_only_model true
    # shardwise: log_every 10
    --logging_steps 10
    # shardwise loads batches in the training process
    --dataloader_num_workers 0
    # no trackers (shardwise writes tensorboard; ms-swift writes its logging.jsonl regardless)
    --report_to none
    # no hub round trip to check the local model is "latest" (see header)
    --check_model false
    --output_dir "$OUT_DIR"
    --add_version false
)

exec "$SWIFT" sft "${args[@]}"
