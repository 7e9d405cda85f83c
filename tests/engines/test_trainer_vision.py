"""The torch trainer on a vision-language model: log-probs of a packed row with images equal the model's own forward
of each sample alone, a step trains the language model and leaves a frozen vision tower as it was, and the engines
are pushed exactly the weights they need."""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from torch import Tensor
from transformers import AutoModelForImageTextToText, AutoTokenizer

from engines.training import ModelOutputs, PackedBatch, TorchTrainer, TorchTrainerConfig, TrainSample
from engines.training.lora import LoraSettings
from engines.training.vision import is_tower_weight
from engines.vision.images import encode_png
from engines.vision.processor import VisionInputs, VisionProcessor

TEMPERATURE = 0.7


def png(width: int, height: int, colour: tuple[int, int, int]) -> bytes:
    return encode_png(Image.new("RGB", (width, height), colour))


def image_sample(processor: VisionProcessor, tokenizer, images: list[bytes], question: str,
                 response: str) -> TrainSample:
    """A prompt with `images` then `question`, its placeholders expanded, and `response` after it."""
    content = [{"type": "image"}] * len(images) + [{"type": "text", "text": question}]
    ids = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                        tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    vision = processor.encode(images, where="test") if images else None
    if vision is not None:
        ids = processor.expand_placeholders(ids, vision, where="test")
    answer = tokenizer.encode(response, add_special_tokens=False)
    length = len(answer)
    return TrainSample(tokens=torch.tensor(ids + answer), response_length=length,
                       advantages=torch.linspace(-1.0, 1.0, length), loss_mask=torch.ones(length), vision=vision)


@pytest.fixture(scope="module")
def parts(tiny_vlm_path):
    processor = VisionProcessor.from_model_folder(tiny_vlm_path)
    assert processor is not None
    return processor, AutoTokenizer.from_pretrained(tiny_vlm_path)


@pytest.fixture(scope="module")
def samples(parts) -> list[TrainSample]:
    return sample_set(*parts)


def sample_set(processor: VisionProcessor, tokenizer) -> list[TrainSample]:
    """Two image samples (two images of two sizes; one image) around a text one, to pack in one row."""
    return [image_sample(processor, tokenizer, [png(56, 56, (200, 30, 30)), png(112, 84, (20, 200, 40))],
                         "Which is red?", "the first"),
            image_sample(processor, tokenizer, [], "Say hi", "hi there"),
            image_sample(processor, tokenizer, [png(84, 56, (10, 10, 220))], "Colour?", "blue")]


def trainer(path, **settings) -> TorchTrainer:
    return TorchTrainer(TorchTrainerConfig(model_path=path, lr=1e-2, grad_clip=None, seed=0, **settings))


def hf_log_probs(model, sample: TrainSample) -> Tensor:
    """The model's own forward of one sample alone, computing its positions itself (mm_token_type_ids)."""
    ids = sample.tokens.view(1, -1)
    extra = {}
    if sample.vision is not None:
        extra = {"pixel_values": sample.vision.pixel_values, "image_grid_thw": sample.vision.grid_thw,
                 "mm_token_type_ids": (ids == model.config.image_token_id).int()}
    with torch.no_grad():
        logits = model(input_ids=ids, **extra).logits[0].float() / TEMPERATURE
    start = sample.prompt_length - 1
    predicted = torch.log_softmax(logits[start:start + sample.response_length], dim=-1)
    return predicted.gather(-1, sample.tokens[sample.prompt_length:, None])[:, 0]


@pytest.mark.integration
def test_packed_log_probs_with_images_equal_the_models_forward_of_each_sample_alone(vlm_family_path) -> None:
    """Per family: each has its own rotary layout, and Qwen3-VL adds the tower's deepstack features to the first
    layers' hidden states at the image tokens of the whole packed row."""
    processor = VisionProcessor.from_model_folder(vlm_family_path)
    assert processor is not None
    samples = sample_set(processor, AutoTokenizer.from_pretrained(vlm_family_path))
    model = AutoModelForImageTextToText.from_pretrained(vlm_family_path, dtype=torch.float32).eval()
    expected = torch.cat([hf_log_probs(model, sample) for sample in samples])
    for attention in ("packed_sdpa", "sdpa"):
        learner = trainer(vlm_family_path, attn_implementation=attention, micro_batch_tokens=10_000)
        assert learner._plan(samples) == [[0, 1, 2]]  # one packed row of all three
        ours = learner.compute_log_probs(samples, temperature=TEMPERATURE).log_probs
        torch.testing.assert_close(ours, expected, atol=1e-5, rtol=0)
    # the images matter: without them the image samples' log-probs change
    blind = [TrainSample(s.tokens, s.response_length, vision=None) for s in samples]
    assert not torch.allclose(learner.compute_log_probs(blind, temperature=TEMPERATURE).log_probs, expected,
                              atol=1e-4)


def policy_gradient_loss(outputs: ModelOutputs, batch: PackedBatch) -> tuple[Tensor, dict]:
    assert batch.advantages is not None
    return -(batch.advantages * outputs.log_probs).mean(), {}


def weights(learner: TorchTrainer) -> dict[str, Tensor]:
    return {name: tensor.detach().clone() for name, tensor in learner._model.named_parameters()}


def changed(before: dict[str, Tensor], after: dict[str, Tensor]) -> set[str]:
    return {name for name in before if not torch.equal(before[name], after[name])}


@pytest.mark.integration
def test_a_step_trains_the_language_model_and_leaves_the_frozen_tower_as_loaded(tiny_vlm_path, samples) -> None:
    learner = trainer(tiny_vlm_path)
    tower = {name for name, _ in learner._model.named_parameters() if is_tower_weight(name)}
    assert tower and all(name.startswith("model.visual.") for name in tower)
    optimized = {id(p) for group in learner._optimizer.param_groups for p in group["params"]}
    assert not any(id(p) in optimized for name, p in learner._model.named_parameters() if name in tower)
    before = weights(learner)
    result = learner.train_step(samples, policy_gradient_loss, temperature=TEMPERATURE)
    assert not result.skipped
    moved = changed(before, weights(learner))
    assert moved and not moved & tower
    assert any(".language_model.layers." in name for name in moved)
    # the engines get the language model's weights, under the model's names, and not the frozen tower's
    pushed = [name for name, _ in learner.named_tensors()]
    assert set(pushed) == set(before) - tower
    checkpoint_names = {name for name, _ in learner.named_tensors("checkpoint")}
    assert "model.layers.0.self_attn.q_proj.weight" in checkpoint_names and "lm_head.weight" in checkpoint_names
    assert len(checkpoint_names) == len(pushed) and not any("visual" in name for name in checkpoint_names)


@pytest.mark.integration
def test_the_torch_engine_loads_what_the_trainer_pushes(tiny_vlm_path, samples) -> None:
    """The engine's model, loaded from the same folder as the engine loads it, takes every pushed weight by its
    name and then computes the trained policy's log-probs with the folder's vision tower."""
    from engines.inference.model_facts import load_model_folder
    from engines.inference.served_weights import ServedWeights

    learner = trainer(tiny_vlm_path)
    learner.train_step(samples, policy_gradient_loss, temperature=TEMPERATURE)
    engine_model, _, _ = load_model_folder(tiny_vlm_path, dtype=torch.float32, device="cpu")
    ServedWeights(engine_model, lora_scaling=None, max_adapters=1).load(learner.named_tensors())
    engine_model.eval()
    torch.testing.assert_close(torch.cat([hf_log_probs(engine_model, sample) for sample in samples]),
                               learner.compute_log_probs(samples, temperature=TEMPERATURE).log_probs,
                               atol=1e-5, rtol=0)


@pytest.mark.integration
def test_an_unfrozen_tower_trains_and_is_pushed(tiny_vlm_path, samples) -> None:
    learner = trainer(tiny_vlm_path, freeze_vision_tower=False)
    before = weights(learner)
    learner.train_step(samples, policy_gradient_loss, temperature=TEMPERATURE)
    moved = changed(before, weights(learner))
    assert any(is_tower_weight(name) for name in moved)
    assert {name for name, _ in learner.named_tensors()} == set(before)
    assert any(name.startswith("visual.") for name, _ in learner.named_tensors("checkpoint"))


@pytest.mark.integration
def test_lora_adapts_the_language_model_only(tiny_vlm_path, samples) -> None:
    learner = trainer(tiny_vlm_path, lora=LoraSettings(rank=2, alpha=4))
    names = [name for name, _ in learner.named_tensors()]
    assert names and not any(is_tower_weight(name) for name in names)
    assert any(".language_model.layers." in name for name in names)
    before = learner.compute_log_probs(samples, temperature=TEMPERATURE).log_probs
    learner.train_step(samples, policy_gradient_loss, temperature=TEMPERATURE)
    learner.train_step(samples, policy_gradient_loss, temperature=TEMPERATURE)
    assert not torch.allclose(learner.compute_log_probs(samples, temperature=TEMPERATURE).log_probs, before)
    with pytest.raises(ValueError, match="freeze_vision_tower=False with LoRA"):
        trainer(tiny_vlm_path, lora=LoraSettings(rank=2, alpha=4), freeze_vision_tower=False)


@pytest.mark.integration
def test_prompt_sharing_is_off_for_a_batch_with_images(tiny_vlm_path, parts) -> None:
    """Two samples with equal prompt tokens but different images (same size: the same placeholders) must not share
    one prompt: each keeps its own image's log-probs."""
    processor, tokenizer = parts
    red, blue = png(56, 56, (220, 0, 0)), png(56, 56, (0, 0, 220))
    pair = [image_sample(processor, tokenizer, [red], "Colour?", "red"),
            image_sample(processor, tokenizer, [blue], "Colour?", "red")]
    assert torch.equal(pair[0].tokens, pair[1].tokens)
    learner = trainer(tiny_vlm_path, share_prompts=True)
    together = learner.compute_log_probs(pair, temperature=TEMPERATURE).log_probs
    alone = torch.cat([learner.compute_log_probs([s], temperature=TEMPERATURE).log_probs for s in pair])
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=0)
    assert not torch.allclose(together[:3], together[3:], atol=1e-4)


@pytest.mark.integration
def test_a_text_group_shares_its_prompt_on_a_vision_language_model(tiny_vlm_path, parts) -> None:
    processor, tokenizer = parts
    group = [image_sample(processor, tokenizer, [], "A question long enough to share", answer)
             for answer in ("yes", "no, not at all")]
    learner = trainer(tiny_vlm_path, share_prompts=True)
    assert learner._share_prompts
    inputs = learner._pack(group, with_token_positions=False)
    assert inputs.input_ids.shape[1] < sum(sample.tokens.numel() for sample in group)  # the prompt packed once
    together = learner.compute_log_probs(group, temperature=TEMPERATURE).log_probs
    alone = torch.cat([learner.compute_log_probs([s], temperature=TEMPERATURE).log_probs for s in group])
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=0)


@pytest.mark.unit
def test_joined_row_images_keep_sample_order() -> None:
    from engines.training.micro_batches import pack_inputs

    def fake(images: int, first: float) -> VisionInputs:
        return VisionInputs(torch.full((4 * images, 2), first), torch.tensor([[1, 2, 2]] * images), (1,) * images)

    row = [TrainSample(torch.arange(6), 2, vision=fake(1, 1.0)), TrainSample(torch.arange(5), 2),
           TrainSample(torch.arange(7), 2, vision=fake(2, 2.0))]
    inputs = pack_inputs(row)
    assert inputs.vision is not None and inputs.vision.tokens_per_image == (1, 1, 1)
    assert inputs.vision.pixel_values[:, 0].tolist() == [1.0] * 4 + [2.0] * 8
    with pytest.raises(ValueError, match="without shared prompts"):
        pack_inputs(row, share_prompts=True)
