"""How a run reads its dataset as supervised conversations and how long it trains on it: slime's
`--loss-mask-type` and `--num-epoch`."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, Field

from actors.config.sections import Section

LOSS_MASK_TYPES = ("qwen", "qwen3", "qwen3_5", "distill_qwen")  # actors/data/loss_masks.py builds each


def check_loss_mask_type(value: str) -> str:
    """A built type, or an error that names the value and the types there are."""
    if value not in LOSS_MASK_TYPES:
        raise ValueError(f"loss_mask_type {value!r}: unknown; choose one of {', '.join(LOSS_MASK_TYPES)}")
    return value


class SftConfig(Section):
    """SFT on whole conversations, and the run's length in passes over its prompts."""

    loss_mask_type: Annotated[str, AfterValidator(check_loss_mask_type)] = Field(
        "qwen", description="with --loss-type sft, a record whose prompt is a whole conversation (chat messages) "
        "and that has no label is trained on its assistant messages, cut by this chat-template family: qwen "
        "(ChatML, each message a turn), qwen3 (each message rendered after a turn, tool results joined), qwen3_5 "
        "(the whole conversation rendered, its assistant turns cut by characters) or distill_qwen (the first "
        "message the prompt, the last the response); slime's --loss-mask-type")
    num_epoch: int | None = Field(
        None, ge=1, description="train for this many passes over --prompt-data: --num-rollout becomes num_epoch x "
        "(the records the buffer keeps // --rollout-batch-size), as slime derives it; a --num-rollout given "
        "as well wins")
