"""The learner's step on real samples from the real torch engine and trainer, without sockets."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from actors.config import build_config
from actors.learner.ranks import data_parallel_shares
from actors.learner.stages import StepBatch, add_advantages, data_parallel_shard, own_shard, with_gradient
from actors.learner.step import TrainingStep
from actors.rollout.generate import RolloutContext, default_generate
from actors.rollout.sft import sft_generate
from bus.schema import Batch, PromptGroup, Sample
from engines.inference.torch_engine import TorchEngine
from engines.training.base import DataParallel, ModelOutputs, ModelRole, TrainSample
from engines.training.config import TorchTrainerConfig
from engines.training.torch_trainer import TorchTrainer
from policies.config import PolicyLossConfig
from tests.support.rendezvous import rendezvous_file


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


class CountingTrainer(TorchTrainer):
    """The real trainer, recording which no-grad forwards the step asks for."""

    def __init__(self, config: TorchTrainerConfig) -> None:
        super().__init__(config)
        self.forwards: list[str] = []

    def compute_log_probs(self, samples: Sequence[TrainSample], *, temperature: float, with_entropy: bool = False,
                          model: ModelRole = "policy") -> ModelOutputs:
        self.forwards.append(model)
        return super().compute_log_probs(samples, temperature=temperature, with_entropy=with_entropy, model=model)


@pytest.fixture(scope="module")
def scored_samples(tiny_model_path: Path) -> list[Sample]:
    config = build_config({"hf_checkpoint": str(tiny_model_path), "n_samples_per_prompt": 4,
                           "rollout_max_response_len": 5})
    samples = generate(tiny_model_path, config, groups(4))
    return [s.__class__(**{**{f: getattr(s, f) for f in s.__struct_fields__}, "reward": float(i % 2)})
            for i, s in enumerate(samples)]


@pytest.mark.integration
@pytest.mark.parametrize("flags", [{"off_policy_correction": "tis", "tis_clip": 1.001},
                                   {"use_decoupled_ppo": True, "off_policy_correction": "none"}],
                         ids=["tis", "decoupled-ppo"])
def test_pi_old_from_the_training_forward_takes_the_same_steps_as_a_separate_forward(
        tiny_model_path: Path, scored_samples: list[Sample], flags: dict) -> None:
    """Two steps on the same samples (the second on samples one version stale, so ratios and clipping bite)."""
    config = build_config({"hf_checkpoint": str(tiny_model_path), "n_samples_per_prompt": 4, "lr": 1e-2, **flags})
    updated = {}
    for pi_old in ("separate_forward", None):
        trainer = CountingTrainer(TorchTrainerConfig(model_path=tiny_model_path, lr=1e-2, eps=1.0,
                                                     check_packing=False))
        step = TrainingStep(trainer, config, pi_old=pi_old)
        metrics = [step.train(scored_samples, staleness=[s] * len(scored_samples)).metrics for s in (0, 1)]
        assert trainer.version == 2
        assert trainer.forwards == (["policy", "policy"] if pi_old else []), trainer.forwards
        updated[step.pi_old] = (weights(trainer), metrics[1])
    assert set(updated) == {"separate_forward", "training_forward"}  # the rule picked the cheap path by itself
    (separate, separate_metrics), (reused, reused_metrics) = updated["separate_forward"], updated["training_forward"]
    if "is_clipfrac" in separate_metrics:  # TIS: the stale step's weights were clipped, so pi_old / mu mattered
        assert separate_metrics["is_clipfrac"] > 0
    assert reused_metrics["loss"] == pytest.approx(separate_metrics["loss"], rel=1e-5, abs=1e-7)
    for name, tensor in separate.items():
        torch.testing.assert_close(reused[name], tensor, atol=1e-6, rtol=0, msg=name)


@pytest.mark.integration
def test_mis_still_computes_pi_old_before_the_step(tiny_model_path: Path, scored_samples: list[Sample]) -> None:
    """MIS rejects tokens by pi_old / mu, which changes the denominators every micro-batch divides by."""
    config = build_config({"hf_checkpoint": str(tiny_model_path), "n_samples_per_prompt": 4,
                           "off_policy_correction": "mis"})
    trainer = CountingTrainer(TorchTrainerConfig(model_path=tiny_model_path, check_packing=False))
    step = TrainingStep(trainer, config)
    assert step.pi_old == "separate_forward"
    step.train(scored_samples, staleness=[0] * len(scored_samples))
    assert trainer.forwards == ["policy"]


@pytest.mark.integration
def test_rank_zero_cuts_each_data_parallel_rank_only_its_share(scored_samples: list[Sample]) -> None:
    batch = Batch(batch_id=4, samples=scored_samples, staleness=list(range(len(scored_samples))))
    shares = data_parallel_shares(batch, 2)
    group_ids = [s.group_id for s in scored_samples]
    lengths = [int(s.response_length) for s in scored_samples]
    for rank, share in enumerate(shares):
        mine = data_parallel_shard(group_ids, lengths, rank=rank, size=2)
        assert [s.sample_id for s in share.samples] == [scored_samples[i].sample_id for i in mine]
        assert share.staleness == mine  # each sample keeps its own staleness
        assert share.batch_id == 4
    assert sum(len(share.samples) for share in shares) == len(scored_samples)


def _whitening_batch() -> StepBatch:
    generator = torch.Generator().manual_seed(5)
    samples, group_ids = [], []
    for index in range(8):
        response = 2 + index % 3
        samples.append(TrainSample(torch.randint(6, 100, (response + 3,), generator=generator), response,
                                   loss_mask=torch.ones(response), reward=float(torch.rand((), generator=generator))))
        group_ids.append(f"g{index // 2}")
    return StepBatch(samples=samples, group_ids=group_ids)


WHITENED = PolicyLossConfig(advantage_estimator="grpo", normalize_advantages=True)


def _whiten_on_rank(rank: int, rendezvous: str, out_dir: Path) -> None:
    torch.distributed.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=2)
    try:
        batch = _whitening_batch()
        ids = {id(sample): index for index, sample in enumerate(batch.samples)}
        share = own_shard(batch, DataParallel(rank=rank, size=2, group=None))  # the torch trainer's default group
        add_advantages(WHITENED, share, DataParallel(rank=rank, size=2, group=None))
        torch.save({ids[id(s)]: s.advantages for s in share.samples}, out_dir / f"rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.integration
def test_advantage_whitening_spans_the_data_parallel_ranks(tmp_path: Path) -> None:
    torch.multiprocessing.spawn(_whiten_on_rank, args=(rendezvous_file(), tmp_path), nprocs=2, join=True)
    whole = _whitening_batch()
    add_advantages(WHITENED, whole, DataParallel(rank=0, size=1))
    sharded = {**torch.load(tmp_path / "rank0.pt"), **torch.load(tmp_path / "rank1.pt")}
    assert sorted(sharded) == list(range(len(whole.samples)))
    for index, sample in enumerate(whole.samples):
        torch.testing.assert_close(sharded[index], sample.advantages, atol=1e-6, rtol=1e-5)


def slime_post_process(args, samples):
    """slime's `(args, samples) -> (raw_rewards, rewards)`: here a reward by position in the group."""
    return [s.reward for s in samples], [float(s.index) - 1.5 for s in samples]


@pytest.mark.integration
def test_a_slime_reward_post_process_gives_the_rewards_the_step_trains_on_as_they_are(tiny_model_path: Path) -> None:
    flags = {"hf_checkpoint": str(tiny_model_path), "n_samples_per_prompt": 4, "rollout_max_response_len": 5,
             "lr": 1e-2, "off_policy_correction": "none"}
    samples = with_rewards(generate(tiny_model_path, build_config(flags), groups(4)), [1.0, 0.0, 0.0, 0.0])
    config = build_config({**flags, "custom_reward_post_process_path": f"{__name__}:slime_post_process"})
    report = TrainingStep(TorchTrainer(TorchTrainerConfig(model_path=tiny_model_path, lr=1e-2)), config).train(
        samples, staleness=[0] * len(samples))
    assert report.metrics["rollout/reward_mean"] == 0.25  # the reward workers' (raw) rewards
    assert report.metrics["rollout/post_processed_reward_mean"] == pytest.approx(0.0)
    # -1.5 .. 1.5 per group, trained as they are: a group baseline with std normalisation would give +-1.16.
    assert (report.metrics["advantage_min"], report.metrics["advantage_max"]) == pytest.approx((-1.5, 1.5))


def with_rewards(samples: list[Sample], rewards: Sequence[float]) -> list[Sample]:
    return [s.__class__(**{**{f: getattr(s, f) for f in s.__struct_fields__}, "reward": float(r)})
            for s, r in zip(samples, np.resize(rewards, len(samples)), strict=True)]


@pytest.mark.integration
def test_a_batch_prepared_beside_the_previous_step_trains_exactly_as_one_prepared_after_it(
        tiny_model_path: Path) -> None:
    """The learner scores batch k+1 with the reference model on a second thread while batch k trains; that
    must change nothing: the reference does not move, and pi_old and the advantages wait for the step."""
    from concurrent.futures import ThreadPoolExecutor

    config = build_config({"hf_checkpoint": str(tiny_model_path), "n_samples_per_prompt": 4,
                           "rollout_max_response_len": 5, "advantage_estimator": "grpo", "lr": 1e-2,
                           "use_kl_loss": True, "kl_loss_coef": 0.1, "kl_loss_type": "low_var_kl",
                           "off_policy_correction": "tis"})
    samples = generate(tiny_model_path, config, groups(4))
    first, second = with_rewards(samples[:8], [1.0, 0.0]), with_rewards(samples[4:], [0.0, 1.0, 1.0])

    def two_steps(beside: bool) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        trainer = TorchTrainer(TorchTrainerConfig(model_path=tiny_model_path, ref_model_path=tiny_model_path,
                                                  lr=1e-2))
        assert trainer.prepares_beside_training
        step = TrainingStep(trainer, config)
        prepared = step.prepare(first, [0] * len(first))
        assert all(s.ref_log_probs is not None and s.old_log_probs is None for s in prepared.batch.samples)
        if beside:
            with ThreadPoolExecutor(1) as pool:
                upcoming = pool.submit(step.prepare, second, [1] * len(second))
                step.train_prepared(prepared)
                ahead = upcoming.result()
        else:
            step.train_prepared(prepared)
            ahead = step.prepare(second, [1] * len(second))
        report = step.train_prepared(ahead)
        return weights(trainer), report.metrics

    after_beside, metrics_beside = two_steps(beside=True)
    after_sequential, metrics_sequential = two_steps(beside=False)
    assert all(torch.equal(after_beside[name], after_sequential[name]) for name in after_sequential)
    assert metrics_beside["loss"] == metrics_sequential["loss"] and metrics_beside["staleness/max"] == 1.0


class SampleCountingTrainer(TorchTrainer):
    """The real trainer, counting the samples each step runs."""

    trained: list[int]

    def train_step(self, samples, loss, **options):
        self.trained = [*getattr(self, "trained", []), len(samples)]
        return super().train_step(samples, loss, **options)


@pytest.mark.integration
@pytest.mark.parametrize("loss", ["ppo", "gspo"])
def test_groups_that_scored_alike_are_not_run_and_the_update_is_the_same(tiny_model_path: Path, loss: str) -> None:
    """Two of three GRPO groups scored alike (advantage 0 everywhere): the step runs the third group alone and
    lands on the same weights, to float precision, as the step that runs all of them."""
    settings = {"hf_checkpoint": str(tiny_model_path), "n_samples_per_prompt": 4, "rollout_max_response_len": 5,
                "advantage_estimator": "grpo", "off_policy_correction": "tis", "lr": 1e-2, "loss_type": loss}
    config = build_config(settings)
    samples = generate(tiny_model_path, config, groups(4))
    rewards = [1.0] * 4 + [0.0] * 4 + [1.0, 0.0, 0.0, 1.0]  # g0 all right, g1 all wrong, g2 mixed
    samples = [s.__class__(**{**{f: getattr(s, f) for f in s.__struct_fields__}, "reward": r})
               for s, r in zip(samples, rewards, strict=True)]
    results = {}
    for skip in (True, False):
        trainer = SampleCountingTrainer(TorchTrainerConfig(model_path=tiny_model_path, lr=1e-2))
        step = TrainingStep(trainer, build_config({**settings, "skip_zero_advantage_samples": skip}))
        report = step.train(samples, staleness=[0] * len(samples))
        results[skip] = (trainer.trained, report.metrics, weights(trainer))
    (skipped, skipped_metrics, skipped_weights), (whole, whole_metrics, whole_weights) = results[True], results[False]
    assert skipped == [4] and whole == [12]
    assert skipped_metrics["zero_advantage_skipped"] == 8 and whole_metrics["zero_advantage_skipped"] == 0
    assert skipped_metrics["loss"] == pytest.approx(whole_metrics["loss"], abs=1e-6)
    for name, tensor in whole_weights.items():
        torch.testing.assert_close(skipped_weights[name], tensor, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.unit
def test_a_batch_that_scored_alike_keeps_a_sample_with_trained_tokens_so_its_step_is_taken() -> None:
    """Every advantage zero and the first sample truncated (loss mask all 0): the one sample kept has tokens to
    train, so the trainer takes the step (zero gradient, as over the whole batch) instead of skipping it as empty."""
    samples = [TrainSample(torch.arange(6), 3, loss_mask=torch.tensor(mask, dtype=torch.float32),
                           advantages=torch.zeros(3)) for mask in ([0, 0, 0], [1, 1, 0], [1, 1, 1])]
    kept = with_gradient(StepBatch(samples=samples, group_ids=["g0", "g0", "g1"]))
    assert kept.samples == [samples[1]] and kept.group_ids == ["g0"]
    samples[2].advantages = torch.tensor([0.0, 0.5, 0.5])
    assert with_gradient(StepBatch(samples=samples, group_ids=["g0", "g0", "g1"])).samples == [samples[2]]


@pytest.mark.unit
def test_samples_are_trained_whatever_their_advantage_when_the_loss_reads_more_than_it() -> None:
    from policies.step_loss import zero_advantage_is_zero_gradient

    assert zero_advantage_is_zero_gradient(PolicyLossConfig(loss_type="cispo"))
    assert not zero_advantage_is_zero_gradient(PolicyLossConfig(use_kl_loss=True, kl_loss_coef=0.01))
    assert not zero_advantage_is_zero_gradient(PolicyLossConfig(entropy_coef=0.001))
    assert not zero_advantage_is_zero_gradient(PolicyLossConfig(loss_type="sft"))


@pytest.mark.integration
@pytest.mark.parametrize("rollout_logprobs", [True, False], ids=["use-rollout-logprobs", "default-tis"])
def test_rollout_logprobs_train_against_the_engines_log_probs_with_no_policy_forward(
        tiny_model_path: Path, scored_samples: list[Sample], rollout_logprobs: bool) -> None:
    """slime's cheapest mode: no no-grad forward of the policy, and the PPO ratio's pi_old is mu, so on samples
    generated one version ago the ratio moves off 1; recomputed (the default), pi_old is today's policy."""
    config = build_config({"hf_checkpoint": str(tiny_model_path), "n_samples_per_prompt": 4, "lr": 1e-2,
                           "use_rollout_logprobs": rollout_logprobs})
    trainer = CountingTrainer(TorchTrainerConfig(model_path=tiny_model_path, lr=1e-2, check_packing=False))
    step = TrainingStep(trainer, config)
    metrics = [step.train(scored_samples, staleness=[s] * len(scored_samples)).metrics for s in (0, 1)]
    assert trainer.forwards == [] and trainer.version == 2
    assert abs(metrics[0]["ppo_kl"]) < 1e-5  # generated by the weights it trains: mu is pi_theta
    if rollout_logprobs:
        assert step.pi_old == "rollout" and abs(metrics[1]["ppo_kl"]) > 1e-4
    else:
        assert step.pi_old == "training_forward" and metrics[1]["ppo_kl"] == 0.0


def adam_steps(trainer: TorchTrainer) -> set[int]:
    return {int(state["step"]) for state in trainer._optimizer.state.values()}


@pytest.mark.integration
@pytest.mark.parametrize("reset", [True, False], ids=["reset", "kept"])
def test_reset_optimizer_states_starts_each_batchs_steps_from_a_fresh_adam(
        tiny_model_path: Path, scored_samples: list[Sample], reset: bool) -> None:
    """Two optimizer steps per batch, two batches: reset before each batch, Adam counts 1, 2 within a batch and
    starts over at the next; kept, it counts on to 4."""
    config = build_config({"hf_checkpoint": str(tiny_model_path), "n_samples_per_prompt": 4,
                           "num_steps_per_rollout": 2, "reset_optimizer_states": reset})
    trainer = TorchTrainer(TorchTrainerConfig(model_path=tiny_model_path, check_packing=False))
    step = TrainingStep(trainer, config)
    for _ in range(2):
        step.train(scored_samples, staleness=[0] * len(scored_samples))
    assert trainer.version == 2 and adam_steps(trainer) == ({2} if reset else {4})


@pytest.mark.integration
def test_the_reference_becomes_the_policy_after_every_nth_batch(tiny_model_path: Path,
                                                                 scored_samples: list[Sample]) -> None:
    """slime refreshes after rollouts N, 2N, ... have trained: with N = 2, after batch 2 and not after 1 or 3."""
    config = build_config({"hf_checkpoint": str(tiny_model_path), "n_samples_per_prompt": 4, "lr": 1e-2,
                           "use_kl_loss": True, "kl_loss_coef": 0.1, "ref_update_interval": 2})
    trainer = TorchTrainer(TorchTrainerConfig(model_path=tiny_model_path, ref_model_path=tiny_model_path, lr=1e-2,
                                              check_packing=False))
    step = TrainingStep(trainer, config)
    samples = [TrainSample(tokens=torch.tensor(s.tokens), response_length=s.response_length)
               for s in scored_samples]

    def scores(model: str) -> torch.Tensor:
        return trainer.compute_log_probs(samples, temperature=1.0, model=model).log_probs

    initial = scores("ref")
    refreshed = []
    for _ in range(3):
        refreshed.append(step.train(scored_samples, staleness=[0] * len(scored_samples)).metrics.get("ref/refreshed"))
        if len(refreshed) == 1:
            assert torch.equal(scores("ref"), initial)
        if len(refreshed) == 2:
            torch.testing.assert_close(scores("ref"), scores("policy"), atol=0, rtol=0)
    assert refreshed == [None, 1.0, None]
    assert not torch.allclose(scores("ref"), scores("policy"), atol=1e-5)  # batch 3 trained past the copy


@pytest.mark.integration
def test_a_reference_that_refreshes_is_never_scored_beside_the_previous_batchs_training(
        tiny_model_path: Path, scored_samples: list[Sample], tmp_path: Path) -> None:
    """The reference a batch's KL reads must be the one after the previous batch's refresh, and copying into it
    while another thread scores with it would race: the learner prepares nothing ahead then."""
    import structlog

    from actors.learner.modes import RealTraining
    from actors.learner.ranks import CollectiveTrainer, LearnerRanks

    batch = Batch(batch_id=1, samples=scored_samples, staleness=[0] * len(scored_samples))
    trainer = TorchTrainer(TorchTrainerConfig(model_path=tiny_model_path, ref_model_path=tiny_model_path,
                                              check_packing=False))
    prepared = {}
    for interval in (None, 2):
        config = build_config({"hf_checkpoint": str(tiny_model_path), "n_samples_per_prompt": 4,
                               "use_kl_loss": True, "kl_loss_coef": 0.1, "ref_update_interval": interval})
        collective = CollectiveTrainer(trainer, LearnerRanks(config, tmp_path, "127.0.0.1", structlog.get_logger()))
        training = RealTraining(collective, TrainingStep(trainer, config), publishes=False)
        prepared[interval] = asyncio.run(training.prepare(batch))
    assert prepared[None] is not None and prepared[2] is None


def _trace_names(path: Path) -> set[str]:
    import gzip
    import json

    with gzip.open(path, "rt") as trace:
        return {event.get("name", "") for event in json.load(trace)["traceEvents"]}


@pytest.mark.integration
def test_profiled_steps_write_traces_in_their_window_and_each_step_its_train_data(tiny_model_path: Path,
                                                                                   tmp_path: Path) -> None:
    """slime's --use-pytorch-profiler over steps [start, end) per --profile-target, and --save-debug-train-data: what
    each step trained on, read back from its file."""
    from actors.learner.train_dump import read_train_data

    config = build_config({"hf_checkpoint": str(tiny_model_path), "n_samples_per_prompt": 2, "lr": 1e-2,
                           "rollout_max_response_len": 4, "advantage_estimator": "grpo",
                           "off_policy_correction": "mis", "use_pytorch_profiler": True, "profile_step_start": 1,
                           "profile_step_end": 2,
                           "profile_dir": str(tmp_path / "profile"), "save_debug_train_data": str(tmp_path / "train")})
    samples = [s.__class__(**{**{f: getattr(s, f) for f in s.__struct_fields__}, "reward": float(i % 2)})
               for i, s in enumerate(generate(tiny_model_path, config, groups(2)))]
    trainer = TorchTrainer(TorchTrainerConfig(model_path=tiny_model_path, lr=1e-2))
    step = TrainingStep(trainer, config)
    for rollout_id in (0, 1, 2):
        step.train(samples, staleness=[0] * len(samples), rollout_id=rollout_id)
    [overall] = sorted((tmp_path / "profile").iterdir())
    assert overall.name == "train_overall_rollout000001_rank0.pt.trace.json.gz"  # step 1 only: the window [1, 2)
    names = _trace_names(overall)
    assert {"train_actor", "train_log_probs"} <= names and any(name.startswith("aten::") for name in names)
    dumps = [read_train_data(tmp_path / "train" / f"train_{i:06d}_rank0.msgpack") for i in (0, 1, 2)]

    parts = TrainingStep(trainer, config.with_settings(profile_target=["train_actor", "train_log_probs"],
                                                       profile_dir=str(tmp_path / "parts")))
    parts.train(samples, staleness=[0] * len(samples), rollout_id=1)
    assert sorted(p.name for p in (tmp_path / "parts").iterdir()) == [
        "train_actor_rollout000001_rank0_1.pt.trace.json.gz",  # the optimizer step
        "train_log_probs_rollout000001_rank0_1.pt.trace.json.gz"]  # pi_old's own forward (mis needs it first)

    assert [dump["policy_version"] for dump in dumps] == [0, 1, 2]
    first = dumps[0]
    assert (first["rollout_id"], first["data_parallel_rank"], first["data_parallel_size"]) == (0, 0, 1)
    assert len(first["samples"]) == len(samples)
    by_tokens = {tuple(s.tokens.tolist()): s for s in samples}
    for row in first["samples"]:
        sample = by_tokens[tuple(row["tokens"])]
        assert (row["group_id"], row["response_length"], row["reward"]) == (
            sample.group_id, sample.response_length, sample.reward)
        for name in ("loss_mask", "rollout_log_probs", "old_log_probs", "advantages"):
            assert len(row[name]) == sample.response_length, name
        assert row["ref_log_probs"] is None  # no KL: the step computed none
    # GRPO: a group's advantages are its rewards less their mean, so each group's sum to 0 at its first token
    for group in {row["group_id"] for row in first["samples"]}:
        assert sum(row["advantages"][0] for row in first["samples"] if row["group_id"] == group) == pytest.approx(0)

