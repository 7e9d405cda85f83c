"""Evaluation settings: the rounds the evaluator runs, how eval groups are sampled and scored, and the settings of
one eval set of its own (slime's `--eval-config` YAML).

An eval set's own settings are run settings of ours under their flat names (`eval_top_p`, `rm_type`, ...): the
set's view of the run (`RunConfig.for_eval_set`) is the run's config with them applied, and every role that handles
one of its groups (`PromptGroup.eval_set`) reads that view (the evaluator its records and pass@k, the rollout worker
its sampling, the reward worker its reward), so no role knows what a per-set setting is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, field_validator

from actors.config.plugin_marks import plugin_for
from actors.config.sections import NO_LABEL, Section

# slime's per-dataset keys (its EvalDatasetConfig) that mean one of our settings, for that set's groups alone.
SLIME_SET_KEYS: dict[str, str] = {
    "input_key": "eval_input_key", "label_key": "eval_label_key", "tool_key": "eval_tool_key",
    "n_samples_per_eval_prompt": "n_samples_per_eval_prompt", "temperature": "eval_temperature",
    "top_p": "eval_top_p", "top_k": "eval_top_k", "max_response_len": "eval_max_response_len",
    "min_new_tokens": "eval_min_new_tokens", "stop": "rollout_stop", "stop_token_ids": "rollout_stop_token_ids",
    "rm_type": "rm_type", "custom_rm_path": "custom_rm_path", "reward_key": "eval_reward_key",
}
SET_SETTINGS = frozenset(SLIME_SET_KEYS.values())
# slime's per-dataset keys with no per-set meaning here, and why.
NOT_PER_SET = {
    "metadata_key": "the run's --metadata-key reads every set",
    "apply_chat_template": "every set is rendered as the run's prompts are (--apply-chat-template)",
    "apply_chat_template_kwargs": "every set is rendered as the run's prompts are (--apply-chat-template-kwargs)",
    "multimodal_keys": "the run's --multimodal-keys reads every set",
    "repetition_penalty": "no engine here applies a repetition penalty",
    "skip_special_tokens": "responses are decoded by the run's --rollout-skip-special-tokens",
    "no_stop_trim": "responses always keep the stop that ended them",
    "custom_generate_function_path": "eval groups use the run's generate path",
    "app_service": "slime's app-service generation is not available",
    "eval_task_timeout": "eval rounds wait by --final-eval-timeout",
    "min_eval_samples": "a round always scores every record of its set",
    "eval_early_stop_remaining": "a round always scores every record of its set",
    "eval_early_stop_idle_timeout": "a round always scores every record of its set",
    "message_processor": "slime's inline source configs are not available",
    "reward_model": "slime's inline source configs are not available; give rm_type or custom_rm_path",
    "remote_environment": "slime's inline source configs are not available",
}


class EvalConfig(Section):
    """Evaluation rounds the evaluator role runs between training versions."""

    eval_prompt_data: list[str] = Field(default_factory=list, description="NAME PATH pairs of evaluation sets")
    eval_interval: int | None = Field(None, ge=1, description="evaluate every N learner versions")
    n_samples_per_eval_prompt: int = Field(1, ge=1, description="samples per eval prompt (pass@k uses them)")
    eval_temperature: float = Field(0.0, ge=0, description="eval sampling temperature (0 = greedy)")
    final_eval_timeout: float = Field(300.0, ge=0, description="seconds the end of a run waits for the eval round "
                                      "of the final version, and the engines stay pinned for any round (0 = no "
                                      "final round)")
    skip_eval_before_train: bool = Field(False, description="no eval round for version 0 (before training)")
    eval_input_key: str | None = Field(None, description="prompt field of eval records (default: --input-key)")
    eval_label_key: str | None = Field(None, description="label field of eval records (default: --label-key; "
                                       f"'{NO_LABEL}': no label)")
    eval_tool_key: str | None = Field(None, description="tool definitions field of eval records (default: "
                                      f"--tool-key; '{NO_LABEL}': not read)")
    eval_top_p: float | None = Field(None, gt=0, le=1, description="eval top-p (default: --rollout-top-p)")
    eval_top_k: int | None = Field(None, ge=-1, description="eval top-k, 0 or -1 = off (default: --rollout-top-k)")
    eval_max_response_len: int | None = Field(None, ge=1, description="max new tokens per eval response "
                                              "(default: --rollout-max-response-len)")
    eval_max_prompt_len: int | None = Field(None, ge=1, description="drop eval prompts longer than this many "
                                            "tokens when the set loads; counted and logged")
    eval_max_context_len: int | None = Field(None, ge=2, description="cap on eval prompt + response tokens "
                                             "(default: --rollout-max-context-len)")
    eval_reward_key: str | None = Field(None, description="key of a dict reward that scores eval samples "
                                        "(default: --reward-key)")

    eval_min_new_tokens: int | None = Field(
        None, ge=0, description="eval responses are at least this many tokens: the stop and end-of-sequence tokens "
        "are held back until then (SGLang's min_new_tokens; the torch engine's dynamic KV cache)")
    eval_function_path: str | None = Field(
        None, description="slime's eval rollout function generate_rollout(args, rollout_id, data_source, "
        "evaluation=True): each eval round is one call of it on a rollout worker pinned at the evaluated version "
        "(its engine's URL in args), and its per-dataset rewards are the round's metrics (eval sets of ours are "
        "then not run; the function reads args.eval_prompt_data itself)", json_schema_extra=plugin_for("rollout"))
    eval_set_settings: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="eval set name -> its own settings (flat names: "
        f"{', '.join(sorted(SET_SETTINGS))}), for that set's groups alone; slime's --eval-config YAML sets them")

    @field_validator("eval_prompt_data")
    @classmethod
    def _pairs(cls, value: list[str]) -> list[str]:
        if len(value) % 2:
            raise ValueError(f"takes NAME PATH pairs, got {len(value)} value(s)")
        return value

    @field_validator("eval_top_k")
    @classmethod
    def _top_k_off(cls, value: int | None) -> int | None:
        return 0 if value == -1 else value  # slime's "off"

    @field_validator("eval_set_settings")
    @classmethod
    def _known_settings(cls, value: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        for name, settings in value.items():
            unknown = sorted(set(settings) - SET_SETTINGS)
            if unknown:
                raise ValueError(f"eval set {name!r}: {unknown} cannot be set per eval set (these can: "
                                 f"{', '.join(sorted(SET_SETTINGS))})")
        return value

    @property
    def sets(self) -> dict[str, str]:
        pairs = self.eval_prompt_data
        return {pairs[i]: pairs[i + 1] for i in range(0, len(pairs), 2)}

    @property
    def evaluates(self) -> bool:
        """Whether the run has eval rounds to run: eval sets of ours, or slime's eval function."""
        return bool(self.sets) or self.eval_function_path is not None


def read_slime_eval_config(path: str) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """slime's `--eval-config` YAML (`eval: {defaults: {...}, datasets: [...]}`, or that mapping at the top; datasets
    a list of entries with `name` and `path`, or a mapping by name) -> (NAME PATH pairs, each set's own settings
    under our names). `defaults` apply to every set that does not set the key itself; a key with no meaning here
    is refused with the set and the reason."""
    import yaml

    try:
        loaded = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as error:
        raise ValueError(f"--eval-config {path}: cannot read it ({error})") from None
    where = f"--eval-config {path}"
    root = loaded.get("eval", loaded) if isinstance(loaded, dict) else None
    if not isinstance(root, dict):
        raise ValueError(f"{where}: expected a mapping with an 'eval' mapping (defaults, datasets)")
    defaults = root.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise ValueError(f"{where}: eval.defaults must be a mapping")
    datasets = root.get("datasets")
    if isinstance(datasets, dict):
        datasets = [{"name": name, **(entry or {})} for name, entry in datasets.items()]
    if not isinstance(datasets, list) or not datasets:
        raise ValueError(f"{where}: defines no datasets under eval.datasets")
    pairs: list[str] = []
    per_set: dict[str, dict[str, Any]] = {}
    for index, entry in enumerate(datasets):
        if not isinstance(entry, dict) or not entry.get("name") or not entry.get("path"):
            raise ValueError(f"{where}: dataset {index} needs a name and a path")
        name = str(entry["name"])
        if name in per_set:
            raise ValueError(f"{where}: dataset {name!r} is defined twice")
        pairs += [name, str(entry["path"])]
        per_set[name] = _our_settings({**defaults, **entry}, f"{where}: dataset {name!r}")
    return pairs, per_set


def _our_settings(entry: dict[str, Any], where: str) -> dict[str, Any]:
    settings: dict[str, Any] = {}
    for key, value in entry.items():
        if key in ("name", "path") or value is None:
            continue
        if key == "metadata_overrides":
            if value:
                raise ValueError(f"{where}: metadata_overrides is not available (records' metadata is read as it "
                                 "is); give rm_type to choose the set's reward")
        elif key in SLIME_SET_KEYS:
            settings[SLIME_SET_KEYS[key]] = value
        elif key in NOT_PER_SET:
            raise ValueError(f"{where}: {key} cannot be set per eval set: {NOT_PER_SET[key]}")
        else:
            raise ValueError(f"{where}: unknown key {key!r} (known: {', '.join(sorted(SLIME_SET_KEYS))})")
    return settings
