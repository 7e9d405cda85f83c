"""A prompt's token ids, computed one way for the rollout workers and for the loaders that filter long prompts.

The buffer and the eval rounds drop prompts over `--rollout-max-prompt-len` / `--eval-max-prompt-len` when a
dataset loads; that count must be the very token count the engine will see, so both sides call `encode_prompt`
with the same chat-template switch and keyword arguments (`--apply-chat-template-kwargs`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from actors.config import RunConfig
from actors.data.prompt_images import PromptImageError
from actors.data.prompts import LoadReport, PromptRecord, image_field, load_prompts
from actors.data.tool_prompts import prompt_stating_tools

if TYPE_CHECKING:
    from engines.vision.images import ImageLimits
    from engines.vision.processor import VisionProcessor

Prompt = str | list[dict[str, Any]]


class ImageTokens:
    """A model's image side for prompt tokens: each image part's placeholder expanded to the tokens its image takes.

    The model folder's image processor loads on the first prompt with images, once: a text run never reads it (its
    --hf-checkpoint may not even be a local folder). A text-only model's prompts with images are refused naming it."""

    def __init__(self, model: str | None, limits: ImageLimits) -> None:
        self.model = model
        self.limits = limits
        self._processor: VisionProcessor | None = None
        self._loaded = False

    @classmethod
    def of_run(cls, config: RunConfig) -> ImageTokens:
        return cls(config.model.hf_checkpoint, config.data.image_limits)

    def processor(self, where: str) -> VisionProcessor:
        if not self._loaded:
            self._loaded = True
            if self.model is not None:
                from engines.vision.processor import VisionProcessor

                try:
                    self._processor = VisionProcessor.from_model_folder(self.model, self.limits)
                except (OSError, ValueError) as error:
                    raise PromptImageError(f"{where}: the model {self.model} cannot read images ({error})") from None
        if self._processor is None:
            model = "no --hf-checkpoint" if self.model is None else f"the model {self.model}"
            raise PromptImageError(f"{where}: the prompt has images, and {model} is a text-only model (its "
                                   "config.json has no vision_config); images need a vision-language model")
        return self._processor

    def expand(self, token_ids: list[int], images: Sequence[bytes], *, where: str) -> list[int]:
        """`token_ids` with each image placeholder expanded; a bad image or a count that does not match the
        placeholders raises PromptImageError naming `where`."""
        processor = self.processor(where)
        try:
            return processor.expand_placeholders(token_ids, processor.encode(images, where=where), where=where)
        except ValueError as error:  # ImageProblem included: a bad image, or not one placeholder per image
            raise PromptImageError(str(error)) from None


def encode_prompt(tokenizer: Any, prompt: Prompt, *, chat_template: bool,
                  chat_template_kwargs: dict[str, Any] | None = None, tools: list[dict[str, Any]] | None = None,
                  describe_ignored_tools: bool = True, images: Sequence[bytes] = (),
                  image_tokens: ImageTokens | None = None, where: str = "the prompt") -> list[int]:
    """Token ids of one prompt: chat messages (or a string with `chat_template`) go through the chat template, with
    the record's `tools` (`--tool-key`); a template that leaves tools out gets them stated in the system message
    unless `describe_ignored_tools` is off (`--no-agent-describe-tools`). With `images` (the prompt's, in the order
    of its image parts), each part's placeholder is expanded by `image_tokens` to the tokens its image takes."""
    if images:
        if image_tokens is None:
            raise PromptImageError(f"{where}: the prompt has images and no model's image processor was given")
        if not isinstance(prompt, list):
            raise PromptImageError(f"{where}: a prompt with images must be chat messages with image parts")
    if chat_template or isinstance(prompt, list):
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        kwargs = dict(chat_template_kwargs or {})
        messages, _ = prompt_stating_tools(tokenizer, messages, tools, describe=describe_ignored_tools, **kwargs)
        if tools:
            kwargs["tools"] = tools
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        return image_tokens.expand(ids, images, where=where) if images and image_tokens is not None else ids
    if tools:
        raise ValueError("a prompt with tools (--tool-key) reaches the model through the chat template: give chat "
                         "messages or --apply-chat-template")
    return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])


def prompt_length_counter(config: RunConfig, tokenizer: Any | None = None
                          ) -> Callable[[Prompt, list[dict[str, Any]] | None, Sequence[bytes]], int]:
    """`(prompt, tools, images) -> token count` as the rollout workers will tokenize it (an image counts the tokens
    it takes); loads --hf-checkpoint's tokenizer unless one is given (a prompt-length cap cannot be honoured without
    the model's tokenizer), and its image processor at the first prompt with images."""
    if tokenizer is None:
        if config.model.hf_checkpoint is None:
            raise ValueError("--rollout-max-prompt-len / --eval-max-prompt-len count tokens and need "
                             "--hf-checkpoint (the tokenizer)")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(config.model.hf_checkpoint)
    data = config.data
    image_tokens = ImageTokens.of_run(config)

    def count(prompt: Prompt, tools: list[dict[str, Any]] | None = None, images: Sequence[bytes] = ()) -> int:
        return len(encode_prompt(tokenizer, prompt, chat_template=data.apply_chat_template,
                                 chat_template_kwargs=data.apply_chat_template_kwargs, tools=tools,
                                 describe_ignored_tools=config.agent.agent_describe_tools, images=images,
                                 image_tokens=image_tokens, where="its prompt"))

    return count


def load_training_prompts(config: RunConfig) -> tuple[list[PromptRecord], LoadReport]:
    """--prompt-data as the buffer serves it: malformed records and prompts over the length cap (default: the
    context cap - 1) left out, as the report counts them."""
    data = config.data
    if data.prompt_data is None:
        raise ValueError("--prompt-data is required (a .jsonl or .parquet file of prompts)")
    context = config.rollout.rollout_max_context_len
    max_prompt = data.rollout_max_prompt_len or (context - 1 if context is not None else None)
    return load_prompts(data.prompt_data, input_key=data.input_key, label_key=data.label_key,
                        metadata_key=data.metadata_key, tool_key=data.tool_key, chat_template=data.apply_chat_template,
                        skip_bad=data.skip_bad_data, max_prompt_len=max_prompt,
                        count_tokens=prompt_length_counter(config) if max_prompt else None,
                        image_field=image_field(data))


def batches_per_epoch(config: RunConfig) -> int:
    """Whole rollout batches in one pass over the training prompts (slime's num_rollout per epoch)."""
    records, _ = load_training_prompts(config)
    return len(records) // config.rollout.rollout_batch_size
