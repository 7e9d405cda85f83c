"""--use-routing-replay in the learner: pi_old's forward records each token's experts, and every optimizer step of
the batch trains on samples that carry them; recipes and models it cannot serve are refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from actors.config import build_config
from actors.learner.step import TrainingStep
from actors.learner.trainer_factory import build_trainer
from engines.training.micro_batches import pack_inputs
from engines.training.moe import Routers, sample_routes
from tests.actors.test_distillation import prompt_groups
from tests.actors.test_learner_step import generate, with_rewards
from tools.standins.tiny_model import TinyModelSpec, cached_tiny_model


def replay_config(model: Path, **settings: object):
    return build_config({"hf_checkpoint": str(model), "n_samples_per_prompt": 4, "rollout_max_response_len": 6,
                         "use_routing_replay": True, "use_decoupled_ppo": True, "num_steps_per_rollout": 2,
                         "lr": 1e-2, **settings})


@pytest.fixture(scope="module")
def moe_model(tiny_model_cache: Path) -> Path:
    return cached_tiny_model(tiny_model_cache, TinyModelSpec(family="qwen3_moe", experts=8))


@pytest.mark.integration
def test_every_optimizer_step_of_a_batch_replays_the_routes_of_pi_olds_forward(moe_model: Path) -> None:
    config = replay_config(moe_model)
    samples = generate(moe_model, config, prompt_groups(4))
    samples = with_rewards(samples, [float(i % 3 == 0) for i in range(len(samples))])
    trainer = build_trainer(config)
    routers = Routers(trainer._model, wanted_by="test")

    def routes_now(train_samples):
        """The experts the policy as it is now would choose, per sample."""
        inputs = pack_inputs(train_samples, with_token_positions=True)
        stripped = [type(s)(s.tokens, s.response_length) for s in train_samples]
        with torch.no_grad(), routers.tapped() as layers:
            trainer._model(input_ids=inputs.input_ids, position_ids=inputs.position_ids, use_cache=False)
        return sample_routes(layers, stripped, inputs)

    seen = []
    train_step = trainer.train_step

    def spying(train_samples, loss, **kwargs):
        seen.append(([s.routed_experts for s in train_samples], routes_now(train_samples)))
        return train_step(train_samples, loss, **kwargs)

    trainer.train_step = spying
    report = TrainingStep(trainer, config).train(samples, [0] * len(samples))
    assert not report.result.skipped and len(seen) == 2  # two optimizer steps over the batch
    (first_carried, first_now), (second_carried, second_now) = seen
    # the first step's policy is pi_old itself: what the samples carry is what it chooses
    assert all(torch.equal(c.long(), n.long()) for c, n in zip(first_carried, first_now, strict=True))
    # after the first update the policy would route some tokens elsewhere; the samples still say pi_old's experts
    assert all(c is not None for c in second_carried)
    assert any(not torch.equal(c.long(), n.long()) for c, n in zip(second_carried, second_now, strict=True))


@pytest.mark.unit
@pytest.mark.parametrize(("settings", "message"), [
    ({"use_decoupled_ppo": False, "off_policy_correction": "none"},
     "records the experts in the learner's pi_old forward, which this recipe"),
    ({"train_backend": "pkg.trainer:build"},
     "--use-routing-replay: the learner.s own routes are recorded and replayed by --train-backend torch or megatron"),
])
def test_recipes_without_a_pi_old_forward_of_their_own_are_refused(tiny_model_path: Path, settings: dict,
                                                                   message: str) -> None:
    with pytest.raises(ValueError, match=message):
        replay_config(tiny_model_path, **settings)


@pytest.mark.integration
@pytest.mark.parametrize("backend", ["torch", "megatron"])
def test_a_dense_model_is_refused_naming_the_flag(tiny_model_path: Path, backend: str) -> None:
    with pytest.raises(ValueError, match=r"use-routing-replay: \w+ has no MoE router"):
        build_trainer(replay_config(tiny_model_path, train_backend=backend))


@pytest.mark.unit
def test_a_samples_routes_cross_the_wire_and_reach_the_trainer_as_its_layout() -> None:
    """int16 on the bus, [len(tokens) - 1, layers, k] for the trainer; a wrong count is refused by name."""
    import numpy as np

    from actors.learner.stages import to_train_sample
    from bus.codec import decode, encode
    from bus.schema import Sample

    routes = np.arange(5 * 3 * 2, dtype=np.int16) % 7
    sample = Sample(sample_id="g/0", group_id="g", index=0, prompt="p", prompt_tokens=4,
                    tokens=np.arange(6, dtype=np.int32), response_length=2, routed_experts=routes, moe_layers=3,
                    moe_top_k=2)
    received = decode(encode(sample))
    train_sample = to_train_sample(received, rewarded=False)
    assert train_sample.routed_experts is not None
    assert train_sample.routed_experts.shape == (5, 3, 2)
    assert train_sample.routed_experts.flatten().tolist() == routes.tolist()
    with pytest.raises(ValueError, match=r"Sample.routed_experts: 24 entries, expected 30"):
        Sample(sample_id="g/0", group_id="g", index=0, prompt="p", prompt_tokens=4,
               tokens=np.arange(6, dtype=np.int32), response_length=2, routed_experts=routes[:24], moe_layers=3,
               moe_top_k=2)
    with pytest.raises(ValueError, match="moe_layers and moe_top_k > 0"):
        Sample(sample_id="g/0", group_id="g", index=0, prompt="p", prompt_tokens=4,
               tokens=np.arange(6, dtype=np.int32), response_length=2, routed_experts=routes)


def generate_with_routes(model: Path, config, groups) -> list:
    import asyncio

    from transformers import AutoTokenizer

    from actors.rollout.generate import RolloutContext, default_generate
    from engines.inference import TorchEngine

    async def run() -> list:
        engine = TorchEngine.from_pretrained(model, max_batch_size=16, seed=0, record_routes=True)
        context = RolloutContext(engine=engine, tokenizer=AutoTokenizer.from_pretrained(model), config=config,
                                 worker_id="w")
        try:
            batches = await asyncio.gather(*(default_generate(context, group) for group in groups))
        finally:
            await engine.close()
        return [sample for batch in batches for sample in batch]

    return asyncio.run(run())


@pytest.mark.integration
def test_rollout_routes_reach_every_policy_forward_and_a_batch_missing_some_trains_unreplayed(
        moe_model: Path) -> None:
    import msgspec

    from actors.learner.step import ROUTELESS_SAMPLES

    config = build_config({"hf_checkpoint": str(moe_model), "n_samples_per_prompt": 4, "rollout_max_response_len": 6,
                           "use_rollout_routing_replay": True, "off_policy_correction": "tis", "lr": 1e-2})
    samples = with_rewards(generate_with_routes(moe_model, config, prompt_groups(3)),
                           [float(i % 3 == 0) for i in range(12)])
    trainer = build_trainer(config)
    seen: dict[str, list] = {"log_probs": [], "train": []}
    compute, train = trainer.compute_log_probs, trainer.train_step

    def spy_compute(train_samples, **kwargs):
        seen["log_probs"].append([s.routed_experts is not None for s in train_samples])
        return compute(train_samples, **kwargs)

    def spy_train(train_samples, loss, **kwargs):
        seen["train"].append([s.routed_experts is not None for s in train_samples])
        return train(train_samples, loss, **kwargs)

    trainer.compute_log_probs, trainer.train_step = spy_compute, spy_train
    step = TrainingStep(trainer, config)
    report = step.train(samples, [0] * len(samples))
    assert report.metrics[ROUTELESS_SAMPLES] == 0
    assert seen["train"] and all(all(flags) for flags in seen["log_probs"] + seen["train"])

    seen["log_probs"].clear(), seen["train"].clear()
    samples[5] = msgspec.structs.replace(samples[5], routed_experts=None, moe_layers=0, moe_top_k=0)
    report = step.train(samples, [0] * len(samples))
    assert report.metrics[ROUTELESS_SAMPLES] == 1 and not report.result.skipped
    assert not any(any(flags) for flags in seen["log_probs"] + seen["train"])
