"""The foundations of the wire schema: the schema version, broadcast topics, the message and record base classes,
and the field helpers (`doc`, `tensor`, tensor checks) that every message in ``bus.schema`` is written with.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
import numpy as np

SCHEMA_VERSION = 1

# Broadcast topics the controller publishes on (Publisher/Subscriber); exact names, not prefixes.
TOPIC_ROSTER = "roster"
TOPIC_VERSION = "version"
TOPIC_CONTROL = "control"
TOPIC_RUN_STATE = "run_state"


class _DefaultVersion(int):
    """The default of ``Message.v``: equal to SCHEMA_VERSION but distinguishable by identity.

    A decoded message whose ``v`` *is* this object had no "v" key on the wire; the codec rejects such a
    top-level frame (reason "bad_version") while constructing a message in code needs no ``v`` argument.
    The codec's encode hook writes it as a plain int.
    """


DEFAULT_VERSION = _DefaultVersion(SCHEMA_VERSION)


def doc(text: str) -> msgspec.Meta:
    """Field documentation, kept next to the field and rendered into docs/wire-protocol.md."""
    return msgspec.Meta(description=text)


def tensor(dtypes: str, text: str) -> msgspec.Meta:
    """A tensor field: its allowed wire dtypes ("int32" or "uint8|bool|float32") and its meaning."""
    return msgspec.Meta(description=text, extra={"dtypes": tuple(dtypes.split("|"))})


class Message(msgspec.Struct, tag_field="type", tag=True, kw_only=True):
    """Base of every message; never sent itself."""

    v: Annotated[int, doc("schema version; receivers reject frames whose version they do not speak")] = DEFAULT_VERSION


class Record(msgspec.Struct):
    """Base of nested plain records (no "type", no "v")."""


def _check_tensor(owner: str, name: str, value: Any, dtypes: tuple[np.dtype, ...], length: int | None) -> Any:
    """Coerce lists to arrays of the first allowed dtype; reject wrong dtypes, ranks and lengths."""
    if value is None:
        return None
    if not isinstance(value, np.ndarray):
        if isinstance(value, (list, tuple)):
            value = np.asarray(value, dtype=dtypes[0])
        else:
            raise ValueError(f"{owner}.{name}: expected a 1-D numpy array, got {type(value).__name__}")
    if value.dtype not in dtypes:  # dtype == is C-level; dtype.name is a slow Python property
        expected = " or ".join(dt.name for dt in dtypes)
        raise ValueError(f"{owner}.{name}: dtype {value.dtype.name}, expected {expected}")
    if value.ndim != 1:
        raise ValueError(f"{owner}.{name}: expected a 1-D array, got shape {list(value.shape)}")
    if length is not None and len(value) != length:
        raise ValueError(f"{owner}.{name}: {len(value)} entries, expected {length} (one per response token)")
    return value


def check_graded_steps(owner: str, ends: Any, rewards: Any, response_length: int) -> tuple[Any, Any]:
    """Graded steps come as a pair of arrays, one entry a step (int32 ends, float32 rewards), each step ending on a
    response token, in order, with a finite reward; returned coerced, or a ValueError naming what is wrong."""
    if (ends is None) != (rewards is None):
        raise ValueError(f"{owner}.step_ends and {owner}.step_rewards come together (one entry per graded step); got "
                         f"only {'step_ends' if rewards is None else 'step_rewards'}")
    if ends is None:
        return None, None
    ends = _check_tensor(owner, "step_ends", ends, (np.dtype("int32"),), None)
    rewards = _check_tensor(owner, "step_rewards", rewards, (np.dtype("float32"),), None)
    if len(rewards) != len(ends):
        raise ValueError(f"{owner}.step_rewards: {len(rewards)} entries for {len(ends)} step_ends (one per graded "
                         "step)")
    if len(ends) and (ends[0] < 0 or ends[-1] >= response_length or bool(np.any(ends[1:] < ends[:-1]))):
        raise ValueError(f"{owner}.step_ends: {ends.tolist()[:8]} must be response token indices in "
                         f"0..{response_length - 1}, in order")
    if not np.isfinite(rewards).all():
        raise ValueError(f"{owner}.step_rewards: every step's reward must be finite")
    return ends, rewards
