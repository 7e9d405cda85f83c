"""Multi-turn episodes as samples: the built-in tool loop, and agents of the user's own behind an OpenAI endpoint.

`--agent-tools-path pkg.mod:TOOLS` runs the tool loop: the model's turn, its `<tool_call>` blocks answered by the
tools (each under `--agent-tool-timeout`, every failure returned to the model as that call's result), the next
turn, up to `--agent-max-turns`. `--agent-environment-path pkg.mod:make` runs the same loop over an environment
of the user's (`actors.rollout.environment`: reset, step, per-turn rewards). The last turn's text (its calls left
out) is the sample's `metadata["final_answer"]`, for a reward function that grades the answer rather than the
whole conversation.

`--agent-function-path pkg.mod:agent` runs `async def agent(episode: Episode) -> dict | None` once per sample.
The agent talks to the policy with any OpenAI client at `episode.base_url` (Chat Completions or Responses), or
with the Anthropic client at `episode.anthropic_base_url` (Messages): the rollout worker's endpoint, whose session
is this sample, so every call it makes lands in the sample's trajectory as tokens (a call whose `model` names another
policy of the run lands in that policy's turns instead: `actors.rollout.cross_policy.AgentCalls`). A dict it returns is
merged into the sample's metadata (the reward function sees it). An agent that raises or overruns
`--agent-timeout` fails its sample, counted and logged with the agent's error; the worker goes on.

Either way the sample is the whole conversation after the prompt: the model's turns trained on, everything else
masked; the reward function is given its text and its chat messages (`Sample.messages`). An agent that rewrites its
context makes its episode several samples, one per segment (`actors.rollout.chat_session`, `bus.episodes`).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from actors.config import RunConfig
from actors.rollout.chat_session import ChatSession
from actors.rollout.cross_policy import AgentCalls
from actors.rollout.environment import (
    EnvironmentFactory,
    ToolsEnvironment,
    Turn,
    check_messages,
    guarded_step,
    make_environment,
)
from actors.rollout.generate import NoRoomError, RolloutContext, failed_sample, failed_samples
from actors.rollout.tool_environment import FunctionTools
from bus.schema import PromptGroup, Sample
from policies.plugins import load_object


@dataclass(frozen=True)
class Episode:
    """What an agent gets for one sample: where the policy answers, and the task."""

    base_url: str  # an OpenAI base URL (".../v1") whose calls are this sample's turns
    api_key: str  # any OpenAI client insists on one; the endpoint accepts any
    model: str
    messages: list[dict[str, Any]]  # the prompt, as chat messages
    label: Any
    metadata: dict[str, Any] = field(default_factory=dict)
    sample_index: int = 0
    tools: list[dict[str, Any]] | None = None  # the dataset record's tool definitions (--tool-key), to pass on
    # The episode's own policy in a run of several (None: a run of one). A call whose `model` names another policy
    # is that policy's turn, which trains it (docs/multi-policy.md).
    policy: str | None = None

    @property
    def anthropic_base_url(self) -> str:
        """The same session for the Anthropic client, which appends `/v1/messages` to its base URL itself."""
        return self.base_url.rstrip("/").removesuffix("/v1")


AgentFunction = Callable[[Episode], Awaitable[Mapping[str, Any] | None]]


def prompt_messages(prompt: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [dict(message) for message in prompt] if isinstance(prompt, list) else [{"role": "user", "content": prompt}]


class EpisodeLoop:
    """The built-in episode: the model's turn, the environment's answer, the next turn, until the environment says
    done, the model runs out of tokens or room, or `--agent-max-turns` turns were taken."""

    def __init__(self, config: RunConfig) -> None:
        agent = config.agent
        if agent.agent_environment_path is not None:
            self.name = agent.agent_environment_path
            factory = load_object(self.name, what="agent environment")
            if not callable(factory):
                raise TypeError(f"--agent-environment-path {self.name!r} must name a factory (prompt, label, "
                                "metadata) -> environment")
            self.factory: EnvironmentFactory = factory
        else:
            assert agent.agent_tools_path is not None
            self.name = agent.agent_tools_path
            tools = load_object(self.name, what="agent tools")
            if not isinstance(tools, Mapping) or not all(callable(tool) for tool in tools.values()):
                raise TypeError(f"--agent-tools-path {self.name!r} must name a dict of tool name -> function")
            environment = ToolsEnvironment(FunctionTools(tools), tool_timeout=agent.agent_tool_timeout)
            self.factory = lambda prompt, label, metadata: environment  # stateless: one serves every episode
        self.schemas = _schemas(agent.agent_tool_schemas_path)
        self.max_turns, self.step_timeout = agent.agent_max_turns, agent.agent_tool_timeout

    async def __call__(self, context: RolloutContext, group: PromptGroup) -> list[Sample]:
        return await _episodes(self.episode, context, group)

    async def episode(self, context: RolloutContext, group: PromptGroup, index: int) -> list[Sample]:
        session = ChatSession(context, group, index)
        try:
            environment = await make_environment(self.factory, group.prompt, group.label, group.metadata)
            opening = check_messages(await environment.reset(), "reset()'s messages")
        except Exception as error:  # the user's environment: its sample fails, counted and logged; the worker goes on
            reason = f"environment {self.name} could not start an episode: {type(error).__name__}: {error}"
            return [failed_sample(group, index, context.prompt_ids(group.prompt, group.tools), reason)]
        messages = [*prompt_messages(group.prompt), *opening]
        final_answer, rewards, tool_calls, tool_errors = "", [], 0, 0
        try:
            for turn_index in range(self.max_turns):
                # a record's own tools (--tool-key) are what its episode offers; else --agent-tool-schemas-path's
                completion = await session.complete(messages, tools=group.tools or self.schemas)
                messages = session.messages
                final_answer = completion.message["content"]
                if completion.finish_reason == "length":
                    break
                turn = Turn(completion.text, completion.parsed, turn_index)
                step = await guarded_step(environment, turn, timeout_s=self.step_timeout)
                tool_calls, tool_errors = tool_calls + step.tool_calls, tool_errors + step.tool_errors
                if step.reward is not None:
                    rewards.append(float(step.reward))
                if step.done or turn_index == self.max_turns - 1:
                    break
                messages = [*messages, *step.messages]
        except NoRoomError as error:  # the conversation filled the context: what was generated still trains, truncated
            if session.model_turns == 0:
                return [failed_sample(group, index, context.prompt_ids(group.prompt, group.tools), str(error))]
        # The environment's counts: it answered the calls (and may count what is not a `<tool_call>` block).
        return session.to_samples(metadata={"final_answer": final_answer, "turn_rewards": rewards,
                                            "tool_calls": tool_calls, "tool_errors": tool_errors})


class AgentRunner:
    """Runs the user's agent once per sample against this worker's OpenAI endpoint."""

    def __init__(self, config: RunConfig) -> None:
        agent = config.agent
        assert agent.agent_function_path is not None
        self.path = agent.agent_function_path
        function = load_object(self.path, what="agent function")
        if not callable(function):
            raise TypeError(f"--agent-function-path {self.path!r} is not callable")
        self.agent: AgentFunction = function
        self.timeout = agent.agent_timeout
        self.running: set[asyncio.Task[Any]] = set()  # the agents' own tasks, one per episode in flight
        # Imported here: its aiohttp costs 0.11 s, on the path of every rollout worker's start, agent or not.
        from actors.rollout.openai_endpoint import OpenAIEndpoint

        self.endpoint = OpenAIEndpoint(host=agent.agent_endpoint_host, model=config.model.hf_checkpoint or "policy")

    async def start(self) -> None:
        await self.endpoint.start()

    def abort_episodes(self) -> None:
        """The first step of a stop: no call reaches the engine from here on, and every agent is cancelled. The
        calls already in the engine end with the engine's abort, which must come next: the endpoint's stop waits
        for them."""
        self.endpoint.refuse_calls()
        for task in self.running:
            task.cancel()

    async def stop(self) -> None:
        await self.endpoint.stop()

    async def __call__(self, context: RolloutContext, group: PromptGroup) -> list[Sample]:
        """The group's episodes' samples, then the groups of other policies they called (`AgentCalls`), which the
        worker sends to those policies (`cross_policy.split_by_policy`)."""
        calls, returned = AgentCalls(context, group), {}
        own = await _episodes(functools.partial(self.episode, calls=calls, returned=returned), context, group)
        return own + calls.samples(returned)

    async def episode(self, context: RolloutContext, group: PromptGroup, index: int, *,
                      calls: AgentCalls | None = None, returned: dict[int, dict[str, Any]] | None = None
                      ) -> list[Sample]:
        """The episode's samples: one per segment (an agent that rewrote its context has several), or its one
        failed sample. What the agent returned goes in `returned[index]` too, for its calls to other policies."""
        session = ChatSession(context, group, index)
        base_url = self.endpoint.open(session, calls)
        episode = Episode(base_url=base_url, api_key="slipstream", model=self.endpoint.model,
                          messages=prompt_messages(group.prompt), label=group.label, metadata=dict(group.metadata),
                          sample_index=index, tools=group.tools, policy=context.policy)
        task = asyncio.create_task(self.agent(episode), name=f"agent.{group.group_id}/{index}")
        self.running.add(task)
        try:
            await asyncio.wait([task], timeout=self.timeout)
            if not task.done():
                reason = f"agent {self.path} did not finish its episode within --agent-timeout {self.timeout:g} s"
            elif task.cancelled():  # abort_episodes: the worker stops, and the group's lease brings it back
                return [_aborted(failed_sample(group, index, context.prompt_ids(group.prompt, group.tools),
                                               f"agent {self.path} was cancelled: the rollout worker stopped"))]
            else:
                metadata = _agent_metadata(task.result())
                if returned is not None:
                    returned[index] = metadata
                return session.to_samples(metadata=metadata)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # the user's agent: its sample fails, the worker goes on
            reason = f"agent {self.path} failed: {type(error).__name__}: {error}"
        finally:
            self.running.discard(task)
            await _cancelled(task)
            self.endpoint.close(base_url)
        return [failed_sample(group, index, context.prompt_ids(group.prompt, group.tools), reason)]


async def _episodes(episode: Callable[[RolloutContext, PromptGroup, int], Awaitable[list[Sample]]],
                    context: RolloutContext, group: PromptGroup) -> list[Sample]:
    """The group's episodes run at once, their samples in episode order (each episode's segments together)."""
    if group.images:  # the chat session and the API surfaces read text; images there are not built yet
        return failed_samples(group, [], f"group {group.group_id} has {len(group.images)} image(s), and agent "
                              "episodes (--agent-function-path, --agent-tools-path, --agent-environment-path) take "
                              "text prompts only: images reach the model through the default generate path")
    runs = await asyncio.gather(*(episode(context, group, index) for index in range(group.n_samples)))
    return [sample for samples in runs for sample in samples]


def agent_generate_for(config: RunConfig) -> EpisodeLoop | AgentRunner | None:
    """The generate function the agent flags ask for, or None when they ask for none."""
    agent = config.agent
    given = [flag for flag, value in (("--agent-function-path", agent.agent_function_path),
                                      ("--agent-tools-path", agent.agent_tools_path),
                                      ("--agent-environment-path", agent.agent_environment_path)) if value]
    if not given:
        return None
    if len(given) > 1:
        raise ValueError(f"{' and '.join(given)} each run the episode: give one (an agent of your own calls its "
                         "tools itself; an environment can hold tools)")
    if config.rollout.custom_generate_function_path is not None:
        raise ValueError("--custom-generate-function-path and the --agent-* episode both generate the samples: "
                         "give one")
    return AgentRunner(config) if agent.agent_function_path is not None else EpisodeLoop(config)


def _schemas(path: str | None) -> list[Mapping[str, Any]] | None:
    if path is None:
        return None
    schemas = load_object(path, what="agent tool schemas")
    if not isinstance(schemas, (list, tuple)) or not all(isinstance(schema, Mapping) for schema in schemas):
        raise TypeError(f"--agent-tool-schemas-path {path!r} must name a list of JSON schemas (dicts)")
    return list(schemas)


def _agent_metadata(returned: object) -> dict[str, Any]:
    """What an agent returned, as the sample's metadata; the tool counts it may report replace the session's, so
    they must be counts (the learner sums them into `multiturn/*`)."""
    if returned is not None and not isinstance(returned, Mapping):
        raise TypeError(f"returned {type(returned).__name__}; an agent returns a dict or None")
    for key in ("tool_calls", "tool_errors"):
        value = (returned or {}).get(key, 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"it returned {key}={value!r}: the counts an agent reports are integers >= 0")
    return dict(returned or {})


def _aborted(sample: Sample) -> Sample:
    return msgspec.structs.replace(sample, status="aborted")


async def _cancelled(task: asyncio.Task[Any]) -> None:
    """`task` ended: cancelled if it still runs (an overrun, or our own cancellation), and waited for, so an agent
    never outlives its episode; its error, if it had one, counted as seen (the episode reported it)."""
    if not task.done():
        task.cancel()
        await asyncio.wait([task])
    if not task.cancelled():
        task.exception()
