#!/bin/bash
# A slime-style GRPO run of a dense 4B model (Qwen3-4B shape) on math prompts, with eval and W&B.
# Written for Slipstream's compatibility tests: every group of slime's flags appears once, in slime's spelling.
MODEL=/models/Qwen3-4B
NUM_GPUS=8

MODEL_ARGS=(
   --swiglu
   --num-layers 36
   --hidden-size 2560
   --ffn-hidden-size 9728
   --num-attention-heads 32
   --group-query-attention
   --num-query-groups 8
   --kv-channels 128
   --use-rotary-position-embeddings
   --disable-bias-linear
   --normalization "RMSNorm"
   --norm-epsilon 1e-6
   --rotary-base 1000000
   --vocab-size 151936
   --qk-layernorm
   --untie-embeddings-and-output-weights
)

CKPT_ARGS=(
   --hf-checkpoint ${MODEL}
   --ref-load ${MODEL}
   --load /ckpt/qwen3-4b-grpo/
   --save /ckpt/qwen3-4b-grpo/
   --save-interval 20
)

ROLLOUT_ARGS=(
   --prompt-data /data/math/train.jsonl
   --input-key prompt
   --label-key label
   --apply-chat-template
   --apply-chat-template-kwargs '{}'
   --rollout-shuffle
   --rollout-seed 7
   --rm-type deepscaler
   --num-rollout 100
   --rollout-batch-size 16
   --n-samples-per-prompt 8
   --rollout-max-response-len 4096
   --rollout-temperature 1.0
   --rollout-top-p 1.0
   --rollout-top-k -1
   --over-sampling-batch-size 24
   --partial-rollout
   --global-batch-size 128
   --balance-data
)

EVAL_ARGS=(
   --eval-interval 10
   --eval-prompt-data aime /data/math/aime.jsonl
   --n-samples-per-eval-prompt 4
   --eval-max-response-len 4096
   --eval-top-p 1.0
   --eval-temperature 0.6
   --skip-eval-before-train
)

PERF_ARGS=(
   --tensor-model-parallel-size 2
   --sequence-parallel
   --pipeline-model-parallel-size 1
   --context-parallel-size 1
   --expert-model-parallel-size 1
   --expert-tensor-parallel-size 1
   --recompute-granularity full
   --recompute-method uniform
   --recompute-num-layers 1
   --use-dynamic-batch-size
   --max-tokens-per-gpu 8192
   --log-probs-chunk-size 1024
)

GRPO_ARGS=(
   --advantage-estimator grpo
   --use-kl-loss
   --kl-loss-coef 0.001
   --kl-loss-type low_var_kl
   --entropy-coef 0.00
   --eps-clip 0.2
   --eps-clip-high 0.28
   --use-tis
   --tis-clip 2.0
   --calculate-per-token-loss
)

OPTIMIZER_ARGS=(
   --optimizer adam
   --lr 1e-6
   --lr-decay-style constant
   --weight-decay 0.1
   --adam-beta1 0.9
   --adam-beta2 0.98
   --clip-grad 1.0
)

WANDB_ARGS=(
   --use-wandb
   --wandb-project slime-compat
   --wandb-group qwen3-4b-grpo
   --wandb-mode offline
   --disable-wandb-random-suffix
   --use-tensorboard
   --tb-project-name slime-compat
)

SGLANG_ARGS=(
   --rollout-num-gpus-per-engine 2
   --sglang-mem-fraction-static 0.7
   --sglang-server-concurrency 256
)

MISC_ARGS=(
   --attention-dropout 0.0
   --hidden-dropout 0.0
   --accumulate-allreduce-grads-in-fp32
   --attention-softmax-in-fp32
   --attention-backend flash
   --update-weights-interval 1
   --update-weight-buffer-size 536870912
   --use-fault-tolerance
   --train-env-vars '{"NCCL_DEBUG":"WARN"}'
)

python3 train.py \
   --actor-num-nodes 1 \
   --actor-num-gpus-per-node 4 \
   --rollout-num-gpus 4 \
   ${MODEL_ARGS[@]} \
   ${CKPT_ARGS[@]} \
   ${ROLLOUT_ARGS[@]} \
   ${OPTIMIZER_ARGS[@]} \
   ${GRPO_ARGS[@]} \
   ${WANDB_ARGS[@]} \
   ${PERF_ARGS[@]} \
   ${EVAL_ARGS[@]} \
   ${SGLANG_ARGS[@]} \
   ${MISC_ARGS[@]}
