"""Build a tiny Qwen-VL vision-language model (Qwen2-VL, Qwen2.5-VL or Qwen3-VL), with its processor, as an ordinary
Hugging Face folder.

No model hub is reachable here, so tests and the VLM demo make their own: the folder holds what a real checkpoint of
the family holds (config.json with a vision and a text config, safetensors weights, tokenizer with the vision
tokens, preprocessor_config.json for the image processor, a chat template that turns an image item into the vision
placeholder), so `AutoTokenizer`, `AutoImageProcessor` and the model class load it the way they load a real one,
and every code path under test (the placeholder expansion, the family's multimodal rotary layout, the vision
tower's patch merge, Qwen3-VL's deepstack features) is the real model's. The text side is the character tokenizer
of `tiny_model.py` plus Qwen's four vision tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoConfig, PreTrainedModel, PreTrainedTokenizerFast
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from tools.standins.tiny_model import TOKENIZER_REVISION, build_tokenizer, cached_folder

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


# The families a tiny VLM can be built as: model_type -> (model class name, the real checkpoints' patch size).
FAMILIES = {
    "qwen2_vl": ("Qwen2VLForConditionalGeneration", 14),
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", 14),
    "qwen3_vl": ("Qwen3VLForConditionalGeneration", 16),
}


@dataclass(frozen=True)
class TinyVlmSpec:
    """Shape of a tiny Qwen-VL of `family` (a key of FAMILIES). Images are cut into `patch_size` patches (None: the
    family's), `merge_size`^2 of which become one language-model token; `min_pixels`/`max_pixels` bound the resized
    image (so a 56x56 image is 4 tokens). Qwen3-VL adds the tower's features of layers `deepstack_layers` to the
    language model's hidden states after its first layers (one per entry)."""

    family: str = "qwen2_5_vl"
    hidden_size: int = 64
    intermediate_size: int = 176
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    vision_depth: int = 2
    vision_hidden_size: int = 32
    patch_size: int | None = None
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 112 * 112
    max_position_embeddings: int = 1024
    deepstack_layers: tuple[int, ...] = (0, 1)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"tiny VLM family {self.family!r} unknown; choose one of {sorted(FAMILIES)}")

    @property
    def patch(self) -> int:
        return self.patch_size or FAMILIES[self.family][1]


def build_vlm_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *VISION_TOKENS]})
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    return tokenizer


def build_tiny_vlm(spec: TinyVlmSpec, tokenizer: PreTrainedTokenizerFast) -> PreTrainedModel:
    start, end, image, video = tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    special = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
               "pad_token_id": tokenizer.pad_token_id}
    text = {"hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size,
            "num_hidden_layers": spec.num_hidden_layers, "num_attention_heads": spec.num_attention_heads,
            "num_key_value_heads": spec.num_key_value_heads, "vocab_size": len(tokenizer),
            "max_position_embeddings": spec.max_position_embeddings, **special}
    class_name = FAMILIES[spec.family][0]
    config = AutoConfig.for_model(
        spec.family, text_config=text | _text_rope(spec), vision_config=_vision_config(spec),
        vision_start_token_id=start, vision_end_token_id=end, image_token_id=image, video_token_id=video,
        architectures=[class_name], **special)
    torch.manual_seed(spec.seed)
    return getattr(transformers, class_name)(config).to(torch.float32)


def _text_rope(spec: TinyVlmSpec) -> dict[str, Any]:
    """The language model's multimodal rotary layout: each head's rotary half (head_dim / 2 frequencies) split
    between time, height and width, in blocks (Qwen2-VL, Qwen2.5-VL) or interleaved (Qwen3-VL)."""
    head_dim = spec.hidden_size // spec.num_attention_heads
    half = head_dim // 2
    sections = [half - 2 * (half // 3), half // 3, half // 3]
    if spec.family != "qwen3_vl":
        return {"rope_scaling": {"type": "mrope", "mrope_section": sections}}
    return {"head_dim": head_dim, "rope_parameters": {"rope_type": "default", "rope_theta": 5_000_000.0,
                                                      "mrope_section": sections, "mrope_interleaved": True}}


def _vision_config(spec: TinyVlmSpec) -> dict[str, Any]:
    shared = {"depth": spec.vision_depth, "num_heads": 2, "patch_size": spec.patch,
              "spatial_merge_size": spec.merge_size, "temporal_patch_size": 2}
    if spec.family == "qwen2_vl":
        return shared | {"embed_dim": spec.vision_hidden_size, "hidden_size": spec.hidden_size, "mlp_ratio": 2}
    shared |= {"hidden_size": spec.vision_hidden_size, "intermediate_size": 2 * spec.vision_hidden_size,
               "out_hidden_size": spec.hidden_size}
    if spec.family == "qwen2_5_vl":
        return shared | {"fullatt_block_indexes": [spec.vision_depth - 1],
                         "window_size": spec.patch * spec.merge_size * 2}
    # Qwen3-VL: a learned position grid (8x8 here) resampled to each image's, and the deepstack layers
    return shared | {"num_position_embeddings": 64, "deepstack_visual_indexes": list(spec.deepstack_layers)}


def build_image_processor(spec: TinyVlmSpec) -> Qwen2VLImageProcessorPil:
    """The family's image processor (what preprocessor_config.json of a real checkpoint describes). The processor
    class that would wrap it and the tokenizer needs torchvision here (engines/vision/processor.py says why), so the
    folder gets the two parts, as a real checkpoint's are, without it."""
    # Qwen3-VL normalizes pixels to [-1, 1]; the earlier families with CLIP's mean and deviation (the default)
    normalize = {"image_mean": [0.5] * 3, "image_std": [0.5] * 3} if spec.family == "qwen3_vl" else {}
    return Qwen2VLImageProcessorPil(min_pixels=spec.min_pixels, max_pixels=spec.max_pixels, patch_size=spec.patch,
                                    merge_size=spec.merge_size, temporal_patch_size=2, **normalize)


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
    """Create the VLM once per spec under `cache_dir`; later calls reuse the folder (`tiny_model.cached_folder`)."""
    fields = {**spec.__dict__, "patch_size": spec.patch}
    if spec.family == "qwen3_vl":  # the other families have no deepstack layers
        fields["deepstack_layers"] = "ds" + ".".join(str(layer) for layer in spec.deepstack_layers)
    else:
        del fields["deepstack_layers"]
    key = "-".join(str(value) for value in [*fields.values(), f"tok{TOKENIZER_REVISION}"])
    return cached_folder(Path(cache_dir) / f"tiny-vlm-{key}", lambda staging: create_tiny_vlm(staging, spec))
