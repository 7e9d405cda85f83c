"""A prompt with images through the rollout worker: the chat template's one placeholder per image part expanded to
the tokens the model's image processor gives each image, the images sent beside the tokens in the engine's request
(and across to another worker's engine), every sample of the group carrying them; the prompt-length cap counts the
same tokens. A group with images on a text-only model, or under an agent episode, fails its samples by name."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from transformers import AutoTokenizer

from actors.buffer.core import BufferCore
from actors.config import RunConfig, build_config
from actors.data.prompt_tokens import ImageTokens, prompt_length_counter
from actors.data.prompts import PromptSource, image_field, load_prompts
from actors.rollout.agent import AgentRunner, agent_generate_for
from actors.rollout.engine_calls import request_from_wire, request_to_wire
from actors.rollout.generate import RolloutContext, default_generate
from bus.codec import decode, encode
from bus.schema import PromptGroup, Sample
from engines.inference.base import GenerateOutput, GenerateRequest, SamplingParams
from engines.inference.torch_engine import TorchEngine
from engines.vision.images import encode_png
from engines.vision.processor import VisionProcessor
from tools.sim.pipeline import SimSpec, SleepingEngine


def png(width: int, height: int) -> bytes:
    return encode_png(Image.new("RGB", (width, height), (200, 30, 30)))


class WatchedEngine(SleepingEngine):
    """The simulation engine, keeping each request it was given (for the groups that must never reach an engine)."""

    def __init__(self) -> None:
        super().__init__(SimSpec(token_seconds=0.0, length_min=2, length_max=3, length_median=2), seed=[0])
        self.requests: list[GenerateRequest] = []

    async def generate(self, request: GenerateRequest) -> list[GenerateOutput]:
        self.requests.append(request)
        return await super().generate(request)


class WatchedTorchEngine(TorchEngine):
    """The torch engine, keeping each request it was given: what the worker sends is what this test reads, and the
    engine generates from it for real."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.requests: list[GenerateRequest] = []

    async def generate(self, request: GenerateRequest) -> list[GenerateOutput]:
        self.requests.append(request)
        return await super().generate(request)


def vlm_config(model: Path, data: Path, **settings: object) -> RunConfig:
    return build_config({"hf_checkpoint": str(model), "prompt_data": str(data), "n_samples_per_prompt": 2,
                         "rollout_max_response_len": 3, "multimodal_keys": '{"image": "images"}', **settings})


def leased_groups(records: list, n_samples: int) -> list[PromptGroup]:
    core = BufferCore(source=PromptSource(records, seed=1, shuffle=False), n_samples=n_samples, groups_per_batch=4,
                      max_staleness=0, lease_timeout=10.0)
    leased = core.lease("rollout-0-0", max_groups=len(records))
    assert leased is not None
    return [decode(encode(group)) for group in leased[1]]  # as the rollout worker receives them


@pytest.mark.integration
def test_the_engine_request_holds_the_expanded_image_tokens_and_the_images(tiny_vlm_path: Path,
                                                                          tmp_path: Path) -> None:
    small, wide = png(56, 56), png(112, 84)  # 4 and 12 tokens after the processor's 2x2 merge
    (tmp_path / "small.png").write_bytes(small)
    (tmp_path / "wide.png").write_bytes(wide)
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"input": "<image> or <image>: which is wider?", "label": "2",
                                "images": ["small.png", "wide.png"]}) + "\n", encoding="utf-8")
    config = vlm_config(tiny_vlm_path, data)
    records, _ = load_prompts(data, image_field=image_field(config.data))
    [group] = leased_groups(records, n_samples=2)
    tokenizer = AutoTokenizer.from_pretrained(tiny_vlm_path)

    async def generate() -> tuple[WatchedTorchEngine, list[Sample]]:
        async with WatchedTorchEngine.from_pretrained(tiny_vlm_path, max_batch_size=2) as engine:
            context = RolloutContext(engine=engine, tokenizer=tokenizer, config=config, worker_id="w",
                                     image_tokens=ImageTokens.of_run(config))
            return engine, await default_generate(context, group)

    engine, samples = asyncio.run(generate())

    [request] = engine.requests
    assert request.images == (small, wide)
    processor = VisionProcessor.from_model_folder(tiny_vlm_path)
    assert processor is not None
    rendered = list(tokenizer.apply_chat_template(group.prompt, add_generation_prompt=True,
                                                  tokenize=True)["input_ids"])
    assert rendered.count(processor.image_token_id) == 2  # one placeholder per image part
    assert request.input_ids.count(processor.image_token_id) == 4 + 12
    assert len(request.input_ids) == len(rendered) - 2 + 4 + 12
    processor.check_expanded(request.input_ids, processor.encode(request.images, where="request"), where="request")
    assert len(samples) == 2  # generated by the engine from the image prompt
    assert all(sample.status in ("completed", "truncated") and sample.error is None for sample in samples)
    for sample in samples:
        assert sample.images == [small, wide]
        assert sample.tokens[:sample.prompt_tokens].tolist() == request.input_ids
    assert prompt_length_counter(config, tokenizer)(group.prompt, None, group.images) == len(request.input_ids)

    wired = request_from_wire(decode(encode(request_to_wire(request))))  # to another worker's engine
    assert (wired.input_ids, wired.images) == (request.input_ids, request.images)


@pytest.mark.integration
def test_an_images_tokens_count_toward_the_prompt_length_cap_at_load(tiny_vlm_path: Path, tmp_path: Path) -> None:
    (tmp_path / "small.png").write_bytes(png(56, 56))
    (tmp_path / "wide.png").write_bytes(png(112, 84))
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"input": "<image>?", "label": "1", "images": [name]}) + "\n"
                            for name in ("small.png", "wide.png")), encoding="utf-8")
    config = vlm_config(tiny_vlm_path, data)
    count = prompt_length_counter(config, AutoTokenizer.from_pretrained(tiny_vlm_path))
    all_records, _ = load_prompts(data, image_field=image_field(config.data))
    small, wide = (count(record.prompt, None, record.images) for record in all_records)
    assert wide - small == 12 - 4  # the same text; the wide image takes 8 more tokens
    records, report = load_prompts(data, image_field=image_field(config.data), max_prompt_len=small,
                                   count_tokens=count)
    assert [record.data_index for record in records] == [0]
    assert (report.too_long, report.first_too_long) == (1, f"line 2 ({wide} tokens)")


@pytest.mark.integration
def test_a_group_with_images_on_a_text_model_fails_its_samples_naming_the_model(tiny_model_path: Path,
                                                                                 tmp_path: Path) -> None:
    config = build_config({"hf_checkpoint": str(tiny_model_path), "n_samples_per_prompt": 2,
                           "multimodal_keys": '{"image": "images"}'})
    group = PromptGroup(group_id="0:3", prompt=[{"role": "user", "content": [{"type": "image"}, {
        "type": "text", "text": "?"}]}], n_samples=2, images=[png(56, 56)])
    engine = WatchedEngine()
    context = RolloutContext(engine=engine, tokenizer=AutoTokenizer.from_pretrained(tiny_model_path), config=config,
                             worker_id="w", image_tokens=ImageTokens.of_run(config))
    samples = asyncio.run(default_generate(context, group))
    assert engine.requests == []
    assert [sample.status for sample in samples] == ["failed", "failed"]
    assert samples[0].error == (f"group 0:3: the prompt has images, and the model {tiny_model_path} is a text-only "
                                "model (its config.json has no vision_config); images need a vision-language model")


async def unused_agent(episode: object) -> None:
    raise AssertionError("an episode with images must not start")


@pytest.mark.integration
def test_agent_episodes_refuse_a_group_with_images_by_name(tiny_vlm_path: Path) -> None:
    config = build_config({"hf_checkpoint": str(tiny_vlm_path), "n_samples_per_prompt": 2,
                           "agent_function_path": f"{__name__}:unused_agent"})
    runner = agent_generate_for(config)
    assert isinstance(runner, AgentRunner)
    group = PromptGroup(group_id="g", prompt=[{"role": "user", "content": [{"type": "image"}]}], n_samples=2,
                        images=[png(56, 56)])
    context = RolloutContext(engine=WatchedEngine(), tokenizer=AutoTokenizer.from_pretrained(tiny_vlm_path),
                             config=config, worker_id="w")
    samples = asyncio.run(runner(context, group))
    assert [sample.status for sample in samples] == ["failed", "failed"]
    assert samples[0].error.startswith("group g has 1 image(s), and agent episodes (--agent-function-path, "
                                       "--agent-tools-path, --agent-environment-path) take text prompts only")
    assert samples[0].images == group.images


@pytest.mark.unit
def test_sampling_params_survive_the_wire_beside_the_images() -> None:
    request = GenerateRequest("w/g/1", [1, 2, 3], SamplingParams(max_new_tokens=5, n=2), images=(b"a", b"bc"))
    assert request_from_wire(decode(encode(request_to_wire(request)))) == request
