"""Benchmark: what training multi-token-prediction (MTP) layers beside the policy costs a train step, and how fast
the draft learns the policy's tokens (`engines.training.mtp`, slime's --enable-mtp-training).

    python -m tools.bench.mtp             # SmolLM2-135M on answers it samples itself
    python -m tools.bench.mtp --quick     # the tiny test model, a few steps: the smoke test
    python -m tools.bench.mtp --json out.json

The samples are the policy's own: its answers (temperature 1, seeded) to "What is A times B? Explain step by
step." in its chat template, the same for both runs. A zero loss holds the policy where it is, so the MTP depth
learns a fixed policy's tokens, as the draft of a slowly moving RL policy does; the policy's forward and backward
still run, so the step time is a step's. Baseline: the same steps without MTP, in the same run (median seconds
after two warm-up steps). Agreement: how often the depth's top-1 guess is the held-out answers' own token
(`TorchTrainer.mtp_agreement`: what greedy speculative decoding would accept of its proposals), before and after.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from engines.training import TorchTrainer, TorchTrainerConfig, TrainSample
from engines.training.base import ModelOutputs, PackedBatch
from engines.training.config import MtpSettings
from tools.standins.tiny_model import TinyModelSpec, cached_tiny_model

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Run:
    name: str
    step_seconds: list[float] = field(default_factory=list)
    mtp_losses: list[float] = field(default_factory=list)
    agreement_before: list[float] = field(default_factory=list)
    agreement_after: list[float] = field(default_factory=list)

    @property
    def median_step(self) -> float:
        return statistics.median(self.step_seconds[2:] or self.step_seconds)


def zero_loss(outputs: ModelOutputs, batch: PackedBatch) -> tuple[Tensor, dict[str, Any]]:
    """The policy's loss, zero: its forward and backward run, its weights stay (AdamW moves nothing on a zero
    gradient without weight decay)."""
    return (outputs.log_probs * 0).sum(), {}


def sampled_answers(model_path: Path, count: int, max_new_tokens: int, seed: int) -> list[TrainSample]:
    """The policy's own answers to multiplication questions, in its chat template where it has one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    generator = torch.Generator().manual_seed(seed)
    questions = [f"What is {a} times {b}? Explain step by step." for a in range(3, 30) for b in range(11, 17)]
    order = torch.randperm(len(questions), generator=generator).tolist()
    torch.manual_seed(seed)
    samples = []
    for index in order[:count]:
        message = [{"role": "user", "content": questions[index]}]
        prompt = (tokenizer.apply_chat_template(message, add_generation_prompt=True, tokenize=False)
                  if tokenizer.chat_template else questions[index])
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            tokens = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=True, temperature=1.0, top_p=1.0,
                                    top_k=0, pad_token_id=tokenizer.eos_token_id)[0]
        response = tokens.numel() - ids.shape[1]
        samples.append(TrainSample(tokens, response, loss_mask=torch.ones(response),
                                   advantages=torch.zeros(response)))
    return samples


def run(model_path: Path, train: list[TrainSample], held_out: list[TrainSample], *, depths: int, steps: int,
        lr: float) -> Run:
    settings = MtpSettings(num_layers=depths) if depths else None
    trainer = TorchTrainer(TorchTrainerConfig(model_path=model_path, lr=lr, share_prompts=False, mtp=settings))
    result = Run(f"MTP, {depths} depth(s)" if depths else "no MTP")
    if depths:
        result.agreement_before = trainer.mtp_agreement(held_out)
    for _ in range(steps):
        started = time.perf_counter()
        step = trainer.train_step(train, zero_loss, temperature=1.0, with_entropy=False)
        result.step_seconds.append(time.perf_counter() - started)
        if depths:
            result.mtp_losses.append(step.metrics["mtp_loss"])
    if depths:
        result.agreement_after = trainer.mtp_agreement(held_out)
    return result


def print_table(runs: list[Run], model: str, samples: int, tokens: float, held_out: int) -> None:
    baseline = runs[0].median_step
    print(f"\n{model}: {samples} sampled answers a step ({tokens:.0f} response tokens on average), "
          f"agreement on {held_out} held-out answers\n")
    print("| run | step s (median) | vs no MTP | MTP loss first -> last | top-1 agreement before -> after |")
    print("|---|---:|---:|---|---|")
    for result in runs:
        loss = (f"{result.mtp_losses[0]:.2f} -> {result.mtp_losses[-1]:.2f}" if result.mtp_losses else "-")
        agreement = ("-" if not result.agreement_before else ", ".join(
            f"{before:.1%} -> {after:.1%}" for before, after in zip(result.agreement_before,
                                                                    result.agreement_after, strict=True)))
        print(f"| {result.name} | {result.median_step:.2f} | {result.median_step / baseline:.2f}x | {loss} | "
              f"{agreement} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the tiny test model, a few steps: a smoke run")
    parser.add_argument("--model-cache", type=Path, default=None, help="where --quick builds its tiny model")
    parser.add_argument("--depths", type=int, default=1, help="MTP depths (--mtp-num-layers)")
    parser.add_argument("--steps", type=int, default=None, help="train steps each way (default 12; 3 with --quick)")
    parser.add_argument("--samples", type=int, default=None, help="answers a step (default 32; 4 with --quick)")
    parser.add_argument("--held-out", type=int, default=None, help="answers for the agreement (default 8; 2)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="answer length cap (default 96; 12)")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write the figures to this JSON file")
    args = parser.parse_args(argv)
    from actors.runtime.logs import quiet_library_output

    quiet_library_output()
    quick = args.quick
    steps = args.steps or (3 if quick else 12)
    count, held = args.samples or (4 if quick else 32), args.held_out or (2 if quick else 8)
    max_new_tokens = args.max_new_tokens or (12 if quick else 96)
    if quick:
        cache = args.model_cache or Path(tempfile.mkdtemp(prefix="mtp-bench-"))
        model_path, model = cached_tiny_model(cache, TinyModelSpec(family="qwen2")), "tiny qwen2"
    else:
        from engines.pretrained import SMOLLM2, cached_pretrained

        model_path, model = cached_pretrained(SMOLLM2, REPO / ".cache"), "SmolLM2-135M-Instruct"
    started = time.perf_counter()
    samples = sampled_answers(model_path, count + held, max_new_tokens, args.seed)
    print(f"sampled {len(samples)} answers in {time.perf_counter() - started:.0f} s", flush=True)
    train, held_out = samples[:count], samples[count:]
    runs = [run(model_path, train, held_out, depths=depths, steps=steps, lr=args.lr) for depths in (0, args.depths)]
    mean_tokens = sum(sample.response_length for sample in train) / len(train)
    print_table(runs, model, count, mean_tokens, held)
    if args.json is not None:
        args.json.write_text(json.dumps({"model": model, "samples": count, "held_out": held,
                                         "mean_response_tokens": mean_tokens,
                                         "runs": [{**asdict(result), "median_step": result.median_step}
                                                  for result in runs]}, indent=2))


if __name__ == "__main__":
    main()
