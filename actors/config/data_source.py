"""Where a run's new training prompts come from when it is not the buffer's --prompt-data reader: slime's
`--data-source-path` (a DataSource class of the user's) and `--disable-rollout-global-dataset` (no dataset: the user's
generate or rollout function makes its own prompts). The buffer owns either stream: it gives every group its id, its
exactly-once accounting and its place in the durable log (actors/data/prompts.py, `PromptStream`)."""

from __future__ import annotations

from pydantic import Field, field_validator

from actors.config.plugin_marks import plugin_for
from actors.config.sections import AgentConfig, RolloutConfig, Section
from actors.config.sft import SftConfig

# slime's own sources spelled out: its dataset with a put-back buffer is the buffer's --prompt-data reader (groups a
# rollout function puts back are held by its worker, actors/slime_compat/data_source.py).
SLIME_BUILTIN_SOURCES = ("slime.rollout.data_source.RolloutDataSourceWithBuffer",
                         "slime.rollout.data_source.RolloutDataSource")


class SourceConfig(Section):
    """The stream of new prompt groups the buffer leases out."""

    data_source_path: str | None = Field(
        None, description="slime's DataSource class (module:Class, or slime's dotted path), built with slime's args "
        "in the buffer: each new prompt group is one group of its get_samples(1); its save(rollout_id) runs at each "
        "learner checkpoint (args.save is the run's buffer/data_source folder) and load(rollout_id) when the buffer "
        "resumes (actors/slime_compat/prompt_source.py)", json_schema_extra=plugin_for("buffer"))
    rollout_global_dataset: bool = Field(
        True, description="off (slime's --disable-rollout-global-dataset): no dataset is read; every group has an "
        "empty prompt for a generate, agent or rollout function of yours to replace (with --data-source-path the "
        "source reads args.rollout_global_dataset itself)")

    @field_validator("data_source_path")
    @classmethod
    def _slime_default(cls, value: str | None) -> str | None:
        return None if value in SLIME_BUILTIN_SOURCES else value

    @property
    def reads_prompt_data(self) -> bool:
        """Whether the buffer reads --prompt-data itself (neither a source of the user's nor none at all)."""
        return self.data_source_path is None and self.rollout_global_dataset


def source_problems(source: SourceConfig, rollout: RolloutConfig, agent: AgentConfig, sft: SftConfig) -> list[str]:
    """What cannot work with the run's prompt stream; each message names the settings involved."""
    if source.reads_prompt_data:
        return []
    given = "data_source_path" if source.data_source_path else "rollout_global_dataset off"
    problems = []
    if sft.num_epoch is not None:
        problems.append(f"num_epoch with {given}: an epoch counts --prompt-data's records, which the buffer does not "
                        "read; give num_rollout (slime refuses the pair too)")
    makes_prompts = (rollout.rollout_function_path, rollout.custom_generate_function_path,
                     agent.agent_function_path, agent.rollout_buffer_url)
    if source.data_source_path is None and not any(makes_prompts):
        problems.append("rollout_global_dataset off (--disable-rollout-global-dataset): every group then has an "
                        "empty prompt, which only a function of yours can replace; give --custom-generate-function-"
                        "path, --rollout-function-path or --agent-function-path (or a --data-source-path)")
    return problems
