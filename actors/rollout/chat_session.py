"""One sample's conversation, driven a chat completion at a time: the engine's tokens in, an assistant message out.

Both ways an episode reaches the policy go through here: the built-in tool loop (`actors.rollout.agent`) and an
agent of the user's own over the OpenAI-compatible endpoint (`actors.rollout.openai_endpoint`). Each call brings
the whole conversation so far, as chat APIs do; only the messages after the last model turn are new, and only
those are rendered (`ChatTurns.next_turn`, loss mask 0). The model's turns stay the tokens the engine produced,
so what trains is what was sampled, whatever the client does to the text of earlier turns in between.

A call whose conversation does not extend the one the session holds (a harness that drops old turns or thinking,
summarises its history, or runs a sub-agent with a fresh context on the same session) rewrote the context. Training
the new turns on the old history would be training on a history the model never saw, so the episode goes on as a
new linear segment instead (`--agent-context-rewrite fork`, the default): its prompt is the rewritten conversation
rendered fresh (masked), its model turns train as any, and it is linked to its parent, the segment whose
conversation shares the longest prefix with the new one (the current one when none shares any). A later call
continues whichever segment's conversation it extends, so a main agent goes on in its own segment after a
sub-agent's. Each segment is a sample (`to_samples`, `bus.episodes`). `--agent-context-rewrite refuse` keeps the
older answer: a `ConversationDiverged` naming the first message that differs.

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
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec
import structlog

from actors.data.tool_prompts import prompt_stating_tools
from actors.rollout.generate import NoRoomError, RolloutContext
from actors.rollout.tool_calls import ParsedTurn, parse_tool_calls, tool_names
from actors.rollout.trajectory import ChatTurns, Trajectory, render
from bus.schema import STATUS_BY_FINISH, PromptGroup, Sample
from engines.inference.base import ContextFull, GenerateOutput, GenerateRequest, InferenceEngine


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


@dataclass
class Segment:
    """One linear part of an episode: a conversation the engine saw as one token sequence, and its sample."""

    trajectory: Trajectory
    turns: ChatTurns | None  # the template around its model turns, with its tools (None: a text completion)
    parent: int | None = None  # the segment it forked from
    shared_messages: int = 0  # leading messages its conversation shares with its parent's
    messages: list[dict[str, Any]] = field(default_factory=list)  # what the trajectory holds, as the client sees it
    last_output: list[int] = field(default_factory=list)
    last_finish: str = "length"


class ChatSession:
    """The conversation of sample `index` of `group`: its messages as the client knows them, its tokens as the
    engine knows them, one segment per context the agent gave the model."""

    def __init__(self, context: RolloutContext, group: PromptGroup, index: int, *,
                 engine: InferenceEngine | None = None) -> None:
        self.context, self.group, self.index = context, group, index
        # Another policy's conversation in the episode (`cross_policy.AgentCalls`) samples from that policy's view.
        self.engine = context.engine if engine is None else engine
        self.segments: list[Segment] = []
        self.current: int | None = None  # the segment the last call continued
        self.text: str | None = None  # a text-completion session: the prompt and completions so far, as text
        self.tool_calls = 0
        self.tool_errors = 0
        self.undeclared_tool_calls = 0  # calls to a function the request's tools do not declare
        self.answered: set[str] = set()  # tool-call ids whose results were counted (a rewrite may send them again)
        key = f"{group.group_id}/{index}".encode()
        self.call_key = hashlib.blake2b(key, digest_size=6).hexdigest()  # this sample's part of its tool-call ids

    @property
    def segment(self) -> Segment | None:
        return None if self.current is None else self.segments[self.current]

    @property
    def trajectory(self) -> Trajectory | None:
        return None if self.segment is None else self.segment.trajectory

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The conversation the last call continued, through the model's answer."""
        return [] if self.segment is None else self.segment.messages

    @property
    def model_turns(self) -> int:
        return sum(segment.trajectory.model_turns for segment in self.segments)

    async def complete(self, messages: Sequence[Mapping[str, Any]], *,
                       tools: Sequence[Mapping[str, Any]] | None = None, max_tokens: int | None = None,
                       stop: Sequence[str] = ()) -> Completion:
        """The model's next turn after `messages`: a conversation of the session's plus what came since, or (a
        rewritten context) the first of a new segment. `tools` (OpenAI function schemas) reach the chat template;
        they belong to a segment's prompt, so other tools start another segment."""
        if self.text is not None:
            raise ConversationDiverged("this session holds a text completion; a chat completion needs a session "
                                       "of its own")
        messages = [dict(message) for message in messages]
        previous = self.current
        segment, opened, before, answers = self._place(messages, list(tools) if tools else None)
        output, prompt_tokens = await self._generate_or_roll_back(segment, opened, before, max_tokens, stop,
                                                                  previous=previous)
        text = self.context.tokenizer.decode(output.output_ids, skip_special_tokens=True)
        assert segment.turns is not None
        parsed = parse_tool_calls(text, id_prefix=f"call_{self.call_key}_{self.model_turns}_")
        if segment.turns.tools is not None:
            declared = tool_names(segment.turns.tools)
            self.undeclared_tool_calls += sum(call.name not in declared for call in parsed.calls)
        message = assistant_message(parsed, text)
        self._count_tool_use(answers, parsed, message)
        segment.messages = [*messages, message]
        finish = "tool_calls" if message.get("tool_calls") and output.finish_reason == "stop" else output.finish_reason
        return Completion(message, text, parsed, finish, prompt_tokens, len(output.output_ids), output.matched_stop)

    async def complete_text(self, prompt: str, *, max_tokens: int | None = None,
                            stop: Sequence[str] = ()) -> tuple[str, str, int, int]:
        """A text completion: (text, finish reason, prompt tokens, completion tokens). A later call's prompt must
        start with the session's text so far (prompt and completions); only what follows it is tokenized."""
        if self.segments and self.text is None:
            raise ConversationDiverged("this session holds a chat; a text completion needs a session of its own")
        opened = not self.segments
        if opened:
            ids = list(self.context.tokenizer(prompt, add_special_tokens=True)["input_ids"])
            self.segments, self.current = [Segment(Trajectory(ids), None)], 0
        segment = self.segments[0]
        before = len(segment.trajectory.response_ids)
        if not opened:
            assert self.text is not None
            if not prompt.startswith(self.text) or len(prompt) == len(self.text):
                raise ConversationDiverged("a later text completion's prompt must be the session's text so far (the "
                                           "first prompt and every completion, unchanged) followed by new text")
            segment.trajectory.add_environment(
                list(self.context.tokenizer(prompt[len(self.text):], add_special_tokens=False)["input_ids"]))
        output, prompt_tokens = await self._generate_or_roll_back(segment, opened, before, max_tokens, stop,
                                                                  previous=None)
        completion = self.context.tokenizer.decode(output.output_ids, skip_special_tokens=True)
        self.text = prompt + completion
        return completion, output.finish_reason, prompt_tokens, len(output.output_ids)

    def to_samples(self, *, metadata: dict[str, Any] | None = None) -> list[Sample]:
        """The episode as samples, one per segment: every model turn trained on, everything between them masked;
        a chat's messages as each segment holds them (through its model's last turn), for the reward. The
        metadata (the tool counts, what the agent returned) is the episode's, on every segment; `turns` and
        `environment_tokens` are each segment's own."""
        if not self.segments:
            raise ValueError(f"sample {self.group.group_id}/{self.index}: the episode never called the model")
        counts = {"tool_calls": self.tool_calls, "tool_errors": self.tool_errors,
                  "undeclared_tool_calls": self.undeclared_tool_calls}
        samples = []
        for number, segment in enumerate(self.segments):
            trajectory = segment.trajectory
            response = self.context.tokenizer.decode(trajectory.response_ids, skip_special_tokens=True)
            forked = {} if segment.parent is None else {"shared_messages": segment.shared_messages}
            sample = trajectory.to_sample(self.group, self.index, response=response,
                                          status=STATUS_BY_FINISH[segment.last_finish],
                                          metadata={**counts, **(metadata or {}), **forked},
                                          messages=segment.messages or None)
            samples.append(sample if len(self.segments) == 1 else msgspec.structs.replace(
                sample, sample_id=f"{sample.sample_id}.{number}" if number else sample.sample_id, segment=number,
                parent_segment=segment.parent, segments=len(self.segments), ends_episode=number == self.current))
        return samples

    def to_sample(self, *, metadata: dict[str, Any] | None = None) -> Sample:
        """The episode as its one sample (`to_samples` for an episode that may have forked)."""
        samples = self.to_samples(metadata=metadata)
        if len(samples) != 1:
            raise ValueError(f"sample {self.group.group_id}/{self.index}: the episode has {len(samples)} segments; "
                             "take them with to_samples()")
        return samples[0]

    def _count_tool_use(self, answers: Sequence[Mapping[str, Any]], parsed: ParsedTurn,
                        message: Mapping[str, Any]) -> None:
        """Count, once a call is in the trajectory, the calls the model wrote in its turn (malformed ones too) and
        the errors: a call the client never received (a turn with a malformed block comes back as text) and each
        tool result the client sent back marked as an error (`tool_result_failed`), once per call id. The built-in
        loop reports its environment's counts instead, and an agent's own counts in its returned dict replace
        these."""
        written = len(parsed.calls) + len(parsed.malformed)
        self.tool_calls += written
        self.tool_errors += written - len(message.get("tool_calls") or [])
        for answer in answers:
            call_id = answer.get("tool_call_id")
            if isinstance(call_id, str) and call_id:
                if call_id in self.answered:
                    continue
                self.answered.add(call_id)
            self.tool_errors += tool_result_failed(answer)

    def _place(self, messages: list[dict[str, Any]],
               tools: list[dict[str, Any]] | None) -> tuple[Segment, bool, int, list[dict[str, Any]]]:
        """The segment this call goes on in, whether it is a new one, its response length before this call, and
        the messages that came back since the model's last turn. A call that continues a segment's conversation
        has its new messages appended to it; one that continues none opens a segment (a rewritten context), or is
        refused (`--agent-context-rewrite refuse`)."""
        if not messages:
            raise ValueError("a chat completion needs at least one message")
        if not self.segments:
            return self._open(messages, tools, parent=None, shared=0), True, 0, []
        continued = self._continued(messages, tools)
        if continued is not None:
            segment = self.segments[continued]
            turns, new = segment.turns, messages[len(segment.messages):]
            assert turns is not None
            before = len(segment.trajectory.response_ids)
            segment.trajectory.add_environment(turns.closing(segment.last_output) + turns.next_turn(new))
            self.current = continued
            return segment, False, before, new
        if self.context.config.agent.agent_context_rewrite == "refuse":
            raise self._divergence(messages, tools)
        parent, shared = self._parent(messages)
        last_model_turn = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=-1)
        return self._open(messages, tools, parent=parent, shared=shared), True, 0, messages[last_model_turn + 1:]

    def _continued(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> int | None:
        """The segment whose conversation `messages` extends with the same tools (the longest, then the current,
        then the newest), or None."""
        sent = [normalized(message) for message in messages]
        extended = [number for number, segment in enumerate(self.segments)
                    if segment.turns is not None and segment.messages and len(sent) > len(segment.messages)
                    and _tools(segment) == tools
                    and sent[:len(segment.messages)] == [normalized(m) for m in segment.messages]]
        return max(extended, key=lambda n: (len(self.segments[n].messages), n == self.current, n), default=None)

    def _parent(self, messages: list[dict[str, Any]]) -> tuple[int, int]:
        """The segment a rewritten context forks from, and how many leading messages the two share: the segment
        sharing the longest prefix (the current one on a tie, so a context rewritten from scratch forks from where
        the episode was)."""
        sent = [normalized(message) for message in messages]

        def shared(segment: Segment) -> int:
            count = 0
            for mine, theirs in zip(sent, segment.messages, strict=False):
                if mine != normalized(theirs):
                    break
                count += 1
            return count

        number = max(range(len(self.segments)),
                     key=lambda n: (shared(self.segments[n]), n == self.current, n))
        return number, shared(self.segments[number])

    def _divergence(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> ConversationDiverged:
        """Why a call does not continue the session's conversation, naming the first message that differs."""
        segment = self.segment
        assert segment is not None
        if tools != _tools(segment):
            return ConversationDiverged("the tools differ from the session's first call: they are part of the "
                                        "prompt the model saw, so they cannot change within a conversation")
        for position, (sent, kept) in enumerate(zip(messages, segment.messages, strict=False)):
            if normalized(sent) != normalized(kept):
                return ConversationDiverged(
                    f"message {position} ({kept.get('role')}) differs from the one this session holds: a session "
                    "continues one conversation, so send every earlier message back unchanged (the model's turns "
                    "as they were returned) and start a new session for a different one (or run with "
                    "--agent-context-rewrite fork)", position=position)
        return ConversationDiverged(f"{len(messages)} messages sent, but the session already holds "
                                    f"{len(segment.messages)}: a later call must add the messages that follow the "
                                    "model's last turn")

    def _open(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, *, parent: int | None,
              shared: int) -> Segment:
        """A new segment whose prompt is `messages` rendered with the chat template (and `tools`), masked."""
        kwargs = self.context.config.data.apply_chat_template_kwargs
        turns = ChatTurns.for_tokenizer(self.context.tokenizer, tools=tools, **kwargs)
        prompt, stated = prompt_stating_tools(self.context.tokenizer, messages, tools,
                                              describe=self.context.config.agent.agent_describe_tools, **kwargs)
        if stated:
            self._say_tools_are_described()
        trajectory = Trajectory(render(self.context.tokenizer, prompt, add_generation_prompt=True, tools=tools,
                                       **kwargs))
        segment = Segment(trajectory, turns, parent=parent, shared_messages=shared)
        self.segments.append(segment)
        self.current = len(self.segments) - 1
        return segment

    def _say_tools_are_described(self) -> None:
        tokenizer = self.context.tokenizer
        name = str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)
        if name not in _TOLD_TOOLS_DESCRIBED:
            _TOLD_TOOLS_DESCRIBED.add(name)
            structlog.get_logger().info(
                "the chat template leaves tools out of the prompt: the agent endpoint states them in the system "
                "message (Hermes <tools> format; --no-agent-describe-tools turns this off)", tokenizer=name)

    async def _generate_or_roll_back(self, segment: Segment, opened: bool, before: int, max_tokens: int | None,
                                     stop: Sequence[str], *, previous: int | None) -> tuple[GenerateOutput, int]:
        """`_generate`; when the conversation no longer fits, the session is left as it was before this call (the
        segment ends where the model last wrote, marked truncated unless a later call that fits finishes otherwise;
        a segment this call opened is taken back, the one the call before continued current again, and the
        session's first call that did not fit leaves no conversation at all)."""
        try:
            return await self._generate(segment, max_tokens, stop)
        except NoRoomError:
            if opened:  # it was opened last, by this call
                self.segments.pop()
            else:
                segment.trajectory.truncate(before)
                segment.last_finish = "length"
            self.current = previous
            raise

    async def _generate(self, segment: Segment, max_tokens: int | None,
                        stop: Sequence[str]) -> tuple[GenerateOutput, int]:
        """One engine call continuing the segment's trajectory, under the run's sampling (the log-probs the
        learner corrects with must be those of how the tokens were drawn, so a client's temperature is not
        honoured)."""
        trajectory = segment.trajectory
        prompt_tokens = trajectory.token_count
        params = self.context.sampling_params(self.group, n=1, prompt_tokens=prompt_tokens)
        if max_tokens is not None:
            params = replace(params, max_new_tokens=max(1, min(params.max_new_tokens, max_tokens)))
        params = replace(params, stop=(*params.stop, *stop), seed=self._seed(self.model_turns))
        # Keyed by the episode: every call of the session goes to the engine that holds its turns so far.
        request = GenerateRequest(request_id=self.context.request_id(self.group),
                                  input_ids=trajectory.prompt_ids + trajectory.response_ids, params=params,
                                  routing_key=f"{self.group.group_id}/{self.index}")
        try:
            output: GenerateOutput = (await self.engine.generate(request))[0]
        except ContextFull as error:  # the conversation outgrew the model: the episode ends, not the worker
            raise NoRoomError(str(error)) from None
        trajectory.add_model(output.output_ids, output.log_probs, output.versions)
        segment.last_output, segment.last_finish = list(output.output_ids), output.finish_reason
        return output, prompt_tokens

    def _seed(self, call: int) -> int:
        """Keyed by the run seed, the group, the sample and the call, not by when the call came: an episode draws
        the same tokens however the samples of its group interleave."""
        key = f"{self.context.config.seed}/{self.group.group_id}/{self.index}/{call}".encode()
        return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def _tools(segment: Segment) -> list[dict[str, Any]] | None:
    tools = None if segment.turns is None else segment.turns.tools
    return None if tools is None else [dict(tool) for tool in tools]


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
