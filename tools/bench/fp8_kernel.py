"""Benchmark: the FP8 engine's two kernels, the scaled matmul that reads the FP8 bytes against the dequantised copy
(the baseline), in the same run (`engines/inference/fp8_matmul.py`).

    python -m tools.bench.fp8_kernel                   # SmolLM2-135M-Instruct
    python -m tools.bench.fp8_kernel --quick           # fewer prompts and tokens

Three tables:

- per projection of SmolLM2 (its real weights, layers 0 and 15; and random weights of the same shapes), the largest
  |scaled matmul - dequantised product| over 16 rows of random inputs, absolute and relative to the output's largest
  value, in float32 compute;
- per kernel, the torch engine decoding the demo's word problems greedily (one batch): generated tokens/s, and the
  bytes the projections keep resident (FP8 values, scales and, for the baseline, the dequantised copy);
- where the engines' greedy responses part; then, teacher-forced over the baseline's sequences, the mean and largest
  |dlogp| of their tokens (temperature 1) and the share of positions with the same argmax, for the scaled matmul
  and, as the floor to read it against, for the baseline with its embeddings moved by float32-sized noise: FP8
  activation rounding is discontinuous, so a float-level difference anywhere flips a few roundings, and these
  compound over the layers into differences of FP8's own size.

Times share this machine's cores with whatever else runs; kernels run one after the other.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import torch

KERNELS = ("dequantised", "scaled_mm")
FLOOR_NOISE = 1e-7  # float32's own rounding, relative
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")


def layer_differences(model_path: Path, layers: tuple[int, ...]) -> list[tuple[str, tuple[int, int], float, float]]:
    """(projection, shape, max abs difference, relative to max |output|), real weights then random ones."""
    from transformers import AutoModelForCausalLM

    from engines.inference.fp8_linear import Fp8Linear

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    rows = []
    for label, layer_index in [*((f"layer {index}", index) for index in layers), ("random", layers[0])]:
        for projection in PROJECTIONS:
            linear = model.get_submodule(f"model.layers.{layer_index}.{projection}")
            if label == "random":
                linear = torch.nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None)
            baseline, scaled = Fp8Linear(linear), Fp8Linear(linear, kernel="scaled_mm")
            inputs = torch.randn(16, linear.in_features, generator=generator)
            with torch.inference_mode():
                expected, got = baseline(inputs), scaled(inputs)
            difference = (got - expected).abs().max().item()
            rows.append((f"{label} {projection}", tuple(linear.weight.shape), difference,
                         difference / expected.abs().max().item()))
    return rows


def resident_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """What the FP8 projections keep (their FP8 values, scales and any dequantised copy), and their weights' count."""
    from engines.inference.fp8_linear import Fp8Linear

    total = count = 0
    for layer in model.modules():
        if isinstance(layer, Fp8Linear):
            total += layer.weight.nbytes + layer.weight_scale_inv.nbytes
            total += layer.served.nbytes if layer.served is not None else 0
            count += layer.weight.numel()
    return total, count


async def decode(model_path: Path, kernel: str, inputs: list[list[int]], max_new_tokens: int
                 ) -> tuple[list[list[int]], float, tuple[int, int]]:
    """The greedy responses, generated tokens/s, and the projections' resident bytes and weights."""
    from engines.inference.base import GenerateRequest, SamplingParams
    from engines.inference.torch_engine import TorchEngine

    engine = TorchEngine.from_pretrained(model_path, fp8=kernel, max_batch_size=len(inputs))
    async with engine:
        params = SamplingParams(temperature=0, max_new_tokens=max_new_tokens, ignore_eos=True)
        started = time.perf_counter()
        outputs = await asyncio.gather(*(engine.generate(GenerateRequest(f"p{index}", ids, params))
                                         for index, ids in enumerate(inputs)))
        seconds = time.perf_counter() - started
        resident = resident_bytes(engine.model)
    responses = [output[0].output_ids for output in outputs]
    return responses, sum(map(len, responses)) / seconds, resident


def teacher_forced(model_path: Path, sequences: list[list[int]], prompt_lens: list[int]
                   ) -> dict[str, tuple[float, float, float]]:
    """Against the baseline, over the sequences' response tokens: mean and largest |dlogp| and the share of positions
    with the same argmax, for the scaled matmul and for the baseline with its embeddings moved by float32 noise (the
    floor: FP8 activation rounding turns any float-level difference into FP8-level ones, layer after layer)."""
    from engines.inference.fp8_linear import serve_fp8
    from engines.inference.model_facts import load_model_folder
    from tools.bench.fp8_rollout import response_logits

    models = {}
    for label, kernel, noise in (("baseline", "dequantised", 0.0), ("scaled_mm", "scaled_mm", 0.0),
                                 (f"dequantised, embeddings x (1 + {FLOOR_NOISE:g} N(0,1))", "dequantised",
                                  FLOOR_NOISE)):
        model, _, _ = load_model_folder(model_path, dtype=torch.float32, device="cpu")
        if noise:
            embeddings = model.get_input_embeddings().weight
            with torch.no_grad():
                embeddings.mul_(1 + noise * torch.randn(embeddings.shape, generator=torch.Generator().manual_seed(1)))
        serve_fp8(model, kernel=kernel)
        models[label] = model.eval()
    rows = {}
    baseline = [response_logits(models["baseline"], s, p) for s, p in zip(sequences, prompt_lens, strict=True)]
    for label in list(models)[1:]:
        differences, same, total = [], 0, 0
        for sequence, prompt_len, reference in zip(sequences, prompt_lens, baseline, strict=True):
            tokens = torch.tensor(sequence[prompt_len:])[:, None]
            logits = response_logits(models[label], sequence, prompt_len)
            differences.append((torch.log_softmax(logits, -1).gather(1, tokens)
                                - torch.log_softmax(reference, -1).gather(1, tokens)).abs())
            same += int((logits.argmax(-1) == reference.argmax(-1)).sum())
            total += tokens.shape[0]
        every = torch.cat(differences)
        rows[label] = (every.mean().item(), every.max().item(), same / total)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, help="word problems decoded in one batch (default 8; --quick 4)")
    parser.add_argument("--max-new-tokens", type=int, help="default 32; --quick 8")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", default="smollm2", help="smollm2 or tiny (tools/bench/models.py)")
    args = parser.parse_args(argv)
    from transformers import AutoConfig, AutoTokenizer

    from actors.runtime.logs import quiet_library_output
    from tools.bench.fp8_rollout import prompts
    from tools.bench.models import bench_model

    quiet_library_output()
    args.prompts = args.prompts or (4 if args.quick else 8)
    args.max_new_tokens = args.max_new_tokens or (8 if args.quick else 32)
    model_path = bench_model(args.model)
    config = AutoConfig.from_pretrained(model_path)
    layers = (0,) if args.quick else (0, config.num_hidden_layers // 2)

    print(f"{'projection':<26} {'N x K':>11} {'max |diff|':>11} {'relative':>9}")
    for name, shape, difference, relative in layer_differences(model_path, layers):
        print(f"{name:<26} {f'{shape[0]} x {shape[1]}':>11} {difference:>11.2e} {relative:>9.1e}")

    budget = config.max_position_embeddings - args.max_new_tokens
    inputs = prompts(AutoTokenizer.from_pretrained(model_path), args.prompts, budget)
    results = {kernel: asyncio.run(decode(model_path, kernel, inputs, args.max_new_tokens)) for kernel in KERNELS}
    dense = results["scaled_mm"][2][1] * 4
    print(f"\n{args.model}: {args.prompts} word problems decoded greedily in one batch, {args.max_new_tokens} tokens "
          f"each (torch threads {torch.get_num_threads()}); the projections are {dense / 2**20:.1f} MiB in float32")
    print(f"{'kernel':<24} {'tokens/s':>9} {'projections MiB':>16}")
    for kernel, (_, speed, resident) in results.items():
        label = f"{kernel} (baseline)" if kernel == KERNELS[0] else kernel
        print(f"{label:<24} {speed:>9.1f} {resident[0] / 2**20:>16.1f}")

    baseline, scaled = results["dequantised"][0], results["scaled_mm"][0]
    diverged = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), None)
                for x, y in zip(baseline, scaled, strict=True)]
    print(f"greedy responses identical: {diverged.count(None)} of {len(diverged)}; the others part at tokens "
          f"{sorted(index for index in diverged if index is not None)}")
    sequences = [ids + response for ids, response in zip(inputs, baseline, strict=True)]
    print(f"\nteacher-forced over the baseline's responses, against the baseline\n"
          f"{'model':<48} {'mean |dlogp|':>13} {'max |dlogp|':>12} {'argmax same':>12}")
    for label, (mean, largest, same) in teacher_forced(model_path, sequences, [len(ids) for ids in inputs]).items():
        print(f"{label:<48} {mean:>13.2e} {largest:>12.2e} {same:>11.1%}")

if __name__ == "__main__":
    main()
