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
                         temperature: float = 0.0, max_batch_size: int = 64) -> dict[str, float]:
    from transformers import AutoTokenizer

    records, _ = load_prompts(data_path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    engine = TorchEngine.from_pretrained(model_path, max_batch_size=max_batch_size)
    params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens)
    try:
        outputs = await asyncio.gather(*(
            engine.generate(GenerateRequest(request_id=f"eval-{r.data_index}",
                                            input_ids=tokenizer(r.prompt)["input_ids"], params=params))
            for r in records
        ))
    finally:
        await engine.close()
    inputs = [RewardInput(prompt=str(r.prompt), response=tokenizer.decode(out[0].output_ids, skip_special_tokens=True),
                          label=r.label, metadata=r.metadata) for r, out in zip(records, outputs, strict=True)]
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
    args = parser.parse_args()
    result = asyncio.run(evaluate_model(args.model, args.data, reward=args.reward,
                                        max_new_tokens=args.max_new_tokens, temperature=args.temperature))
    print(" ".join(f"{k}={v:.4f}" for k, v in result.items()))


if __name__ == "__main__":
    main()
