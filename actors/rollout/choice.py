"""Which generate function a run's rollout workers use, from its flags; the one place that decides it.

In order: an `--agent-*` episode (the tool loop, or the user's agent over the OpenAI endpoint), a
`--custom-generate-function-path` (ours, or slime's detected by its signature and adapted), SFT's teacher forcing
under `--loss-type sft`, and the default single turn. Flags that would each generate the samples are refused
together, naming both.
"""

from __future__ import annotations

from actors.config import RunConfig
from actors.extensions.load import custom_generate_function
from actors.rollout.agent import AgentRunner, EpisodeLoop, agent_generate_for
from actors.rollout.generate import GenerateFunction, default_generate
from actors.rollout.sft import sft_generate


def choose_generate_function(config: RunConfig) -> GenerateFunction | EpisodeLoop | AgentRunner:
    """An `AgentRunner` serves an endpoint: the worker starts it before the first group and stops it last."""
    agent = agent_generate_for(config)
    if agent is not None:
        return agent
    custom = custom_generate_function(config)  # ours, or slime's converted
    if custom is not None:
        return custom
    return sft_generate if config.policy.loss_type == "sft" else default_generate
