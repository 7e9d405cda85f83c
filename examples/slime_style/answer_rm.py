"""A per-sample reward model in slime's style: ``async rm(args, sample, **kwargs) -> float``.

1 when the label is the last number of the response, else 0 (slime's math RMs also read the final answer). Run
with ``--custom-rm-path examples.slime_style.answer_rm.rm``; the batched form is ``group_rm.py``.
"""

from __future__ import annotations

from typing import Any

from actors.slime_compat import Sample
from examples.slime_style.group_rm import last_number


async def rm(args: Any, sample: Sample, **kwargs: Any) -> float:
    return float(sample.label is not None and last_number(sample.response) == str(sample.label).strip())
