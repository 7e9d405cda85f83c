"""A colocated engine gives its cached memory back each time it runs out of work, so the learner can train."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from engines.inference import GenerateRequest, SamplingParams, TorchEngine

pytestmark = pytest.mark.integration
PARAMS = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)


async def _releases_after(engine: TorchEngine, requests: int) -> int:
    """Run `requests` generations one after another (the engine idles between them) and count releases."""
    for index in range(requests):
        await engine.generate(GenerateRequest(f"r{index}", [7, 12, 30], PARAMS))
        for _ in range(100):  # the decode thread releases right after it finds itself idle
            if (await engine.health())["memory_releases"] > index:
                break
            await asyncio.sleep(0.01)
    return int((await engine.health())["memory_releases"])


async def test_the_engine_releases_its_cache_at_each_idle_turn_only_when_colocated(tiny_model_path: Path) -> None:
    async with TorchEngine.from_pretrained(tiny_model_path, release_memory_when_idle=True) as colocated:
        assert await _releases_after(colocated, 3) == 3
    async with TorchEngine.from_pretrained(tiny_model_path) as separate:
        assert await _releases_after(separate, 2) == 0
