#!/bin/bash
# A slime-style fully asynchronous run of a 0.5B model: generation never waits for training (train_async.py),
# one learner GPU and one engine GPU. Written for Slipstream's compatibility tests.
MODEL_DIR=/models/Qwen2.5-0.5B-Instruct
DATA_PATH=/data/gsm8k/train.jsonl

CKPT_ARGS=(
   --hf-checkpoint ${MODEL_DIR}
   --ref-load ${MODEL_DIR}
   --save /tmp/slime_fully_async/
   --save-interval 9999
)

ROLLOUT_ARGS=(
   --prompt-data ${DATA_PATH}
   --input-key prompt
   --label-key label
   --rollout-shuffle
   --rm-type math
   --num-rollout 3
   --rollout-batch-size 2
   --n-samples-per-prompt 2
   --rollout-max-response-len 8
   --rollout-temperature 1
   --global-batch-size 4
   --balance-data
)

PERF_ARGS=(
   --use-dynamic-batch-size
   --max-tokens-per-gpu 4096
)

GRPO_ARGS=(
   --advantage-estimator grpo
   --kl-loss-type low_var_kl
   --entropy-coef 0.00
   --eps-clip 0.2
   --eps-clip-high 0.28
   --use-tis
)

OPTIMIZER_ARGS=(
   --lr 1e-6
   --lr-decay-style constant
   --weight-decay 0.1
   --adam-beta1 0.9
   --adam-beta2 0.98
)

MISC_ARGS=(
   --rollout-num-gpus-per-engine 1
   --update-weights-interval 1
   --rollout-health-check-interval 30
   --distributed-timeout-minutes 30
   --save-debug-rollout-data /tmp/slime_fully_async/debug/{rollout_id}.pt
)

python3 train_async.py \
   --actor-num-nodes 1 \
   --actor-num-gpus-per-node 1 \
   --rollout-num-gpus 1 \
   ${CKPT_ARGS[@]} \
   ${ROLLOUT_ARGS[@]} \
   ${OPTIMIZER_ARGS[@]} \
   ${GRPO_ARGS[@]} \
   ${PERF_ARGS[@]} \
   ${MISC_ARGS[@]}
