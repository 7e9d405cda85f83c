"""One sample's conversation, driven a chat completion at a time: the engine's tokens in, an assistant message out.

Both ways an episode reaches the policy go through here: the built-in tool loop (`actors.rollout.agent`) and an
agent of the user's own over the OpenAI-compatible endpoint (`actors.rollout.openai_endpoint`). Each call brings
the whole conversation so far, as chat APIs do; only the messages after the last model turn are new, and only
those are rendered (`ChatTurns.next_turn`, loss mask 0). The model's turns stay the tokens the engine produced,
so what trains is what was sampled, whatever the client does to the text of earlier turns in between. A client
that rewrites an earlier turn gets a `ConversationDiverged` naming the first message that differs: training on a
history the model never saw would be off-policy in a way no importance weight corrects.

The model's tool calls get ids that are unique within the run (the sample's key and the turn), so a client that
keys its tool results by id never mixes up two turns. A call to a function the request did not declare is still
returned, as OpenAI-compatible servers do, and counted (`undeclared_tool_calls`): the agent can answer it with an
error, and the run can see how often the policy invents tools. When the chat template leaves `tools` out of the
prompt, the session states them in the system message instead (`--agent-describe-tools`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import structlog

from actors.rollout.generate import NoRoomError, RolloutContext
from actors.rollout.tool_calls import ParsedTurn, describe_tools, parse_tool_calls, tool_names
from actors.rollout.trajectory import ChatTurns, Trajectory, render, template_renders_tools
from bus.schema import STATUS_BY_FINISH, PromptGroup, Sample
from engines.inference.base import ContextFull, GenerateOutput, GenerateRequest


class ConversationDiverged(ValueError):
    """The messages sent do not extend the session's conversation: an earlier turn was changed or dropped.
    `position` is the first message that differs, where one does: an API adapter names its own item by it."""

    def __init__(self, message: str, *, position: int | None = None) -> None:
        super().__init__(message)
        self.position = position


_TOLD_TOOLS_DESCRIBED: set[str] = set()  # tokenizers this process said it describes tools for: said once each


@dataclass(frozen=True)
class Completion:
    message: dict[str, Any]  # the assistant message, OpenAI-shaped: content and, if the model called tools, calls
    text: str  # what the model wrote, call blocks included (special tokens left out)
    parsed: ParsedTurn
    finish_reason: str  # "stop", "length", "tool_calls" or "abort"
    prompt_tokens: int
    completion_tokens: int
    matched_stop: str | int | None = None  # the stop string or token id the engine stopped on


class ChatSession:
    """The conversation of sample `index` of `group`: its messages as the client knows them, its tokens as the
    engine knows them."""

    def __init__(self, context: RolloutContext, group: PromptGroup, index: int) -> None:
        self.context, self.group, self.index = context, group, index
        self.turns: ChatTurns | None = None  # read off the template with the first call's tools
        self.trajectory: Trajectory | None = None
        self.messages: list[dict[str, Any]] = []  # what the trajectory holds, each turn as the client sees it
        self.text: str | None = None  # a text-completion session: the prompt and completions so far, as text
        self.last_output: list[int] = []
        self.last_finish = "length"
        self.tool_calls = 0
        self.tool_errors = 0
        self.undeclared_tool_calls = 0  # calls to a function the request's tools do not declare
        key = f"{group.group_id}/{index}".encode()
        self.call_key = hashlib.blake2b(key, digest_size=6).hexdigest()  # this sample's part of its tool-call ids

    async def complete(self, messages: Sequence[Mapping[str, Any]], *,
                       tools: Sequence[Mapping[str, Any]] | None = None, max_tokens: int | None = None,
                       stop: Sequence[str] = ()) -> Completion:
        """The model's next turn after `messages`: the session's conversation so far plus what came since.
        `tools` (OpenAI function schemas) reach the chat template; they cannot change within a session."""
        if self.text is not None:
            raise ConversationDiverged("this session holds a text completion; a chat completion needs a session "
                                       "of its own")
        messages = [dict(message) for message in messages]
        before = self._response_length()
        answers = messages[len(self.messages):] if self.messages else []  # what came back since the last turn
        self._append_messages(messages, tools)
        output, prompt_tokens = await self._generate_or_roll_back(before, max_tokens, stop)
        text = self.context.tokenizer.decode(output.output_ids, skip_special_tokens=True)
        assert self.trajectory is not None and self.turns is not None
        parsed = parse_tool_calls(text, id_prefix=f"call_{self.call_key}_{self.trajectory.model_turns}_")
        if self.turns.tools is not None:
            declared = tool_names(self.turns.tools)
            self.undeclared_tool_calls += sum(call.name not in declared for call in parsed.calls)
        message = assistant_message(parsed, text)
        self._count_tool_use(answers, parsed, message)
        self.messages = [*messages, message]
        finish = "tool_calls" if message.get("tool_calls") and output.finish_reason == "stop" else output.finish_reason
        return Completion(message, text, parsed, finish, prompt_tokens, len(output.output_ids), output.matched_stop)

    async def complete_text(self, prompt: str, *, max_tokens: int | None = None,
                            stop: Sequence[str] = ()) -> tuple[str, str, int, int]:
        """A text completion: (text, finish reason, prompt tokens, completion tokens). A later call's prompt must
        start with the session's text so far (prompt and completions); only what follows it is tokenized."""
        if self.messages or (self.trajectory is not None and self.text is None):
            raise ConversationDiverged("this session holds a chat; a text completion needs a session of its own")
        before = self._response_length()
        if self.trajectory is None:
            self.trajectory = Trajectory(list(self.context.tokenizer(prompt, add_special_tokens=True)["input_ids"]))
        else:
            assert self.text is not None
            if not prompt.startswith(self.text) or len(prompt) == len(self.text):
                raise ConversationDiverged("a later text completion's prompt must be the session's text so far (the "
                                           "first prompt and every completion, unchanged) followed by new text")
            self.trajectory.add_environment(
                list(self.context.tokenizer(prompt[len(self.text):], add_special_tokens=False)["input_ids"]))
        output, prompt_tokens = await self._generate_or_roll_back(before, max_tokens, stop)
        completion = self.context.tokenizer.decode(output.output_ids, skip_special_tokens=True)
        self.text = prompt + completion
        return completion, output.finish_reason, prompt_tokens, len(output.output_ids)

    def to_sample(self, *, metadata: dict[str, Any] | None = None) -> Sample:
        """The episode as one sample: every model turn trained on, everything between them masked; a chat's
        messages as the session holds them (through the model's last turn), for the reward."""
        trajectory = self.trajectory
        if trajectory is None:
            raise ValueError(f"sample {self.group.group_id}/{self.index}: the episode never called the model")
        response = self.context.tokenizer.decode(trajectory.response_ids, skip_special_tokens=True)
        counts = {"tool_calls": self.tool_calls, "tool_errors": self.tool_errors,
                  "undeclared_tool_calls": self.undeclared_tool_calls}
        return trajectory.to_sample(self.group, self.index, response=response,
                                    status=STATUS_BY_FINISH[self.last_finish], metadata={**counts, **(metadata or {})},
                                    messages=self.messages or None)

    def _count_tool_use(self, answers: Sequence[Mapping[str, Any]], parsed: ParsedTurn,
                        message: Mapping[str, Any]) -> None:
        """Count, once a call is in the trajectory, the calls the model wrote in its turn (malformed ones too) and
        the errors: a call the client never received (a turn with a malformed block comes back as text) and each
        tool result the client sent back marked as an error (`tool_result_failed`). The built-in loop reports its
        environment's counts instead, and an agent's own counts in its returned dict replace these."""
        written = len(parsed.calls) + len(parsed.malformed)
        self.tool_calls += written
        self.tool_errors += written - len(message.get("tool_calls") or [])
        self.tool_errors += sum(tool_result_failed(answer) for answer in answers)

    def _append_messages(self, messages: list[dict[str, Any]], tools: Sequence[Mapping[str, Any]] | None) -> None:
        """Start the trajectory on the first call; on a later one, append what follows the last model turn."""
        if not messages:
            raise ValueError("a chat completion needs at least one message")
        tools = list(tools) if tools else None
        kwargs = self.context.config.data.apply_chat_template_kwargs
        if self.turns is None:
            self.turns = ChatTurns.for_tokenizer(self.context.tokenizer, tools=tools, **kwargs)
            prompt = messages
            if tools and self.context.config.agent.agent_describe_tools and \
                    not template_renders_tools(self.context.tokenizer, tools, **kwargs):
                prompt = with_tools_described(messages, tools)
                self._say_tools_are_described()
            self.trajectory = Trajectory(render(self.context.tokenizer, prompt, add_generation_prompt=True,
                                                tools=tools, **kwargs))
            return
        if tools != (list(self.turns.tools) if self.turns.tools is not None else None):
            raise ConversationDiverged("the tools differ from the session's first call: they are part of the "
                                       "prompt the model saw, so they cannot change within a conversation")
        known = len(self.messages)
        for position, (sent, kept) in enumerate(zip(messages, self.messages, strict=False)):
            if normalized(sent) != normalized(kept):
                raise ConversationDiverged(
                    f"message {position} ({kept.get('role')}) differs from the one this session holds: a session "
                    "continues one conversation, so send every earlier message back unchanged (the model's turns "
                    "as they were returned) and start a new session for a different one", position=position)
        if len(messages) <= known:
            raise ConversationDiverged(f"{len(messages)} messages sent, but the session already holds {known}: a "
                                       "later call must add the messages that follow the model's last turn")
        assert self.trajectory is not None
        self.trajectory.add_environment(self.turns.closing(self.last_output) + self.turns.next_turn(messages[known:]))

    def _say_tools_are_described(self) -> None:
        tokenizer = self.context.tokenizer
        name = str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)
        if name not in _TOLD_TOOLS_DESCRIBED:
            _TOLD_TOOLS_DESCRIBED.add(name)
            structlog.get_logger().info(
                "the chat template leaves tools out of the prompt: the agent endpoint states them in the system "
                "message (Hermes <tools> format; --no-agent-describe-tools turns this off)", tokenizer=name)

    def _response_length(self) -> int:
        return len(self.trajectory.response_ids) if self.trajectory is not None else 0

    async def _generate_or_roll_back(self, before: int, max_tokens: int | None,
                                     stop: Sequence[str]) -> tuple[GenerateOutput, int]:
        """`_generate`; when the conversation no longer fits, the session is left as it was before this call (the
        sample ends where the model last wrote, marked truncated unless a later call that fits finishes otherwise; a
        first call that did not fit leaves no conversation at all)."""
        try:
            return await self._generate(max_tokens, stop)
        except NoRoomError:
            assert self.trajectory is not None
            if self.trajectory.model_turns:
                self.trajectory.truncate(before)
                self.last_finish = "length"
            else:
                self.trajectory, self.turns = None, None
            raise

    async def _generate(self, max_tokens: int | None, stop: Sequence[str]) -> tuple[GenerateOutput, int]:
        """One engine call continuing the trajectory, under the run's sampling (the log-probs the learner corrects
        with must be those of how the tokens were drawn, so a client's temperature is not honoured)."""
        trajectory = self.trajectory
        assert trajectory is not None
        prompt_tokens = trajectory.token_count
        params = self.context.sampling_params(self.group, n=1, prompt_tokens=prompt_tokens)
        if max_tokens is not None:
            params = replace(params, max_new_tokens=max(1, min(params.max_new_tokens, max_tokens)))
        params = replace(params, stop=(*params.stop, *stop), seed=self._seed(trajectory.model_turns))
        request = GenerateRequest(request_id=self.context.request_id(self.group),
                                  input_ids=trajectory.prompt_ids + trajectory.response_ids, params=params)
        try:
            output: GenerateOutput = (await self.context.engine.generate(request))[0]
        except ContextFull as error:  # the conversation outgrew the model: the episode ends, not the worker
            raise NoRoomError(str(error)) from None
        trajectory.add_model(output.output_ids, output.log_probs, output.versions)
        self.last_output, self.last_finish = list(output.output_ids), output.finish_reason
        return output, prompt_tokens

    def _seed(self, call: int) -> int:
        """Keyed by the run seed, the group, the sample and the call, not by when the call came: an episode draws
        the same tokens however the samples of its group interleave."""
        key = f"{self.context.config.seed}/{self.group.group_id}/{self.index}/{call}".encode()
        return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def with_tools_described(messages: Sequence[Mapping[str, Any]],
                          tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with the tools stated in the system message: after the client's own system text, or as a system
    message of their own. Only the prompt's tokens change; the conversation the client sends back stays its own."""
    described = describe_tools(tools)
    messages = [dict(message) for message in messages]
    if messages and messages[0].get("role") == "system" and isinstance(messages[0].get("content"), str):
        messages[0]["content"] = f"{messages[0]['content']}\n\n{described}"
        return messages
    return [{"role": "system", "content": described}, *messages]


def assistant_message(parsed: ParsedTurn, text: str) -> dict[str, Any]:
    """The OpenAI shape of a model turn. A turn with a malformed call block returns its whole text as content and
    no calls, as OpenAI-compatible servers do: the client cannot answer a call it cannot read."""
    if parsed.malformed or not parsed.calls:
        return {"role": "assistant", "content": text.strip()}
    calls = [{"id": call.call_id, "type": "function",
              "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}
             for call in parsed.calls]
    return {"role": "assistant", "content": parsed.content, "tool_calls": calls}


def tool_result_failed(message: Mapping[str, Any]) -> bool:
    """Whether a message a client sent back is a tool result saying the call failed: a `tool` message marked
    `"is_error": true` (Anthropic's tool_result field), or whose text starts with "error:" in any case (how the
    built-in tools, examples/openai_agent.py and LangChain's tool node word a failure). OpenAI's tool messages have
    no error field, so the words are the convention; an agent that words errors otherwise reports its counts."""
    if message.get("role") != "tool":
        return False
    return message.get("is_error") is True or message_text(message).lstrip().lower().startswith("error:")


def message_text(message: Mapping[str, Any]) -> str:
    """A message's text: its content, or the text of its OpenAI content parts joined; absent or None is ""."""
    content = message.get("content") or ""
    if isinstance(content, list):
        content = "".join(part.get("text", "") for part in content if isinstance(part, Mapping))
    return content if isinstance(content, str) else str(content)


def normalized(message: Mapping[str, Any]) -> tuple[Any, ...]:
    """What must match for a message sent back to be the one the session holds: role, text and calls, with the
    spellings clients vary in (absent or None content, arguments as a JSON string or an object) made equal."""
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", call)
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            with contextlib.suppress(json.JSONDecodeError):  # kept as the string: compared as written
                arguments = json.loads(arguments) if arguments.strip() else {}
        calls.append((function.get("name"), json.dumps(arguments, sort_keys=True)))
    return message.get("role"), message_text(message).strip(), tuple(calls)
