"""`--save-debug-train-data DIR`: what each learner rank trains on, one file per step, for post-hoc analysis.

slime saves the train side of every rollout (per-sample tokens, masks, advantages and log-probs) beside the rollout
dump. Here each learner rank writes its own share, after the advantages and `--rollout-data-postprocess-path` (what
the optimizer steps train on), to `DIR/train_{rollout_id:06d}_rank{R}.msgpack`: a plain msgpack map, readable by
any msgpack library (`read_train_data` here):

    format              "slipstream.train_data/1"
    rollout_id          the step's 0-based rollout id (batch_id - 1)
    rank                this learner rank
    data_parallel_rank, data_parallel_size    which share of the batch the file holds
    policy_version      the policy version the step started from
    samples             one map per sample, in the order the rank trained them:
        group_id            the prompt group it came from
        tokens              prompt then response token ids
        response_length     how many of `tokens` are the response
        reward              the scalar reward the advantages read (null for SFT)
        loss_mask, rollout_log_probs, old_log_probs, ref_log_probs, teacher_log_probs, advantages, values,
        returns             one number per response token, or null when the step did not compute it
                            (`engines.training.base.TokenFields` says what each is)

A slime `{rollout_id}` template given as the path is read as its folder, as `--save-debug-rollout-data` is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from engines.training.base import TOKEN_FIELDS, DataParallel, TrainSample

FORMAT = "slipstream.train_data/1"


def train_data_path(directory: Path, rollout_id: int, rank: int) -> Path:
    return directory / f"train_{rollout_id:06d}_rank{rank}.msgpack"


def _sample(sample: TrainSample, group_id: str) -> dict[str, Any]:
    row: dict[str, Any] = {"group_id": group_id, "tokens": sample.tokens.tolist(),
                           "response_length": int(sample.response_length),
                           "reward": None if sample.reward is None else float(sample.reward)}
    for name in TOKEN_FIELDS:
        value = getattr(sample, name)
        row[name] = None if value is None else value.detach().float().cpu().tolist()
    return row


def write_train_data(directory: Path, *, rollout_id: int, rank: int, parallel: DataParallel, version: int,
                     samples: list[TrainSample], group_ids: list[str]) -> Path:
    """Write one rank's step; the file appears whole (written aside, then renamed)."""
    payload = {"format": FORMAT, "rollout_id": rollout_id, "rank": rank, "data_parallel_rank": parallel.rank,
               "data_parallel_size": parallel.size, "policy_version": version,
               "samples": [_sample(sample, group) for sample, group in zip(samples, group_ids, strict=True)]}
    directory.mkdir(parents=True, exist_ok=True)
    path = train_data_path(directory, rollout_id, rank)
    partial = path.with_suffix(".partial")
    partial.write_bytes(msgspec.msgpack.encode(payload))
    partial.replace(path)
    return path


def read_train_data(path: Path) -> dict[str, Any]:
    """One file written by `write_train_data`; an error names the file when it is not one."""
    try:
        payload = msgspec.msgpack.decode(Path(path).read_bytes())
    except msgspec.DecodeError as error:
        raise ValueError(f"{path}: not a msgpack train-data file ({error})") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise ValueError(f"{path}: expected format {FORMAT!r}, found {found!r}")
    return payload
