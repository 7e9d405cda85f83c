"""The torch engine generates from prompts with images what Hugging Face's `generate()` does on the same model:
alone, beside other image and text prompts in one batch, as n samples of one request, and after a weight update
made it prefill a half-generated row again (whose positions continue past the image's rotary grid). Those three run
on a tiny model of each Qwen-VL family (`vlm_family_path`): their rotary layouts differ, and Qwen3-VL adds deepstack
features inside the language model."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageDraw

from engines.inference import GenerateRequest, SamplingParams, TorchEngine, continuation_request
from engines.inference.vision_rows import placeholder_tokens
from engines.vision.images import encode_png
from engines.vision.processor import VisionProcessor
from tests.engines.test_inference_engine_control import StepGate

pytestmark = pytest.mark.integration


def picture(colour: tuple[int, int, int], shapes: int, size: tuple[int, int] = (84, 56),
            background: tuple[int, int, int] = (255, 255, 255)) -> bytes:
    image = Image.new("RGB", size, background)
    draw = ImageDraw.Draw(image)
    for index in range(shapes):
        draw.ellipse([6 + 18 * index, 10, 20 + 18 * index, 24], fill=colour)
    return encode_png(image)


def prompt(engine: TorchEngine, processor: VisionProcessor, images: list[bytes], question: str) -> list[int]:
    content = [{"type": "image"}] * len(images) + [{"type": "text", "text": question}]
    ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                               tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return processor.expand_placeholders(ids, processor.encode(images, where="test"), where="test") if images else ids


def vision_kwargs(processor: VisionProcessor, ids: list[int], images: list[bytes]) -> dict[str, torch.Tensor]:
    inputs = processor.encode(images, where="reference")
    return {"pixel_values": inputs.pixel_values, "image_grid_thw": inputs.grid_thw,
            "mm_token_type_ids": (torch.tensor([ids]) == processor.image_token_id).int()}


def hf_greedy(model: torch.nn.Module, processor: VisionProcessor, ids: list[int], images: list[bytes],
              tokens: int) -> list[int]:
    extra = vision_kwargs(processor, ids, images) if images else {}
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        # no end-of-sequence token (`eos_token_id=[]`): generation runs past one as the engine's ignore_eos does,
        # where min_new_tokens would forbid it and pick the runner-up
        out = model.generate(input_ids=input_ids, max_new_tokens=tokens, eos_token_id=[], do_sample=False,
                             suppress_tokens=placeholder_tokens(model), **extra)
    return out[0, len(ids):].tolist()


def hf_log_probs(model: torch.nn.Module, processor: VisionProcessor, ids: list[int], images: list[bytes],
                 output: list[int]) -> list[float]:
    """log p(output[i] | prompt, output[:i]) by one HF forward that computes its own rotary positions."""
    input_ids = torch.tensor([ids + output])
    extra = vision_kwargs(processor, ids + output, images) if images else {}
    with torch.no_grad():
        logits = model(input_ids=input_ids, **extra).logits[0, len(ids) - 1 : -1]
    logits[:, placeholder_tokens(model)] = float("-inf")  # the distribution the engine samples from
    return logits.log_softmax(-1).gather(-1, torch.tensor(output).unsqueeze(-1)).squeeze(-1).tolist()


def assert_same_log_probs(engine_log_probs: list[float], reference: list[float]) -> None:
    assert torch.allclose(torch.tensor(engine_log_probs), torch.tensor(reference), atol=1e-4), (
        engine_log_probs, reference)


def greedy(tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=tokens, ignore_eos=True, n=n)


def load_processor(path: Path) -> VisionProcessor:
    found = VisionProcessor.from_model_folder(path)
    assert found is not None
    return found


@pytest.fixture(scope="module")
def processor(vlm_family_path: Path) -> VisionProcessor:
    """The image side of each family's tiny VLM (the tests whose claim depends on the family)."""
    return load_processor(vlm_family_path)


@pytest.fixture(scope="module")
def qwen25_processor(tiny_vlm_path: Path) -> VisionProcessor:
    return load_processor(tiny_vlm_path)


async def test_image_prompts_batched_with_text_generate_what_hf_generate_does(vlm_family_path: Path,
                                                                              processor: VisionProcessor) -> None:
    red, blue = [picture((220, 20, 20), 3)], [picture((20, 20, 220), 1), picture((20, 160, 20), 2, (56, 112))]
    # as red's in size, so in tokens; a colour change alone leaves the tiny random Qwen3-VL's greedy answer as it is
    other = [picture((20, 20, 220), 3, background=(0, 0, 0))]
    async with TorchEngine.from_pretrained(vlm_family_path, prefix_cache_bytes=1 << 24) as engine:
        question = "How many shapes?"
        cases = {"red": (prompt(engine, processor, red, question), red),
                 "blue": (prompt(engine, processor, blue, question), blue),
                 "same tokens, other image": (prompt(engine, processor, other, question), other),
                 "text": (prompt(engine, processor, [], question), [])}
        assert cases["red"][0] == cases["same tokens, other image"][0]  # only the pixels tell them apart
        await engine.pause()  # all four wait, and one prefill admits them together
        generations = [asyncio.ensure_future(engine.generate(GenerateRequest(name, ids, greedy(12),
                                                                             images=tuple(images))))
                       for name, (ids, images) in cases.items()]
        await asyncio.sleep(0)
        await engine.resume()
        outputs = dict(zip(cases, [output for [output] in await asyncio.gather(*generations)], strict=True))
        expected = {name: hf_greedy(engine.model, processor, ids, images, 12) for name, (ids, images) in cases.items()}
        for name, (ids, images) in cases.items():
            assert_same_log_probs(outputs[name].log_probs,
                                  hf_log_probs(engine.model, processor, ids, images, outputs[name].output_ids))
    assert {name: output.output_ids for name, output in outputs.items()} == expected
    assert expected["red"] != expected["same tokens, other image"], "the test needs images that change the answer"


async def test_n_samples_of_an_image_prompt_prefill_it_once(vlm_family_path: Path, processor: VisionProcessor) -> None:
    gate = StepGate(at=-1)
    images = [picture((220, 20, 20), 2)]
    async with TorchEngine.from_pretrained(vlm_family_path, step_listener=gate) as engine:
        ids = prompt(engine, processor, images, "Count.")
        outputs = await engine.generate(GenerateRequest("group", ids, greedy(6, n=4), images=tuple(images)))
        expected = hf_greedy(engine.model, processor, ids, images, 6)
    assert [output.output_ids for output in outputs] == [expected] * 4
    [admitting] = [record for record in gate.records if record.admitted]
    assert len(admitting.admitted) == 4 and admitting.columns == len(ids)  # one row prefilled, fanned out to four


async def test_a_weight_update_mid_generation_prefills_the_image_row_again_at_the_right_positions(
        vlm_family_path: Path, processor: VisionProcessor) -> None:
    gate = StepGate(at=5)
    images = [picture((20, 160, 20), 3)]
    async with TorchEngine.from_pretrained(vlm_family_path, step_listener=gate) as engine:
        ids = prompt(engine, processor, images, "What colour?")
        weights = {name: tensor.clone() for name, tensor in engine.model.state_dict().items()}
        generation = asyncio.ensure_future(engine.generate(GenerateRequest("r", ids, greedy(16),
                                                                           images=tuple(images))))
        await gate.wait_reached()
        await gate.release_after(engine.update_weights(weights.items(), version=1))
        [output] = await generation
        expected = hf_greedy(engine.model, processor, ids, images, 16)
        reference = hf_log_probs(engine.model, processor, ids, images, output.output_ids)
    assert_same_log_probs(output.log_probs, reference)
    assert output.versions == [0] * 5 + [1] * 11
    assert any(record.admitted for record in gate.records[5:]), "the update did not make the row prefill again"
    assert output.output_ids == expected


async def test_an_image_request_aborted_mid_generation_resumes_to_the_same_greedy_answer(
        tiny_vlm_path: Path, qwen25_processor: VisionProcessor) -> None:
    gate = StepGate(at=4)
    images = [picture((200, 120, 0), 2)]
    async with TorchEngine.from_pretrained(tiny_vlm_path, step_listener=gate) as engine:
        ids = prompt(engine, qwen25_processor, images, "Count.")
        request = GenerateRequest("r", ids, greedy(14), images=tuple(images))
        generation = asyncio.ensure_future(engine.generate(request))
        await gate.wait_reached()
        await gate.release_after(engine.pause("abort"))
        [partial] = await generation
        await engine.resume()
        [rest] = await engine.generate(continuation_request(request, partial))
        expected = hf_greedy(engine.model, qwen25_processor, request.input_ids, images, 14)
    assert partial.finish_reason == "abort" and 0 < len(partial.output_ids) < 14
    assert partial.output_ids + rest.output_ids == expected


async def test_the_engine_never_samples_an_image_placeholder(tiny_vlm_path: Path,
                                                             qwen25_processor: VisionProcessor) -> None:
    """A generated placeholder would be taken for an image slot by the next prefill of the row (and by the
    learner), which would find more slots than images. Planted: the placeholder's head row made the model's top
    choice after the prompt."""
    images = [picture((20, 20, 220), 2)]
    async with TorchEngine.from_pretrained(tiny_vlm_path) as engine:
        ids = prompt(engine, qwen25_processor, images, "Count.")
        first = hf_greedy(engine.model, qwen25_processor, ids, images, 1)[0]
        head = engine.model.get_output_embeddings().weight
        planted = {name: tensor.clone() for name, tensor in engine.model.state_dict().items()}
        planted_head = next(name for name, tensor in engine.model.state_dict().items() if tensor is head
                            or tensor.data_ptr() == head.data_ptr())
        planted[planted_head][qwen25_processor.image_token_id] = 3 * head[first].detach()
        await engine.update_weights(planted.items(), version=1)
        with torch.no_grad():
            extra = vision_kwargs(qwen25_processor, ids, images)
            top = engine.model(input_ids=torch.tensor([ids]), **extra).logits[0, -1]
        assert int(top.argmax()) == qwen25_processor.image_token_id  # the premise
        outputs = await engine.generate(GenerateRequest("r", ids, SamplingParams(temperature=1.0, max_new_tokens=12,
                                                                                 ignore_eos=True, n=4, seed=0),
                                                        images=tuple(images)))
        greedy_output = await engine.generate(GenerateRequest("g", ids, greedy(4), images=tuple(images)))
    assert all(qwen25_processor.image_token_id not in output.output_ids for output in [*outputs, *greedy_output])
    assert greedy_output[0].output_ids[0] == first


async def test_requests_whose_images_do_not_fit_are_refused_by_name(tiny_vlm_path: Path, tiny_model_path: Path,
                                                                    qwen25_processor: VisionProcessor) -> None:
    image = picture((0, 0, 0), 1)
    async with TorchEngine.from_pretrained(tiny_vlm_path) as engine:
        ids = prompt(engine, qwen25_processor, [image], "?")
        with pytest.raises(ValueError, match="request 'two': the tokens hold 6 image token"):
            await engine.generate(GenerateRequest("two", ids, greedy(2), images=(image, image)))
        with pytest.raises(ValueError, match="request 'none': its tokens hold image tokens but it carries no image"):
            await engine.generate(GenerateRequest("none", ids, greedy(2)))
        with pytest.raises(ValueError, match="image 0 of request 'broken': not a readable image"):
            await engine.generate(GenerateRequest("broken", ids, greedy(2), images=(image[:40],)))
    async with TorchEngine.from_pretrained(tiny_model_path) as text_engine:
        with pytest.raises(ValueError, match=r"request 'text': 1 image\(s\) sent to a text-only model"):
            await text_engine.generate(GenerateRequest("text", [5, 6, 7], greedy(2), images=(image,)))
    with pytest.raises(ValueError, match=r"images \(a vision-language model\) need kv_cache='dynamic'"):
        TorchEngine.from_pretrained(tiny_vlm_path, kv_cache="static")
