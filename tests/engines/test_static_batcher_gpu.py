"""The static KV batcher's CUDA graphs: a replayed step decodes exactly what the eager step does."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from engines.inference import SamplingParams, TorchEngine
from tests.engines.test_static_batcher import _requests


@pytest.mark.gpu
async def test_cuda_graph_replays_give_the_eager_steps_tokens_and_log_probs(tiny_model_path: Path) -> None:
    """Graph capture must not change a token: greedy and seeded sampling, rows joining and leaving, against the same
    static batcher stepping eagerly and against the dynamic batcher (greedy)."""
    greedy = SamplingParams(temperature=0, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, ignore_eos=True, seed=3, n=2)
    results = {}
    for name, options in {"dynamic": {}, "eager": {"kv_cache": "static", "cuda_graphs": False},
                          "graphs": {"kv_cache": "static", "cuda_graphs": True}}.items():
        async with TorchEngine.from_pretrained(tiny_model_path, device="cuda", max_batch_size=2,
                                               kv_pool_columns=64, **options) as engine:
            outputs = await asyncio.gather(*(engine.generate(r) for r in [*_requests(engine, greedy, "g"),
                                                                          *_requests(engine, sampled, "s")]))
            if name == "graphs":
                assert engine._batcher.decoder.graphs, "no decode step was captured"
        results[name] = [[(s.output_ids, s.log_probs) for s in output] for output in outputs]
    assert [r[0][0] for r in results["graphs"][:4]] == [r[0][0] for r in results["dynamic"][:4]]
    assert [[s[0] for s in r] for r in results["graphs"]] == [[s[0] for s in r] for r in results["eager"]]
    for graph_output, eager_output in zip(results["graphs"], results["eager"], strict=True):
        for (_, graph_log_probs), (_, eager_log_probs) in zip(graph_output, eager_output, strict=True):
            assert graph_log_probs == pytest.approx(eager_log_probs, abs=1e-5)
