"""Each role's plugins built from the run's settings, in our own types (`actors.extensions.points`).

slime's plugins are recognised here, by their flags and signatures, and converted by `actors.slime_compat`: a slime
``rm(args, sample)`` becomes a reward that reads whole samples, a slime dynamic filter a group filter, a slime
``generate(args, sample, sampling_params)`` a generate function, ``--custom-advantage-function-path`` an advantage
function, a slime custom loss ``(args, batch, logits, sum_of_sample_mean)`` a policy loss, the train-data
conversion and reward post-process a batch rewrite, ``--rollout-function-path`` a rollout loop. A role asks for the
kind it runs and never learns which convention the user wrote in.

Each loader imports what its kind needs when called: the buffer and reward processes never import torch, and the
slime advantage adapter does.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from actors.config import RunConfig
from actors.extensions.points import (
    AdvantageFunction,
    BatchReader,
    BatchRewrite,
    BatchSelector,
    EvalLogHook,
    GeneratedGroupsHook,
    GroupFilter,
    PolicyLossFunction,
    RolloutLogHook,
    RolloutLoop,
)
from bus.schema import Sample, ScoredGroup
from policies.filters import FilterGroup, apply_filters
from policies.plugins import load_object
from policies.registry import resolve_filter, resolve_policy_loss
from policies.rewards import RewardSpec, build_reward

if TYPE_CHECKING:
    from actors.data.prompts import PromptStream
    from actors.slime_compat.postprocess import RolloutDataPostprocess
    from actors.slime_compat.rollout_function import RolloutHost
    from policies.losses import PgReducer


def reward_spec(config: RunConfig) -> RewardSpec:
    """`--rm-type` / `--custom-rm-path` / `--group-rm` / `--rm-url`; a slime ``rm(args, sample)`` (or
    ``rm(args, samples)``) reads whole samples."""
    from actors.slime_compat.plugins import load_slime_reward

    reward = config.reward
    spec = build_reward(reward.rm_type, custom_rm_path=reward.custom_rm_path, group_rm=reward.group_rm,
                        rm_url=reward.rm_url, remote_timeout_s=reward.reward_timeout)
    slime_rm = load_slime_reward(config)
    if slime_rm is not None:
        return RewardSpec(spec.name, slime_rm, is_group=reward.group_rm, argument_of=_the_sample)
    return spec


def _the_sample(sample: Sample, segments: list[Sample]) -> Sample:
    """What an adapted slime reward reads: the wire sample itself (it converts it to slime's `Sample`)."""
    return sample


def dynamic_filter(config: RunConfig) -> GroupFilter | None:
    """The buffer's `--dynamic-sampling-filter-path`, or None without one."""
    return group_filter(config.buffer.dynamic_sampling_filter_path, config)


def group_filter(spec: str | None, config: RunConfig | None = None) -> GroupFilter | None:
    """`--dynamic-sampling-filter-path` as the buffer core wants it: a drop reason, or None to keep. A slime-style
    filter ``(args, samples, **kwargs)`` is detected by signature and converted (that needs `config`)."""
    from actors.slime_compat.plugins import adapt_filter

    if spec is None:
        return None
    resolve_filter(spec)  # fail at start-up on a bad name or path, not on the first group
    slime_filter = adapt_filter(spec, config) if config is not None else None

    def filter_group(group: ScoredGroup) -> str | None:
        verdict = apply_filters([slime_filter or spec], FilterGroup(
            rewards=[s.reward for s in group.samples], statuses=[s.status for s in group.samples],
            samples=group.samples, metadata=group.samples[0].metadata if group.samples else {},
        ))
        return None if verdict.keep else (verdict.reason or "filtered")

    return filter_group


def batch_selector(config: RunConfig) -> BatchSelector | None:
    """`--buffer-filter-path` (slime's signature), or None: the buffer takes the oldest groups."""
    from actors.slime_compat.buffer_filter import load_buffer_filter

    return load_buffer_filter(config)


def custom_generate_function(config: RunConfig) -> Callable[..., Awaitable[list[Any]]] | None:
    """`--custom-generate-function-path`: ours as it is, slime's ``generate(args, sample, sampling_params)``
    converted; None without the flag."""
    from actors.slime_compat.plugins import adapt_generate, is_slime_style

    path = config.rollout.custom_generate_function_path
    function = load_generate_function(path)
    if function is not None and is_slime_style(function, 3):
        return adapt_generate(function, config, path or "")
    if config.rollout.rollout_sample_hook_path:
        raise ValueError("--rollout-sample-hook-path applies to a slime-style --custom-generate-function-path "
                         "(args, sample, sampling_params); with ours, edit the samples in the generate function")
    return function


def load_generate_function(path: str | None) -> Callable[..., Awaitable[list[Any]]] | None:
    if path is None:
        return None
    function = load_object(path, what="custom generate function")
    if not callable(function):
        raise TypeError(f"custom generate function {path!r} is not callable")
    return function  # type: ignore[return-value]


def advantage_function(config: RunConfig) -> AdvantageFunction | None:
    """`--custom-advantage-function-path` (slime's ``fn(args, rollout_data)``), replacing the estimator."""
    from actors.slime_compat.advantages import load_custom_advantages

    return load_custom_advantages(config)


def rollout_data_postprocess(config: RunConfig) -> RolloutDataPostprocess | None:
    """slime's `--rollout-data-postprocess-path` ``fn(args, rollout_id, rollout_data)``, loaded now, or None."""
    from actors.slime_compat.postprocess import load_rollout_data_postprocess

    return load_rollout_data_postprocess(config)


def weight_disk_post_write(config: RunConfig) -> Callable[[str, tuple[str, ...]], None] | None:
    """`--weight-disk-post-write-path` (slime's ``hook(args, version_dir, rollout_engines)``) as the disk weight
    transport calls it, ``(version_dir, engines)``, loaded now; or None."""
    from actors.slime_compat.weight_disk import post_write_hook

    return post_write_hook(config)


def policy_loss(config: RunConfig) -> PolicyLossFunction:
    """`--loss-type`: a registered loss or a plugin of ours as it is; a slime custom loss
    (`--custom-loss-function-path`, which the flags make the loss type) converted."""
    from actors.slime_compat.losses import adapt_loss, is_slime_loss

    loss = resolve_policy_loss(config.policy.loss_type)
    return adapt_loss(loss) if is_slime_loss(loss) else loss


def pg_loss_reducer(config: RunConfig) -> PgReducer | None:
    """slime's `--custom-pg-loss-reducer-function-path`, loaded now and adapted, or None."""
    from actors.slime_compat.pg_reducer import load_pg_loss_reducer

    return load_pg_loss_reducer(config)


def batch_rewrite(config: RunConfig) -> BatchRewrite | None:
    """slime's whole-batch hooks: its samples -> train-data conversion, which replaces its reward post-process too
    (with both set, only the conversion runs), or the reward post-process alone; its rollout sample filter
    (`--rollout-sample-filter-path`) first, as slime's rollout function calls it before either."""
    from actors.slime_compat.plugins import load_reward_post_process
    from actors.slime_compat.rollout_hooks import load_sample_filter
    from actors.slime_compat.train_data import load_convert_samples

    rewrite = load_convert_samples(config) or load_reward_post_process(config)
    sample_filter = load_sample_filter(config)
    if sample_filter is None:
        return rewrite
    if rewrite is None:
        return BatchRewrite(sample_filter, rewards_as_given=False)
    return BatchRewrite(lambda samples: rewrite(sample_filter(samples)), rewards_as_given=rewrite.rewards_as_given)


def generated_groups_hook(config: RunConfig) -> GeneratedGroupsHook | None:
    """slime's `--rollout-all-samples-process-path`, fed by the buffer with every group generated for each batch
    (the dropped ones too), or None."""
    from actors.slime_compat.rollout_hooks import load_all_samples_process

    return load_all_samples_process(config)


def recorded_batch_reader(config: RunConfig) -> BatchReader | None:
    """The reader of `--load-debug-rollout-data` when it names slime's rollout dumps (a file or a {rollout_id}
    template: slime's `--load-forge-rollout-data`), or None for a folder of our recorded batches."""
    from actors.slime_compat.forge import dump_batch_reader

    return dump_batch_reader(config)


def check_rollout_loop(config: RunConfig) -> None:
    """Refuse at start-up, before the engine loads, a rollout loop that cannot work with the other flags."""
    from actors.slime_compat.eval_function import check_eval_function
    from actors.slime_compat.rollout_function import check_rollout_function

    check_rollout_function(config)
    check_eval_function(config)


def rollout_loop(worker: RolloutHost) -> RolloutLoop | None:
    """`--rollout-function-path` (slime's ``generate_rollout``), or the client of `--rollout-buffer-url`'s service
    (a rollout function of ours), as the worker's loop; call on the worker's event
    loop once its engine is up. None without the flag: the worker runs its own loop."""
    from actors.slime_compat.rollout_function import RolloutFunctionRunner, function_path

    if not function_path(worker.config):
        return None
    return RolloutFunctionRunner.load(worker)


def prompt_stream(config: RunConfig, folder: Path) -> PromptStream | None:
    """The buffer's new prompts when they are not --prompt-data's records: slime's `--data-source-path` (a user's
    DataSource, its state kept in `folder`), or `--disable-rollout-global-dataset` (empty prompts); None: the buffer
    reads --prompt-data."""
    from actors.data.prompts import EmptyPrompts

    if config.source.data_source_path is not None:
        from actors.slime_compat.prompt_source import SlimeSourceStream

        return SlimeSourceStream.load(config, folder)
    return None if config.source.rollout_global_dataset else EmptyPrompts()


def round_function(config: RunConfig, server_url: str | None) -> Callable[..., Awaitable[list[Sample]]] | None:
    """slime's `--eval-function-path` as the generate function of a whole eval round's group (`WHOLE_ROUND`): one
    call of the user's function against `server_url`, the worker's engine. None without the flag."""
    if not config.eval.eval_function_path:
        return None
    from actors.slime_compat.eval_function import EvalFunctionRound

    return EvalFunctionRound(config, server_url or "")


def rollout_log_hook(config: RunConfig, log: Any, counters: Counter[str]) -> RolloutLogHook | None:
    """slime's `--custom-rollout-log-function-path`, called as our hook (a raising one is reported and counted in
    `counters`, and the default metrics are written); None without the flag."""
    from actors.slime_compat.log_hooks import SlimeRolloutLogHook

    return SlimeRolloutLogHook.load(config, log, counters)


def eval_log_hook(config: RunConfig, log: Any, counters: Counter[str]) -> EvalLogHook | None:
    """slime's `--custom-eval-rollout-log-function-path`, as `rollout_log_hook`."""
    from actors.slime_compat.log_hooks import SlimeEvalLogHook

    return SlimeEvalLogHook.load(config, log, counters)
