"""The torch engine records each token's experts as it generates (rollout routing replay's first half): the routes
an MoE model took while decoding are the routes the learner's forward of the finished sequence takes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from engines.inference import GenerateOutput, GenerateRequest, SamplingParams, TorchEngine
from engines.training import TorchTrainer, TorchTrainerConfig, TrainSample
from tests.engines.test_routing_replay import recorded
from tools.standins.tiny_model import TinyModelSpec, cached_tiny_model

PROMPTS = [[5, 9, 11, 7], [8, 8, 3, 21, 40, 6, 6, 12, 30], [17, 4]]


@pytest.fixture(scope="module")
def moe_model(tiny_model_cache: Path) -> Path:
    return cached_tiny_model(tiny_model_cache, TinyModelSpec(family="qwen3_moe", experts=8))


def routes_of(output: GenerateOutput) -> torch.Tensor:
    assert output.routed_experts is not None
    table = np.frombuffer(output.routed_experts.data, dtype="<i2").reshape(output.routed_experts.shape)
    return torch.from_numpy(table.astype(np.int64))


async def _generate(engine: TorchEngine, params: SamplingParams) -> list[GenerateOutput]:
    results = await asyncio.gather(*(engine.generate(GenerateRequest(f"r{i}", prompt, params))
                                     for i, prompt in enumerate(PROMPTS)))
    return [sample for result in results for sample in result]


def _learner_routes(model: Path, prompts: list[list[int]], outputs: list[GenerateOutput],
                    weights: dict[str, torch.Tensor] | None = None) -> list[torch.Tensor]:
    trainer = TorchTrainer(TorchTrainerConfig(model_path=model))
    if weights is not None:
        trainer._model.load_state_dict(weights)
    samples = [TrainSample(torch.tensor(prompt + output.output_ids), len(output.output_ids))
               for prompt, output in zip(prompts, outputs, strict=True)]
    try:
        return recorded(trainer, samples, share_prompts=False)
    finally:
        trainer.close()


def _assert_same_routes(engine_outputs: list[GenerateOutput], learner_routes: list[torch.Tensor]) -> None:
    engine_routes = [routes_of(output) for output in engine_outputs]
    assert [routes.shape for routes in engine_routes] == [routes.shape for routes in learner_routes]
    differing = sum(int((mine != theirs).any(-1).any(-1).sum()) for mine, theirs in
                    zip(engine_routes, learner_routes, strict=True))
    total = sum(routes.shape[0] for routes in engine_routes)
    assert differing == 0, f"{differing} of {total} tokens routed elsewhere by the learner"


@pytest.mark.integration
@pytest.mark.parametrize("deterministic", [False, True])
async def test_recorded_routes_are_the_learners_routes_of_the_same_tokens(moe_model: Path,
                                                                         deterministic: bool) -> None:
    """Three requests of two samples each, batched (rows join and leave at different lengths), sampled."""
    params = SamplingParams(temperature=1.0, max_new_tokens=12, n=2, seed=4, ignore_eos=True)
    async with TorchEngine.from_pretrained(moe_model, max_batch_size=3, record_routes=True,
                                           deterministic=deterministic) as engine:
        outputs = await _generate(engine, params)
    prompts = [prompt for prompt in PROMPTS for _ in range(2)]
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.routed_experts is not None
        assert output.routed_experts.shape == (len(prompt) + len(output.output_ids) - 1, 2, 2)
    _assert_same_routes(outputs, _learner_routes(moe_model, prompts, outputs))


@pytest.mark.integration
async def test_a_weight_update_mid_generation_rerecords_the_prefix(moe_model: Path) -> None:
    """Caches dropped at an update are recomputed with the new weights, routes included: the output's routes are
    those of the weights that last computed each token."""
    params = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
    async with TorchEngine.from_pretrained(moe_model, max_batch_size=3, record_routes=True) as engine:
        weights = [(name, tensor.detach() + 0.2 * torch.randn(tensor.shape, generator=torch.Generator()
                                                               .manual_seed(index)))
                   for index, (name, tensor) in enumerate(engine.model.state_dict().items())]
        pending = asyncio.ensure_future(_generate(engine, params))
        while engine._batcher.steps < 6:
            await asyncio.sleep(0.001)
        await engine.update_weights(weights, version=1)
        outputs = await pending
    assert all(output.versions[0] == 0 and output.versions[-1] == 1 for output in outputs)
    _assert_same_routes(outputs, _learner_routes(moe_model, PROMPTS, outputs, dict(weights)))


@pytest.mark.integration
async def test_recording_needs_a_mixture_of_experts_and_the_dynamic_cache(moe_model: Path,
                                                                         tiny_model_path: Path) -> None:
    with pytest.raises(ValueError, match=r"recording routed experts: .* has no MoE router"):
        TorchEngine.from_pretrained(tiny_model_path, record_routes=True)
    with pytest.raises(ValueError, match="kv_cache='static' does not record routed experts"):
        TorchEngine.from_pretrained(moe_model, record_routes=True, kv_cache="static")
    async with TorchEngine.from_pretrained(moe_model) as engine:
        outputs = await _generate(engine, SamplingParams(temperature=0, max_new_tokens=3))
    assert all(output.routed_experts is None for output in outputs)
