"""A slime-style samples -> train-data conversion that trains nothing of a truncated response.

slime's signature, loading unchanged with
``--custom-convert-samples-to-train-data-path examples.slime_style.train_data:skip_truncated``. It builds the dict
slime's own conversion builds, with two changes: a truncated sample's loss mask is all zeros (its unfinished answer
is neither rewarded nor punished), and the rewards are centred on their group's mean, since a conversion replaces
slime's reward post-process and so must normalise the rewards itself. A truncated sample's reward still counts in
its group's mean.
"""

from __future__ import annotations

from typing import Any

from actors.slime_compat import Sample


def skip_truncated(args: Any, samples: list[Sample]) -> dict[str, Any]:
    raw = [float(s.get_reward_value(args) or 0.0) for s in samples]
    groups: dict[Any, list[float]] = {}
    for sample, reward in zip(samples, raw, strict=True):
        groups.setdefault(sample.group_index, []).append(reward)
    means = {key: sum(values) / len(values) for key, values in groups.items()}
    truncated = [s.status == Sample.Status.TRUNCATED for s in samples]
    loss_masks = []
    for sample, cut in zip(samples, truncated, strict=True):
        mask = list(sample.loss_mask) if sample.loss_mask is not None else [1] * sample.response_length
        loss_masks.append([0] * sample.response_length if cut or sample.remove_sample else mask)
    data: dict[str, Any] = {
        "tokens": [s.tokens for s in samples],
        "response_lengths": [s.response_length for s in samples],
        "rewards": [reward - means[s.group_index] for s, reward in zip(samples, raw, strict=True)],
        "raw_reward": raw,
        "truncated": [int(cut) for cut in truncated],
        "sample_indices": [s.index for s in samples],
        "loss_masks": loss_masks,
    }
    if samples and samples[0].rollout_log_probs is not None:
        data["rollout_log_probs"] = [s.rollout_log_probs for s in samples]
    return data
