"""Which generate function a run's rollout workers use, from its flags; the one place that decides it.

In order: an `--agent-*` episode (the tool loop, or the user's agent over the OpenAI endpoint), a
`--custom-generate-function-path` (ours, or slime's detected by its signature and adapted), SFT's teacher forcing
under `--loss-type sft`, and the default single turn. Flags that would each generate the samples are refused
together, naming both.
"""

from __future__ import annotations

from actors.config import RunConfig
from actors.rollout.agent import AgentRunner, EpisodeLoop, agent_generate_for
from actors.rollout.generate import GenerateFunction, default_generate
from actors.rollout.sft import sft_generate
from actors.slime_compat.plugins import adapt_generate, is_slime_style
from policies.plugins import load_object


def choose_generate_function(config: RunConfig) -> GenerateFunction | EpisodeLoop | AgentRunner:
    """An `AgentRunner` serves an endpoint: the worker starts it before the first group and stops it last."""
    agent = agent_generate_for(config)
    if agent is not None:
        return agent
    custom = load_generate_function(config.rollout.custom_generate_function_path)
    path = config.rollout.custom_generate_function_path
    if custom is not None and is_slime_style(custom, 3):  # slime's generate(args, sample, sampling_params)
        return adapt_generate(custom, config, path or "")
    if config.rollout.rollout_sample_hook_path:
        raise ValueError("--rollout-sample-hook-path applies to a slime-style --custom-generate-function-path "
                         "(args, sample, sampling_params); with ours, edit the samples in the generate function")
    if custom is not None:
        return custom
    return sft_generate if config.policy.loss_type == "sft" else default_generate


def load_generate_function(path: str | None) -> GenerateFunction | None:
    if path is None:
        return None
    function = load_object(path, what="custom generate function")
    if not callable(function):
        raise TypeError(f"custom generate function {path!r} is not callable")
    return function  # type: ignore[return-value]
