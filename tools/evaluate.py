"""Score an HF model folder on a prompt set with a reward function: `python tools/evaluate.py MODEL DATA.jsonl`.

Greedy by default, batched through the embedded torch engine (the same engine the rollout workers use), so
numbers here are comparable with the eval rounds of a run. The demo prints this before and after training.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import numpy as np

from actors.buffer.prompt_data import load_prompts
from engines.inference.base import GenerateRequest, SamplingParams
from engines.inference.torch_engine import TorchEngine
from policies.registry import resolve_reward
from policies.rewards import RewardInput, score


async def evaluate_model(model_path: Path, data_path: Path, *, reward: str = "exact_match", max_new_tokens: int = 8,
                         temperature: float = 0.0, max_batch_size: int = 64, samples_per_prompt: int = 1,
                         seed: int | None = None) -> dict[str, float]:
    """Accuracy and mean reward over every sample; `samples_per_prompt` > 1 at a temperature gives avg@k, the
    expected accuracy of one sample, which moves smoothly with the weights where greedy answers flip."""
    from transformers import AutoTokenizer

    records, _ = load_prompts(data_path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    engine = TorchEngine.from_pretrained(model_path, max_batch_size=max_batch_size)
    def params(index: int) -> SamplingParams:
        # A seed of its own per prompt: one seed for all would give every prompt the same random draws.
        return SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, n=samples_per_prompt,
                              seed=None if seed is None else seed * 1_000_003 + index)

    try:
        outputs = await asyncio.gather(*(
            engine.generate(GenerateRequest(request_id=f"eval-{r.data_index}",
                                            input_ids=tokenizer(r.prompt)["input_ids"], params=params(r.data_index)))
            for r in records
        ))
    finally:
        await engine.close()
    inputs = [RewardInput(prompt=str(r.prompt), response=tokenizer.decode(sample.output_ids, skip_special_tokens=True),
                          label=r.label, metadata=r.metadata)
              for r, out in zip(records, outputs, strict=True) for sample in out]
    outcomes = await score(resolve_reward(reward), inputs)
    rewards = np.asarray([o.reward if o.reward is not None else 0.0 for o in outcomes])
    return {"accuracy": float((rewards >= 1.0).mean()), "mean_reward": float(rewards.mean()),
            "prompts": float(len(records))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path)
    parser.add_argument("data", type=Path)
    parser.add_argument("--reward", default="exact_match")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--samples-per-prompt", type=int, default=1,
                        help="with a temperature: avg@k, the expected accuracy of one sample")
    parser.add_argument("--seed", type=int, default=None, help="seeded draws (each prompt its own)")
    args = parser.parse_args()
    result = asyncio.run(evaluate_model(args.model, args.data, reward=args.reward,
                                        max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                        samples_per_prompt=args.samples_per_prompt, seed=args.seed))
    print(" ".join(f"{k}={v:.4f}" for k, v in result.items()))


if __name__ == "__main__":
    main()
