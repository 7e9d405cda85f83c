"""Every message on the bus, as typed msgspec structs: the single source of truth for the wire.

On the wire each message is a msgpack map ``{"type": <class name>, "v": SCHEMA_VERSION, ...fields}``. Key
order is not significant; unknown keys are ignored (so a peer may add fields without breaking older peers);
missing keys take the default shown here, and a key without a default is required. Structs validate their
fields on decode (types, literals, and the invariants checked in ``__post_init__``), so an actor that
receives a ``Sample`` can rely on its arrays having the documented dtype and lengths.

Messages nested inside messages (the samples of a ``Batch``, the roster inside ``Registered``) carry "type"
like any message; their "v" may be omitted and is checked when present. ``Member`` and ``RosterEvent``
are plain records, not messages: maps without "type" or "v".

``docs/wire-protocol.md`` embeds ``bus.schema_doc.render_schema()``; regenerate it after editing this file
with ``python -m bus.schema_doc --update docs/wire-protocol.md`` (a test fails until you do).
"""

from __future__ import annotations

import math
import sys
import typing
from typing import Annotated, Any, Literal

import msgspec
import numpy as np

from bus.schema_base import (
    DEFAULT_VERSION,
    SCHEMA_VERSION,
    TOPIC_CONTROL,
    TOPIC_ROSTER,
    TOPIC_RUN_STATE,
    TOPIC_VERSION,
    Message,
    Record,
    _check_tensor,
    check_graded_steps,
    doc,
    tensor,
)
from bus.schema_control import (
    Control,
    Heartbeat,
    Leave,
    Member,
    PolicyJoin,
    PolicyLeave,
    Register,
    Registered,
    Roster,
    RosterEvent,
    RosterEventKind,
    RunConfigQuery,
    RunConfigReply,
    RunState,
    StateReport,
    WaitState,
)
from bus.schema_engine import EngineAbort, EngineGenerate, EngineGenerated, EngineOutput

# Re-exported: the codec, the actors and foreign tools take these from bus.schema.
__all__ = [
    "DEFAULT_VERSION",
    "SCHEMA_VERSION",
    "TOPIC_CONTROL",
    "TOPIC_ROSTER",
    "TOPIC_RUN_STATE",
    "TOPIC_VERSION",
    "Control",
    "EngineAbort",
    "EngineGenerate",
    "EngineGenerated",
    "EngineOutput",
    "Heartbeat",
    "Leave",
    "Member",
    "PolicyJoin",
    "PolicyLeave",
    "Register",
    "Registered",
    "Roster",
    "RosterEvent",
    "RosterEventKind",
    "RunConfigQuery",
    "RunConfigReply",
    "RunState",
    "StateReport",
    "WaitState",
]

SampleStatus = Literal["pending", "completed", "truncated", "aborted", "failed"]
# An engine's finish reason as a sample status, and back: the status is how the finish reason travels (a reward
# function is given it as `finish_reason`).
STATUS_BY_FINISH: dict[str, SampleStatus] = {"stop": "completed", "length": "truncated", "abort": "aborted"}
FINISH_BY_STATUS: dict[str, str] = {status: finish for finish, status in STATUS_BY_FINISH.items()}


IMAGES = ("the prompt's images for a vision-language model, encoded as the data held them (PNG, JPEG, ...: never "
          "decoded pixels), in the order of the image items in the prompt's messages")


class Sample(Message):
    """One trajectory: a prompt and one generated response, with everything the learner needs.

    Created by the rollout worker from a leased ``PromptGroup`` (``n_samples`` episodes per group), filled in by
    generation, scored by a reward worker, trained on by the learner. An episode is one sample, or, when its agent
    rewrote its context, a tree of linear segments, each a sample of its own linked by ``index`` (the episode) and
    ``parent_segment`` (``bus.episodes``). Per-response-token arrays have exactly
    ``response_length`` entries and line up with ``tokens[prompt_tokens:]``. Received arrays are read-only
    views of the frame: replace them (``sample.loss_mask = mask.copy()``), do not write into them.
    """

    sample_id: Annotated[str, doc('unique id, f"{group_id}/{index}", and f"{group_id}/{index}.{segment}" for a '
                                  "segment after an episode's first; rollout worker")]
    group_id: Annotated[str, doc("the PromptGroup this sample belongs to; rollout worker")]
    index: Annotated[int, doc("the episode's position within the group, 0..n_samples-1 (every segment of an "
                              "episode has its episode's index); rollout worker")]
    prompt: Annotated[str | list[dict[str, Any]], doc("raw text or chat messages, copied from the group")]
    prompt_tokens: Annotated[int, doc("how many leading entries of `tokens` are the prompt; rollout worker")] = 0
    tokens: Annotated[np.ndarray, tensor("int32", "prompt + response token ids (1-D); rollout worker")] = (
        msgspec.field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    )
    response: Annotated[str, doc("decoded response text; rollout worker")] = ""
    response_length: Annotated[int, doc("len(tokens) - prompt_tokens; rollout worker")] = 0
    label: Annotated[Any, doc("reference answer / grading info from the dataset, copied from the group")] = None
    reward: Annotated[float | None, doc("scalar reward; reward worker (None until scored)")] = None
    loss_mask: Annotated[
        np.ndarray | None,
        tensor("uint8|bool|int8|int32|float32", "per response token: 1 = trained on, 0 = masked; rollout worker"),
    ] = None
    rollout_log_probs: Annotated[
        np.ndarray | None, tensor("float32", "per response token: the engine's log-prob of the token; rollout worker")
    ] = None
    token_versions: Annotated[
        np.ndarray | None,
        tensor("int32", "per response token: policy version of the weights that produced it; rollout worker"),
    ] = None
    teacher_log_probs: Annotated[
        np.ndarray | None,
        tensor("float32", "per response token: a distillation teacher's log-prob of the token; reward worker (a "
               "teacher server's score) or absent (the learner's teacher scores it)"),
    ] = None
    step_ends: Annotated[np.ndarray | None, tensor("int32", "process supervision: the response token (its index "
                         "among them) each graded step ends on, in order; reward worker, from step_rewards")] = None
    step_rewards: Annotated[np.ndarray | None, tensor("float32", "each graded step's reward; reward worker")] = None
    routed_experts: Annotated[
        np.ndarray | None,
        tensor("int16", "MoE routing replay: per token of tokens[:-1], per MoE layer, the experts the engine routed "
               "it to, flattened row-major [len(tokens) - 1, moe_layers, moe_top_k]; rollout worker"),
    ] = None
    moe_layers: Annotated[int, doc("MoE layers in routed_experts (0: none recorded); rollout worker")] = 0
    moe_top_k: Annotated[int, doc("experts per token in routed_experts; rollout worker")] = 0
    status: Annotated[SampleStatus, doc("lifecycle; rollout worker (reward worker may set failed)")] = "pending"
    metadata: Annotated[dict[str, Any], doc("free-form extras (finish reason, reward breakdown, timings)")] = (
        msgspec.field(default_factory=dict)
    )
    error: Annotated[str | None, doc("why generation or scoring failed, if status is failed/aborted")] = None
    messages: Annotated[
        list[dict[str, Any]] | None,
        doc("a chat episode (this segment's conversation, when it has several) as OpenAI chat messages: the "
            "prompt's, then every turn up to the model's last (its calls as `tool_calls`, the tool results as `tool` "
            "messages), for a reward that reads the conversation; rollout worker (agent episodes), None for a sample "
            "that is not a chat"),
    ] = None
    segment: Annotated[int, doc(
        "which segment of its episode this sample is, numbered in the order they started: an episode whose agent "
        "rewrote its context (dropped or summarised turns, a sub-agent's fresh context) goes on in a new segment, "
        "one sample each; 0 for an episode's first (and only, for most); rollout worker")] = 0
    parent_segment: Annotated[int | None, doc(
        "the segment this one forked from (the one whose conversation shares the longest prefix with its own); None "
        "for segment 0; rollout worker")] = None
    segments: Annotated[int, doc("how many segments the episode has, the same on each of them: a consumer tells a "
                                 "whole episode from a part of one; rollout worker")] = 1
    ends_episode: Annotated[bool, doc(
        "this segment holds the episode's last model turn: the reward is computed here, once per episode, and "
        "every segment of the episode carries it; rollout worker")] = True
    images: Annotated[list[bytes], doc(IMAGES + "; each placeholder in `tokens` is already expanded to the tokens its "
                                       "image takes; copied from the group by the rollout worker")] = (
        msgspec.field(default_factory=list)
    )

    def __post_init__(self) -> None:
        self.tokens = _check_tensor("Sample", "tokens", self.tokens, _INT32, None)
        if not 0 <= self.prompt_tokens <= len(self.tokens):
            raise ValueError(f"Sample.prompt_tokens={self.prompt_tokens} outside 0..len(tokens)={len(self.tokens)}")
        if self.response_length != len(self.tokens) - self.prompt_tokens:
            raise ValueError(
                f"Sample.response_length={self.response_length}, but len(tokens) - prompt_tokens = "
                f"{len(self.tokens) - self.prompt_tokens}"
            )
        if not 0 <= self.segment < self.segments:
            raise ValueError(f"Sample.segment={self.segment} outside 0..segments-1 (segments={self.segments})")
        parent = self.parent_segment
        if (parent is not None) if self.segment == 0 else (parent is None or not 0 <= parent < self.segment):
            raise ValueError(f"Sample.parent_segment={self.parent_segment} for segment {self.segment}: segment 0 "
                             "has none, a later one forked from an earlier one")
        n = self.response_length
        self.loss_mask = _check_tensor("Sample", "loss_mask", self.loss_mask, _MASK_DTYPES, n)
        self.rollout_log_probs = _check_tensor("Sample", "rollout_log_probs", self.rollout_log_probs, _FLOAT32, n)
        self.token_versions = _check_tensor("Sample", "token_versions", self.token_versions, _INT32, n)
        self.teacher_log_probs = _check_tensor("Sample", "teacher_log_probs", self.teacher_log_probs, _FLOAT32, n)
        self.step_ends, self.step_rewards = check_graded_steps("Sample", self.step_ends, self.step_rewards, n)
        if self.routed_experts is not None:
            width = self.moe_layers * self.moe_top_k
            expected = max(len(self.tokens) - 1, 0) * width
            if width <= 0:
                raise ValueError(f"Sample.routed_experts needs moe_layers and moe_top_k > 0, got {self.moe_layers} "
                                 f"and {self.moe_top_k}")
            self.routed_experts = _check_tensor("Sample", "routed_experts", self.routed_experts, _INT16, expected)


_INT32 = (np.dtype("int32"),)
_INT16 = (np.dtype("int16"),)
_FLOAT32 = (np.dtype("float32"),)
_MASK_DTYPES = tuple(np.dtype(name) for name in ("uint8", "bool", "int8", "int32", "float32"))


class PromptGroup(Message):
    """A prompt to sample ``n_samples`` responses for (a GRPO group); the buffer creates it from the dataset, or
    another role hands it to the buffer to lease out (``GuestGroups``: the evaluator's held-out prompts)."""

    group_id: Annotated[str, doc("unique id of the group; buffer")]
    prompt: Annotated[str | list[dict[str, Any]], doc("raw text or chat messages; buffer (from the dataset)")]
    label: Annotated[Any, doc("reference answer / grading info; buffer (from the dataset)")] = None
    metadata: Annotated[dict[str, Any], doc("dataset extras passed through to samples and rewards")] = msgspec.field(
        default_factory=dict
    )
    n_samples: Annotated[int, doc("responses to generate for this prompt")] = 1
    tools: Annotated[list[dict[str, Any]] | None, doc(
        "the record's tool definitions (--tool-key), given to the chat template with the prompt; buffer (from the "
        "dataset)")] = None
    data_index: Annotated[int, doc("position of the prompt in the dataset order of its epoch")] = 0
    epoch: Annotated[int, doc("dataset epoch the prompt was drawn in")] = 0
    is_eval: Annotated[bool, doc("evaluation prompt: sampled with the --eval-* settings and scored with "
                                 "--eval-reward-key; evaluator")] = False
    eval_set: Annotated[str | None, doc("the eval set of an evaluation prompt, whose own settings (--eval-config) "
                                        "sample and score it; evaluator")] = None
    owner: Annotated[str | None, doc(
        "the role whose group this is (None: the buffer's own, a training prompt); an owned group is leased ahead "
        "of training prompts, never trained on, and its ScoredGroup goes back to that role; its owner")] = None
    weights_version: Annotated[int | None, doc(
        "generate with exactly these weights (None: any the staleness bound takes): leased only to a worker whose "
        "engine has them or newer, which generates it on its own engine once it has them; its owner")] = None
    images: Annotated[list[bytes], doc(IMAGES + "; each image item of `prompt` is a bare {\"type\": \"image\"} "
                                       "part: the bytes travel here; buffer (from the dataset's --multimodal-keys "
                                       "column)")] = msgspec.field(default_factory=list)


class LeaseRequest(Message):
    """Rollout worker -> buffer (RPC): 'I have capacity for up to max_groups prompt groups (and max_samples rows)'."""

    worker_id: Annotated[str, doc("the asking rollout worker's actor id")]
    max_groups: Annotated[int, doc("upper bound on groups to lease now (the worker's free capacity)")]
    max_samples: Annotated[int | None, doc(
        "upper bound on the samples of the groups leased (the engine's free rows), so one-sample eval groups fill "
        "the rows eight-sample training groups would; the first group is leased whatever its size (None: no "
        "bound)")] = None
    weights_version: Annotated[
        int | None, doc("the version of the weights the worker's engine serves (None: the learner pushes none); a "
                        "group for newer weights is left for a worker that has them, and weights too old for "
                        "training get only owned groups (PromptGroup.owner) they can serve")
    ] = None
    holds_none: Annotated[bool, doc(
        "the worker's first request for this policy since it began generating for it (it started, or the policy "
        "joined the run again): it holds none of the leases the buffer restored for it, given out again at once")
    ] = False
    training: Annotated[bool, doc(
        "False: only groups another role owns (PromptGroup.owner: an eval round's, whose episodes feed no other "
        "policy); the worker holds its policy's training episodes back because they feed a policy with no "
        "Lease.adoption_room left")] = True


class Lease(Message):
    """Buffer -> rollout worker (RPC reply): groups leased until ``expires_at`` unless renewed or done.

    An expired lease's unfinished groups are re-issued to another worker; results for an expired lease are
    dropped by the buffer, which is what makes generation at-least-once and training exactly-once.
    """

    lease_id: Annotated[str, doc("unique id of the lease; buffer")]
    worker_id: Annotated[str, doc("holder of the lease")]
    groups: Annotated[list[PromptGroup], doc("leased prompt groups (may be empty: nothing to do now)")]
    expires_at: Annotated[float, doc("unix time (buffer clock) after which the groups are re-issued")]
    version: Annotated[int, doc("learner version when leased (admission control reference)")]
    adoption_room: Annotated[int | None, doc(
        "how many more groups of this policy's turns in other policies' episodes (ScoredGroup.host_group) its "
        "buffer takes before its --max-adopted-waiting bound; at 0 the workers hold back the episodes that feed it "
        "(None: no bound, or the policy trains no more batches)")] = None


class LeaseRenew(Message):
    """Rollout worker -> buffer (RPC): extend a lease still being worked on; reply Ack (ok=False if expired)."""

    lease_id: Annotated[str, doc("lease to extend")]


class LostGroups(Message):
    """Rollout worker -> buffer (RPC): groups it handed to a reward worker that died before they were scored.

    The buffer re-issues each one still in flight under the named lease (one scored meanwhile, or already re-issued,
    is left alone), so a dead reward worker costs a re-generation, not a lease timeout. Reply Ack.
    """

    lease_ids: Annotated[list[str], doc("the lease each group was generated under")]
    group_ids: Annotated[list[str], doc("the groups, in the same order")]
    reason: Annotated[str, doc("why they are lost, for the log")]


HOST_GROUP = ("the group of another policy whose episode generated this one, this policy's turns in it "
            "(docs/multi-policy.md): the policy's buffer adopts it, lease_id being the other group's lease; null: a "
            "group this policy's buffer leased")


class GeneratedGroup(Message):
    """Rollout worker -> reward worker (stream): the generated samples of one group, not yet scored."""

    lease_id: Annotated[str, doc("lease the group was generated under")]
    group_id: Annotated[str, doc("the group")]
    samples: Annotated[list[Sample], doc("n_samples episodes, each one sample or its segments, rewards unset")]
    worker_id: Annotated[str, doc("rollout worker that generated them")]
    is_eval: Annotated[bool, doc("the PromptGroup's: scored with --eval-reward-key, without a teacher")] = False
    eval_set: Annotated[str | None, doc("the PromptGroup's: its eval set's own reward settings score it")] = None
    policy: Annotated[str | None, doc("the policy whose buffer leased the group (its reward, its buffer) in a run of "
                                      "several; null in a run of one")] = None
    host_group: Annotated[str | None, doc(HOST_GROUP)] = None


class ScoredGroup(Message):
    """Reward worker -> buffer (stream): the same group with ``reward`` filled in on every sample."""

    lease_id: Annotated[str, doc("lease the group was generated under")]
    group_id: Annotated[str, doc("the group")]
    samples: Annotated[list[Sample], doc("scored samples")]
    worker_id: Annotated[str, doc("rollout worker that generated them (for lease bookkeeping)")]
    host_group: Annotated[str | None, doc(HOST_GROUP)] = None


class BatchRequest(Message):
    """Learner -> buffer (RPC, long-poll): 'give me batch trained_batch + 1'.

    Batches are numbered from 1 and kept by the buffer until a learner checkpoint covers them, so a learner that
    restarts from the checkpoint after batch c asks with trained_batch=c and is served batch c+1 again,
    identically: nothing accepted is lost and nothing is trained twice in the final model's lineage.
    """

    learner_version: Annotated[int, doc("the learner's current policy version (optimizer steps applied)")]
    trained_batch: Annotated[int, doc("id of the last batch the learner trained (0 before the first)")] = 0
    checkpointed_batch: Annotated[int, doc("id of the last batch covered by a durable learner checkpoint")] = 0
    ahead: Annotated[bool, doc("asked while batch trained_batch still trains (prefetch): its staleness counts against "
                               "the version that step leaves, learner_version + 1 until it is announced")] = False


class Batch(Message):
    """Buffer -> learner (RPC reply): a training batch of whole groups within the staleness bound (a group's failed
    samples left out, `--failed-sample-policy leave_out`).

    An empty `samples` list means "not ready yet, ask again" (the buffer answers a long-poll after a while).
    A replayed batch (the learner restarted from a checkpoint and asked again) is the first serving unchanged:
    the same samples, and the staleness and learner_version they were assembled with.
    """

    batch_id: Annotated[int, doc("sequence number from 1; the learner trains batches in this order")]
    samples: Annotated[list[Sample], doc("scored samples, whole groups")]
    staleness: Annotated[
        list[int],
        doc("per sample: the largest |learner_version - v| over its token versions v (normally learner_version - "
            "min(token_versions); tokens newer than a learner restarted from a checkpoint count their distance)"),
    ]
    replayed: Annotated[bool, doc("served before: the learner restarted from a checkpoint and asked again")] = False
    learner_version: Annotated[
        int, doc("the learner version `staleness` is measured against: the one the batch was first requested at, "
                 "or, for a batch served ahead of a step that applied no update, the version that step kept")
    ] = 0
    left_out_samples: Annotated[
        int, doc("failed samples (episodes, each with all its segments) of the batch's groups, left out: each of "
                 "those groups trains on its others")
    ] = 0


class FinalCommit(Message):
    """Learner -> buffer (RPC) once, after the last batch and its checkpoint; reply Ack.

    The buffer commits every batch the checkpoint covers (they are never served again).
    """

    learner_version: Annotated[int, doc("the final policy version (optimizer steps applied)")]
    trained_batch: Annotated[int, doc("id of the last batch the learner trained")]
    checkpointed_batch: Annotated[int, doc("id of the last batch covered by the final durable checkpoint")]



class GuestGroups(Message):
    """A role -> buffer (RPC): prompt groups it owns (``PromptGroup.owner``), to lease out ahead of training prompts;
    reply Ack. A group whose id is already queued or in flight is not queued again (an owner that restarted hands
    over its pending groups again)."""

    groups: Annotated[list[PromptGroup], doc("the groups, each with its owner set")]


class WeightPin(Message):
    """A role -> learner (RPC); reply WeightPinState. Keep the engines on one version's weights: the learner pushes
    no newer weights while a version is pinned, until it is released or --final-eval-timeout passes. The evaluator
    asks, so that an evaluation round is generated by the weights it evaluates; it asks again (the same request)
    until the pin is taken.

    The pin is taken on the first version of at least ``at_least`` the engines get (at once, if they serve one and
    no push is under way), and, with ``final``, on the run's last version at the end of training: the learner ends
    the run only once that pin is released. One request releases and arms, so no push slips between the two.
    """

    at_least: Annotated[int | None, doc("pin the first weights of this version or newer (None: pin nothing new)")]
    release_through: Annotated[int, doc("release every pin of a version up to this one (-1: none)")] = -1
    final: Annotated[bool, doc("pin the run's last version too, when training ends, whatever at_least")] = False


class WeightPinState(Message):
    """Learner -> the asking role (RPC reply to WeightPin)."""

    pinned: Annotated[int | None, doc("the version the engines are pinned on now (None: no pin yet)")]
    publishes: Annotated[bool, doc("the learner pushes weights (false: --debug-rollout-only, --debug-train-only): "
                                   "versions are labels, and only the final pin is ever taken")] = True
    version: Annotated[int, doc("the learner's current version")] = 0


class VersionAnnouncement(Message):
    """Controller -> everyone (broadcast, topic "version"): the learner finished a step."""

    version: Annotated[int, doc("policy version: optimizer steps applied by the learner")]
    weights_version: Annotated[int | None, doc("version of the weights every engine has acknowledged loading; "
                                               "null until the first acknowledged push")] = None
    step: Annotated[int, doc("training step counter (equals version unless steps were skipped)")] = 0
    timestamp: Annotated[float, doc("unix time the version was committed (controller clock)")] = 0.0
    policy: Annotated[str | None, doc("whose version: the policy of the announcing learner in a run of several; "
                                      "null in a run of one")] = None


class WeightUpdateOrder(Message):
    """Learner -> rollout worker (RPC): join (or reuse) the weight-transfer group and receive one update.

    The weights themselves travel over torch.distributed, never over the bus. The reply (Ack) is sent after
    the engine loaded every bucket, which is what lets the learner commit the version.
    """

    version: Annotated[int, doc("policy version of the weights being sent")]
    group: Annotated[
        dict[str, Any],
        doc(
            "transfer group spec: host and port of the learner's rendezvous store, generation (a new one whenever "
            "the engines change), members (the learner first, then engine actor ids; rank = position), backend "
            '("gloo" or "nccl")'
        ),
    ]
    timeout_s: Annotated[float, doc("give up on joining or receiving after this long")] = 120.0
    adapter: Annotated[str | None, doc("the named LoRA adapter these weights replace on the engine, beside the others "
                                       "it serves (a policy's, in a run of several); null: the engine's own "
                                       "weights")] = None


class Ack(Message):
    """Generic RPC reply: done (ok) or refused with a reason."""

    ok: Annotated[bool, doc("request accepted")] = True
    error: Annotated[str | None, doc("why not, when ok is false")] = None


BATCH_ORDER = "batch_order"  # Error reason: the buffer can never serve the batch asked for; the learner fails the run


class Error(Message):
    """RPC reply when a request could not be handled (bad frame, handler raised)."""

    reason: Annotated[str, doc("short machine-readable key (a DecodeError reason or handler_error)")]
    detail: Annotated[str, doc("human-readable explanation")] = ""


class ActorCall(Message):
    """Any actor or plugin -> a custom actor (RPC): call one of its `@method`s by name; reply ActorReply, or Error
    (reason "unknown_method", or "handler_error" when the method raised). The built-in roles neither send nor serve
    it: it is how a reward function reaches a judge, or an environment its sandbox (docs/custom-actors.md)."""

    method: Annotated[str, doc("the name of the method, as the actor class defines it")]
    args: Annotated[dict[str, Any], doc("its keyword arguments: any msgpack data")] = msgspec.field(
        default_factory=dict)


class ActorReply(Message):
    """Custom actor -> caller (RPC reply to ActorCall): what the method returned."""

    result: Annotated[Any, doc("the method's return value: any msgpack data")] = None


class StreamHello(Message):
    """Stream sender -> receiver: 'I am here, send me credit'. Sent on connect and when starved."""

    sender_id: Annotated[str, doc("the sender's id (also its zmq routing id)")]
    session: Annotated[str, doc("random per sender instance; a new session resets the receiver's accounting")]


class StreamCredit(Message):
    """Stream receiver -> sender: you may have sent ``limit`` data frames in total this session."""

    limit: Annotated[int, doc("cumulative count of data frames the sender may have sent in `session`")]
    window: Annotated[int, doc("the receiver's window (informational)")]
    incarnation: Annotated[str, doc("random per receiver instance; a change means the receiver restarted")]
    session: Annotated[str, doc("the sender session this credit is for")]


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.__name__: cls
    for cls in (
        Sample,
        PromptGroup,
        LeaseRequest,
        Lease,
        LeaseRenew,
        LostGroups,
        GeneratedGroup,
        ScoredGroup,
        BatchRequest,
        Batch,
        FinalCommit,
        GuestGroups,
        WeightPin,
        WeightPinState,
        VersionAnnouncement,
        WeightUpdateOrder,
        Register,
        Leave,
        PolicyJoin,
        PolicyLeave,
        Registered,
        RunConfigQuery,
        RunConfigReply,
        Heartbeat,
        StateReport,
        Roster,
        Control,
        RunState,
        Ack,
        Error,
        ActorCall,
        ActorReply,
        EngineGenerate,
        EngineGenerated,
        EngineAbort,
        StreamHello,
        StreamCredit,
    )
}
RECORD_TYPES: dict[str, type[Record]] = {cls.__name__: cls for cls in (Member, RosterEvent, WaitState, EngineOutput)}
AnyMessage = typing.Union[tuple(MESSAGE_TYPES.values())]  # noqa: UP007 - built from the registry


def messages_equal(a: Any, b: Any) -> bool:
    """Deep equality that compares arrays by dtype, shape and bytes and treats NaN as equal to NaN.

    msgspec's ``==`` cannot compare structs holding arrays; round-trip tests and durable-log replays need this.
    """
    if isinstance(a, msgspec.Struct) or isinstance(b, msgspec.Struct):
        if type(a) is not type(b):
            return False
        fields = [f for f in a.__struct_fields__ if f != "v"]
        return (not isinstance(a, Message) or int(a.v) == int(b.v)) and all(
            messages_equal(getattr(a, f), getattr(b, f)) for f in fields
        )
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            isinstance(a, np.ndarray)
            and isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and a.tobytes() == b.tobytes()
        )
    if _is_torch(a) or _is_torch(b):
        return (
            _is_torch(a)
            and _is_torch(b)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and a.contiguous().view(-1).view(_torch().uint8).numpy().tobytes()
            == b.contiguous().view(-1).view(_torch().uint8).numpy().tobytes()
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(messages_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(messages_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def _torch() -> Any:
    return sys.modules["torch"]


def _is_torch(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)
