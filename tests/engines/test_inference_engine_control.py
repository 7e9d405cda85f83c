"""Weight updates, pause/resume, abort, cancellation and bad input, applied between two decode steps.

To land a command at a known step without timing, a step listener blocks the decode thread after step k;
the test queues the command, then releases the thread, which applies it before step k + 1.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable
from pathlib import Path

import pytest
import torch

from engines.inference import (
    GenerateRequest,
    KvCacheAccount,
    SamplingParams,
    StepRecord,
    TorchEngine,
    continuation_request,
)
from tools.standins.tiny_model import TinyModelSpec, build_tiny_model, build_tokenizer

PROMPT_TEXT = "The quick brown fox"


class StepGate:
    """A step listener that holds the decode thread after step `at` until released."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.reached = threading.Event()
        self.released = threading.Event()
        self.records: list[StepRecord] = []

    def __call__(self, record: StepRecord) -> None:
        self.records.append(record)
        if record.step == self.at:
            self.reached.set()
            self.released.wait(timeout=60)

    async def wait_reached(self) -> None:
        assert await asyncio.to_thread(self.reached.wait, 60), f"step {self.at} never happened"

    async def release_after(self, command: Awaitable[object]) -> object:
        """Queue `command` while the thread is held, then let the thread go on and await the command."""
        task = asyncio.ensure_future(command)
        await asyncio.sleep(0)  # the task runs up to its first await, which is after it queued the command
        self.released.set()
        return await task


def _greedy(tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=tokens, ignore_eos=True)


def _plain_greedy(model: torch.nn.Module, prefix: list[int], tokens: int) -> list[int]:
    """Greedy continuation by full forwards, no cache: what the given weights produce from `prefix`."""
    sequence, output = list(prefix), []
    with torch.no_grad():
        for _ in range(tokens):
            token = int(model(torch.tensor([sequence])).logits[0, -1].argmax())
            output.append(token)
            sequence.append(token)
    return output


def _other_weights() -> dict[str, torch.Tensor]:
    return build_tiny_model(TinyModelSpec(family="qwen2", seed=1), build_tokenizer()).state_dict()


@pytest.mark.integration
async def test_weight_update_mid_generation_tags_later_tokens_and_uses_new_weights(tiny_model_path: Path) -> None:
    gate = StepGate(at=5)
    new_weights = _other_weights()
    async with TorchEngine.from_pretrained(tiny_model_path, step_listener=gate) as engine:
        prompt = engine.tokenizer.encode(PROMPT_TEXT)
        old_tokens = _plain_greedy(engine.model, prompt, 5)
        generation = asyncio.ensure_future(engine.generate(GenerateRequest("r", prompt, _greedy(20))))
        await gate.wait_reached()
        await gate.release_after(engine.update_weights(new_weights.items(), version=1))
        [output] = await generation
        assert engine.version == 1
        assert engine.kv_cache_account() == KvCacheAccount(recomputes_on_update=True, stale_kv_tokens=0)
        new_model = build_tiny_model(TinyModelSpec(family="qwen2", seed=1), build_tokenizer()).eval()
    assert output.versions == [0] * 5 + [1] * 15
    assert output.output_ids[:5] == old_tokens
    assert output.output_ids[5:] == _plain_greedy(new_model, prompt + old_tokens, 15)


@pytest.mark.integration
async def test_weight_update_keeping_the_old_cache_still_tags_new_tokens_with_the_new_version(
    tiny_model_path: Path,
) -> None:
    gate = StepGate(at=3)
    async with TorchEngine.from_pretrained(
        tiny_model_path, step_listener=gate, recompute_kv_on_update=False
    ) as engine:
        prompt = engine.tokenizer.encode(PROMPT_TEXT)
        generation = asyncio.ensure_future(engine.generate(GenerateRequest("r", prompt, _greedy(8))))
        await gate.wait_reached()
        await gate.release_after(engine.update_weights(_other_weights().items(), version=4))
        [output] = await generation
        account = engine.kv_cache_account()
    assert output.versions == [0] * 3 + [4] * 5
    assert all(record.admitted == () for record in gate.records[3:]), "the cache was recomputed"
    assert account == KvCacheAccount(recomputes_on_update=False, stale_kv_tokens=5)  # said, as the setting allows


@pytest.mark.integration
async def test_an_update_that_forgot_to_drop_the_cache_is_counted_against_the_engines_promise(
    tiny_model_path: Path,
) -> None:
    """The guard of the certificate's `caches` check: the count comes from where keys and values are computed, so
    a cache that outlives an update it should not have is seen, token by token."""
    gate = StepGate(at=3)
    async with TorchEngine.from_pretrained(tiny_model_path, step_listener=gate) as engine:
        engine._batcher.drop_cache = lambda: None  # the bug: an update that keeps the old keys and values
        prompt = engine.tokenizer.encode(PROMPT_TEXT)
        generation = asyncio.ensure_future(engine.generate(GenerateRequest("r", prompt, _greedy(8))))
        await gate.wait_reached()
        await gate.release_after(engine.update_weights(_other_weights().items(), version=1))
        await generation
        assert engine.kv_cache_account() == KvCacheAccount(recomputes_on_update=True, stale_kv_tokens=5)
        assert (await engine.health())["stale_kv_tokens"] == 5


@pytest.mark.integration
async def test_pause_with_abort_returns_partial_output_that_resumes_to_the_full_completion(
    tiny_model_path: Path,
) -> None:
    gate = StepGate(at=6)
    async with TorchEngine.from_pretrained(tiny_model_path, step_listener=gate) as engine:
        request = GenerateRequest("r", engine.tokenizer.encode(PROMPT_TEXT), _greedy(25))
        generation = asyncio.ensure_future(engine.generate(request))
        await gate.wait_reached()
        await gate.release_after(engine.pause("abort"))
        [partial] = await generation
        await engine.resume()
        [rest] = await engine.generate(continuation_request(request, partial))
        [uninterrupted] = await engine.generate(GenerateRequest("again", request.input_ids, request.params))
    assert (partial.finish_reason, len(partial.output_ids)) == ("abort", 6)
    assert rest.finish_reason == "length"
    assert partial.output_ids + rest.output_ids == uninterrupted.output_ids


@pytest.mark.integration
async def test_pause_keep_holds_requests_without_stepping_and_resume_finishes_them(tiny_model_path: Path) -> None:
    gate = StepGate(at=3)
    async with TorchEngine.from_pretrained(tiny_model_path, step_listener=gate) as engine:
        prompt = engine.tokenizer.encode(PROMPT_TEXT)
        running = asyncio.ensure_future(engine.generate(GenerateRequest("running", prompt, _greedy(12))))
        await gate.wait_reached()
        await gate.release_after(engine.pause("keep"))
        arrived_while_paused = asyncio.ensure_future(engine.generate(GenerateRequest("late", prompt, _greedy(12))))
        steps_at_pause = len(gate.records)
        await asyncio.sleep(0.2)
        assert len(gate.records) == steps_at_pause
        assert not running.done() and not arrived_while_paused.done()
        assert (await engine.health())["paused"] is True
        await engine.resume()
        [resumed], [late] = await asyncio.gather(running, arrived_while_paused)
    assert resumed.finish_reason == "length"
    assert resumed.output_ids == late.output_ids == _plain_greedy(engine.model, prompt, 12)


@pytest.mark.integration
async def test_abort_of_one_request_leaves_the_others_running(tiny_model_path: Path) -> None:
    gate = StepGate(at=4)
    async with TorchEngine.from_pretrained(tiny_model_path, step_listener=gate) as engine:
        prompt = engine.tokenizer.encode(PROMPT_TEXT)
        doomed = asyncio.ensure_future(engine.generate(GenerateRequest("doomed", prompt, _greedy(30))))
        kept = asyncio.ensure_future(engine.generate(GenerateRequest("kept", prompt, _greedy(30))))
        await gate.wait_reached()
        await gate.release_after(engine.abort("doomed"))
        [aborted], [finished] = await asyncio.gather(doomed, kept)
    assert aborted.finish_reason == "abort"
    assert 0 < len(aborted.output_ids) < 30
    assert (finished.finish_reason, len(finished.output_ids)) == ("length", 30)


@pytest.mark.integration
async def test_cancelled_generate_frees_its_slot_for_the_next_request(tiny_model_path: Path) -> None:
    gate = StepGate(at=2)
    async with TorchEngine.from_pretrained(tiny_model_path, max_batch_size=1, step_listener=gate) as engine:
        prompt = engine.tokenizer.encode(PROMPT_TEXT)
        hog = asyncio.ensure_future(engine.generate(GenerateRequest("hog", prompt, _greedy(400))))
        await gate.wait_reached()
        hog.cancel()
        await asyncio.sleep(0)  # the cancelled task runs its handler, which queues the abort
        gate.released.set()
        [next_output] = await engine.generate(GenerateRequest("next", prompt, _greedy(5)))
        health = await engine.health()
    assert next_output.finish_reason == "length"
    assert health["requests"] == 0 and health["running"] == 0
    assert [record.step for record in gate.records if ("hog", 0) in record.decoded] == [2]


@pytest.mark.integration
async def test_event_loop_stays_responsive_while_the_decode_thread_is_busy(tiny_model_path: Path) -> None:
    gate = StepGate(at=1)
    async with TorchEngine.from_pretrained(tiny_model_path, step_listener=gate) as engine:
        generation = asyncio.ensure_future(
            engine.generate(GenerateRequest("r", engine.tokenizer.encode(PROMPT_TEXT), _greedy(5)))
        )
        await gate.wait_reached()  # the decode thread is now held inside a step
        health = await asyncio.wait_for(engine.health(), timeout=5)
        assert not generation.done()
        gate.released.set()
        await generation
    assert health["healthy"] is True and health["running"] == 1


@pytest.mark.integration
async def test_close_aborts_requests_in_flight_and_refuses_new_ones(tiny_model_path: Path) -> None:
    gate = StepGate(at=2)
    engine = TorchEngine.from_pretrained(tiny_model_path, step_listener=gate)
    prompt = engine.tokenizer.encode(PROMPT_TEXT)
    generation = asyncio.ensure_future(engine.generate(GenerateRequest("r", prompt, _greedy(50))))
    await gate.wait_reached()
    await gate.release_after(engine.close())
    [output] = await generation
    assert output.finish_reason == "abort"
    with pytest.raises(RuntimeError, match="closed"):
        await engine.generate(GenerateRequest("late", prompt, _greedy(5)))


@pytest.mark.integration
async def test_bad_weight_update_is_refused_whole_and_the_engine_keeps_serving(tiny_model_path: Path) -> None:
    async with TorchEngine.from_pretrained(tiny_model_path) as engine:
        prompt = engine.tokenizer.encode(PROMPT_TEXT)
        [before] = await engine.generate(GenerateRequest("before", prompt, _greedy(8)))
        good = _other_weights()
        first_name = next(iter(good))
        with pytest.raises(ValueError, match=r"'model\.layers\.0\.not_a_weight' is not a weight"):
            await engine.update_weights(
                [(first_name, good[first_name]), ("model.layers.0.not_a_weight", good[first_name])], 1
            )
        with pytest.raises(ValueError, match=r"has shape \(3,\)"):
            await engine.update_weights([(first_name, torch.zeros(3))], 1)
        [after] = await engine.generate(GenerateRequest("after", prompt, _greedy(8)))
        assert engine.version == 0
    assert after.output_ids == before.output_ids


@pytest.mark.integration
async def test_duplicate_request_id_in_flight_is_refused(tiny_model_path: Path) -> None:
    gate = StepGate(at=1)
    async with TorchEngine.from_pretrained(tiny_model_path, step_listener=gate) as engine:
        prompt = engine.tokenizer.encode(PROMPT_TEXT)
        first = asyncio.ensure_future(engine.generate(GenerateRequest("same", prompt, _greedy(3))))
        await gate.wait_reached()
        with pytest.raises(ValueError, match="'same' is already in flight"):
            await gate.release_after(engine.generate(GenerateRequest("same", prompt, _greedy(3))))
        [output] = await first
    assert output.finish_reason == "length"


@pytest.mark.integration
async def test_prompts_the_model_cannot_take_are_refused_before_reaching_the_engine(tiny_model_path: Path) -> None:
    async with TorchEngine.from_pretrained(tiny_model_path, max_model_len=32) as engine:
        with pytest.raises(ValueError, match="request 'big-id': input_ids holds 5000"):
            await engine.generate(GenerateRequest("big-id", [1, 5000]))
        with pytest.raises(ValueError, match="request 'long': prompt of 40 tokens"):
            await engine.generate(GenerateRequest("long", [5] * 40))
        [clamped] = await engine.generate(GenerateRequest("fits", [5] * 30, _greedy(100)))
    assert (clamped.finish_reason, len(clamped.output_ids)) == ("length", 2)


@pytest.mark.integration
async def test_pause_with_an_unknown_mode_names_the_allowed_ones(tiny_model_path: Path) -> None:
    async with TorchEngine.from_pretrained(tiny_model_path) as engine:
        with pytest.raises(ValueError, match=r"one of \('abort', 'keep'\)"):
            await engine.pause("drain")  # type: ignore[arg-type]


@pytest.mark.integration
async def test_failed_step_fails_its_requests_and_the_engine_serves_the_next_ones(tiny_model_path: Path) -> None:
    async with TorchEngine.from_pretrained(tiny_model_path) as engine:
        prompt = engine.tokenizer.encode(PROMPT_TEXT)
        failures = [RuntimeError("simulated kernel failure")]

        def fail_once(module: torch.nn.Module, args: object, output: object) -> None:
            if failures:
                raise failures.pop()

        hook = engine.model.model.layers[0].register_forward_hook(fail_once)
        with pytest.raises(RuntimeError, match=r"torch engine step failed: .*simulated kernel failure"):
            await engine.generate(GenerateRequest("unlucky", prompt, _greedy(5)))
        [output] = await engine.generate(GenerateRequest("next", prompt, _greedy(5)))
        health = await engine.health()
        hook.remove()
    assert output.finish_reason == "length"
    assert health["healthy"] is True and "simulated kernel failure" in health["last_error"]
