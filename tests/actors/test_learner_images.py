"""A vision-language model's samples on their way into the learner: their images decoded with the model's own
processor, a sample whose images cannot be used dropped by name and counted (never a crash), and a backend that
cannot train such a model refused at preflight with the reason."""

from __future__ import annotations

import logging
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer

from actors.config import RunConfig, build_config
from actors.config.preflight import preflight
from actors.learner.stages import BAD_IMAGE_SAMPLES, with_usable_images
from actors.learner.step import TrainingStep
from actors.learner.trainer_factory import build_trainer
from bus.schema import Sample
from engines.vision.images import encode_png
from engines.vision.processor import VisionProcessor
from tests.support.inprocess import use_spec
from tools.sim.pipeline import SimSpec

HEAD = {"controller": 1, "buffer": 1, "learner": 1, "rollout": 1, "reward": 1}


def png(colour: tuple[int, int, int]) -> bytes:
    return encode_png(Image.new("RGB", (56, 56), colour))  # 4 image tokens with the tiny VLM's processor


def image_sample(processor: VisionProcessor, tokenizer, index: int, image: bytes, *,
                 image_tokens: int = 4) -> Sample:
    prompt = tokenizer.encode("Colour? ", add_special_tokens=False)
    tokens = [processor.vision_start_token_id, *[processor.image_token_id] * image_tokens, *prompt, 5, 6, 7]
    return Sample(sample_id=f"g/{index}", group_id="g", index=index, prompt="p", prompt_tokens=len(tokens) - 3,
                  tokens=np.asarray(tokens, dtype=np.int32), response="red", response_length=3, reward=1.0,
                  rollout_log_probs=np.zeros(3, np.float32), status="completed", images=[image])


@pytest.fixture(scope="module")
def parts(tiny_vlm_path: Path):
    processor = VisionProcessor.from_model_folder(tiny_vlm_path)
    assert processor is not None
    return processor, AutoTokenizer.from_pretrained(tiny_vlm_path)


@pytest.mark.integration
def test_a_response_holding_an_image_placeholder_is_dropped_naming_it(parts, caplog: pytest.LogCaptureFixture
                                                                       ) -> None:
    """One from an engine that samples placeholders (SGLang, or any but ours): the learner's forward would take it
    for an image slot, with or without images in the prompt."""
    processor, tokenizer = parts
    with_images = image_sample(processor, tokenizer, 0, png((200, 20, 20)))
    tokens = np.asarray(with_images.tokens).copy()
    tokens[-2] = processor.image_token_id
    text = Sample(sample_id="t/0", group_id="t", index=0, prompt="p", prompt_tokens=2,
                  tokens=np.asarray([40, 41, processor.image_token_id], dtype=np.int32), response="?",
                  response_length=1, reward=0.0, rollout_log_probs=np.zeros(1, np.float32), status="completed")
    generated = [msgspec.structs.replace(with_images, tokens=tokens), text]
    with caplog.at_level(logging.WARNING, logger="actors.learner.stages"):
        kept, _ = with_usable_images([with_images, *generated], processor)
    assert kept == [with_images]
    assert caplog.text.count("its response holds 1 image placeholder token(s) the model generated") == 2


@pytest.mark.integration
def test_a_sample_with_a_broken_image_is_dropped_by_name_and_counted(tiny_vlm_path: Path, parts, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    processor, tokenizer = parts
    good = png((200, 20, 20))
    samples = [image_sample(processor, tokenizer, 0, good),
               image_sample(processor, tokenizer, 1, good[: len(good) // 2]),  # truncated on the way
               image_sample(processor, tokenizer, 2, good, image_tokens=3),  # tokens for another image size
               image_sample(processor, tokenizer, 3, png((20, 20, 200)))]
    use_spec(SimSpec(train_sample_seconds=0.0), tmp_path, monkeypatch)
    config = build_config({"train_backend": "tools.sim.pipeline:sleeping_trainer", "n_samples_per_prompt": 4,
                           "hf_checkpoint": str(tiny_vlm_path)})
    step = TrainingStep(build_trainer(config), config)
    with caplog.at_level(logging.WARNING, logger="actors.learner.stages"):
        prepared = step.prepare(samples, staleness=[0] * 4)
    assert prepared.metrics[BAD_IMAGE_SAMPLES] == 2.0
    kept = prepared.batch.samples
    assert len(kept) == 2 and all(sample.vision is not None for sample in kept)
    assert torch.equal(kept[0].vision.pixel_values, processor.encode([good], where="x").pixel_values)
    assert not torch.equal(kept[0].vision.pixel_values, kept[1].vision.pixel_values)
    warnings = "\n".join(record.getMessage() for record in caplog.records)
    assert "image 0 of sample g/1 (group g): not a readable image" in warnings
    assert "sample g/2 (group g): the tokens hold 3 image token(s) where its 1 image(s) take 4" in warnings


@pytest.mark.integration
def test_images_for_a_model_without_a_vision_tower_are_dropped(parts) -> None:
    processor, tokenizer = parts
    sample = image_sample(processor, tokenizer, 0, png((1, 2, 3)))
    assert with_usable_images([sample], None) == ([], [])
    assert with_usable_images([sample], processor)[0] == [sample]


@pytest.mark.integration
def test_a_vision_language_model_on_the_megatron_backend_is_refused_at_preflight(tiny_vlm_path: Path,
                                                                                tiny_model_path: Path) -> None:
    def problems(backend: str, model: Path) -> list[str]:
        config = RunConfig(hf_checkpoint=str(model), train_backend=backend)
        return [problem for problem in preflight(config, {"learner": 1}) if "--train-backend" in problem]

    [refusal] = problems("megatron", tiny_vlm_path)
    assert refusal.startswith(f"--train-backend megatron: {tiny_vlm_path} is a vision-language model")
    assert "Transformer Engine" in refusal and "--train-backend torch trains vision-language models" in refusal
    assert problems("torch", tiny_vlm_path) == []
    assert problems("megatron", tiny_model_path) == []


@pytest.mark.integration
def test_the_run_flag_trains_the_vision_tower(tiny_vlm_path: Path) -> None:
    def tower_trains(**flags: object) -> bool:
        trainer = build_trainer(build_config({"hf_checkpoint": str(tiny_vlm_path), **flags}))
        return any(parameter.requires_grad for name, parameter in trainer._model.named_parameters()
                   if name.startswith("model.visual."))

    assert not tower_trains()
    assert tower_trains(freeze_vision_tower=False)
