"""Score an HF model folder on a prompt set with a reward function: `python -m tools.evaluate MODEL DATA.jsonl`.

Greedy by default, batched through the embedded torch engine (the same engine the rollout workers use), so
numbers here are comparable with the eval rounds of a run: the same data flags as the launcher (`--input-key`,
`--label-key`, `--metadata-key`, `--apply-chat-template`), the prompt tokenized as the workers tokenize it, and
the reward function given what the reward workers give it. The demo prints this before and after training.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from actors.config.sections import resolve_label_key
from actors.data.prompt_images import ImageField
from actors.data.prompt_tokens import ImageTokens, encode_prompt
from actors.data.prompts import PromptRecord, load_prompts
from actors.runtime.logs import quiet_library_output
from engines.inference.base import GenerateOutput, GenerateRequest, SamplingParams
from engines.inference.torch_engine import TorchEngine
from engines.vision.images import DEFAULT_LIMITS
from policies.plugins import put_working_directory_on_path
from policies.registry import resolve_reward
from policies.rewards import RewardInput, prompt_text, score

SKIPPED_SHOWN = 10  # dropped records named one by one; the rest are counted
PROGRESS_EVERY_S = 10.0


class EvalInputError(ValueError):
    """The data file or the reward names something unusable; the message says which and why."""


class Progress:
    """A line on stderr every `every_s` seconds while the prompts are generated, and one when all are: a real
    model on a few thousand prompts takes minutes, and a silent terminal looks like a hang."""

    def __init__(self, total: int, every_s: float) -> None:
        self.total, self.every_s, self.done = total, every_s, 0
        self.started = self.shown = time.monotonic()

    def one_done(self) -> None:
        self.done += 1
        now = time.monotonic()
        if self.done == self.total or now - self.shown >= self.every_s:
            self.shown = now
            print(f"evaluate: generated {self.done}/{self.total} prompts in {now - self.started:.0f} s",
                  file=sys.stderr, flush=True)


async def evaluate_model(model_path: Path, data_path: Path, *, reward: str = "exact_match", max_new_tokens: int = 8,
                         temperature: float = 0.0, max_batch_size: int = 64, samples_per_prompt: int = 1,
                         seed: int | None = None, input_key: str = "input", label_key: str | None = "label",
                         metadata_key: str | None = "metadata", tool_key: str | None = "tools",
                         apply_chat_template: bool = False,
                         chat_template_kwargs: dict[str, Any] | None = None,
                         progress_every_s: float | None = None, image_key: str | None = None,
                         samples_out: Path | None = None) -> dict[str, float]:
    """Accuracy and mean reward over every sample; `samples_per_prompt` > 1 at a temperature gives avg@k, the
    expected accuracy of one sample, which moves smoothly with the weights where greedy answers flip. Records the
    data file cannot use are left out, named on stderr and counted (`skipped`), as a run's buffer does; a file with
    none, or a reward that does not resolve, raises EvalInputError. With `progress_every_s`, generation reports
    its progress on stderr that often. `image_key`: the records' images (a vision-language model; the run's
    --multimodal-keys '{"image": KEY}'). The median and mean response length (tokens) come with the accuracy: a
    reward can be gamed by dropping the reasoning it was meant to need. `samples_out`: every sample as a JSON line
    (prompt, response, tokens, reward and its extras), to read the answers behind the numbers."""
    from transformers import AutoTokenizer

    try:
        records, report = load_prompts(data_path, input_key=input_key, label_key=label_key,
                                       metadata_key=metadata_key, tool_key=tool_key,
                                       chat_template=apply_chat_template,
                                       image_field=None if image_key is None else ImageField(image_key))
        reward_fn = resolve_reward(reward)  # a wrong name fails before the model loads
    except ValueError as error:  # a DatasetError; an unknown reward name or a broken module:attr (PluginError)
        raise EvalInputError(str(error)) from error
    for problem in report.skipped[:SKIPPED_SHOWN]:
        print(f"evaluate: skipped {problem}", file=sys.stderr)
    if len(report.skipped) > SKIPPED_SHOWN:
        print(f"evaluate: skipped {len(report.skipped) - SKIPPED_SHOWN} more record(s) of {data_path}",
              file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    image_tokens = ImageTokens(str(model_path), DEFAULT_LIMITS)
    prompts = [encode_prompt(tokenizer, r.prompt, chat_template=apply_chat_template,
                             chat_template_kwargs=chat_template_kwargs, tools=r.tools, images=r.images,
                             image_tokens=image_tokens, where=f"record {r.data_index}") for r in records]
    engine = TorchEngine.from_pretrained(model_path, max_batch_size=max_batch_size)

    def params(index: int) -> SamplingParams:
        # A seed of its own per prompt: one seed for all would give every prompt the same random draws.
        return SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, n=samples_per_prompt,
                              seed=None if seed is None else seed * 1_000_003 + index)

    progress = Progress(len(records), progress_every_s) if progress_every_s is not None else None

    async def generate(record: PromptRecord, ids: list[int]) -> list[GenerateOutput]:
        outputs = await engine.generate(GenerateRequest(request_id=f"eval-{record.data_index}", input_ids=ids,
                                                        params=params(record.data_index), images=tuple(record.images)))
        if progress is not None:
            progress.one_done()
        return outputs

    try:
        outputs = await asyncio.gather(*(generate(r, ids) for r, ids in zip(records, prompts, strict=True)))
    finally:
        await engine.close()
    inputs = [RewardInput(prompt=prompt_text(r.prompt),
                          response=tokenizer.decode(sample.output_ids, skip_special_tokens=True),
                          label=r.label, metadata=r.metadata, prompt_ids=ids, response_ids=list(sample.output_ids),
                          finish_reason=sample.finish_reason)
              for r, ids, out in zip(records, prompts, outputs, strict=True) for sample in out]
    outcomes = await score(reward_fn, inputs)
    rewards = np.asarray([o.reward if o.reward is not None else 0.0 for o in outcomes])
    lengths = np.asarray([len(i.response_ids) for i in inputs])
    if samples_out is not None:
        samples_out.write_text("".join(json.dumps({"prompt": i.prompt, "response": i.response, "label": i.label,
                                                   "tokens": len(i.response_ids), "finish_reason": i.finish_reason,
                                                   "reward": o.reward, **o.extras}) + "\n"
                                       for i, o in zip(inputs, outcomes, strict=True)), encoding="utf-8")
    return {"accuracy": float((rewards >= 1.0).mean()), "mean_reward": float(rewards.mean()),
            "prompts": float(len(records)), "skipped": float(len(report.skipped)),
            "response_length_median": float(np.median(lengths)), "response_length_mean": float(lengths.mean())}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path)
    parser.add_argument("data", type=Path, help="a .jsonl or .parquet prompt file")
    parser.add_argument("--reward", default="exact_match", help="a reward name or a module:attr path")
    parser.add_argument("--input-key", default="input", help="the prompt's field (as the launcher's)")
    parser.add_argument("--label-key", default="label", type=resolve_label_key,
                        help="the answer's field; a record without it is skipped ('none': the reward needs no label)")
    parser.add_argument("--metadata-key", default="metadata", help="the metadata's field")
    parser.add_argument("--tool-key", default="tools", type=resolve_label_key,
                        help="the tool definitions' field, given to the chat template ('none': not read)")
    parser.add_argument("--apply-chat-template", action="store_true",
                        help="wrap a text prompt in the tokenizer's chat template, as the run does with this flag")
    parser.add_argument("--apply-chat-template-kwargs", type=json.loads, default=None,
                        help='JSON keyword arguments for the chat template, e.g. \'{"enable_thinking": false}\'')
    parser.add_argument("--image-key", default=None,
                        help="the records' images for a vision-language model (the run's --multimodal-keys "
                             "'{\"image\": KEY}')")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--samples-per-prompt", type=int, default=1,
                        help="with a temperature: avg@k, the expected accuracy of one sample")
    parser.add_argument("--seed", type=int, default=None, help="seeded draws (each prompt its own)")
    parser.add_argument("--samples-out", type=Path, default=None,
                        help="write every sample (prompt, response, tokens, reward and its extras) to this JSONL")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    put_working_directory_on_path()  # `--reward my_reward:fn` beside where this was started, as a run finds it
    quiet_library_output()  # transformers' load bar otherwise sits above the one line this prints
    if not args.model.is_dir():
        print(f"evaluate: model {args.model}: no such folder (an HF model folder: config.json and weights)",
              file=sys.stderr)
        return 2
    try:
        result = asyncio.run(evaluate_model(
            args.model, args.data, reward=args.reward, max_new_tokens=args.max_new_tokens,
            temperature=args.temperature, samples_per_prompt=args.samples_per_prompt, seed=args.seed,
            input_key=args.input_key, label_key=args.label_key, metadata_key=args.metadata_key,
            tool_key=args.tool_key, image_key=args.image_key, samples_out=args.samples_out,
            apply_chat_template=args.apply_chat_template, chat_template_kwargs=args.apply_chat_template_kwargs,
            progress_every_s=PROGRESS_EVERY_S))
    except EvalInputError as error:
        print(f"evaluate: {error}", file=sys.stderr)
        return 2
    print(" ".join(f"{k}={v:.4f}" for k, v in result.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
