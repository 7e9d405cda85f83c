"""Benchmark: what rolling out in FP8 (`--rollout-fp8`) changes, against full-precision rollout in the same run.

    python -m tools.bench.fp8_rollout                  # SmolLM2-135M-Instruct on the demo's word problems
    python -m tools.bench.fp8_rollout --quick          # fewer prompts and tokens

Each rollout precision runs the torch engine on the same prompts (the demo's harder task: word problems in the chat
template, answers of 80-190 tokens), sampling at the demo's temperature 0.7:

- fp32: the baseline, what this machine's learner computes with;
- bf16: the engine in bfloat16 (the usual GPU rollout);
- fp8: the projections in FP8 with per-tile scales, inputs rounded per token and group, computed in float32;
- fp8 (bf16): the same in bfloat16, as SGLang's FP8 kernels compute on a GPU.

Per precision: the mismatch, mean |log pi_train - log pi_rollout| over every sampled token, where pi_rollout is the
engine's reported log-prob and pi_train the learner's forward (the model in float32) over the same tokens: what the
run reports as train_rollout_logprob_abs_diff at staleness 0, and what --off-policy-correction corrects; its 99th
percentile; the share of the fp32 engine's response tokens where the precision's greedy choice (teacher-forced, the
argmax at each position) is fp32's; the engine's generated tokens/s on this workload. Then the bytes one push
carries in each precision, at SmolLM2 and the Qwen2.5-0.5B shape (from the pushed specs), and the seconds the
learner spends quantising one push. Times share this machine's two cores; precisions run one after the other.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

TEMPERATURE = 0.7


@dataclass(frozen=True)
class Precision:
    label: str
    dtype: torch.dtype
    fp8: bool


PRECISIONS = (Precision("fp32 (baseline)", torch.float32, False), Precision("bf16", torch.bfloat16, False),
              Precision("fp8", torch.float32, True), Precision("fp8 (bf16)", torch.bfloat16, True))


@dataclass
class Rollout:
    sequences: list[list[int]]  # prompt + response
    prompt_lens: list[int]
    log_probs: list[list[float]]  # the engine's, per response token
    tokens_per_s: float


def prompts(tokenizer, count: int, budget: int) -> list[list[int]]:
    """`count` word problems as token ids, each cut to its last `budget` tokens (the tiny model's context is 64)."""
    from tools.make_arithmetic_data import word_problems

    problems = word_problems(seed=1)[:: max(1, 400 // count)][:count]
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": problem["input"]}],
                                               add_generation_prompt=True, tokenize=True, return_dict=False))[-budget:]
            for problem in problems]


async def roll_out(model_path: Path, precision: Precision, inputs: list[list[int]], samples: int,
                   max_new_tokens: int) -> Rollout:
    from engines.inference.base import GenerateRequest, SamplingParams
    from engines.inference.torch_engine import TorchEngine

    engine = TorchEngine.from_pretrained(model_path, dtype=precision.dtype, fp8=precision.fp8, max_batch_size=64)
    async with engine:
        params = SamplingParams(temperature=TEMPERATURE, max_new_tokens=max_new_tokens, n=samples, seed=7)
        started = time.perf_counter()
        outputs = await asyncio.gather(*(engine.generate(GenerateRequest(f"p{index}", ids, params))
                                         for index, ids in enumerate(inputs)))
        seconds = time.perf_counter() - started
    rollout = Rollout([], [], [], 0.0)
    for ids, samples_out in zip(inputs, outputs, strict=True):
        for sample in samples_out:
            rollout.sequences.append(ids + sample.output_ids)
            rollout.prompt_lens.append(len(ids))
            rollout.log_probs.append(sample.log_probs)
    rollout.tokens_per_s = sum(len(lp) for lp in rollout.log_probs) / seconds
    return rollout


def model_of(model_path: Path, precision: Precision) -> torch.nn.Module:
    from engines.inference.fp8_linear import serve_fp8
    from engines.inference.model_facts import load_model_folder

    model, _, _ = load_model_folder(model_path, dtype=precision.dtype, device="cpu")
    if precision.fp8:
        serve_fp8(model)
    return model.eval()


@torch.inference_mode()
def response_logits(model: torch.nn.Module, sequence: list[int], prompt_len: int) -> torch.Tensor:
    """The logits that predict each response token of `sequence`, in float32."""
    logits = model(input_ids=torch.tensor([sequence])).logits[0, prompt_len - 1:-1]
    return logits.float()


def mismatch(trainer: torch.nn.Module, rollout: Rollout) -> tuple[float, float]:
    """Mean and 99th percentile of |log pi_train - log pi_rollout| over every response token."""
    differences = []
    for sequence, prompt_len, engine_log_probs in zip(rollout.sequences, rollout.prompt_lens, rollout.log_probs,
                                                      strict=True):
        log_probs = torch.log_softmax(response_logits(trainer, sequence, prompt_len) / TEMPERATURE, dim=-1)
        tokens = torch.tensor(sequence[prompt_len:])
        train = log_probs.gather(1, tokens[:, None])[:, 0]
        differences.append((train - torch.tensor(engine_log_probs)).abs())
    every = torch.cat(differences)
    return every.mean().item(), torch.quantile(every, 0.99).item()


def agreement(reference: list[torch.Tensor], model: torch.nn.Module, rollout: Rollout) -> float:
    """The share of response positions where `model`'s argmax is the reference model's."""
    same = total = 0
    for argmax, sequence, prompt_len in zip(reference, rollout.sequences, rollout.prompt_lens, strict=True):
        ours = response_logits(model, sequence, prompt_len).argmax(-1)
        same += int((ours == argmax).sum())
        total += argmax.numel()
    return same / total


def push_sizes(names: tuple[str, ...]) -> list[tuple[str, dict[str, float], float]]:
    """(model, MiB per push by precision, seconds to quantise one push) for the benchmark models `names`."""
    from transformers import AutoModelForCausalLM

    from engines.weights import fp8
    from engines.weights.stream import SpecifiedTensors, spec_of
    from tools.bench.models import bench_model

    rows = []
    for name in names:
        model = AutoModelForCausalLM.from_pretrained(bench_model(name), dtype=torch.float32)
        named = [(key, tensor.detach()) for key, tensor in model.named_parameters()]
        specs = tuple(spec_of(key, tensor) for key, tensor in named)
        sizes = {"fp32": sum(s.nbytes for s in specs) / 2**20,
                 "bf16": sum(s.numel * 2 for s in specs) / 2**20,
                 "fp8": sum(s.nbytes for s in fp8.wire_specs(specs, torch.bfloat16)) / 2**20}
        started = time.perf_counter()
        for _ in fp8.quantised_push(SpecifiedTensors(specs, named), torch.bfloat16):
            pass
        rows.append((name, sizes, time.perf_counter() - started))
        del model, named
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, help="word problems (default 24; --quick 8)")
    parser.add_argument("--samples", type=int, help="samples per prompt (default 4; --quick 2)")
    parser.add_argument("--max-new-tokens", type=int, help="default 128; --quick 48")
    parser.add_argument("--quick", action="store_true", help="fewer prompts, samples and tokens; push sizes of the "
                        "model alone")
    parser.add_argument("--model", default="smollm2", help="smollm2 or tiny (tools/bench/models.py): the mismatch "
                        "means something on a trained model only; tiny checks the benchmark runs")
    args = parser.parse_args(argv)
    from transformers import AutoConfig, AutoTokenizer

    from actors.runtime.logs import quiet_library_output
    from tools.bench.models import bench_model

    quiet_library_output()
    for name, default, quick in (("prompts", 24, 8), ("samples", 4, 2), ("max_new_tokens", 128, 48)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else default)
    model_path = bench_model(args.model)
    context = AutoConfig.from_pretrained(model_path).max_position_embeddings

    inputs = prompts(AutoTokenizer.from_pretrained(model_path), args.prompts, context - args.max_new_tokens)
    trainer = model_of(model_path, PRECISIONS[0])
    rollouts = {}
    for precision in PRECISIONS:
        rollouts[precision.label] = asyncio.run(roll_out(model_path, precision, inputs, args.samples,
                                                         args.max_new_tokens))
        print(f"  {precision.label}: {sum(map(len, rollouts[precision.label].log_probs))} tokens sampled", flush=True)
    baseline = rollouts[PRECISIONS[0].label]
    reference = [response_logits(trainer, s, p).argmax(-1) for s, p in zip(baseline.sequences, baseline.prompt_lens,
                                                                            strict=True)]
    tokens = sum(len(lp) for lp in baseline.log_probs)
    print(f"\n{args.model}, {args.prompts} word problems x {args.samples} samples at temperature "
          f"{TEMPERATURE}, up to {args.max_new_tokens} tokens ({tokens} tokens in the baseline's responses)")
    print(f"{'rollout':<16} {'mean |dlogp|':>13} {'p99 |dlogp|':>12} {'greedy = fp32':>14} {'tokens/s':>9}")
    speeds = []
    for precision in PRECISIONS:
        rollout = rollouts[precision.label]
        mean, p99 = mismatch(trainer, rollout)
        agree = 1.0 if precision is PRECISIONS[0] else agreement(reference, model_of(model_path, precision), baseline)
        speeds.append(rollout.tokens_per_s)
        print(f"{precision.label:<16} {mean:>13.4f} {p99:>12.4f} {agree:>13.1%} {rollout.tokens_per_s:>9.1f}")
    print(f"(tokens/s median over precisions {statistics.median(speeds):.1f}; decoding shares two cores)")
    print(f"\n{'model':<14} {'fp32 MiB':>9} {'bf16 MiB':>9} {'fp8 MiB':>8} {'fp8/bf16':>9} {'quantise s':>11}")
    for name, sizes, seconds in push_sizes((args.model,) if args.quick else (args.model, "qwen2.5-0.5b")):
        print(f"{name:<14} {sizes['fp32']:>9.0f} {sizes['bf16']:>9.0f} {sizes['fp8']:>8.0f} "
              f"{sizes['fp8'] / sizes['bf16']:>9.2f} {seconds:>11.2f}")


if __name__ == "__main__":
    main()
