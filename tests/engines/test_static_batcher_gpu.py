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


@pytest.mark.gpu
async def test_graphs_decode_with_the_weights_pushed_after_their_capture(tiny_model_path: Path) -> None:
    """A captured graph reads the parameters' storage: an update copied in place must reach the next replay. The
    engine serving the pushed weights must decode what a fresh engine loaded with them decodes."""
    import torch

    greedy = SamplingParams(temperature=0, ignore_eos=True)
    options = {"device": "cuda", "kv_cache": "static", "cuda_graphs": True, "max_batch_size": 4}
    async with TorchEngine.from_pretrained(tiny_model_path, **options) as pushed:
        before = await asyncio.gather(*(pushed.generate(r) for r in _requests(pushed, greedy, "before")))
        assert pushed._batcher.decoder.graphs
        generator = torch.Generator().manual_seed(1)
        weights = [(name, (tensor.detach().cpu() + 0.05 * torch.randn(tensor.shape, generator=generator)).cuda())
                   for name, tensor in pushed.model.state_dict().items()]
        await pushed.update_weights(weights, version=1)
        after = await asyncio.gather(*(pushed.generate(r) for r in _requests(pushed, greedy, "after")))
    async with TorchEngine.from_pretrained(tiny_model_path, **options) as fresh:
        fresh.model.load_state_dict(dict(weights))
        expected = await asyncio.gather(*(fresh.generate(r) for r in _requests(fresh, greedy, "fresh")))
    assert [o[0].output_ids for o in after] == [o[0].output_ids for o in expected]
    assert [o[0].output_ids for o in after] != [o[0].output_ids for o in before]
