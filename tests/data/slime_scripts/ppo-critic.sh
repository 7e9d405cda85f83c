#!/bin/bash
# PPO with a critic in slime's flags: --advantage-estimator ppo trains a value model initialised from the actor's
# checkpoint, with a critic-only warm-up and the critic's learning rate from the role overrides of
# --megatron-config-path. Written for Slipstream's compatibility tests.
MODEL_DIR=/models/Qwen3-4B
DATA_PATH=/data/gsm8k/train.jsonl
MEGATRON_CONFIG=/configs/megatron_ppo.yaml

CKPT_ARGS=(
   --hf-checkpoint ${MODEL_DIR}
   --ref-load ${MODEL_DIR}
   --save /tmp/slime_ppo/
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

PPO_ARGS=(
   --advantage-estimator ppo
   --megatron-config-path ${MEGATRON_CONFIG}
   --num-critic-only-steps 1
   --value-clip 0.2
   --gamma 1.0
   --lambd 0.95
   --normalize-advantages
   --kl-coef 0.01
   --kl-loss-type k1
   --eps-clip 0.2
   --eps-clip-high 0.28
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
   ${PPO_ARGS[@]}
