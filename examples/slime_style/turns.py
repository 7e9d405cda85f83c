"""One model turn over SGLang's native HTTP API, as slime's generate plugins do it (shared by the examples)."""

from __future__ import annotations

from typing import Any

from actors.slime_compat import Sample, post


async def model_turn(args: Any, sample: Sample, sampling_params: dict[str, Any], budget: int) -> str:
    """Generate up to ``budget`` tokens after ``sample.tokens``; append them (trainable) and return their text."""
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    params = {**sampling_params, "max_new_tokens": budget}
    output = await post(url, {"input_ids": sample.tokens, "sampling_params": params, "return_logprob": True})
    meta = output["meta_info"]
    pairs = meta.get("output_token_logprobs") or []
    sample.append_response_tokens(args, tokens=[p[1] for p in pairs], log_probs=[p[0] for p in pairs],
                                  trainable=True, meta_info=meta, text=output.get("text", ""))
    return output.get("text", "")


def append_observation(args: Any, sample: Sample, tokenizer: Any, text: str) -> None:
    """Append environment text (tool output, retrieved passages) with loss mask 0: the policy did not write it."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    sample.append_response_tokens(args, tokens=ids, trainable=False, text=text)


def prompt_ids(tokenizer: Any, prompt: Any) -> list[int]:
    """The prompt's token ids; chat messages rendered by the template first (transformers 5's
    ``apply_chat_template(tokenize=True)`` returns an encoding, not the ids)."""
    if isinstance(prompt, list):
        text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
