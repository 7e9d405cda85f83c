"""The learner's step on real samples from the real torch engine and trainer, without sockets."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from actors.config import build_config
from actors.learner_step import TrainingStep, data_parallel_shard
from actors.rollout_generate import RolloutContext, default_generate, sft_generate
from bus.schema import PromptGroup, Sample
from engines.inference.torch_engine import TorchEngine
from engines.training.config import TorchTrainerConfig
from engines.training.torch_trainer import TorchTrainer


def generate(model: Path, config, groups: list[PromptGroup], *, sft: bool = False) -> list[Sample]:
    async def run() -> list[Sample]:
        from transformers import AutoTokenizer

        engine = TorchEngine.from_pretrained(model, max_batch_size=16, seed=0)
        context = RolloutContext(engine=engine, tokenizer=AutoTokenizer.from_pretrained(model), config=config,
                                 worker_id="w")
        try:
            produce = sft_generate if sft else default_generate
            batches = await asyncio.gather(*(produce(context, group) for group in groups))
        finally:
            await engine.close()
        return [sample for batch in batches for sample in batch]

    return asyncio.run(run())


def groups(n: int) -> list[PromptGroup]:
    return [PromptGroup(group_id=f"g{i}", prompt=f"{i}+{i}=", label=str(2 * i), n_samples=n, data_index=i)
            for i in range(3)]


def weights(trainer: TorchTrainer) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in trainer.named_tensors()}


@pytest.mark.integration
def test_grpo_step_on_engine_samples_moves_the_policy(tiny_model_path: Path) -> None:
    config = build_config({"hf_checkpoint": str(tiny_model_path), "n_samples_per_prompt": 4,
                           "rollout_max_response_len": 5, "advantage_estimator": "grpo", "lr": 1e-2})
    samples = generate(tiny_model_path, config, groups(4))
    rewards = np.resize([1.0, 0.0, 0.0, 1.0], len(samples))
    samples = [s.__class__(**{**{f: getattr(s, f) for f in s.__struct_fields__}, "reward": float(r)})
               for s, r in zip(samples, rewards, strict=True)]
    trainer = TorchTrainer(TorchTrainerConfig(model_path=tiny_model_path, lr=1e-2))
    before = weights(trainer)
    report = TrainingStep(trainer, config).train(samples, staleness=[0] * len(samples))
    assert not report.result.skipped and trainer.version == 1
    after = weights(trainer)
    assert any(not torch.equal(before[name], after[name]) for name in before)
    assert report.metrics["rollout/reward_mean"] == pytest.approx(float(np.mean(rewards)))
    # The engine's log-probs are the learner's at version parity, so TIS weights are 1 before the update.
    assert report.metrics["train_rollout_logprob_abs_diff"] < 1e-4


@pytest.mark.integration
def test_sft_step_raises_the_likelihood_of_the_labels(tiny_model_path: Path) -> None:
    config = build_config({"hf_checkpoint": str(tiny_model_path), "n_samples_per_prompt": 1, "loss_type": "sft",
                           "lr": 1e-2})
    samples = generate(tiny_model_path, config, groups(1), sft=True)
    assert [s.response for s in samples] == ["0", "2", "4"]
    trainer = TorchTrainer(TorchTrainerConfig(model_path=tiny_model_path, lr=1e-2))
    step = TrainingStep(trainer, config)
    first = step.train(samples, staleness=[0, 0, 0]).metrics["loss"]
    for _ in range(5):
        last = step.train(samples, staleness=[0, 0, 0]).metrics["loss"]
    assert last < first


@pytest.mark.integration
def test_tis_weights_samples_from_older_weights(tiny_model_path: Path) -> None:
    """With a correction on, pi_old comes from the learner, so stale samples get weights != 1."""
    config = build_config({"hf_checkpoint": str(tiny_model_path), "n_samples_per_prompt": 4,
                           "rollout_max_response_len": 5, "off_policy_correction": "tis", "lr": 5e-2})
    samples = generate(tiny_model_path, config, groups(4))
    samples = [s.__class__(**{**{f: getattr(s, f) for f in s.__struct_fields__}, "reward": float(i % 2)})
               for i, s in enumerate(samples)]
    trainer = TorchTrainer(TorchTrainerConfig(model_path=tiny_model_path, lr=5e-2))
    step = TrainingStep(trainer, config)
    fresh = step.train(samples, staleness=[0] * len(samples)).metrics
    stale = step.train(samples, staleness=[1] * len(samples)).metrics  # the policy moved since generation
    assert fresh["is_weight_abs_dev"] < 1e-4
    assert stale["is_weight_abs_dev"] > 1e-3


@pytest.mark.unit
def test_data_parallel_shards_partition_the_batch_into_whole_balanced_groups() -> None:
    group_ids = ["a", "a", "b", "b", "c", "c", "d", "d", "e", "e"]
    lengths = [9, 9, 1, 1, 4, 4, 3, 3, 2, 2]
    shards = [data_parallel_shard(group_ids, lengths, rank=rank, size=2) for rank in range(2)]
    assert sorted(shards[0] + shards[1]) == list(range(len(group_ids)))
    for shard in shards:
        groups = {group_ids[i] for i in shard}
        assert sorted(shard) == sorted(i for i, g in enumerate(group_ids) if g in groups), "a group was split"
    tokens = [sum(lengths[i] for i in shard) for shard in shards]
    assert abs(tokens[0] - tokens[1]) <= 2 * max(lengths), tokens
    # a (18 tokens) fills rank 0; c, d, e (18) fill rank 1; b goes to the rank holding fewer groups at the tie.
    assert [{group_ids[i] for i in shard} for shard in shards] == [{"a", "b"}, {"c", "d", "e"}]


@pytest.mark.unit
def test_too_few_groups_for_the_data_parallel_ranks_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="2 groups cannot feed 4 data-parallel ranks"):
        data_parallel_shard(["a", "b"], [1, 1], rank=0, size=4)
