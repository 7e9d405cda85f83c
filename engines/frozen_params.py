"""slime's parameter freezing by name (`--only-train-params-name-list`, `--freeze-params-name-list`), for any
trainer's model.

slime's rule: each entry is a Python regular expression searched in a parameter's name (`re.search`, so a plain
substring matches too); only-train freezes every parameter that no entry matches, freeze freezes those that one
does. A frozen parameter gets `requires_grad=False` before the optimizer is built, so it has no gradient and no
optimizer state. Names are the model's own: Hugging Face's on the torch backend (`model.embed_tokens.weight`),
megatron-core's on the Megatron backend (`embedding.word_embeddings.weight`), which are the names slime's scripts
write. Only parameters the run trains are considered: with LoRA that is the adapter, and an entry never unfreezes
a weight the run keeps frozen anyway.

Stricter than slime, which ignores an entry that matches nothing: here that entry is an error naming the flag and
showing some real names, since a typo would otherwise train (or freeze) what the user meant to keep. A model split
over pipeline stages checks the entries over all of them (`gather`): a stage may hold none of a pattern's layers.

Torch-free at import (outside `engines.training`, whose package imports torch): the run config checks the lists
with the same rules on actors that never load torch.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

ONLY_TRAIN_FLAG = "--only-train-params-name-list"
FREEZE_FLAG = "--freeze-params-name-list"
_SHOWN_NAMES = 6

Gather = Callable[[Any], list[Any]]
"""Every rank's copy of a picklable object (`torch.distributed.all_gather_object`); one rank: `[obj]`."""


def _alone(mine: Any) -> list[Any]:
    return [mine]


def check_patterns(flag: str, patterns: Sequence[str]) -> None:
    """Each entry of one list is a regular expression; the error names the flag and the entry."""
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as error:
            raise ValueError(f"{flag} {pattern!r}: not a regular expression ({error})") from None


def check_name_lists(only_train: Sequence[str], freeze: Sequence[str]) -> None:
    """What can be said before a model exists: one list at most (as slime asserts), each entry a regex."""
    if only_train and freeze:
        raise ValueError(f"{ONLY_TRAIN_FLAG} and {FREEZE_FLAG} were both given; give one of them (as in slime)")
    check_patterns(ONLY_TRAIN_FLAG, only_train)
    check_patterns(FREEZE_FLAG, freeze)


def frozen_names(names: Sequence[str], only_train: Sequence[str], freeze: Sequence[str]) -> list[str]:
    """Which of `names` slime's rule freezes (module docstring)."""
    patterns = [re.compile(pattern) for pattern in (only_train or freeze)]
    keep_matches = bool(only_train)
    return [name for name in names if any(p.search(name) for p in patterns) != keep_matches]


def freeze_by_name(model: nn.Module, only_train: Sequence[str], freeze: Sequence[str], *,
                   gather: Gather = _alone) -> list[str]:
    """Freeze `model`'s trainable parameters by slime's rule and return the frozen names (none without a list).

    Call on every rank before the optimizer and any DDP wrapper are built. Raises ValueError (on every rank alike)
    naming the flag when an entry matches no trainable parameter anywhere, or when nothing would be left to train.
    """
    check_name_lists(only_train, freeze)
    if not only_train and not freeze:
        return []
    flag, patterns = (ONLY_TRAIN_FLAG, list(only_train)) if only_train else (FREEZE_FLAG, list(freeze))
    trainable = {name: parameter for name, parameter in model.named_parameters() if parameter.requires_grad}
    matched = {pattern for pattern in patterns for name in trainable if re.search(pattern, name)}
    frozen = frozen_names(list(trainable), only_train, freeze)
    reports = gather((sorted(matched), len(trainable) - len(frozen), list(trainable)[:_SHOWN_NAMES]))
    matched_anywhere = {pattern for report in reports for pattern in report[0]}
    missing = [pattern for pattern in patterns if pattern not in matched_anywhere]
    if missing:
        examples = ", ".join(dict.fromkeys(name for report in reports for name in report[2]))
        raise ValueError(f"{flag} {' '.join(patterns)}: {', '.join(map(repr, missing))} matches no trainable "
                         f"parameter name (Python regular expressions, searched in each name as slime does); the "
                         f"names look like: {examples}")
    if sum(report[1] for report in reports) == 0:
        raise ValueError(f"{flag} {' '.join(patterns)}: freezes every trainable parameter; nothing would train")
    for name in frozen:
        trainable[name].requires_grad_(False)
    return frozen
