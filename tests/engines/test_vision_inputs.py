"""The image side of a vision-language model: bad images refused by name, placeholders expanded to the tokens the
model's own processor would give, and our multimodal rotary positions the ones the model computes itself."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoTokenizer

from engines.vision.images import ImageLimits, ImageProblem, decode_image, encode_png
from engines.vision.processor import VisionInputs, VisionProcessor, rope_positions


def png(width: int, height: int, colour: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    return encode_png(Image.new("RGB", (width, height), colour))


@pytest.mark.unit
def test_unusable_images_are_refused_naming_the_image_and_the_reason() -> None:
    good = png(40, 30)
    assert decode_image(good, where="row 3").size == (40, 30)
    cases = {
        b"": "empty",
        b"not an image at all": "not a readable image",
        good[: len(good) // 2]: "not a readable image",
    }
    for data, reason in cases.items():
        with pytest.raises(ImageProblem, match=f"row 3: .*{reason}"):
            decode_image(data, where="row 3")
    with pytest.raises(ImageProblem, match="row 4: the image is 40x30 = 1200 pixels, over the limit of 1000"):
        decode_image(good, where="row 4", limits=ImageLimits(max_pixels=1000))
    with pytest.raises(ImageProblem, match=f"row 5: the image is {len(good)} bytes, over the limit of 10"):
        decode_image(good, where="row 5", limits=ImageLimits(max_bytes=10))
    with pytest.raises(ImageProblem, match="must be encoded bytes, got str"):
        decode_image("image.png", where="row 6")  # type: ignore[arg-type]


@pytest.mark.unit
def test_a_jpeg_decodes_to_rgb() -> None:
    buffer = io.BytesIO()
    Image.new("L", (16, 16), 128).save(buffer, format="JPEG")
    assert decode_image(buffer.getvalue(), where="grey").mode == "RGB"


@pytest.fixture(scope="module")
def vlm(tiny_vlm_path):
    processor = VisionProcessor.from_model_folder(tiny_vlm_path)
    assert processor is not None
    tokenizer = AutoTokenizer.from_pretrained(tiny_vlm_path)
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm_path).eval()
    return processor, tokenizer, model


def prompt_ids(tokenizer, images: int) -> list[int]:
    content = [{"type": "image"}] * images + [{"type": "text", "text": "How many circles?"}]
    ids = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.mark.integration
def test_placeholders_expand_to_one_token_per_merged_patch_and_a_mismatch_is_refused(vlm) -> None:
    processor, tokenizer, _ = vlm
    inputs = processor.encode([png(56, 56), png(112, 84)], where="row 0")
    # 56x56 -> a 4x4 patch grid -> 4 tokens after the 2x2 merge; 112x84 -> 8x6 -> 12
    assert inputs.grid_thw.tolist() == [[1, 4, 4], [1, 6, 8]]
    assert inputs.tokens_per_image == (4, 12)
    ids = prompt_ids(tokenizer, 2)
    expanded = processor.expand_placeholders(ids, inputs, where="row 0")
    assert len(expanded) == len(ids) + 4 + 12 - 2
    assert expanded.count(processor.image_token_id) == 16
    processor.check_expanded(expanded, inputs, where="row 0")
    with pytest.raises(ValueError, match="row 1: the prompt has 1 image placeholder\\(s\\) for 2 image\\(s\\)"):
        processor.expand_placeholders(prompt_ids(tokenizer, 1), inputs, where="row 1")
    with pytest.raises(ValueError, match=r"row 2: the tokens hold 16 image token\(s\) where its 1 image\(s\) take 4"):
        processor.check_expanded(expanded, processor.encode([png(56, 56)], where="row 2"), where="row 2")


@pytest.mark.integration
def test_a_text_model_folder_has_no_image_side(tiny_model_path) -> None:
    assert VisionProcessor.from_model_folder(tiny_model_path) is None


@pytest.mark.integration
def test_our_rotary_positions_give_the_logits_of_the_models_own(vlm) -> None:
    processor, tokenizer, model = vlm
    inputs = processor.encode([png(56, 56), png(112, 84)], where="row 0")
    ids = torch.tensor([processor.expand_placeholders(prompt_ids(tokenizer, 2), inputs, where="row 0")])
    positions, next_position = rope_positions(model, ids[0], inputs, processor.image_token_id)
    assert positions.shape == (3, ids.shape[1])
    assert next_position == int(positions.max()) + 1 < ids.shape[1]  # an image takes fewer positions than tokens
    image = ids[0] == processor.image_token_id
    assert not torch.equal(positions[1, image], positions[2, image])  # height and width differ inside an image
    assert torch.equal(positions[0, ~image], positions[1, ~image])  # text tokens: one index on all three
    with torch.no_grad():
        own = model(input_ids=ids, pixel_values=inputs.pixel_values, image_grid_thw=inputs.grid_thw,
                    mm_token_type_ids=image.view(1, -1).int()).logits
        ours = model(input_ids=ids, pixel_values=inputs.pixel_values, image_grid_thw=inputs.grid_thw,
                     position_ids=positions.unsqueeze(1)).logits
    assert torch.equal(own, ours)
    text_only, after = rope_positions(model, ids[0, :5], None, processor.image_token_id)
    assert text_only.tolist() == [list(range(5))] * 3 and after == 5


@pytest.mark.integration
def test_joined_inputs_keep_prompt_order(vlm) -> None:
    processor, _, _ = vlm
    first, empty, second = (processor.encode(images, where="r") for images in ([png(56, 56)], [], [png(112, 84)]))
    joined = VisionInputs.join([first, empty, second])
    assert joined is not None and joined.tokens_per_image == (4, 12)
    assert torch.equal(joined.pixel_values, torch.cat([first.pixel_values, second.pixel_values]))
    assert VisionInputs.join([empty]) is None


@pytest.mark.integration
def test_the_tiny_qwen3_vl_adds_its_deepstack_features_at_the_image_tokens(tiny_model_cache) -> None:
    """The Qwen3-VL stand-in's deepstack features are live, so the engine and learner parity tests over it cover
    them: silencing the deepstack mergers changes the logits from the first image token on, and not before it."""
    from tools.standins.tiny_vlm import TinyVlmSpec, cached_tiny_vlm

    path = cached_tiny_vlm(tiny_model_cache, TinyVlmSpec(family="qwen3_vl"))
    processor = VisionProcessor.from_model_folder(path)
    assert processor is not None and processor.model_type == "qwen3_vl"
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    inputs = processor.encode([png(64, 64)], where="row 0")
    ids = torch.tensor([processor.expand_placeholders(prompt_ids(AutoTokenizer.from_pretrained(path), 1), inputs,
                                                      where="row 0")])
    image = ids == processor.image_token_id
    first_image = int(image[0].nonzero()[0])

    def logits() -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=ids, pixel_values=inputs.pixel_values, image_grid_thw=inputs.grid_thw,
                         mm_token_type_ids=image.int()).logits[0]

    with_deepstack = logits()
    mergers = model.model.visual.deepstack_merger_list
    assert len(mergers) == 2  # one per deepstack layer, added after the language model's first two layers
    with torch.no_grad():
        for merger in mergers:
            merger.linear_fc2.weight.zero_()
            merger.linear_fc2.bias.zero_()
    without = logits()
    assert torch.equal(with_deepstack[:first_image], without[:first_image])
    assert not torch.allclose(with_deepstack[first_image:], without[first_image:], atol=1e-4)


@pytest.mark.unit
def test_an_unknown_tiny_vlm_family_is_refused_naming_the_known_ones() -> None:
    from tools.standins.tiny_vlm import TinyVlmSpec

    with pytest.raises(ValueError, match=r"tiny VLM family 'llava' unknown; choose one of \['qwen2_5_vl', 'qwen2_vl'"):
        TinyVlmSpec(family="llava")
