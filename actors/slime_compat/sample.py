"""A slime-style ``Sample`` for plugins written against slime, and its conversion to and from our wire sample.

A slime plugin's ``from slime.utils.types import Sample`` imports this class (`actors.slime_compat.imports`),
as ``from actors.slime_compat import Sample`` does. The class has slime's field names, its ``Status`` enum (same values
as our wire statuses) and the helpers plugins call (``append_response_tokens``, ``get_reward_value``,
``effective_response_length``). It is our own class, not slime's: multimodal and top-p replay fields exist so
plugins that set them do not break, but nothing downstream reads them.

Conversion keeps what training needs: tokens, the loss mask (tool output stays at 0), the engine's log-probs,
and per-token policy versions. slime records one ``weight_version`` string per engine call, not per token; we
keep an extra ``token_versions`` list that ``append_response_tokens`` fills from the server's per-token spans.
Where a plugin builds tokens by hand and leaves versions unset, every response token gets the engine version
at the call's start: the oldest weights that can have produced them, so the staleness bound stays safe.

An attribute a plugin sets on a sample beyond slime's fields (retool's generate counts ``sample.tool_call_count``,
which its reward reads) reaches the reward and the filters as it would in slime's one process: it travels in the
wire sample's metadata (`ATTRIBUTES`) when it is plain data (None, bool, number, string, and lists and string-keyed
dicts of them); anything else (a client, a tensor) stays with the generate.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import msgspec
import numpy as np

from bus.schema import PromptGroup
from bus.schema import Sample as WireSample

__all__ = ["ATTRIBUTES", "REMOVED", "Sample", "from_group", "from_wire", "to_wire", "to_wire_episode"]

REMOVED = "remove_sample"  # in a wire sample's metadata: slime's remove_sample was set (its loss mask is all zero)
ATTRIBUTES = "slime_attributes"  # in a wire sample's metadata: what a plugin set on its sample beyond slime's fields


@dataclass
class Sample:
    """One trajectory as slime's plugins see it (slime's field names and meanings)."""

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    prompt: str | list[dict[str, Any]] = ""
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: dict[str, Any] | None = None
    multimodal_train_inputs: dict[str, Any] | None = None
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    response: str = ""
    response_length: int = 0
    label: Any = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    rollout_top_p_token_ids: list[int] | None = None
    rollout_top_p_token_offsets: list[int] | None = None
    rollout_routed_experts: Any = None
    remove_sample: bool = False
    teacher_log_probs: list[float] | None = None
    status: Sample.Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    generate_function_path: str | None = None
    custom_rm_path: str | None = None
    train_metadata: dict[str, Any] | None = None
    session_id: str | None = None
    non_generation_time: float = 0.0
    # Ours, not slime's: the policy version of each response token (None where unknown), kept in step with
    # `tokens` by append_response_tokens.
    token_versions: list[int | None] | None = None

    def get_reward_value(self, args: Any) -> float:
        """The scalar reward; with `args.reward_key` set, that key of a dict reward (slime's --reward-key)."""
        key = getattr(args, "reward_key", None)
        return self.reward[key] if key and isinstance(self.reward, dict) else self.reward  # type: ignore[return-value]

    @property
    def effective_response_length(self) -> int:
        return sum(self.loss_mask) if self.loss_mask is not None else self.response_length

    def append_response_tokens(self, args: Any = None, *, tokens: Any = None, log_probs: Any = None,
                               trainable: bool = True, meta_info: dict[str, Any] | None = None,
                               text: str | None = None, update_terminal_info: bool = True) -> None:
        """Append response tokens with their mask, log-probs and versions kept aligned (slime's helper).

        Model tokens: ``trainable=True`` with the engine's log-probs and ``meta_info``. Tool or environment
        tokens: ``trainable=False``; they get loss mask 0 and log-prob 0.
        """
        new = [int(t) for t in (tokens if tokens is not None else [])]
        probs = None if log_probs is None else [float(p) for p in log_probs]
        if probs is not None and len(probs) != len(new):
            raise ValueError(f"append_response_tokens: {len(probs)} log_probs for {len(new)} tokens")
        if new and trainable and probs is None:
            raise ValueError("append_response_tokens: trainable tokens need the engine's log_probs")
        if new and not trainable:
            if probs is not None:
                raise ValueError("append_response_tokens: non-trainable (tool) tokens take no log_probs")
            probs = [0.0] * len(new)
        if text is not None:
            self.response += text
        before = self.response_length
        if self.loss_mask is None:
            self.loss_mask = [1] * before
        if self.rollout_log_probs is None:
            self.rollout_log_probs = [0.0] * before
        if self.token_versions is None or len(self.token_versions) != before:
            self.token_versions = [None] * before
        self.tokens = list(self.tokens) + new
        self.response_length = before + len(new)
        self.loss_mask += [1 if trainable else 0] * len(new)
        self.rollout_log_probs += probs or []
        meta = meta_info or {}
        spans = meta.get("weight_versions")
        if trainable and spans is not None:
            # Imported here: the protocol module brings torch, which a rollout worker loads only with its engine.
            from engines.sglang.protocol import token_versions

            self.token_versions += token_versions(spans, len(new), where="append_response_tokens")
        else:
            # A server without per-token spans reports the version at the call's end, which may postdate some
            # tokens; leave them unknown so they take the conservative start version (to_wire).
            self.token_versions += [None] * len(new)
        if not update_terminal_info or "finish_reason" not in meta:
            return
        if "weight_version" in meta:
            self.weight_versions.append(str(meta["weight_version"]))
        finish = meta["finish_reason"]
        kind = finish.get("type") if isinstance(finish, dict) else finish
        self.status = {"length": Sample.Status.TRUNCATED, "abort": Sample.Status.ABORTED,
                       "stop": Sample.Status.COMPLETED}.get(kind, self.status)


def from_group(group: PromptGroup, index: int) -> Sample:
    """A pending slime sample for response ``index`` of a leased group (what slime's data buffer hands out)."""
    return Sample(group_index=group.data_index, index=index, prompt=group.prompt, label=group.label,
                  metadata={**group.metadata, "data_index": group.data_index})


def from_wire(sample: WireSample) -> Sample:
    """Our wire sample as a slime sample (for reward functions and filters): nothing is dropped."""
    metadata = dict(sample.metadata)
    attributes = metadata.pop(ATTRIBUTES, None)
    restored = Sample(
        group_index=int(sample.metadata.get("data_index", 0)), index=sample.index, prompt=sample.prompt,
        tokens=sample.tokens.tolist(), response=sample.response, response_length=sample.response_length,
        label=sample.label, reward=sample.reward,
        loss_mask=None if sample.loss_mask is None else [int(m) for m in sample.loss_mask.tolist()],
        rollout_log_probs=None if sample.rollout_log_probs is None else sample.rollout_log_probs.tolist(),
        token_versions=None if sample.token_versions is None else sample.token_versions.tolist(),
        weight_versions=[] if sample.token_versions is None or not len(sample.token_versions)
        else [str(int(sample.token_versions.min()))],
        status=Sample.Status(sample.status), metadata=metadata,
        remove_sample=bool(sample.metadata.get(REMOVED, False)),
    )
    for name, value in (attributes if isinstance(attributes, dict) else {}).items():
        if _own_attribute(name):
            setattr(restored, name, value)
    return restored


def to_wire(sample: Sample, group: PromptGroup, index: int, *, start_version: int) -> WireSample:
    """A slime sample produced for ``group`` back onto the wire.

    ``start_version`` is the engine's version when the plugin was called: the version given to response tokens
    whose version the plugin did not record (see the module docstring). The sample's own prompt and label win
    over the group's (a plugin that fills a leased slot with another task's trajectory, as the rollout-buffer
    client does, says which task it was).
    """
    where = f"slime-style sample {group.group_id}/{index}"
    n = int(sample.response_length)
    if not 0 <= n <= len(sample.tokens):
        raise ValueError(f"{where}: response_length {n} outside 0..len(tokens)={len(sample.tokens)}")
    mask = [1] * n if sample.loss_mask is None else list(sample.loss_mask)
    if len(mask) != n:
        raise ValueError(f"{where}: loss_mask has {len(mask)} entries for response_length {n}")
    if sample.remove_sample:
        mask = [0] * n  # slime trains nothing of a removed sample
    log_probs = sample.rollout_log_probs
    if log_probs is not None and len(log_probs) != n:
        raise ValueError(f"{where}: rollout_log_probs has {len(log_probs)} entries for response_length {n}")
    versions = sample.token_versions if sample.token_versions is not None and len(sample.token_versions) == n \
        else [None] * n
    status = sample.status.value if isinstance(sample.status, Sample.Status) else str(sample.status)
    reward = sample.reward.get("reward") if isinstance(sample.reward, dict) else sample.reward
    return WireSample(
        sample_id=f"{group.group_id}/{index}", group_id=group.group_id, index=index,
        prompt=sample.prompt if sample.prompt else group.prompt,
        prompt_tokens=len(sample.tokens) - n, tokens=np.asarray(sample.tokens, dtype=np.int32),
        response=sample.response, response_length=n,
        label=group.label if sample.label is None else sample.label,
        reward=None if reward is None else float(reward), loss_mask=np.asarray(mask, dtype=np.int8),
        rollout_log_probs=None if log_probs is None else np.asarray(log_probs, dtype=np.float32),
        token_versions=np.asarray([start_version if v is None else v for v in versions], dtype=np.int32),
        status=status, metadata={**group.metadata, **sample.metadata, "data_index": group.data_index,
                                 **({REMOVED: True} if sample.remove_sample else {}), **_attributes(sample)},
        error=None,
    )


_FIELDS = frozenset(spec.name for spec in dataclasses.fields(Sample))


def _attributes(sample: Sample) -> dict[str, Any]:
    """`ATTRIBUTES`: the plain-data attributes a plugin set on `sample` beyond slime's fields ({} when none)."""
    carried = {name: value for name, value in vars(sample).items() if _own_attribute(name) and _plain(value)}
    return {ATTRIBUTES: carried} if carried else {}


def _own_attribute(name: str) -> bool:
    return name.isidentifier() and not name.startswith("_") and name not in _FIELDS and not hasattr(Sample, name)


def _plain(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(item) for item in value)
    return isinstance(value, dict) and all(isinstance(key, str) and _plain(item) for key, item in value.items())


def to_wire_episode(samples: list[Sample], group: PromptGroup, index: int, *, start_version: int
                    ) -> list[WireSample]:
    """The samples one slime generate call returned for response ``index`` (a multi-agent system's, each agent's
    call a sample of its own) as one episode of segments, in the order returned.

    slime stamps such siblings with one ``rollout_id`` so that its loss reducer and step splitter count the
    rollout once; an episode is that here (``bus.episodes``): it counts once in its group and its batch, and its
    segments train in one step. Each segment forked from the one before it; the last ends the episode, so the
    reward scores its response and every segment carries that reward (a reward the plugin set on the last sample
    is kept).
    """
    if not samples:
        raise ValueError(f"slime-style episode {group.group_id}/{index}: no samples")
    wire = [to_wire(sample, group, index, start_version=start_version) for sample in samples]
    if len(wire) == 1:
        return wire
    return [msgspec.structs.replace(sample, sample_id=f"{sample.sample_id}.{number}" if number else sample.sample_id,
                                    segment=number, parent_segment=number - 1 if number else None,
                                    segments=len(wire), ends_episode=number == len(wire) - 1)
            for number, sample in enumerate(wire)]
