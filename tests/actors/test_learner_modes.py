"""The learner's debug modes as strategies: recording and replaying batches, and training that only counts."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from actors.config import build_config
from actors.learner.modes import CountingOnly, Progress, RecordedBatches, Recording, pick_source, subsampled
from bus.schema import Batch, Sample


class Fixed:
    """A source that yields given batches in order (stands in for the buffer, which needs sockets)."""

    def __init__(self, batches: list[Batch]) -> None:
        self.batches = batches
        self.finished = False

    async def next(self, progress: Progress, *, ahead: bool = False) -> Batch | None:
        return self.batches[progress.trained_batch] if progress.trained_batch < len(self.batches) else None

    async def finish(self, progress: Progress) -> None:
        self.finished = True


def at(trained_batch: int) -> Progress:
    return Progress(learner_version=trained_batch, trained_batch=trained_batch, checkpointed_batch=0)


@pytest.mark.unit
def test_a_recording_replays_batch_for_batch_and_a_gap_names_the_missing_file(tmp_path: Path) -> None:
    batches = [Batch(batch_id=i, samples=[], staleness=[], learner_version=i - 1) for i in (1, 2)]
    inner = Fixed(batches)
    recorder = Recording(inner, tmp_path / "recording")

    async def scenario() -> list[Batch | None]:
        seen = [await recorder.next(at(i)) for i in range(3)]
        await recorder.finish(at(2))
        replay = RecordedBatches(tmp_path / "recording")
        replayed = [await replay.next(at(i)) for i in range(2)]
        with pytest.raises(FileNotFoundError, match=r"batch_000003\.msgpack missing \(batch 3\)"):
            await replay.next(at(2))
        return seen + replayed

    seen = asyncio.run(scenario())
    assert seen == [*batches, None, *batches]
    assert inner.finished, "the recorder passes the final commit on to the source it wraps"


@pytest.mark.unit
def test_rollout_only_training_counts_versions_and_keeps_no_model() -> None:
    training = CountingOnly()
    batch = Batch(batch_id=1, samples=[], staleness=[])
    assert asyncio.run(training.train(batch)) is None
    assert asyncio.run(training.train(batch)) is None
    assert training.version == 2
    assert not training.keeps_model and not training.publishes


@pytest.mark.unit
def test_sources_are_picked_once_from_the_debug_flags(tmp_path: Path) -> None:
    config = build_config({"hf_checkpoint": str(tmp_path), "debug_train_only": True,
                           "load_debug_rollout_data": str(tmp_path / "in"),
                           "save_debug_rollout_data": str(tmp_path / "out")})
    source = pick_source(config, buffer=None, counters=None, log=None)
    assert isinstance(source, Recording) and isinstance(source.inner, RecordedBatches)
    assert source.directory == tmp_path / "out" and source.inner.directory == tmp_path / "in"


@pytest.mark.unit
def test_a_subsampled_replay_trains_whole_groups_from_the_batchs_start_and_end(tmp_path: Path) -> None:
    """slime's --load-debug-rollout-data-subsample keeps int(n x fraction) rows, half from the start of the batch and
    the rest from its end; here the rows are whole groups, so each group's baseline still has its group."""
    samples = [Sample(sample_id=f"g{g}/{i}", group_id=f"g{g}", index=i, prompt="p") for g in range(5) for i in (0, 1)]
    recorded = Batch(batch_id=1, samples=samples, staleness=[g for g in range(5) for _ in (0, 1)])
    asyncio.run(Recording(Fixed([recorded]), tmp_path).next(at(0)))
    config = build_config({"hf_checkpoint": str(tmp_path), "debug_train_only": True,
                           "load_debug_rollout_data": str(tmp_path), "load_debug_rollout_data_subsample": 0.6})
    batch = asyncio.run(pick_source(config, buffer=None, counters=None, log=None).next(at(0)))
    assert [s.sample_id for s in batch.samples] == ["g0/0", "g0/1", "g3/0", "g3/1", "g4/0", "g4/1"]
    assert batch.staleness == [0, 0, 3, 3, 4, 4]  # each sample keeps its own
    assert [s.group_id for s in subsampled(recorded, 0.01).samples] == ["g4", "g4"]  # never an empty batch
    with pytest.raises(ValueError, match="load_debug_rollout_data_subsample needs load_debug_rollout_data"):
        build_config({"load_debug_rollout_data_subsample": 0.5})


def slime_sample(index: int, group_index: int, reward: object, **extra: object) -> dict[str, object]:
    """One sample as slime's `Sample.to_dict()` writes it into a rollout dump (every field, status as its value)."""
    return {"group_index": group_index, "index": index, "rollout_id": None, "prompt": f"{group_index}+1=",
            "tokens": [5, 6, 7, 8, 9], "multimodal_inputs": None, "multimodal_train_inputs": None, "response": "ab",
            "response_length": 2, "label": str(group_index + 1), "reward": reward, "loss_mask": None,
            "weight_versions": ["3"], "rollout_log_probs": [-0.5, -0.25], "remove_sample": False,
            "status": "completed", "metadata": {"source": "dump"}, "train_metadata": None,
            "spec_info": {"spec_accept_token_num": 0}, "prefix_cache_info": {"cached_tokens": 0}, **extra}


@pytest.mark.unit
def test_slimes_rollout_dumps_replay_as_batches_of_whole_groups(tmp_path: Path) -> None:
    """--load-forge-rollout-data: slime's torch-saved dumps, read without unpickling code; a {rollout_id} template
    falls back to its 0 file; groups by group_index; remove_sample trains nothing; a dict reward at --reward-key;
    tokens at the learner's version."""
    import torch

    samples = [slime_sample(0, 7, {"acc": 1.0}), slime_sample(1, 7, {"acc": 0.0}, remove_sample=True),
               slime_sample(2, 9, {"acc": 0.5}), slime_sample(3, 9, {"acc": 0.0}, loss_mask=[0, 1])]
    torch.save({"rollout_id": 0, "samples": samples}, tmp_path / "0.pt")
    torch.save({"rollout_id": 1, "samples": samples[:2]}, tmp_path / "1.pt")
    config = build_config({"hf_checkpoint": str(tmp_path), "n_samples_per_prompt": 2, "reward_key": "acc",
                           "load_debug_rollout_data": str(tmp_path / "{rollout_id}.pt")})
    source = pick_source(config, buffer=None, counters=None, log=None)
    first, second, third = (asyncio.run(source.next(Progress(learner_version=v, trained_batch=v,
                                                             checkpointed_batch=0))) for v in (0, 1, 2))
    assert [len(b.samples) for b in (first, second, third)] == [4, 2, 4]  # batch 3 has no 2.pt: 0.pt again
    assert [(s.group_id, s.index) for s in first.samples] == [("forge-1-0", 0), ("forge-1-0", 1), ("forge-1-1", 0),
                                                              ("forge-1-1", 1)]
    assert [s.reward for s in first.samples] == [1.0, 0.0, 0.5, 0.0]
    assert [s.loss_mask.tolist() for s in first.samples] == [[1, 1], [0, 0], [1, 1], [0, 1]]
    assert first.samples[1].metadata["remove_sample"] is True
    assert third.samples[0].token_versions.tolist() == [2, 2] and third.staleness == [0, 0, 0, 0]
    assert first.samples[0].prompt_tokens == 3 and first.samples[0].metadata["data_index"] == 7
    assert first.samples[0].rollout_log_probs.tolist() == [-0.5, -0.25]


@pytest.mark.unit
def test_a_rollout_dump_of_pickled_objects_is_refused_not_unpickled(tmp_path: Path) -> None:
    import numpy as np
    import torch

    torch.save({"samples": [slime_sample(0, 0, 1.0, rollout_log_probs=np.zeros(2))]}, tmp_path / "dump.pt")
    config = build_config({"hf_checkpoint": str(tmp_path), "n_samples_per_prompt": 1,
                           "load_debug_rollout_data": str(tmp_path / "dump.pt")})
    source = pick_source(config, buffer=None, counters=None, log=None)
    with pytest.raises(ValueError, match=r"--load-forge-rollout-data .*dump\.pt: not a dump of plain values "
                                         r"\(torch\.load weights_only=True refused it"):
        asyncio.run(source.next(at(0)))
    torch.save({"samples": [slime_sample(0, 0, None)]}, tmp_path / "unscored.pt")
    config = config.with_settings(load_debug_rollout_data=str(tmp_path / "unscored.pt"))
    with pytest.raises(ValueError, match=r"unscored\.pt: sample 0: reward None is not a number"):
        asyncio.run(pick_source(config, buffer=None, counters=None, log=None).next(at(0)))
