#!/bin/bash
# slime's vision-language GRPO run (scripts/run-qwen3-vl-8B-fsdp.sh at slime 16b83e1, 2025-11-28): Qwen3-VL-8B on
# geo3k (geometry problems with a figure each) on slime's FSDP backend, colocated on one node of 8 GPUs. Its flags
# as slime's script passes them, Ray start-up and the NVLink probe left out; written for Slipstream's tests.
MODEL=/root/Qwen3-VL-8B-Instruct
DATA=/root/geo3k
NUM_GPUS=8

CKPT_ARGS=(
   --hf-checkpoint ${MODEL}
)

ROLLOUT_ARGS=(
   --prompt-data ${DATA}/train.parquet
   --input-key prompt
   --label-key label
   --multimodal-keys '{"image":"images"}'
   --apply-chat-template
   --rollout-shuffle
   --rm-type geo3k
   --num-rollout 3000
   --rollout-batch-size 32
   --n-samples-per-prompt 8
   --rollout-max-response-len 8192
   --rollout-temperature 0.8
   --global-batch-size 128
)

EVAL_ARGS=(
   --eval-interval 20
   --eval-prompt-data geo3k-test ${DATA}/test.parquet
   --n-samples-per-eval-prompt 1
   --eval-max-response-len 16384
   --eval-top-p 0.7
)

GRPO_ARGS=(
   --advantage-estimator grpo
   # --use-kl-loss
   --kl-loss-coef 0.00
   --kl-loss-type low_var_kl
   --entropy-coef 0.00
   --eps-clip 0.2
   --eps-clip-high 0.28
)

OPTIMIZER_ARGS=(
   --optimizer adam
   --lr 1e-6
   --lr-decay-style constant
   --weight-decay 0.1
   --adam-beta1 0.9
   --adam-beta2 0.98
)

SGLANG_ARGS=(
   --rollout-num-gpus-per-engine 1
   --sglang-mem-fraction-static 0.6
   --sglang-cuda-graph-bs 1 2 4 8 $(seq 16 8 256)
)

FSDP_ARGS=(
   # --fsdp-full-params (FULL_STATE_DICT weight updates; off: SHARDED_STATE_DICT)
   --train-backend fsdp
   --update-weight-buffer-size $((512 * 1024 * 1024))
   # --attn-implementation flash_attention_2
   --gradient-checkpointing
   --sglang-attention-backend fa3
   --attn-implementation flash_attention_3
)

MISC_ARGS=(
   --actor-num-nodes 1
   --actor-num-gpus-per-node ${NUM_GPUS}
   --colocate
)

python3 train.py \
   ${CKPT_ARGS[@]} \
   ${ROLLOUT_ARGS[@]} \
   ${OPTIMIZER_ARGS[@]} \
   ${GRPO_ARGS[@]} \
   ${EVAL_ARGS[@]} \
   ${SGLANG_ARGS[@]} \
   ${FSDP_ARGS[@]} \
   ${MISC_ARGS[@]}
