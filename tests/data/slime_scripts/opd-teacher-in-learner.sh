#!/bin/bash
# On-policy distillation with slime's flags, the teacher held by the trainer (slime's --opd-type megatron):
# GRPO on a math reward plus the teacher's per-token reverse KL in the advantages. Written for Slipstream's
# compatibility tests.
MODEL_DIR=/models/Qwen3-1.7B
TEACHER_DIR=/models/Qwen3-8B
DATA_PATH=/data/dapo-math-17k/train.jsonl

CKPT_ARGS=(
   --hf-checkpoint ${MODEL_DIR}
   --ref-load ${MODEL_DIR}
   --save /tmp/slime_opd/
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
)

GRPO_ARGS=(
   --advantage-estimator grpo
   --use-opd
   --opd-type megatron
   --opd-kl-coef 1.0
   --opd-teacher-load ${TEACHER_DIR}
   --use-kl-loss
   --kl-loss-coef 0.00
   --kl-loss-type low_var_kl
   --entropy-coef 0.00
)

OPTIMIZER_ARGS=(
   --optimizer adam
   --lr 1e-6
   --lr-decay-style constant
   --weight-decay 0.1
   --adam-beta1 0.9
   --adam-beta2 0.98
)

python3 train.py \
   --actor-num-nodes 1 \
   --actor-num-gpus-per-node 1 \
   --rollout-num-gpus 1 \
   ${CKPT_ARGS[@]} \
   ${ROLLOUT_ARGS[@]} \
   ${OPTIMIZER_ARGS[@]} \
   ${GRPO_ARGS[@]}
