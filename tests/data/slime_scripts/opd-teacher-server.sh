#!/bin/bash
# On-policy distillation with slime's flags, the teacher an SGLang server of its own (slime's --opd-type sglang):
# slime's OPD reward function asks the server at --rm-url for the teacher's log-probs of the student's tokens and
# its post-process gives every sample reward 0, so the teacher is the only signal. Written for Slipstream's
# compatibility tests.
MODEL_DIR=/models/Qwen3-8B-Base
DATA_PATH=/data/openthoughts/train.jsonl
TEACHER_IP=127.0.0.1
TEACHER_PORT=13141

CKPT_ARGS=(
   --hf-checkpoint ${MODEL_DIR}
   --ref-load ${MODEL_DIR}
   --save /tmp/slime_opd_sglang/
   --save-interval 9999
)

ROLLOUT_ARGS=(
   --prompt-data ${DATA_PATH}
   --input-key prompt
   --rollout-shuffle
   --num-rollout 3
   --rollout-batch-size 2
   --n-samples-per-prompt 2
   --rollout-max-response-len 8
   --rollout-temperature 1
   --global-batch-size 4
)

RM_ARGS=(
   --custom-rm-path slime.rollout.on_policy_distillation.reward_func
   --custom-reward-post-process-path slime.rollout.on_policy_distillation.post_process_rewards
   --rm-url http://${TEACHER_IP}:${TEACHER_PORT}/generate
)

GRPO_ARGS=(
   --advantage-estimator grpo
   --use-opd
   --opd-type sglang
   --opd-kl-coef 1.0
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
)

python3 train.py \
   --actor-num-nodes 1 \
   --actor-num-gpus-per-node 1 \
   --rollout-num-gpus 1 \
   ${CKPT_ARGS[@]} \
   ${ROLLOUT_ARGS[@]} \
   ${OPTIMIZER_ARGS[@]} \
   ${GRPO_ARGS[@]} \
   ${RM_ARGS[@]}
