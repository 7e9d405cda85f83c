"""``GenerateState`` and ``load_tokenizer`` shaped like slime's, for generate plugins that read a tokenizer.

slime's plugins write ``state = GenerateState(args)`` and use ``state.tokenizer`` and ``state.sampling_params``;
here it is a small per-checkpoint cache, not a process-wide singleton holding mutable run state.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

__all__ = ["GenerateState", "load_tokenizer"]


@functools.lru_cache(maxsize=4)
def load_tokenizer(name_or_path: str, trust_remote_code: bool = True) -> Any:
    """The Hugging Face tokenizer of a checkpoint, loaded once per process."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)


class GenerateState:
    """What slime's generate plugins take from its ``GenerateState``: tokenizer, sampling params, a semaphore."""

    def __init__(self, args: Any) -> None:
        if not getattr(args, "hf_checkpoint", None):
            raise ValueError("GenerateState: args.hf_checkpoint is unset (--hf-checkpoint), so there is no tokenizer")
        self.args = args
        self.tokenizer = load_tokenizer(args.hf_checkpoint)
        self.processor = None
        self.semaphore = asyncio.Semaphore(int(getattr(args, "sglang_server_concurrency", 512) or 512))
        self.sampling_params: dict[str, Any] = {
            "temperature": args.rollout_temperature, "top_p": args.rollout_top_p, "top_k": args.rollout_top_k,
            "max_new_tokens": args.rollout_max_response_len, "stop": args.rollout_stop,
            "stop_token_ids": args.rollout_stop_token_ids, "skip_special_tokens": args.rollout_skip_special_tokens,
            "no_stop_trim": True, "spaces_between_special_tokens": False,
        }
