"""Every flag slime declares (`slime/utils/arguments.py` and slime's own SGLang router/engine flags), and what
Slipstream does with it.

One row per flag: how argparse must read it (so a flag that takes a value consumes it, as slime declares it), and
its fate here:

- `same`: one of our own settings by the same name and meaning; nothing to do.
- `alias`: accepted and translated into our settings (`actors/config/slime_flags.py` holds the translations).
- `explained`: accepted; it has no effect here, and the start-up note says why (Ray-only, or what we do instead).
- `refused`: an error that names the flag and the missing feature or hardware.
- `owned`: another section's setting (plugin paths, Megatron's own flags, batching); while that section lacks
  it the flag is refused with "not available yet", never dropped.

A conditional row (`when`) is accepted only for the values that mean what Slipstream does anyway (an off switch,
slime's default); any other value is refused with the row's reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Fate = Literal["same", "alias", "explained", "refused", "owned"]
Shape = Literal["switch", "value", "list", "list0", "optional_bool", "append"]


@dataclass(frozen=True)
class SlimeFlag:
    """One slime flag: how it is read (`shape`, `type`) and what happens to it (`fate`, `why`)."""

    fate: Fate
    shape: Shape = "value"
    why: str = ""
    type: type = str


def _same(shape: Shape = "value", why: str = "") -> SlimeFlag:
    return SlimeFlag("same", shape, why)


def _alias(why: str, shape: Shape = "value", kind: type = str) -> SlimeFlag:
    return SlimeFlag("alias", shape, why, kind)


def _explained(why: str, shape: Shape = "switch", kind: type = str) -> SlimeFlag:
    return SlimeFlag("explained", shape, why, kind)


def _refused(why: str, shape: Shape = "switch", kind: type = str) -> SlimeFlag:
    return SlimeFlag("refused", shape, why, kind)


def _owned(owner: str, shape: Shape = "value") -> SlimeFlag:
    return SlimeFlag("owned", shape, owner)


ROUTER_BEHIND = ("with --sglang-router-port: -> --rollout-engine sglang --sglang-router-url http://IP:PORT: the "
                 "servers registered with that sglang-router become the run's SGLang servers, asked for once at "
                 "start-up (GET /workers), one rollout worker attached to each as with --sglang-url, so weight pushes "
                 "and version tags stay per server; the calls are routed by --router-policy (affinity is slime's "
                 "consistent_hashing with a load bound), not through the router (docs/router.md)")
RAY = "Ray-only: there is no Ray here (launcher.py starts the actors; samples travel over the bus)"
OFFLOADS_WITH_COLOCATE = ("--colocate moves the learner's optimizer state off the GPU while the engines generate and "
                          "frees the engines' memory while the learner trains (an SGLang server releases its KV "
                          "cache); without it each owns its devices and nothing needs moving between phases")
DISK_SYNC = ("(--weight-transport disk: each push written into a folder the learner and every engine see, "
             "safetensors under the pushed names; torch engines load them, deltas included, SGLang servers reload "
             "each push with /update_weights_from_disk, a delta once written into each host's local checkpoint "
             "(--weight-disk-local-dir); docs/reliability.md)")
ROLLOUT_BUFFER = ("the rollout worker is slime's rollout-buffer client (actors/slime_compat/rollout_buffer.py, "
                  "docs/agents.md)")
DEEPGEMM = ("DeepGEMM's FP8 GEMMs need an NVIDIA Hopper or Blackwell GPU and the deep_gemm package, and FP8 "
            "training is not implemented here (the trainers train in bf16)")
CI = "slime's own CI assertions; Slipstream's checks live in its test suite"

SLIME_FLAGS: dict[str, SlimeFlag] = {
    # --- cluster / placement ---
    "--actor-num-nodes": _same(),
    "--actor-num-gpus-per-node": _same(),
    "--rollout-num-gpus": _same(),
    "--rollout-num-gpus-per-engine": _same(),
    "--num-gpus-per-node": _same(),
    "--colocate": _same("switch", "on-policy, the engines (torch, or SGLang servers) on the learner's device "
                                  "(docs/colocate.md)"),
    "--offload": _explained(OFFLOADS_WITH_COLOCATE),
    "--offload-train": _explained(OFFLOADS_WITH_COLOCATE, "optional_bool"),
    "--offload-rollout": _explained(OFFLOADS_WITH_COLOCATE, "optional_bool"),
    "--distributed-backend": _explained("the learner picks its torch.distributed backend: NCCL on GPUs, gloo on "
                                        "CPUs", "value"),
    "--distributed-timeout-minutes": _explained("every cross-actor wait has its own deadline (e.g. "
                                                "--weight-transfer-timeout, --lease-timeout)", "value", int),
    "--train-env-vars": _alias("JSON object of environment variables, set for every actor this launcher starts "
                               "(slime: the training actors)"),
    # --- training engine ---
    "--train-backend": _same("value", "fsdp (slime's FSDP backend, which trains the HF model with data "
                             "parallelism) runs on our torch backend, which does the same with DDP: every learner "
                             "rank holds the whole model and optimizer state, where FSDP shards them over the ranks"),
    "--qwen-gdn-backend": _refused("Gated DeltaNet (Qwen3-Next) layers are not built by either trainer: the Megatron "
                                   "bridge builds dense llama, qwen2 and qwen3, and the GDN kernels (flash-linear-"
                                   "attention, on Triton) need a GPU", "value"),
    "--custom-model-provider-path": _owned("megatron"),
    "--recompute-loss-function": _explained("a Megatron memory saving with identical results; our trainers bound "
                                            "memory with --micro-batch-tokens"),
    "--log-probs-chunk-size": _explained("a memory saving with identical results; log-prob passes are bounded by "
                                         "--micro-batch-tokens", "value", int),
    "--log-probs-max-tokens-per-gpu": _explained("log-prob passes use the training token budget "
                                                 "(--micro-batch-tokens)", "value", int),
    "--only-train-params-name-list": _same("list0", "regular expressions searched in the backend's parameter "
                                           "names, as slime does; one that matches nothing is an error"),
    "--freeze-params-name-list": _same("list0", "as --only-train-params-name-list"),
    "--freeze-indexer": _refused("DSA indexer models (DeepSeek-V3.2, GLM-5) are not built by either trainer; their "
                                 "sparse-attention kernels (DeepGEMM, FlashMLA) need Hopper GPUs"),
    "--allgather-cp": _explained("context parallelism (--context-parallel-size, torch backend) always gathers each "
                                 "layer's keys and values across the group: the all-gather layout"),
    "--micro-batch-size": _owned("megatron"),
    "--padded-vocab-size": _owned("megatron"),
    "--mtp-num-layers": _owned("megatron"),
    "--mtp-loss-scaling-factor": _owned("megatron"),
    "--enable-mtp-training": _owned("megatron", "switch"),
    "--megatron-config-path": _alias("slime's actor/critic role overrides: the critic's lr -> --critic-lr and "
                                      "load -> --critic-load, the actor's lr -> --lr; other keys are refused by "
                                      "name"),
    "--megatron-deepgemm-forward-layers": _refused(DEEPGEMM, "list"),
    "--megatron-deepgemm-forward-modules": _refused(DEEPGEMM, "list"),
    "--megatron-deepgemm-moe-forward-layers": _refused(DEEPGEMM, "list"),
    "--megatron-deepgemm-moe-forward-modules": _refused(DEEPGEMM, "list"),
    "--custom-megatron-init-path": _owned("megatron"),
    "--custom-megatron-before-log-prob-hook-path": _owned("megatron"),
    "--custom-megatron-before-train-step-hook-path": _owned("megatron"),
    # --- weight sync ---
    "--update-weights-interval": _same(),
    "--update-weight-mode": _alias("full: every push whole (the default); delta -> --weight-delta-sync (deltas over "
                                   "the run's transport, the shared folder too; to SGLang servers through the folder "
                                   "only, written into each host's --update-weight-local-checkpoint-dir copy, which "
                                   "the server reloads, as slime does: SGLang has no delta endpoint)"),
    "--update-weight-transport": _alias("nccl -> --weight-transport nccl; disk -> --weight-transport disk "
                                        + DISK_SYNC),
    "--update-weight-buffer-size": _alias("-> --weight-bucket-bytes: the most bytes one transfer of a push "
                                          "coalesces (as slime's buckets; over torch.distributed a tensor of 1 MiB "
                                          "or more travels alone)", "value", int),
    "--release-train": _explained(OFFLOADS_WITH_COLOCATE),
    "--update-weight-disk-dir": _alias("-> --weight-disk-dir: the folder of the disk transport, the same path on the "
                                       "learner and every engine " + DISK_SYNC),
    "--update-weight-disk-keep-files": _alias("-> --weight-disk-keep-files: each version's folder stays after its "
                                              "push (removed once the push is over otherwise, as slime does)",
                                              "switch"),
    "--update-weight-delta-encoding": _alias(
        "xor and overwrite are both served by --weight-delta-sync's own encoding: each tensor's changed elements as "
        "new values (indices, a bitmap, or the tensor whole, whichever is smallest), applied bit for bit, and the "
        "end state certified by the weight check; the bytes on the wire are ours either way, and unlike xor a "
        "delta applied twice changes nothing. With SGLang servers and disk transport: written into each host's "
        "local checkpoint, which is checked against the learner's prints before the server reloads it"),
    "--update-weight-delta-checksum": _alias("-> --weight-check-stride 1: the weight check fingerprints every byte "
                                             "each engine serves after every push, as slime checksums each tensor "
                                             "(xxh3-64 on CPUs, a weighted word sum on GPUs; the algorithm is not "
                                             "chosen by name)"),
    "--update-weight-local-checkpoint-dir": _alias("-> --weight-disk-local-dir: each engine copies a push into "
                                                   "DIR/<engine> on its own disk and loads it from there; SGLang "
                                                   "deltas are written into that copy by the rollout worker (slime: "
                                                   "each host, via its patched SGLang's /pull_weights)"),
    "--custom-update-weight-post-write-path": _alias("-> --weight-disk-post-write-path: fn(args, version_dir, "
                                                     "engines), slime's signature, called on the learner once a "
                                                     "push's files are written and before any engine reads them "
                                                     "(engines: the rollout workers' names)"),
    "--keep-old-actor": _alias("-> --use-decoupled-ppo on-policy (--max-staleness 0, slime's train.py): slime's "
                               "old actor is the weights that generated the batch, which are then the learner's "
                               "before the update, so pi_old recomputed by the learner has the same numbers "
                               "without a second copy; refused off-policy, where it would be an older version's "
                               "copy, not kept here", "switch"),
    "--check-weight-update-equal": _alias("-> --weight-check strict --weight-check-stride 1: every byte of every "
                                          "push is fingerprinted on both ends, a mismatch stops the run", "switch"),
    # --- rollout ---
    "--hf-checkpoint": _same(),
    "--model-name": _explained("the architecture and weight names are read from the HF checkpoint's config",
                               "value"),
    "--rollout-function-path": _same(),
    "--custom-generate-function-path": _same(),
    "--rollout-sample-hook-path": _owned("plugins (slime rollout sample hooks)", "append"),
    "--custom-rollout-log-function-path": _same("value", "called by the learner on each batch, with the batch's "
                                                "samples as slime's; True leaves out the default rollout metrics"),
    "--custom-eval-rollout-log-function-path": _same("value", "called by the evaluator on each eval round (one "
                                                     "dataset); True leaves out the round's default metrics"),
    "--buffer-filter-path": _same(),
    "--dynamic-sampling-filter-path": _same(),
    "--rollout-data-postprocess-path": _same("value", "fn(args, rollout_id, rollout_data) on each learner rank's "
                                                      "samples after the advantages; the loss masks and advantages "
                                                      "it leaves are trained"),
    "--rollout-temperature": _same(),
    "--rollout-top-p": _same(),
    "--rollout-top-k": _same("value", "-1 (slime's off) is read as 0 (off)"),
    "--rollout-max-context-len": _same(),
    "--rollout-max-prompt-len": _same(),
    "--rollout-max-response-len": _same(),
    "--rollout-skip-special-tokens": _same("switch", "on by default here (--no-rollout-skip-special-tokens for "
                                          "slime's default)"),
    "--rollout-stop": _same("list"),
    "--rollout-stop-token-ids": _same("list"),
    "--rollout-shuffle": _same("switch"),
    "--rollout-seed": _same("value"),
    "--over-sampling-batch-size": _explained("the buffer keeps leasing prompts until a batch's groups pass the "
                                             "dynamic-sampling filter, so over-sampling is implicit", "value", int),
    "--partial-rollout": _explained("a weight update never aborts generation here: requests in flight continue "
                                    "under the new weights, each token tagged with its version, so every sample "
                                    "that spans an update is a partial rollout resumed in place"),
    "--mask-offpolicy-in-partial-rollout": _same("switch"),
    "--rollout-data-transport": _refused("NIXL is not available; samples travel over the bus (msgpack on ZeroMQ) "
                                         "(object-store, Ray's, is accepted: " + RAY + ")", "value"),
    "--rollout-external-engine-addrs": _alias("-> --rollout-engine sglang --sglang-url ADDR... (attach to running "
                                              "servers)", "list"),
    # --- SGLang router and engine deployment (slime's own, not the server's) ---
    "--sglang-router-ip": _alias(ROUTER_BEHIND),
    "--sglang-router-port": _alias("with --sglang-router-ip: the router's port (--sglang-router-ip); alone (slime: "
                                   "the port its own router listens on) it has no effect: no router is started "
                                   "here, each rollout worker routes its own calls", "value", int),
    "--sglang-router-request-timeout-secs": _alias("-> --router-request-timeout (seconds a generate call may take, "
                                                   "over every engine it is tried on)", "value", int),
    "--sglang-router-policy": _alias("-> --router-policy: consistent_hashing, manual, cache_aware and prefix_hash "
                                     "-> affinity (a session's calls to one engine, on a consistent-hash ring with "
                                     "a load bound); round_robin and random -> round-robin; power_of_two -> "
                                     "least-load; bucket is refused (prefill/decode disaggregation is not "
                                     "available)", "value"),
    "--sglang-server-concurrency": _alias("-> --rollout-max-batch-size (sequences in flight per engine)", "value",
                                          int),
    "--sglang-config": _refused("engine groups from a YAML file (PD disaggregation, placeholders) are not "
                                "available", "value"),
    "--prefill-num-servers": _refused("prefill/decode disaggregation is not available: it needs SGLang servers "
                                      "paired over RDMA (Mooncake or NIXL transfer engines) behind a PD router",
                                      "value", int),
    # --- fault tolerance ---
    "--use-fault-tolerance": _explained("always on: heartbeats detect dead actors and the launcher restarts them "
                                        "(--max-restarts)"),
    "--rollout-health-check-interval": _explained("engines are watched by actor heartbeats "
                                                  "(--heartbeat-interval)", "value", float),
    "--rollout-health-check-timeout": _explained("engines are watched by actor heartbeats (dead after 5 missed "
                                                 "intervals)", "value", float),
    "--rollout-health-check-first-wait": _explained("a launched SGLang server is awaited for "
                                                    "--sglang-startup-timeout", "value", float),
    # --- data ---
    "--num-rollout": _same(),
    "--num-epoch": _same("value", "--num-rollout becomes num_epoch x (the records kept // --rollout-batch-size), "
                                  "as slime derives it; a --num-rollout given as well wins"),
    "--disable-rollout-global-dataset": _alias("-> --no-rollout-global-dataset: no dataset is read, every group's "
                                               "prompt is empty for your generate, agent or rollout function to "
                                               "replace", "switch"),
    "--data-source-path": _same("value", "the buffer takes each new prompt group from your DataSource's "
                                "get_samples(1) and calls its save/load at checkpoints and on resume; slime's own "
                                "classes are the buffer's --prompt-data reader"),
    "--prompt-data": _same(),
    "--apply-chat-template": _same("switch"),
    "--apply-chat-template-kwargs": _alias("-> apply_chat_template_kwargs (the JSON object read into the data "
                                           "section; a mapping in YAML)"),
    "--input-key": _same(),
    "--label-key": _same(),
    "--metadata-key": _same(),
    "--multimodal-keys": _same(),
    "--tool-key": _same(),
    "--start-rollout-id": _explained("the learner resumes its step count from the checkpoint in --load", "value",
                                     int),
    "--rollout-batch-size": _same(),
    "--n-samples-per-prompt": _same(),
    "--global-batch-size": _same(),
    "--num-steps-per-rollout": _owned("learner (several optimizer steps per rollout)"),
    "--balance-data": _explained("always done: learner ranks get micro-batches balanced by tokens"),
    "--balance-by-flops": _explained("learner ranks are balanced by tokens, not by estimated FLOPs"),
    "--use-dynamic-batch-size": _alias("micro-batches are always packed to a token budget: with "
                                       "--max-tokens-per-gpu it sets --micro-batch-tokens", "switch"),
    "--max-tokens-per-gpu": _alias("-> --micro-batch-tokens", "value", int),
    # --- eval ---
    "--eval-function-path": _same("value", "each eval round is one call of it (evaluation=True) on a rollout "
                                  "worker pinned at the evaluated version; its per-dataset rewards are the round's "
                                  "eval metrics"),
    "--eval-prompt-data": _same("list"),
    "--eval-config": _alias("-> --eval-prompt-data NAME PATH per dataset and each dataset's own settings "
                            "(eval_set_settings: sampling, sample count, record keys, reward); a key with no "
                            "per-set meaning here is refused by name"),
    "--eval-interval": _same(),
    "--skip-eval-before-train": _same("switch"),
    "--eval-input-key": _same(),
    "--eval-label-key": _same(),
    "--eval-tool-key": _same(),
    "--n-samples-per-eval-prompt": _same(),
    "--eval-temperature": _same(),
    "--eval-top-p": _same(),
    "--eval-top-k": _same("value", "-1 (slime's off) is read as 0 (off)"),
    "--eval-max-response-len": _same(),
    "--eval-max-prompt-len": _same(),
    "--eval-min-new-tokens": _same("value", "stop and end-of-sequence tokens held back until then: SGLang's "
                                            "min_new_tokens, the torch engine's dynamic KV cache"),
    "--eval-max-context-len": _same(),
    "--eval-reward-key": _same(),
    # --- checkpoints ---
    "--load": _same(),
    "--save": _same(),
    "--save-interval": _same(),
    "--ref-load": _alias("-> --ref-checkpoint (a Hugging Face folder here; slime's torch_dist folders are "
                         "Megatron-only)"),
    "--ref-ckpt-step": _alias("the --ref-load folder's checkpoint of that step (Megatron's iter_NNNNNNN, as slime "
                              "saves, or the learner's step_NNNNNN) becomes --ref-checkpoint; it must be an HF "
                              "folder (preflight names the converter for a Megatron one)", "value", int),
    "--async-save": _owned("megatron", "switch"),
    "--no-save-optim": _same("switch", "checkpoints without the optimizer state; a resumed run starts a fresh "
                                        "optimizer on the saved weights, as slime's --no-load-optim"),
    "--save-hf": _same("value", "an HF export at every checkpoint (--save-interval, the last batch), slime's "
                                "{rollout_id} the batch's 0-based id; both backends"),
    "--seed": _same(),
    # --- algorithm ---
    "--lr": _same(),
    "--clip-grad": _same(),
    "--calculate-per-token-loss": _alias("-> --loss-agg-mode token-mean", "switch"),
    "--num-critic-only-steps": _same(),
    "--eps-clip": _same(),
    "--eps-clip-high": _same(),
    "--eps-clip-c": _same(),
    "--value-clip": _same(),
    "--kl-coef": _same(),
    "--loss-type": _same(),
    "--custom-loss-function-path": _alias("-> --loss-type PATH (slime's custom loss signature is detected and "
                                          "adapted; with --loss-type custom_loss or no --loss-type)"),
    "--kl-loss-type": _same(),
    "--advantage-estimator": _same(),
    "--disable-compute-advantages-and-returns": _same("switch", "no advantages computed: they start at zero for "
                                                               "the --rollout-data-postprocess-path hook (or a "
                                                               "custom loss) to set, as slime leaves them to it; "
                                                               "pi_old and reference log-probs are still taken "
                                                               "where the loss reads them; SFT computes none"),
    "--custom-advantage-function-path": _same(),
    "--use-kl-loss": _same("switch"),
    "--kl-loss-coef": _same(),
    "--use-unbiased-kl": _same("switch"),
    "--ref-update-interval": _same("value", "after rollout batches N, 2N, ... as slime; not with LoRA"),
    "--entropy-coef": _same(),
    "--gamma": _same(),
    "--lambd": _same(),
    "--normalize-advantages": _same("switch"),
    "--disable-grpo-std-normalization": _same("switch"),
    "--disable-rewards-normalization": _same("switch"),
    "--use-rollout-entropy": _same("switch", "as slime: the learner's forward before the update (pi_old's, or "
                                             "one of its own) also takes each token's entropy, for slime's hooks "
                                             "(rollout_data['entropy']) and rollout/entropy; both backends"),
    "--get-mismatch-metrics": _explained("train/rollout log-prob mismatch is logged whenever the learner "
                                         "recomputes log-probs (--use-decoupled-ppo or an --off-policy-correction)"),
    "--reset-optimizer-states": _same("switch"),
    "--use-stateless-adam": _same("switch", "Adam whose moments start from zero at every step, keeping none "
                                            "(torch backend; the critic's too); slime's --no-save-optim is not "
                                            "needed: there is nothing to save"),
    "--use-rollout-logprobs": _same("switch", "pi_old is the engine's log-probs: --off-policy-correction none, "
                                              "no --use-decoupled-ppo"),
    "--use-tis": _alias("-> --off-policy-correction tis", "switch"),
    "--tis-clip": _same(),
    "--tis-clip-low": _same(),
    "--custom-tis-function-path": _alias("-> --off-policy-correction PATH (a registered correction)"),
    "--custom-pg-loss-reducer-function-path": _same("value", "slime's reducer factory, called per micro-batch "
                                                    "as slime calls it; its scalar is the policy-gradient term's "
                                                    "numerator, divided by the step's --loss-agg-mode count"),
    "--use-routing-replay": _same("switch"),
    "--use-rollout-routing-replay": _same("switch"),
    "--use-opsm": _same("switch"),
    "--opsm-delta": _same(),
    # --- on-policy distillation ---
    "--use-opd": _same("switch"),
    "--opd-type": _same(),
    "--opd-kl-coef": _same(),
    "--opd-teacher-load": _same(),
    "--opd-teacher-ckpt-step": _alias("the --opd-teacher-load folder's checkpoint of that step, as "
                                      "--ref-ckpt-step picks the reference's", "value", int),
    # --- logging ---
    "--use-wandb": _same("switch"),
    "--wandb-mode": _same("value", "'disabled' turns W&B off"),
    "--wandb-dir": _explained("W&B's files live in RUN_DIR/wandb", "value"),
    "--wandb-key": _alias("-> WANDB_API_KEY in every actor's environment"),
    "--wandb-host": _alias("-> WANDB_BASE_URL in every actor's environment"),
    "--wandb-team": _alias("-> WANDB_ENTITY in every actor's environment"),
    "--wandb-group": _same(),
    "--wandb-project": _same(),
    "--disable-wandb-random-suffix": _explained("W&B runs are named after the run directory, without a suffix"),
    "--wandb-always-use-train-step": _explained("every metric is logged against the learner step"),
    "--wandb-run-id": _same("value", "the W&B run the controller's mirror logs into, resumed where it exists"),
    "--log-multi-turn": _same("switch"),
    "--log-passrate": _explained("eval rounds always log pass@k (with --n-samples-per-eval-prompt > 1)"),
    "--log-reward-category": _same("value", "the key is read from a dict reward's extra fields (or the sample's "
                                            "metadata)"),
    "--log-correct-samples": _same("switch"),
    "--use-tensorboard": _same("switch"),
    "--tb-project-name": _explained("TensorBoard events go to RUN_DIR/tensorboard", "value"),
    "--tb-experiment-name": _explained("TensorBoard events go to RUN_DIR/tensorboard", "value"),
    # --- debug and profiling ---
    "--debug-rollout-only": _same("switch"),
    "--debug-train-only": _same("switch"),
    "--save-debug-rollout-data": _same("value", "slime's {rollout_id} template names a file per batch; here the "
                                       "template's folder receives batch_NNNNNN.msgpack files"),
    "--load-debug-rollout-data": _same("value", "a {rollout_id} template is read as its folder, as for "
                                       "--save-debug-rollout-data"),
    "--load-forge-rollout-data": _alias("-> --load-debug-rollout-data PATH: slime's rollout dumps (a .pt file "
                                        "reused for every batch, or a {rollout_id} template falling back to its 0 "
                                        "file) read with torch.load(weights_only=True), plain values only, in "
                                        "place of the buffer's batches; engines still start and take every push "
                                        "unless --debug-train-only (slime's forge_load rollout function goes)"),
    "--load-debug-rollout-data-subsample": _same("value", "of each replayed batch, int(groups x fraction) whole "
                                                 "groups: half from its start, the rest from its end, as slime "
                                                 "cuts samples"),
    "--save-debug-train-data": _same("value", "each learner rank writes each step's train data (tokens, masks, "
                                     "advantages, log-probs) to DIR/train_{rollout_id:06d}_rank{R}.msgpack; a "
                                     "slime template is read as its folder"),
    "--dump-details": _same("value", "DIR/rollout_data (the batches), DIR/train_data (the train data) and "
                            "DIR/tokenizer, as slime"),
    "--memory-snapshot-dir": _same("value", "default: --profile-dir (RUN_DIR/profile), not slime's '.'"),
    "--memory-snapshot-num-steps": _same(),
    "--profile-target": _same("list", "train_overall, train_actor (the optimizer steps), train_log_probs (the "
                              "log-prob forwards): a chrome trace each, into --profile-dir"),
    "--memory-recorder": _same("value", "torch needs a GPU and memray its package: preflight refuses either "
                               "where it is missing"),
    "--record-memory-history": _same("switch", "CUDA's allocator history (a GPU) or memray's host capture"),
    # --- network ---
    "--http-proxy": _alias("-> http_proxy / https_proxy in every actor's environment"),
    "--use-distributed-post": _explained(RAY + "; reward calls are spread over reward workers "
                                         "(--reward-workers)"),
    # --- reward ---
    "--rm-type": _same(),
    "--reward-key": _same(),
    "--group-rm": _same("switch"),
    "--rm-url": _same(),
    "--custom-rm-path": _same(),
    "--custom-reward-post-process-path": _owned("plugins (slime reward post-processing)"),
    "--custom-convert-samples-to-train-data-path": _same(),
    # --- slime's external rollout buffer (agent framework) ---
    "--rollout-buffer-url": _same("value", ROLLOUT_BUFFER + ": it starts the service with its engine's URL and "
                                  "trains on the trajectory groups the service returns, rewards as scored there"),
    "--fetch-trajectory-retry-times": _same("value", "failed requests to the service one rollout batch survives "
                                            "(-1: no limit; --rollout-buffer-timeout still bounds the batch)"),
    "--min-batch-collection-ratio": _explained("declared by slime and read nowhere in it, its rollout-buffer client "
                                               "included", "value", float),
    "--rollout-task-type": _same("value", "sent to the service in /start_rollout: which of its generators runs"),
    "--loss-mask-type": _same("value", "qwen, qwen3, qwen3_5 and distill_qwen cut an SFT conversation as "
                                       "slime's do (actors/data/loss_masks.py)"),
    "--data-pad-size-multiplier": _explained("packing chooses its own padding", "value", int),
    "--rollout-sample-filter-path": _same("value", "fn(args, groups) on each batch's groups, called by the "
                                          "learner before the other batch hooks; a sample it marks remove_sample "
                                          "trains with an all-zero loss mask and stays in its group's "
                                          "normalisation, as slime"),
    "--rollout-all-samples-process-path": _same("value", "fn(args, all_groups, data_source), called by the buffer "
                                                "as each batch forms: its groups and every group dropped since the "
                                                "last (the dynamic filter's too); data_source is a stand-in that "
                                                "raises, the buffer owns the prompt cursor"),
    # --- CI ---
    "--ci-test": _explained(CI),
    "--ci-disable-kl-checker": _explained(CI),
    "--ci-train-rollout-logprob-abs-diff-threshold": _explained(CI, "value", float),
    "--ci-save-grad-norm": _explained(CI, "value"),
    "--ci-load-grad-norm": _explained(CI, "value"),
    # --- plugin configuration ---
    "--custom-config-path": _alias("-> custom_config: the YAML's keys appear on the args every slime-style "
                                   "plugin receives; as slime merges it into its args, a key naming a slime flag "
                                   "is that flag and one naming a setting of ours sets it (an SGLang server "
                                   "setting is refused: --sglang-NAME)"),
}


# slime's FSDP backend's own flags (`FSDPArgs` in slime/backends/fsdp_utils/arguments.py at 16b83e1, 2025-11-28, the
# version of slime's Qwen3-VL FSDP script; `--fsdp-full-params` from before 9f04d49e). slime removed the backend on
# 2026-03-04, so the 2026-08-21 snapshot above lacks them; its scripts still run here, on the torch backend
# (`--train-backend fsdp`). The dataclass's other fields are Megatron's names, read as above or by our own flags.
NEVER_READ = "declared by slime's FSDP backend but never read by it"
FSDP_BACKEND_FLAGS: dict[str, SlimeFlag] = {
    "--gradient-checkpointing": _alias("-> --recompute-granularity full: gradient checkpointing of every layer of "
                                       "the HF model (the torch backend's recompute), as slime's FSDP asks "
                                       "transformers for", "switch"),
    "--attn-implementation": _explained("the torch trainer's language model attends with its own packed attention "
                                        "(SDPA per sequence inside a packed row, what flash_attention_2/3's "
                                        "variable-length kernels do for slime's FSDP) and a vision tower with SDPA "
                                        "per image: the same attention, by another kernel", "value"),
    "--fsdp-full-params": _explained("every learner rank holds whole tensors and the learner pushes them whole: "
                                     "what slime's full and sharded state-dict modes both deliver to the engines"),
    "--fsdp-state-dict-cpu-offload": _explained(NEVER_READ + " (where slime's FSDP gathers its state dict); weight "
                                                "pushes here stream buckets from the learner's device"),
    "--fsdp-cpu-offload": _refused("parameters, gradients and optimizer state offloaded to the CPU (a CPU optimizer "
                                   "step) are not available on either backend; --colocate moves the optimizer "
                                   "state off the GPU while the engines generate"),
    "--fsdp-cpu-backend": _explained("the learner picks its torch.distributed backend: NCCL on GPUs, gloo on CPUs",
                                     "value"),
    "--warmup-ratio": _explained(NEVER_READ + " (its learning rate is --lr from the first step); "
                                 "--lr-warmup-fraction warms up here", "value", float),
    "--wandb-run-name": _explained(NEVER_READ + "; W&B runs are named after the run directory", "value"),
    "--tensorboard-dir": _explained("TensorBoard events go to RUN_DIR/tensorboard", "value"),
}
SLIME_FLAGS.update(FSDP_BACKEND_FLAGS)
