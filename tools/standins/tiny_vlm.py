"""Build a tiny Qwen2.5-VL vision-language model, with its processor, as an ordinary Hugging Face folder.

No model hub is reachable here, so tests and the VLM demo make their own: the folder holds what a real Qwen2.5-VL
checkpoint holds (config.json with a vision and a text config, safetensors weights, tokenizer with the vision
tokens, preprocessor_config.json for the image processor, a chat template that turns an image item into the vision
placeholder), so
`AutoTokenizer`, `AutoImageProcessor` and the model class load it the way they load a real one, and every code path
under test (the placeholder expansion, multimodal rotary positions, the vision tower's patch merge) is the real
model's. The text side is the character tokenizer of `tiny_model.py` plus Qwen's four vision tokens.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from tools.standins.tiny_model import TOKENIZER_REVISION, build_tokenizer

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# Qwen's layout of a message: text parts as they are, an image part as the vision placeholder the processor expands
# into one <|image_pad|> per merged patch.
VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class TinyVlmSpec:
    """Shape of a tiny Qwen2.5-VL. Images are cut into `patch_size` patches, `merge_size`^2 of which become one
    language-model token; `min_pixels`/`max_pixels` bound the resized image (so a 56x56 image is 4 tokens)."""

    hidden_size: int = 64
    intermediate_size: int = 176
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    vision_depth: int = 2
    vision_hidden_size: int = 32
    patch_size: int = 14
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 112 * 112
    max_position_embeddings: int = 1024
    seed: int = 0


def build_vlm_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *VISION_TOKENS]})
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    return tokenizer


def build_tiny_vlm(spec: TinyVlmSpec, tokenizer: PreTrainedTokenizerFast) -> Qwen2_5_VLForConditionalGeneration:
    start, end, image, video = tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    head_dim = spec.hidden_size // spec.num_attention_heads
    # mrope splits each head's rotary half (head_dim / 2 frequencies) between time, height and width
    half = head_dim // 2
    sections = [half - 2 * (half // 3), half // 3, half // 3]
    config = Qwen2_5_VLConfig(
        text_config={
            "hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size,
            "num_hidden_layers": spec.num_hidden_layers, "num_attention_heads": spec.num_attention_heads,
            "num_key_value_heads": spec.num_key_value_heads, "vocab_size": len(tokenizer),
            "max_position_embeddings": spec.max_position_embeddings,
            "rope_scaling": {"type": "mrope", "mrope_section": sections},
            "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            "depth": spec.vision_depth, "hidden_size": spec.vision_hidden_size,
            "intermediate_size": 2 * spec.vision_hidden_size, "num_heads": 2, "out_hidden_size": spec.hidden_size,
            "patch_size": spec.patch_size, "spatial_merge_size": spec.merge_size, "temporal_patch_size": 2,
            "fullatt_block_indexes": [spec.vision_depth - 1], "window_size": spec.patch_size * spec.merge_size * 2,
        },
        vision_start_token_id=start, vision_end_token_id=end, image_token_id=image, video_token_id=video,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        architectures=["Qwen2_5_VLForConditionalGeneration"],
    )
    torch.manual_seed(spec.seed)
    return Qwen2_5_VLForConditionalGeneration(config).to(torch.float32)


def build_image_processor(spec: TinyVlmSpec) -> Qwen2VLImageProcessorPil:
    """The family's image processor (what preprocessor_config.json of a real checkpoint describes). The processor
    class that would wrap it and the tokenizer needs torchvision here (engines/vision/processor.py says why), so the
    folder gets the two parts, as a real checkpoint's are, without it."""
    return Qwen2VLImageProcessorPil(min_pixels=spec.min_pixels, max_pixels=spec.max_pixels,
                                    patch_size=spec.patch_size, merge_size=spec.merge_size, temporal_patch_size=2)


def create_tiny_vlm(path: str | Path, spec: TinyVlmSpec = TinyVlmSpec()) -> Path:
    """Write a tiny VLM, its tokenizer and its processor to `path` and return the path."""
    path = Path(path)
    tokenizer = build_vlm_tokenizer()
    model = build_tiny_vlm(spec, tokenizer)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    build_image_processor(spec).save_pretrained(path)
    return path


def cached_tiny_vlm(cache_dir: str | Path, spec: TinyVlmSpec = TinyVlmSpec()) -> Path:
    """Create the VLM once per spec under `cache_dir`; later calls reuse the folder (staged per process, as
    `tiny_model.cached_tiny_model`)."""
    key = "-".join(str(value) for value in [*spec.__dict__.values(), f"tok{TOKENIZER_REVISION}"])
    path = Path(cache_dir) / f"tiny-vlm-{key}"
    if not (path / "config.json").exists():
        staging = path.with_name(f"{path.name}.partial-{os.getpid()}")
        create_tiny_vlm(staging, spec)
        try:
            staging.rename(path)
        except OSError:
            if not (path / "config.json").exists():
                raise
            shutil.rmtree(staging, ignore_errors=True)
    return path
