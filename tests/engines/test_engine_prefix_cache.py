"""The torch engine's prefix cache across requests: the same tokens and log-probs as without it, less prefill, and
never keys and values of other weights under a sample (the certificate's `caches` check sees it if they were)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from actors.report.integrity import caches_verdict
from actors.rollout.kv_cache_log import record_kv_cache
from engines.inference import (
    GenerateOutput,
    GenerateRequest,
    KvCacheAccount,
    SamplingParams,
    TorchEngine,
    continuation_request,
)
from tests.engines.test_engine_routes import routes_of
from tools.standins.tiny_model import TinyModelSpec, build_tiny_model, build_tokenizer, cached_tiny_model

GREEDY = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, max_new_tokens=10, ignore_eos=True, seed=5)
SYSTEM = "You are a careful assistant. Answer in one line. "
QUESTIONS = ["What is 3 + 4?", "Name a colour.", "Count to three.", "What is 3 + 4?"]


def _tool_reply(turn: int) -> str:
    return f" <tool>result {turn}</tool> "


async def _conversation(engine: TorchEngine, prompt: list[int], turns: int, params: SamplingParams,
                        tag: str) -> list[GenerateOutput]:
    """`turns` calls of one conversation, each sending the whole history (prompt, every answer and tool reply so
    far), as chat_session.py does."""
    tokenizer = engine.tokenizer
    history, outputs = list(prompt), []
    for turn in range(turns):
        seed = None if params.seed is None else params.seed + turn
        [output] = await engine.generate(GenerateRequest(f"{tag}-{turn}", history, replace(params, seed=seed)))
        outputs.append(output)
        history = history + output.output_ids + tokenizer.encode(_tool_reply(turn))
    return outputs


async def _conversations(engine: TorchEngine, params: SamplingParams, turns: int = 3) -> list[list[GenerateOutput]]:
    """Four conversations at once; two share their prompt (a group's samples), all share a system prompt."""
    prompts = [engine.tokenizer.encode(SYSTEM + question) for question in QUESTIONS]
    return list(await asyncio.gather(*(_conversation(engine, prompt, turns, params, f"c{index}")
                                       for index, prompt in enumerate(prompts))))


def _assert_same_samples(got: list[list[GenerateOutput]], expected: list[list[GenerateOutput]], *,
                         exact: bool) -> None:
    for mine, theirs in zip(got, expected, strict=True):
        assert [output.output_ids for output in mine] == [output.output_ids for output in theirs]
        for output, reference in zip(mine, theirs, strict=True):
            if exact:
                assert output.log_probs == reference.log_probs  # compared as Python floats: every bit
            else:
                torch.testing.assert_close(torch.tensor(output.log_probs), torch.tensor(reference.log_probs),
                                           rtol=0, atol=1e-5)


def _new_weights() -> dict[str, torch.Tensor]:
    return build_tiny_model(TinyModelSpec(family="qwen2", seed=1), build_tokenizer()).state_dict()


async def _first_turn_then_new_weights(engine: TorchEngine) -> tuple[int, list[int]]:
    """A conversation's first turn at version 0, then new weights as version 1. Returns how many tokens the turn left
    in the cache and the second turn's input."""
    prompt = engine.tokenizer.encode(SYSTEM + QUESTIONS[0])
    [first] = await engine.generate(GenerateRequest("turn-0", prompt, GREEDY))
    history = prompt + first.output_ids + engine.tokenizer.encode(_tool_reply(0))
    await engine.update_weights(_new_weights().items(), version=1)
    return len(prompt) + len(first.output_ids) - 1, history


@pytest.mark.integration
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["stock", "batch-invariant"])
async def test_conversations_sample_the_same_tokens_and_log_probs_with_the_cache_as_without(
    tiny_model_path: Path, params: SamplingParams, deterministic: bool,
) -> None:
    """Batch-invariant decoding makes it bit for bit (a cached key is the key a full prefill computes); the stock
    kernels round differently with the shapes of the forwards, as they do with the rows beside a sequence."""
    async with TorchEngine.from_pretrained(tiny_model_path, deterministic=deterministic) as engine:
        cached = await _conversations(engine, params)
        stats = engine.prefix_cache_stats()
    async with TorchEngine.from_pretrained(tiny_model_path, deterministic=deterministic,
                                           prefix_cache_bytes=0) as engine:
        uncached = await _conversations(engine, params)
        assert engine.prefix_cache_stats() is None
    assert stats is not None and stats.reused_tokens > stats.prefilled_tokens, stats
    assert all(output.cached_tokens > 0 for conversation in cached for output in conversation[1:])
    _assert_same_samples(cached, uncached, exact=deterministic)


@pytest.mark.integration
async def test_a_later_turn_prefills_only_what_the_earlier_turn_did_not_compute(tiny_model_path: Path) -> None:
    async with TorchEngine.from_pretrained(tiny_model_path) as engine:
        prompt = engine.tokenizer.encode(SYSTEM + QUESTIONS[0])
        [first] = await engine.generate(GenerateRequest("turn-0", prompt, GREEDY))
        before = engine.prefix_cache_stats()
        reply = engine.tokenizer.encode(_tool_reply(0))
        history = prompt + first.output_ids + reply
        assert engine.cached_prefix_tokens(history) == len(prompt) + len(first.output_ids) - 1
        [second] = await engine.generate(GenerateRequest("turn-1", history, GREEDY))
        after = engine.prefix_cache_stats()
    assert before is not None and after is not None
    # the keys and values of everything but the first turn's last token (sampled, never fed) came from the cache
    assert second.cached_tokens == len(prompt) + len(first.output_ids) - 1
    assert after.prefilled_tokens - before.prefilled_tokens == 1 + len(reply)
    assert (after.lookups - before.lookups, after.hits - before.hits) == (1, 1)


@pytest.mark.integration
async def test_samples_of_a_prompt_that_arrive_apart_share_its_prefill(tiny_model_path: Path) -> None:
    """An agent's episodes are one request each: a group's samples reach the engine steps or seconds apart."""
    async with TorchEngine.from_pretrained(tiny_model_path) as engine:
        prompt = engine.tokenizer.encode(SYSTEM + QUESTIONS[1])
        first = asyncio.ensure_future(engine.generate(GenerateRequest("sample-0", prompt, GREEDY)))
        while engine._batcher.steps < 2:  # the first sample is decoding; the second joins a later step
            await asyncio.sleep(0.001)
        second = await engine.generate(GenerateRequest("sample-1", prompt, GREEDY))
        [first_output] = await first
        [third] = await engine.generate(GenerateRequest("sample-2", prompt, GREEDY))  # after both finished
    assert first_output.cached_tokens == 0
    assert second[0].cached_tokens == third.cached_tokens == len(prompt) - 1
    assert second[0].output_ids == third.output_ids == first_output.output_ids


@pytest.mark.integration
async def test_a_resumed_sample_reuses_what_it_decoded_before_the_abort(tiny_model_path: Path) -> None:
    async with TorchEngine.from_pretrained(tiny_model_path) as engine:
        request = GenerateRequest("r", engine.tokenizer.encode(SYSTEM), replace(GREEDY, max_new_tokens=20))
        pending = asyncio.ensure_future(engine.generate(request))
        while engine._batcher.steps < 6:
            await asyncio.sleep(0.001)
        await engine.abort("r")
        [partial] = await pending
        [rest] = await engine.generate(continuation_request(request, partial))
    assert rest.cached_tokens == len(request.input_ids) + len(partial.output_ids) - 1


@pytest.mark.integration
async def test_the_cache_stays_within_its_budget_and_evicts_the_least_recently_used(tiny_model_path: Path) -> None:
    config = build_tiny_model(TinyModelSpec(family="qwen2"), build_tokenizer()).config
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * (
        config.hidden_size // config.num_attention_heads) * 4
    budget = 120  # tokens: about two of these conversations' first turns
    async with TorchEngine.from_pretrained(tiny_model_path, prefix_cache_bytes=budget * per_token) as engine:
        conversations = [await _conversation(engine, engine.tokenizer.encode(f"{index} " + SYSTEM + question), 2,
                                             GREEDY, f"c{index}") for index, question in enumerate(QUESTIONS[:3])]
        stats = engine.prefix_cache_stats()
        newest = engine.tokenizer.encode("2 " + SYSTEM + QUESTIONS[2])
        oldest = engine.tokenizer.encode("0 " + SYSTEM + QUESTIONS[0])
        held = engine.cached_prefix_tokens(newest), engine.cached_prefix_tokens(oldest)
    async with TorchEngine.from_pretrained(tiny_model_path, prefix_cache_bytes=0) as engine:
        uncached = [await _conversation(engine, engine.tokenizer.encode(f"{index} " + SYSTEM + question), 2,
                                        GREEDY, f"c{index}") for index, question in enumerate(QUESTIONS[:3])]
    assert stats is not None and stats.capacity_tokens == budget
    assert stats.held_tokens <= budget and stats.evicted_tokens > 0
    assert held == (len(newest), 0)
    _assert_same_samples(conversations, uncached, exact=False)


@pytest.mark.integration
async def test_a_weight_update_between_two_turns_leaves_no_token_sampled_over_older_keys_and_values(
    tiny_model_path: Path, tmp_path: Path,
) -> None:
    """The second turn computes the conversation again under the new weights; the cache says what it held."""
    async with TorchEngine.from_pretrained(tiny_model_path) as engine:
        held, history = await _first_turn_then_new_weights(engine)
        assert engine.cached_prefix_tokens(history) == 0
        [second] = await engine.generate(GenerateRequest("turn-1", history, GREEDY))
        account, stats = engine.kv_cache_account(), engine.prefix_cache_stats()
        record_kv_cache(tmp_path, "rollout-0-0", engine, engine.version)
    async with TorchEngine(build_tiny_model(TinyModelSpec(family="qwen2", seed=1), build_tokenizer()),
                           build_tokenizer(), version=1, prefix_cache_bytes=0) as fresh:
        [reference] = await fresh.generate(GenerateRequest("turn-1", history, GREEDY))
    assert (second.cached_tokens, second.stale_cached_tokens) == (0, held)
    assert stats is not None and stats.stale_tokens == held
    assert second.versions == [1] * len(second.output_ids)
    assert second.output_ids == reference.output_ids
    torch.testing.assert_close(torch.tensor(second.log_probs), torch.tensor(reference.log_probs), rtol=0, atol=1e-5)
    assert account == KvCacheAccount(recomputes_on_update=True, stale_kv_tokens=0)
    verdict = caches_verdict(tmp_path)
    assert verdict["verdict"] == "pass" and verdict["prefix_cache"]["stale_tokens"] == held  # what it said it redid


@pytest.mark.integration
async def test_stale_keys_and_values_reused_past_a_removed_version_check_fail_the_certificate(
    tiny_model_path: Path, tmp_path: Path,
) -> None:
    """The guard of the guard: the engine stamps keys and values where it computes them and checks the stamp where it
    reuses them; with the check taken out (the bug a flush-based design has when a flush is missed), the old run is
    reused, and the account, which reads the stamps and not the check, counts every token sampled over it."""
    async with TorchEngine.from_pretrained(tiny_model_path) as engine:
        engine._batcher.prefix_cache.usable = lambda node, epoch: True  # the bug: stamps no longer checked
        held, history = await _first_turn_then_new_weights(engine)
        [second] = await engine.generate(GenerateRequest("turn-1", history, GREEDY))
        account = engine.kv_cache_account()
        record_kv_cache(tmp_path, "rollout-0-0", engine, engine.version)
    assert second.cached_tokens == held  # the stale run was attended
    assert account == KvCacheAccount(recomputes_on_update=True, stale_kv_tokens=len(second.output_ids))
    verdict = caches_verdict(tmp_path)
    assert verdict["verdict"] == "fail"
    assert verdict["culprits"] == [{"engine": "rollout-0-0", "stale_kv_tokens": len(second.output_ids)}]


@pytest.mark.integration
async def test_a_repush_under_the_same_version_number_voids_the_cache_too(tiny_model_path: Path) -> None:
    """A push repaired after a failed fingerprint check comes again as the same version; the weights changed."""
    async with TorchEngine.from_pretrained(tiny_model_path) as engine:
        prompt = engine.tokenizer.encode(SYSTEM + QUESTIONS[2])
        await engine.generate(GenerateRequest("before", prompt, GREEDY))
        await engine.update_weights(_new_weights().items(), version=0)
        [after] = await engine.generate(GenerateRequest("after", prompt, GREEDY))
    assert (after.cached_tokens, after.stale_cached_tokens) == (0, len(prompt) - 1)


@pytest.mark.integration
async def test_keys_and_values_kept_across_an_update_by_setting_are_reused_and_counted(
    tiny_model_path: Path,
) -> None:
    """recompute_kv_on_update=False (SGLang's keep): the old run is reused, and every token sampled over it counts,
    as it would in the sample's own cache row."""
    async with TorchEngine.from_pretrained(tiny_model_path, recompute_kv_on_update=False) as engine:
        held, history = await _first_turn_then_new_weights(engine)
        [second] = await engine.generate(GenerateRequest("turn-1", history, GREEDY))
        account = engine.kv_cache_account()
    assert second.cached_tokens == held
    assert account == KvCacheAccount(recomputes_on_update=False, stale_kv_tokens=len(second.output_ids))


@pytest.mark.integration
async def test_the_static_pool_takes_cached_prefixes_and_decodes_the_same_tokens(tiny_model_path: Path) -> None:
    async with TorchEngine.from_pretrained(tiny_model_path, kv_cache="static", kv_pool_columns=256) as engine:
        cached = await _conversations(engine, GREEDY)
        stats = engine.prefix_cache_stats()
    async with TorchEngine.from_pretrained(tiny_model_path, prefix_cache_bytes=0) as engine:
        uncached = await _conversations(engine, GREEDY)
    assert stats is not None and stats.reused_tokens > 0
    assert [[o.output_ids for o in c] for c in cached] == [[o.output_ids for o in c] for c in uncached]


@pytest.mark.integration
async def test_routes_of_cached_tokens_are_the_routes_they_were_computed_with(tiny_model_cache: Path) -> None:
    """Rollout routing replay: a later turn's routes for the history come from the cache with its keys and values."""
    moe = cached_tiny_model(tiny_model_cache, TinyModelSpec(family="qwen3_moe", experts=8))
    async with TorchEngine.from_pretrained(moe, record_routes=True) as engine:
        cached = await _conversations(engine, SEEDED, turns=2)
        stats = engine.prefix_cache_stats()
    async with TorchEngine.from_pretrained(moe, record_routes=True, prefix_cache_bytes=0) as engine:
        uncached = await _conversations(engine, SEEDED, turns=2)
    assert stats is not None and stats.reused_tokens > 0
    for mine, theirs in zip(cached, uncached, strict=True):
        assert [output.output_ids for output in mine] == [output.output_ids for output in theirs]
        for output, reference in zip(mine, theirs, strict=True):
            assert torch.equal(routes_of(output), routes_of(reference))


@pytest.mark.integration
async def test_smollm2_conversations_are_the_same_with_the_cache_as_without(smollm2_path: Path) -> None:
    """A real chat template and a 49k vocabulary: each turn is the conversation so far plus a tool's answer."""
    async def chat(engine: TorchEngine) -> tuple[list[GenerateOutput], list[int]]:
        tokenizer = engine.tokenizer
        messages = [{"role": "system", "content": "You are a helpful assistant with a calculator tool."},
                    {"role": "user", "content": "What is 17 times 23? Use the tool."}]
        history = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
        outputs, lengths = [], []
        for turn in range(3):
            [output] = await engine.generate(GenerateRequest(f"t{turn}", history, replace(GREEDY, max_new_tokens=12)))
            outputs.append(output)
            lengths.append(len(history))
            reply = f"<|im_end|>\n<|im_start|>tool\n{391 + turn}<|im_end|>\n<|im_start|>assistant\n"
            history = history + output.output_ids + tokenizer.encode(reply, add_special_tokens=False)
        return outputs, lengths

    async with TorchEngine.from_pretrained(smollm2_path) as engine:
        cached, lengths = await chat(engine)
        stats = engine.prefix_cache_stats()
    async with TorchEngine.from_pretrained(smollm2_path, prefix_cache_bytes=0) as engine:
        uncached, _ = await chat(engine)
    # every turn after the first took the previous turn's input and output (but its last token) from the cache
    held = [0, *(length + len(output.output_ids) - 1 for length, output in zip(lengths[:-1], cached[:-1],
                                                                                 strict=True))]
    assert [output.cached_tokens for output in cached] == held
    assert stats is not None and (stats.reused_tokens, stats.prefilled_tokens) == (sum(held), sum(lengths) - sum(held))
    _assert_same_samples([cached], [uncached], exact=False)


@pytest.mark.integration
async def test_an_adapter_push_voids_what_the_base_weights_computed(tiny_model_path: Path) -> None:
    """A LoRA run's pushes are adapters the engine folds into its weights: a weight load like any other."""
    from tests.engines.test_engine_lora import ADAPTER, PROMPT, _policy_greedy, _step, _trainer

    trainer = _trainer(tiny_model_path)
    _step(trainer, 1)
    params = replace(GREEDY, max_new_tokens=12)
    async with TorchEngine.from_pretrained(tiny_model_path, lora_scaling=ADAPTER.scaling) as engine:
        await engine.generate(GenerateRequest("base", PROMPT, params))
        await engine.update_weights(trainer.named_tensors(), 1)
        [adapted] = await engine.generate(GenerateRequest("adapted", PROMPT, params))
    assert (adapted.cached_tokens, adapted.stale_cached_tokens) == (0, len(PROMPT) - 1)
    assert adapted.output_ids == _policy_greedy(trainer, 12)
