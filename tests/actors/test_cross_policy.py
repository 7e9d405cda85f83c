"""An episode that calls another policy: what the rollout context gives it (`engine_of`, `group_for`) and how the
worker tells the policies' samples apart (`split_by_policy`). The engine is a real torch engine serving two named
adapters; the episode is tests/support/cross_policy.py's."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from actors.config import RunConfig
from actors.rollout.cross_policy import split_by_policy
from actors.rollout.generate import RolloutContext
from actors.rollout.lanes import AdapterEngine
from bus.schema import PromptGroup
from engines.inference import GenerateRequest, TorchEngine
from tests.support.adapters import random_adapter
from tests.support.cross_policy import SUMS_TURN, add_then_sums

pytestmark = pytest.mark.integration
GROUP = PromptGroup(group_id="0:3", prompt="1 + 2 =", label="3", n_samples=2, data_index=3)


def _context(engine: TorchEngine, tokenizer: object, policy: str | None = "add") -> RolloutContext:
    config = RunConfig(hf_checkpoint="unused", n_samples_per_prompt=2, rollout_max_response_len=6,
                       rollout_temperature=0.0)
    sums = RunConfig(hf_checkpoint="unused", n_samples_per_prompt=3, rollout_max_response_len=4,
                     rollout_temperature=0.0)
    policies = ("add", "sums") if policy is not None else ()
    return RolloutContext(engine=AdapterEngine(engine, "add") if policy else engine, tokenizer=tokenizer,
                          config=config, worker_id="rollout-0-0", policy=policy,
                          policy_engines={name: AdapterEngine(engine, name) for name in policies},
                          policy_configs={"add": config, "sums": sums} if policy else {})


@pytest.fixture
async def engine(tiny_model_path: Path) -> TorchEngine:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    served = TorchEngine(model, None, lora_scaling=2.0)  # type: ignore[arg-type]
    await served.update_weights(random_adapter(model, 4, 1, scale=0.5), 2, adapter="add")
    await served.update_weights(random_adapter(model, 4, 2, scale=0.5), 5, adapter="sums")
    yield served
    await served.close()


async def test_an_episodes_turns_of_another_policy_come_from_its_adapter_and_form_a_group_of_its_own(
        engine: TorchEngine, tiny_model_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    context = _context(engine, tokenizer)
    samples = await add_then_sums(context, GROUP)
    own, others = split_by_policy(context, GROUP, samples)
    assert [sample.sample_id for sample in own] == ["0:3/0", "0:3/1"]
    assert all(set(sample.token_versions.tolist()) == {2} for sample in own)  # add's adapter, at add's version
    [turns] = others
    assert (turns.policy, turns.group.group_id, turns.group.n_samples) == ("sums", "0:3@sums.echo", 3)
    assert turns.group.metadata == {"host_group": "0:3", "host_policy": "add"} and turns.group.data_index == 3
    assert [sample.sample_id for sample in turns.samples] == [f"0:3@sums.echo/{index}" for index in range(3)]
    assert turns.samples[0].prompt == SUMS_TURN + own[0].response
    # sums' turns are what sums' adapter samples, at sums' version, from the prompt the episode built
    prompt_ids = turns.samples[0].tokens[: turns.samples[0].prompt_tokens].tolist()
    [alone] = await engine.generate(GenerateRequest("alone", prompt_ids, context.sampling_params(turns.group, n=1),
                                                    adapter="sums"))
    assert turns.samples[0].tokens[len(prompt_ids):].tolist() == alone.output_ids
    assert set(turns.samples[0].token_versions.tolist()) == {5}
    # each policy's turns are sampled by its own settings
    assert (context.sampling_params(GROUP).max_new_tokens, context.sampling_params(turns.group).max_new_tokens) == (
        6, 4)
    assert max(sample.response_length for sample in turns.samples) <= 4


async def test_an_episode_is_told_what_it_cannot_do_by_name(engine: TorchEngine, tiny_model_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    context = _context(engine, tokenizer)
    with pytest.raises(ValueError, match=r"engine_of\('judge'\): no policy 'judge' in this run \(policies: \['add', "
                                         r"'sums'\]\)"):
        context.engine_of("judge")
    with pytest.raises(ValueError, match="that is this episode's own policy"):
        context.group_for("add", GROUP, "k", "prompt")
    with pytest.raises(ValueError, match="must be a non-empty name without '/' or '@'"):
        context.group_for("sums", GROUP, "a/b", "prompt")
    context.group_for("sums", GROUP, "k", "prompt")
    with pytest.raises(ValueError, match="key 'k' is used twice in the episode of 0:3"):
        context.group_for("sums", GROUP, "k", "prompt")
    alone = _context(engine, tokenizer, policy=None)
    with pytest.raises(ValueError, match="none: this run has one unnamed policy"):
        alone.engine_of("sums")
    episode = _context(engine, tokenizer)
    samples = await add_then_sums(episode, GROUP)
    stray = msgspec.structs.replace(samples[0], group_id="0:4", sample_id="0:4/0")
    with pytest.raises(ValueError, match=r"neither its group '0:3' nor one it opened .*\['0:4/0'\]"):
        split_by_policy(episode, GROUP, [*samples, stray])
