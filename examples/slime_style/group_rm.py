"""A batched group reward model in slime's style: ``async rm(args, samples) -> list[float]`` under ``--group-rm``.

Correctness is the label appearing as the last number of the response; among correct samples, a response whose
text repeats another sample's of the same group earns ``DUPLICATE_PENALTY`` less (a diversity term that only a
group reward can compute). Run with ``--custom-rm-path examples.slime_style.group_rm:rm --group-rm``.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from actors.slime_compat import Sample

DUPLICATE_PENALTY = 0.25


def last_number(text: str) -> str | None:
    found = re.findall(r"-?\d+", text)
    return found[-1] if found else None


async def rm(args: Any, samples: list[Sample], **kwargs: Any) -> list[float]:
    counts = Counter(s.response.strip() for s in samples)
    rewards = []
    for sample in samples:
        correct = sample.label is not None and last_number(sample.response) == str(sample.label).strip()
        duplicate = counts[sample.response.strip()] > 1
        rewards.append((1.0 if correct else 0.0) - (DUPLICATE_PENALTY if duplicate else 0.0))
    return rewards
