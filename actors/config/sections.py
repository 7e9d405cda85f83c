"""The run's settings, one model per component that reads them.

Each section is what one part of the system needs and nothing else: the buffer reads `buffer` and `data`, the
trainer factory `trainer`, the engine factory `engine`. Field names stay slime's flag names (`--rollout-top-p` is
`rollout.rollout_top_p`), so a flag, a YAML key and the attribute that reads it are the same word. Constraints that
concern one field live on the field; rules that tie sections together live on `RunConfig`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from actors.config.engines import engine_choices
from actors.config.plugin_marks import plugin_for
from engines.frozen_params import check_name_lists, check_patterns
from engines.vision.images import MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS, ImageLimits
from policies.failed_samples import FailedSamplePolicy
from policies.registry import FILTERS, REWARDS, BuiltinNames

SLIME_BUFFER_FILTER = "slime.rollout.data_source.pop_first"  # slime's default spelled out: the buffer's own choice


def _is_plugin_path(value: str) -> bool:
    module, colon, attr = value.partition(":")
    return bool(colon and module.strip() and attr.strip())


def _builtin_or_plugin(value: str, info: ValidationInfo) -> str:
    """A built-in name, or a plugin's `module:attr` (loaded by the actor that uses it, which checks its type)."""
    builtins = engine_choices(info.field_name or "")
    if value in builtins or _is_plugin_path(value):
        return value
    raise ValueError(f"{value!r}: expected one of {', '.join(builtins)}, or a plugin factory path "
                     "'package.module:attr'")


# A built-in engine name or a plugin path; which built-ins, the field's name says (engine_choices).
BuiltinOrPlugin = Annotated[str, AfterValidator(_builtin_or_plugin)]

JSON_FLAG = "json_flag"  # json_schema_extra key of a mapping setting whose flag takes a JSON object
MEDIA_TYPES = ("image",)  # --multimodal-keys' media types that are built (slime's also names video and audio)

NO_LABEL = "none"  # --label-key none: records carry no label, and none is required of them


def resolve_label_key(value: str | None) -> str | None:
    """`--label-key none` (or an empty key) reads as no label key at all, as a YAML `label_key: null` does."""
    return None if value is None or value.strip().lower() in ("", NO_LABEL) else value


def reward_names() -> list[str]:
    """--rm-type's names: the registered rewards and the remote reward model (built apart: it needs --rm-url)."""
    from policies.rewards.selection import REMOTE_RM_TYPE

    return sorted([*REWARDS.listed_names(), REMOTE_RM_TYPE])


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(Section):
    """Which weights the run starts from and in what precision: the learner, the reference and the engines agree."""

    hf_checkpoint: str | None = Field(None, description="HF model folder (policy, reference and engines)")
    ref_checkpoint: str | None = Field(None, description="HF folder of the reference model (default: hf_checkpoint)")
    bf16: bool = Field(False, description="train in bfloat16 (float32 master weights and optimizer state), run the "
                       "engines in bfloat16 and push bfloat16 weights")


class DataConfig(Section):
    """Where prompts come from and how a record is read (the buffer and the eval rounds use the same reader)."""

    prompt_data: str | None = Field(None, description="training prompts, .jsonl or .parquet")
    input_key: str = Field("input", description="prompt field of each record")
    label_key: Annotated[str | None, AfterValidator(resolve_label_key)] = Field(
        "label", description="label field of each record; a record without it is malformed (skipped and counted). "
        f"'{NO_LABEL}': the reward needs no label (a judge, an environment's return)")
    metadata_key: str | None = Field("metadata", description="metadata field of each record")
    tool_key: Annotated[str | None, AfterValidator(resolve_label_key)] = Field(
        "tools", description="tool definitions field of each record (optional per record: a list of OpenAI-style "
        "function tools, or that list as a JSON string), given to the chat template with the prompt; a template "
        f"that leaves tools out gets them stated in the system message (--agent-describe-tools). '{NO_LABEL}': "
        "records' tools are not read")
    apply_chat_template: bool = Field(False, description="wrap prompts with the tokenizer's chat template")
    skip_bad_data: bool = Field(True, description="skip (and report) malformed dataset lines instead of stopping")
    rollout_shuffle: bool = Field(True, description="visit the prompts in a seeded random order each epoch "
                                  "(slime's default is file order: --no-rollout-shuffle)")
    rollout_seed: int | None = Field(None, description="seed of the prompt order (default: --seed)")
    rollout_max_prompt_len: int | None = Field(None, ge=1, description="drop training prompts longer than this "
                                               "many tokens (after the chat template) when the dataset loads; "
                                               "counted and logged (default: --rollout-max-context-len - 1)")
    apply_chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="extra keyword arguments of the tokenizer's apply_chat_template, e.g. "
        "{\"enable_thinking\": false}; on the command line a JSON object")
    multimodal_keys: dict[str, str] | None = Field(
        None, json_schema_extra={JSON_FLAG: True}, description="media type -> the record's field holding that "
        "media, as a JSON object, e.g. {\"image\": \"images\"} (slime's): each image a file path (relative to the "
        "data file's folder, or absolute), a base64 string or data: URL, or bytes (a Parquet binary column); a "
        "prompt's '<image>' marks, or its {\"type\": \"image\"} parts, take the images in order. A missing, "
        "unreadable or too large image skips its record (counted, named); nothing is fetched from the network")
    max_image_bytes: int = Field(MAX_IMAGE_BYTES, ge=1, description="largest encoded image a record may hold; "
                                 "a larger one skips its record")
    max_image_pixels: int = Field(MAX_IMAGE_PIXELS, ge=1, description="most pixels (width x height) an image may "
                                  "have; a larger one skips its record")

    @field_validator("apply_chat_template_kwargs", mode="before")
    @classmethod
    def _json_kwargs(cls, value: Any) -> Any:
        """slime passes a JSON string on the command line; YAML gives a mapping."""
        if isinstance(value, str):
            try:
                value = json.loads(value) if value.strip() else {}
            except json.JSONDecodeError as error:
                raise ValueError(f"{value!r} is not JSON ({error.msg})") from None
            if not isinstance(value, dict):
                raise ValueError(f"expected a JSON object of keyword arguments, got {type(value).__name__}")
        return value

    @field_validator("multimodal_keys", mode="before")
    @classmethod
    def _media_keys(cls, value: Any) -> Any:
        """slime's JSON object (a mapping in YAML) of media type -> the record's field; images are the media built."""
        if isinstance(value, str):
            try:
                value = json.loads(value) if value.strip() else None
            except json.JSONDecodeError as error:
                raise ValueError(f"{value!r} is not JSON ({error.msg}); expected e.g. '{{\"image\": \"images\"}}'"
                                 ) from None
        if value is None:
            return None
        if not isinstance(value, dict) or not all(isinstance(key, str) and key for key in value.values()):
            raise ValueError(f"expected a JSON object of media type -> the record's field name, e.g. "
                             f"{{\"image\": \"images\"}}; got {value!r}")
        others = sorted(set(value) - set(MEDIA_TYPES))
        if others:
            raise ValueError(f"media type(s) {', '.join(map(repr, others))} not supported yet (supported: "
                             f"{', '.join(MEDIA_TYPES)})")
        return value or None

    @property
    def image_key(self) -> str | None:
        """The record's field of images (--multimodal-keys' "image"), or None when records carry none."""
        return (self.multimodal_keys or {}).get("image")

    @property
    def image_limits(self) -> ImageLimits:
        return ImageLimits(max_bytes=self.max_image_bytes, max_pixels=self.max_image_pixels)


class RolloutConfig(Section):
    """What a rollout worker generates per prompt and how it samples."""

    rollout_batch_size: int = Field(8, ge=1, description="prompts (groups) per training batch")
    n_samples_per_prompt: int = Field(4, ge=1, description="responses generated per prompt")
    rollout_temperature: float = Field(1.0, ge=0, description="sampling temperature")
    rollout_top_p: float = Field(1.0, gt=0, le=1, description="top-p sampling")
    rollout_top_k: int = Field(0, ge=0, description="top-k sampling (0 = off)")
    rollout_max_response_len: int = Field(32, ge=1, description="max new tokens per response")
    rollout_stop: list[str] = Field(default_factory=list, description="stop strings")
    rollout_stop_token_ids: list[int] = Field(default_factory=list, description="token ids that end a response "
                                              "(besides the model's end-of-sequence)")
    rollout_skip_special_tokens: bool = Field(True, description="leave special tokens out of the response text "
                                              "(token ids keep them; slime's default keeps them in the text: "
                                              "--no-rollout-skip-special-tokens)")
    rollout_max_context_len: int | None = Field(None, ge=2, description="cap on prompt + response tokens: a "
                                                "request's max new tokens shrink to fit, and a prompt that leaves "
                                                "no room fails its samples (counted and logged)")
    custom_generate_function_path: str | None = Field(None, description="module:function for multi-turn rollouts; "
                                                      "ours (context, group) or slime's (args, sample, "
                                                      "sampling_params), detected by signature",
                                                      json_schema_extra=plugin_for("rollout"))
    rollout_sample_hook_path: list[str] = Field(default_factory=list, description="slime-style hooks "
                                                "hook(args, sample, *, rollout_id, evaluation) -> Sample | None "
                                                "applied to each sample of a slime-style generate function",
                                                json_schema_extra=plugin_for("rollout"))
    rollout_function_path: str | None = Field(None, description="slime's whole-rollout function "
                                              "generate_rollout(args, rollout_id, data_source, evaluation): each "
                                              "rollout worker calls it once per rollout batch, its data source "
                                              "leasing prompt groups from the buffer",
                                              json_schema_extra=plugin_for("rollout"))
    generate_failure_limit: int = Field(200, ge=0, description="end the run as failed once this many samples in a "
                                        "row fail in generation (the generate function, agent or engine raises, or "
                                        "marks them failed) with none generated in between; 0 = never")

    @field_validator("rollout_function_path")
    @classmethod
    def _default_rollout_function(cls, value: str | None) -> str | None:
        """slime's default spelled out, and its fully asynchronous rollout (a fixed pool of in-flight groups that
        carries across batch boundaries, aborted groups re-queued): our rollout workers are both already."""
        return None if value in SLIME_BUILTIN_ROLLOUTS else value

    @property
    def samples_per_batch(self) -> int:
        return self.rollout_batch_size * self.n_samples_per_prompt


class AgentConfig(Section):
    """Multi-turn episodes through chat: the built-in tool loop, or an agent of the user's own over an
    OpenAI-compatible endpoint each rollout worker serves (actors/rollout/agent.py)."""

    agent_function_path: str | None = Field(None, description="module:function async (episode) -> dict | None, "
                                            "an agent that drives the policy through episode.base_url with any "
                                            "OpenAI client; its conversation is the sample",
                                            json_schema_extra=plugin_for("rollout"))
    agent_tools_path: str | None = Field(None, description="module:attr of a dict name -> function (sync or "
                                         "async): the built-in tool loop answers the model's <tool_call> blocks "
                                         "with them", json_schema_extra=plugin_for("rollout"))
    agent_environment_path: str | None = Field(None, description="module:attr of a factory (prompt, label, "
                                               "metadata) -> environment with async reset() and step(turn): the "
                                               "built-in loop's answers between turns, with per-turn rewards",
                                               json_schema_extra=plugin_for("rollout"))
    agent_tool_schemas_path: str | None = Field(None, description="module:attr of the tools' JSON schemas, given "
                                                "to the chat template (default: none)",
                                                json_schema_extra=plugin_for("rollout"))
    agent_max_turns: int = Field(4, ge=1, description="model turns per episode of the built-in tool loop")
    agent_tool_timeout: float = Field(10.0, gt=0, description="seconds one tool call (or environment step) may "
                                      "take; an overrun is returned to the model as an error")
    agent_timeout: float = Field(300.0, gt=0, description="seconds one agent episode may take; an overrun fails "
                                 "the sample (counted and logged) and the worker goes on")
    agent_endpoint_host: str = Field("127.0.0.1", description="address the OpenAI-compatible endpoint listens on "
                                     "(0.0.0.0 to serve agents on other machines)")
    agent_describe_tools: bool = Field(True, description="when the chat template leaves a request's tools out of "
                                       "the prompt (SmolLM2's does), state them in the system message in the "
                                       "Hermes <tools> format the tool-call parser reads; off for a model taught to "
                                       "call its tools without being shown them")
    agent_context_rewrite: Literal["fork", "refuse"] = Field(
        "fork", description="a call whose conversation does not extend the session's (the agent dropped or "
        "summarised turns, or runs a sub-agent with a fresh context): fork goes on in a new segment of the episode, "
        "its prompt the new conversation, each segment a sample that trains (docs/agents.md, Trajectory trees); "
        "refuse answers it with an error naming the first message that differs")
    rollout_buffer_url: str | None = Field(None, description="http(s)://HOST:PORT of slime's rollout-buffer service "
                                           "(an agent framework generating through our engine): the rollout worker "
                                           "starts it and trains on the trajectories it returns, scored there "
                                           "(actors/slime_compat/rollout_buffer.py)")
    rollout_task_type: str = Field("math", description="the rollout-buffer service's generator (its TASK_TYPE)")
    fetch_trajectory_retry_times: int = Field(-1, ge=-1, description="failed requests to the rollout-buffer "
                                              "service one rollout batch survives before it fails (-1: no limit; "
                                              "--rollout-buffer-timeout still bounds the batch)")
    rollout_buffer_timeout: float = Field(600.0, gt=0, description="seconds a rollout batch waits for the "
                                          "rollout-buffer service's trajectory groups before it fails (counted, "
                                          "logged; its prompt slots go back to the buffer)")

    @field_validator("rollout_buffer_url")
    @classmethod
    def _service_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError(f"{value!r}: expected the service's http(s)://HOST:PORT")
        return None if value is None else value.rstrip("/")


class BufferConfig(Section):
    """Admission, leases and durability of the buffer: the one place staleness is enforced."""

    max_staleness: int = Field(2, ge=0, description="how many weight versions a trained token may lag behind the "
                               "learner (learner version - the sample's oldest token version); 0 = on-policy, "
                               "synchronous")
    lease_timeout: float = Field(120.0, gt=0, description="seconds before an unfinished prompt lease is re-issued")
    buffer_log_compact_mb: float = Field(256.0, ge=0, description="compact the buffer's durable log into a "
                                         "snapshot once it passes this size (0 = never)")
    dynamic_sampling_filter_path: Annotated[str | None, BuiltinNames(FILTERS.listed_names)] = Field(
        None, description="drop finished groups before they are trained: a built-in filter, or a function of ours "
        "(group) or slime's (args, samples, **kwargs)",
        json_schema_extra=plugin_for("buffer", builder="dynamic_filter"))
    buffer_filter_path: str | None = Field(None, description="slime's buffer filter (args, rollout_id, buffer, "
                                           "num_samples) -> groups: picks which finished groups form the next "
                                           "training batch (the rest are taken oldest first)",
                                           json_schema_extra=plugin_for("buffer", builtins=(SLIME_BUFFER_FILTER,)))
    rollout_all_samples_process_path: str | None = Field(
        None, description="slime's fn(args, all_groups, data_source), called by the buffer as each batch forms with "
        "its groups and every group dropped since the last (the dynamic filter's too)", json_schema_extra=plugin_for(
            "buffer", builder="generated_groups_hook"))
    failed_sample_policy: FailedSamplePolicy = Field(
        "leave_out", description="a group with failed samples (an episode that raised or overran, a reward that "
        "failed): leave_out trains it on the others, normalised over them, while at least 2 remain; drop_group "
        "drops the whole group")
    max_adopted_waiting: int | None = Field(None, ge=0, description="groups of this policy's turns in other policies' "
        "episodes that may wait untrained in its buffer; at the bound those episodes wait (docs/multi-policy.md) "
        "(default: (--max-staleness + 1) x --rollout-batch-size, what can train before it goes stale; 0 = no bound)")

    @field_validator("dynamic_sampling_filter_path")
    @classmethod
    def _slime_builtin_filter(cls, value: str | None) -> str | None:
        """slime's scripts name its own DAPO filter, which keeps the groups whose rewards vary: ours is that."""
        return "nonzero_std" if value == SLIME_NONZERO_STD_FILTER else value


SLIME_BUILTIN_ROLLOUTS = ("slime.rollout.sglang_rollout.generate_rollout",
                          "slime.rollout.fully_async_rollout.generate_rollout_fully_async")
SLIME_NONZERO_STD_FILTER = "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std"


class RewardConfig(Section):
    """How reward workers score a group."""

    rm_type: Annotated[str, BuiltinNames(reward_names)] = Field(
        "exact_match", description="the built-in reward each sample is scored by, unless --custom-rm-path is given "
        "(docs/policies.md, Rewards)", json_schema_extra=plugin_for("reward", builder="reward_spec"))
    reward_key: str | None = Field(None, description="the reward function returns a dict and this key holds the "
                                   "reward (default: a number, or a dict's 'reward')")
    custom_rm_path: str | None = Field(None, description="module:function reward (sync or async); ours "
                                       "(RewardInput) or slime's (args, sample, **kwargs), batched (args, samples) "
                                       "with --group-rm",
                                       json_schema_extra=plugin_for("reward", builder="reward_spec"))
    custom_reward_post_process_path: str | None = Field(
        None, description="slime's reward post-process (args, samples) -> (raw_rewards, rewards): the learner calls "
        "it on each whole batch before the advantages and trains on `rewards` as they are (no group normalisation)",
        json_schema_extra=plugin_for("learner"))
    group_rm: bool = Field(False, description="the reward function scores whole groups")
    rm_url: str | None = Field(None, description="URL of a remote reward model (--rm-type remote_rm)")
    reward_timeout: float = Field(60.0, gt=0, description="seconds before one reward call counts as failed")
    reward_concurrency: int = Field(4, ge=1, description="groups scored at once per reward worker")
    reward_failure_limit: int = Field(200, ge=0, description="end the run as failed once this many samples in a "
                                      "row fail to score (the reward function raises, times out or returns no "
                                      "number) with none scored in between; 0 = never")


class LearnerConfig(Section):
    """How long the learner trains, what it saves, and its debug modes."""

    num_rollout: int = Field(20, ge=0, description="training batches to consume (learner steps)")
    global_batch_size: int | None = Field(None, ge=1, description="samples (episodes: an agent's episode of "
                                          "several segments is one) per optimizer step; must divide "
                                          "rollout_batch_size x n_samples_per_prompt (default: all of them, one "
                                          "step per batch)")
    num_steps_per_rollout: int | None = Field(None, ge=1, description="optimizer steps per rollout batch, i.e. "
                                              "global_batch_size = rollout_batch_size x n_samples_per_prompt / N")
    use_decoupled_ppo: bool = Field(False, description="recompute proximal log-probs before the update (always "
                                    "done when --off-policy-correction is not none)")
    save: str | None = Field(None, description="checkpoint directory (default: RUN_DIR/checkpoints)")
    save_interval: int | None = Field(None, ge=1, description="checkpoint every N learner steps")
    no_save_optim: bool = Field(False, description="checkpoints leave out the optimizer state (AdamW's moments and "
                                "step, the critic's too): smaller; a run resumed from one starts a fresh optimizer on "
                                "the saved weights, as slime's --no-save-optim (which implies --no-load-optim) does")
    keep_last_checkpoints: int | None = Field(None, ge=1, description="keep only the newest N checkpoints: an "
                                              "older one is deleted once a newer one is on disk and `latest` "
                                              "names it (default: keep every checkpoint)")
    load: str | None = Field(None, description="resume from this checkpoint directory")
    save_hf: str | None = Field(None, description="also export the model as a Hugging Face folder at every "
                                "checkpoint, to this path; slime's {rollout_id} in it is the 0-based id of the "
                                "batch just trained (default: only the final model, RUN_DIR/final_model)")
    skip_zero_advantage_samples: bool = Field(True, description="leave out of the forward and backward the "
                                              "samples whose advantages are all zero (a GRPO group that scored "
                                              "alike) when the loss gives them no gradient (no KL loss, no "
                                              "entropy bonus): the same update, and the step's diagnostics are "
                                              "means over the samples trained")
    mask_offpolicy_in_partial_rollout: bool = Field(False, description="train only on the tokens of a sample's "
                                                    "newest weight version: the part generated before a weight "
                                                    "update landed mid-sample stays as context, loss mask 0")
    num_critic_only_steps: int = Field(0, ge=0, description="PPO with a critic: the first N batches train the "
                                       "critic alone, the policy waits (slime's warm-up)")
    debug_rollout_only: bool = Field(False, description="generate and score, never train")
    debug_train_only: bool = Field(False, description="train on --load-debug-rollout-data, no generation")
    save_debug_rollout_data: str | None = Field(None, description="write every batch to this directory")
    load_debug_rollout_data: str | None = Field(None, description="read batches from this directory, or from "
                                                "slime's rollout dumps: a .pt file, or a {rollout_id} template")
    load_debug_rollout_data_subsample: float | None = Field(
        None, gt=0, le=1, description="train on this fraction of each replayed batch's groups: the first half of "
        "them from the batch's start, the rest from its end (slime's cut, by whole groups here)")
    save_debug_train_data: str | None = Field(None, description="each learner rank writes what each step trains "
                                              "on (tokens, masks, advantages, log-probs) to "
                                              "DIR/train_{rollout_id:06d}_rank{R}.msgpack "
                                              "(actors/learner/train_dump.py)")
    dump_details: str | None = Field(None, description="everything for post-hoc analysis, as slime: the batches "
                                     "(DIR/rollout_data, --save-debug-rollout-data), the train data "
                                     "(DIR/train_data, --save-debug-train-data) and the tokenizer (DIR/tokenizer)")
    disable_compute_advantages_and_returns: bool = Field(
        False, description="slime's: no advantages are computed; every sample's start at zero and the "
        "--rollout-data-postprocess-path hook sets them (or a custom loss reads what it needs itself); SFT computes "
        "none anyway")
    use_rollout_entropy: bool = Field(False, description="slime's: the learner's forward before the step (pi_old's) "
                                      "also takes each token's entropy, logged as rollout/entropy and handed to "
                                      "slime's hooks as rollout_data['entropy'] (e.g. for a loss mask of "
                                      "high-entropy tokens); a forward of its own where pi_old needs none")
    rollout_data_postprocess_path: str | None = Field(
        None, description="slime's fn(args, rollout_id, rollout_data), called on each learner rank's samples after "
        "the advantages: the loss_masks and advantages it leaves are what the step trains on",
        json_schema_extra=plugin_for("learner"))
    rollout_sample_filter_path: str | None = Field(
        None, description="slime's fn(args, groups) on each batch's groups: the samples it marks remove_sample train "
        "nothing (an all-zero loss mask) and still count in their group's normalisation", json_schema_extra=plugin_for(
            "learner", builder="batch_rewrite"))
    custom_advantage_function_path: str | None = Field(None, description="slime's advantage hook "
                                                       "(args, rollout_data) that fills rollout_data['advantages'] "
                                                       "and ['returns'] in place of --advantage-estimator",
                                                       json_schema_extra=plugin_for("learner"))
    custom_pg_loss_reducer_function_path: str | None = Field(
        None, description="slime's fn(total_lengths, response_lengths, loss_masks, calculate_per_token_loss) -> "
        "reducer: the reducer's scalar of a micro-batch's per-token policy-gradient loss replaces the "
        "--loss-agg-mode sum of that term (divided by the step's count as the mode's is); the KL and entropy terms "
        "keep the mode (e.g. Dr.GRPO: divide by a constant)", json_schema_extra=plugin_for("learner"))
    custom_convert_samples_to_train_data_path: str | None = Field(None, description="slime's (args, samples) -> "
                                                                  "train-data dict: the learner trains on the "
                                                                  "tokens, masks and rewards it returns",
                                                                  json_schema_extra=plugin_for("learner"))


    @model_validator(mode="before")
    @classmethod
    def _detail_dumps(cls, values: Any) -> Any:
        """slime's --dump-details: the two dumps in its folder, unless given apart."""
        if isinstance(values, dict) and values.get("dump_details"):
            folder = values["dump_details"]
            values = {"save_debug_rollout_data": f"{folder}/rollout_data",
                      "save_debug_train_data": f"{folder}/train_data",
                      **{key: value for key, value in values.items() if value is not None}}
        return values

    @model_validator(mode="after")
    def _subsample_needs_replay(self) -> LearnerConfig:
        if self.load_debug_rollout_data_subsample is not None and not self.load_debug_rollout_data:
            raise ValueError("load_debug_rollout_data_subsample needs load_debug_rollout_data (the batches it cuts)")
        return self

    @field_validator("save_hf")
    @classmethod
    def _rollout_id_only(cls, value: str | None) -> str | None:
        """slime formats the path with `rollout_id` alone; any other placeholder would fail at the first export."""
        if value is not None:
            try:
                value.format(rollout_id=0)
            except (KeyError, IndexError, ValueError) as error:
                raise ValueError(f"{value!r}: the only placeholder is {{rollout_id}} ({error!r})") from None
        return value


class TrainerConfig(Section):
    """The training backend, its parallelism and its optimizer."""

    train_backend: Annotated[BuiltinOrPlugin, BuiltinNames(lambda: engine_choices("train_backend"))] = Field(
        "torch", description="the training engine (a plugin: a factory (config) -> Trainer)",
        json_schema_extra=plugin_for("learner"))
    learner_ranks: int = Field(1, ge=1, description="learner processes (torch.distributed ranks) started by the "
                               "learner: TP x PP x DP (the torch backend is data-parallel only)")
    tensor_model_parallel_size: int = Field(1, ge=1, description="Megatron tensor parallel size")
    pipeline_model_parallel_size: int = Field(1, ge=1, description="Megatron pipeline parallel size")
    use_distributed_optimizer: bool = Field(True, description="Megatron: shard optimizer state over data "
                                            "parallel")
    qkv_format: Literal["thd", "bshd"] = Field("thd", description="Megatron: thd packs a micro-batch's samples "
                                               "into one row (no padding); bshd pads each sample to a row")
    megatron_checkpoint: str | None = Field(None, description="Megatron distributed checkpoint to start from "
                                            "(default: convert --hf-checkpoint)")
    lr: float = Field(1e-4, ge=0, description="learning rate")
    critic_load: str | None = Field(None, description="PPO's value model starts from this HF folder (default: the "
                                    "policy's --hf-checkpoint, as slime's critic starts from the actor's weights)")
    critic_lr: float | None = Field(None, gt=0, description="the critic's learning rate (default: --lr)")
    lr_decay_style: Literal["constant", "cosine"] = Field("constant", description="LR schedule")
    lr_warmup_iters: int = Field(0, ge=0, description="LR warmup steps")
    min_lr: float = Field(0.0, ge=0, description="where the cosine schedule ends")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1")
    adam_beta2: float = Field(0.999, ge=0, lt=1, description="AdamW beta2")
    clip_grad: float = Field(1.0, ge=0, description="gradient norm clip")
    micro_batch_tokens: int = Field(8192, ge=1, description="token budget of one packed micro-batch")
    share_prompts: bool = Field(True, description="torch backend: pack a group's prompt once for all its samples, "
                                "and a preamble all prompts of a micro-batch start with once (the same gradients "
                                "from fewer tokens; needs its packed_sdpa attention)")
    fused_output_head: bool = Field(True, description="torch backend: log-probs from hidden states a chunk of "
                                    "tokens at a time, never the whole [tokens x vocabulary] logits (the same "
                                    "values; a model that changes its logits after the head keeps the plain path)")
    freeze_vision_tower: bool = Field(True, description="torch backend, vision-language model: keep the vision "
                                      "tower as loaded (not trained, not pushed to the engines); false trains it "
                                      "with the language model (verl's freeze_vision_tower)")
    use_routing_replay: bool = Field(False, description="MoE, torch or Megatron backend (R2): the pi_old forward "
                                     "records each token's experts and every training forward of the batch routes "
                                     "there (needs "
                                     "the learner's own pi_old forward: --use-decoupled-ppo or an "
                                     "--off-policy-correction)")
    use_rollout_routing_replay: bool = Field(False, description="MoE, torch or Megatron backend (R3): the "
                                             "engines record each token's experts as they generate, the samples "
                                             "carry them, and every policy forward of the learner (pi_old and "
                                             "training) routes each token where the engine did")
    reset_optimizer_states: bool = Field(False, description="zero the optimizer's state (Adam's moments and step "
                                         "count; the critic's too) before each rollout batch's optimizer steps, "
                                         "as slime does")
    use_stateless_adam: bool = Field(False, description="Adam without state (slime's): its moments start from "
                                     "zero at every step (the critic's too), so the update is lr * g / (|g| + eps) "
                                     "plus weight decay, and no moments are kept or checkpointed; torch backend")
    only_train_params_name_list: list[str] = Field(
        default_factory=list, description="train only the parameters whose name matches one of these Python "
        "regular expressions (searched in the name, as slime does); the others are frozen: no gradient, no "
        "optimizer state. Names are the backend's: Hugging Face's on torch (model.layers.0.mlp.up_proj.weight), "
        "megatron-core's on megatron (decoder.layers.0.mlp.linear_fc1.weight)")
    freeze_params_name_list: list[str] = Field(
        default_factory=list, description="freeze the parameters whose name matches one of these Python regular "
        "expressions (as --only-train-params-name-list reads them; give one of the two)")
    ref_update_interval: int | None = Field(None, ge=1, description="the reference model becomes a copy of the "
                                            "policy after every N rollout batches' update (slime's rule: after "
                                            "batches N, 2N, ...), so the KL term pulls toward a recent policy; "
                                            "needs a reference (a KL term), and is refused with LoRA, whose "
                                            "reference is the base model under the adapter")

    @field_validator("only_train_params_name_list", "freeze_params_name_list")
    @classmethod
    def _regular_expressions(cls, patterns: list[str], info: ValidationInfo) -> list[str]:
        check_patterns("--" + (info.field_name or "").replace("_", "-"), patterns)
        return patterns

    @model_validator(mode="after")
    def _one_name_list(self) -> TrainerConfig:
        check_name_lists(self.only_train_params_name_list, self.freeze_params_name_list)
        return self


class LoraConfig(Section):
    """A LoRA adapter instead of full fine-tuning (the torch backend, through PEFT): the learner trains and sends
    the adapter alone; torch engines fold it into their weights, SGLang servers load it by name. Names as in PEFT
    and slime's LoRA recipe."""

    lora_rank: int = Field(0, ge=0, description="LoRA rank; 0 trains every weight (no adapter)")
    lora_alpha: float = Field(32.0, gt=0, description="LoRA alpha: the adapter's product is scaled by "
                              "lora_alpha / lora_rank")
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input while training (0 "
                                "keeps the learner's log-probs those of the policy that generated)")
    target_modules: list[str] = Field(default_factory=lambda: ["all-linear"], description="modules that get an "
                                      "adapter, by name suffix (q_proj k_proj v_proj o_proj gate_proj up_proj "
                                      "down_proj ...) or all-linear: every linear layer but the output head")
    lora_sync_dir: str | None = Field(None, description="with --rollout-engine sglang: where rollout workers write "
                                      "each adapter version for their server to load (the server must read it; "
                                      "default: the system's temporary directory)")

    @property
    def enabled(self) -> bool:
        return self.lora_rank > 0


class PlacementConfig(Section):
    """slime's placement flags; see actors/launch/placement.py for what the launcher does with them."""

    actor_num_nodes: int = Field(1, ge=1, description="nodes of the learner: the head runs ranks 0..G-1 of its "
                                 "G = learner_ranks / actor_num_nodes per node, node n (--node-rank n) ranks "
                                 "nG..nG+G-1 (docs/cluster.md)")
    learner_world_address: str | None = Field(None, description="tcp://HOST:PORT where a learner spanning nodes "
                                              "forms its world (rank 0's store); the head's launcher picks a free "
                                              "port on its --host when not given")
    actor_num_gpus_per_node: int | None = Field(None, ge=1, description="learner GPUs per node: one learner rank "
                                                "each (sets --learner-ranks)")
    rollout_num_gpus: int | None = Field(None, ge=0, description="GPUs of all inference engines; on the head, "
                                         "--rollout-workers defaults to rollout_num_gpus / "
                                         "rollout_num_gpus_per_engine")
    num_gpus_per_node: int | None = Field(None, ge=0, description="GPUs a node may use (default: every GPU its "
                                          "launcher sees)")
    cpu_budget: Literal["auto", "off"] = Field("auto", description="on a node without GPUs: 'auto' gives a "
                                               "fully-async run's learner cores of its own and a synchronous run's "
                                               "learner every core's threads (actors/runtime/cpu_budget.py); 'off' "
                                               "leaves placement to the OS")
    colocate: bool = Field(False, description="learner and engines share the learner's devices and take turns: "
                           "on-policy (--max-staleness 0), the learner offloads its optimizer state while the "
                           "engines generate, the engines give back their memory while it trains (SGLang: "
                           "release_memory_occupation), and weights move over CUDA IPC (GPU) or shared memory "
                           "(CPU) instead of a broadcast")


class ControllerConfig(Section):
    """What the controller watches beyond heartbeats: a run that stopped making progress."""

    hang_timeout: float = Field(900.0, ge=0, description="fail the run when no actor finished any work (a group "
                                "generated, scored or accepted, a batch served, a step trained) for this many "
                                "seconds, with a report of what each actor waits for (RUN_DIR/hang-report.txt); "
                                "set it above your longest training step or generation; 0 = never")
    start_timeout: float = Field(1800.0, ge=0, description="fail the run when the head's actors have not all "
                                 "registered this many seconds after the last one did (loading models, starting "
                                 "SGLang servers, forming the learner's process groups), naming the roles still "
                                 "missing; 0 = never")


class LoggingConfig(Section):
    """Where the run's metrics go besides the console and the run directory's JSONL."""

    use_tensorboard: bool = Field(True, description="write TensorBoard events to RUN_DIR/tensorboard")
    plots: bool = Field(True, description="write PNG plots at the end of the run")
    use_wandb: bool = Field(False, description="mirror the run's metrics into a Weights & Biases run "
                                               "(key: WANDB_API_KEY or `wandb login`)")
    wandb_project: str = Field("slipstream", description="W&B project")
    wandb_group: str | None = Field(None, description="W&B group, e.g. to gather the seeds of one experiment")
    wandb_mode: Literal["online", "offline"] = Field("online", description="offline: write RUN_DIR/wandb only, "
                                                                            "`wandb sync` it later")
    wandb_run_id: str | None = Field(None, description="log into the W&B run of this id, resuming it where it "
                                     "exists (default: a new run, and the same one again when this run directory "
                                     "is resumed)")
    log_multi_turn: bool = Field(False, description="add slime's multi-turn metrics to each batch's: response "
                                 "lengths with and without environment tokens, and model turns per sample")
    log_reward_category: str | None = Field(None, description="KEY of a dict reward (or of sample metadata): log "
                                            "the share of each batch's samples per value of it "
                                            "(rollout/error_cat/VALUE)")
    log_correct_samples: bool = Field(False, description="add slime's metrics of the correct samples (reward 1) of "
                                      "each batch: how their response lengths spread over the quarters of "
                                      "--rollout-max-response-len, and their entropy estimate")
    custom_rollout_log_function_path: str | None = Field(
        None, description="slime's rollout log hook (rollout_id, args, samples, rollout_extra_metrics, "
        "rollout_time) -> bool, called by the learner on each batch; True leaves the batch's default rollout "
        "metrics out of train.jsonl", json_schema_extra=plugin_for("learner"))
    custom_eval_rollout_log_function_path: str | None = Field(
        None, description="slime's eval log hook (rollout_id, args, data, extra_metrics) -> bool, called by the "
        "evaluator on each eval round; True leaves the round's default metrics out of eval.jsonl",
        json_schema_extra=plugin_for("evaluator"))
