"""How much rollout routing replay (R3) closes the train/rollout log-prob gap of an MoE model, on one batch.

    python -m tools.experiments.routing_replay [--prompts 32] [--samples 4] [--longest 48] [--experts 8]

A tiny Qwen3-MoE model (random weights, its routers' logits close together, so routing is fragile: the case R3
exists for) generates a batch with the torch engine, which records every token's experts. The learner's fp32
forward then scores the same tokens twice: routing for itself, and replaying the engine's routes. Rows: the engine
in bf16 (the usual mismatch: an inference engine in bf16, a trainer in fp32) and in fp32 (batching and padding
alone). Columns: mean |log pi_train - log pi_rollout| over the response tokens without and with replay, and the
share of (token, layer) choices where the learner's own router picks other experts than the engine did.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
from pathlib import Path

import numpy as np
import torch

from actors.runtime.logs import quiet_library_output
from engines.inference import GenerateRequest, SamplingParams, TorchEngine
from engines.training import TorchTrainer, TorchTrainerConfig, TrainSample
from engines.training.micro_batches import pack_inputs
from engines.training.moe import Routers, sample_routes
from tools.standins.tiny_model import TinyModelSpec, cached_tiny_model


def generate(path: Path, dtype: torch.dtype, args: argparse.Namespace) -> list[TrainSample]:
    rng = random.Random(0)
    prompts = [[rng.randrange(6, 100) for _ in range(rng.randint(4, 16))] for _ in range(args.prompts)]
    params = SamplingParams(temperature=1.0, max_new_tokens=args.longest, n=args.samples, seed=1, ignore_eos=True)

    async def run() -> list[TrainSample]:
        async with TorchEngine.from_pretrained(path, dtype=dtype, record_routes=True, max_batch_size=32) as engine:
            results = await asyncio.gather(*(engine.generate(GenerateRequest(f"p{i}", prompt, params))
                                             for i, prompt in enumerate(prompts)))
        samples = []
        for prompt, result in zip(prompts, results, strict=True):
            for output in result:
                assert output.routed_experts is not None
                routes = output.routed_experts.table()
                samples.append(TrainSample(torch.tensor(prompt + output.output_ids), len(output.output_ids),
                                           rollout_log_probs=torch.tensor(output.log_probs),
                                           routed_experts=torch.from_numpy(routes.astype(np.int64))))
        return samples

    return asyncio.run(run())


def measure(trainer: TorchTrainer, samples: list[TrainSample]) -> tuple[float, float, float]:
    rollout = torch.cat([sample.rollout_log_probs for sample in samples])
    bare = [TrainSample(s.tokens, s.response_length) for s in samples]
    own = trainer.compute_log_probs(bare, temperature=1.0).log_probs
    replayed = trainer.compute_log_probs(samples, temperature=1.0).log_probs
    routers = Routers(trainer._model, wanted_by="routing_replay experiment")
    inputs = pack_inputs(bare, with_token_positions=True)
    with torch.no_grad(), routers.tapped() as layers:
        trainer._model(input_ids=inputs.input_ids, position_ids=inputs.position_ids, use_cache=False)
    learner_routes = sample_routes(layers, bare, inputs)
    differing = total = 0
    for sample, mine in zip(samples, learner_routes, strict=True):
        assert sample.routed_experts is not None
        engine_sets = sample.routed_experts.sort(-1).values
        differing += int((mine.sort(-1).values != engine_sets).any(-1).sum())
        total += mine.shape[0] * mine.shape[1]
    return float((own - rollout).abs().mean()), float((replayed - rollout).abs().mean()), differing / total


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--longest", type=int, default=48)
    parser.add_argument("--experts", type=int, default=8)
    args = parser.parse_args(argv)
    quiet_library_output()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="routing-replay-") as scratch:
        path = cached_tiny_model(Path(scratch), TinyModelSpec(family="qwen3_moe", experts=args.experts,
                                                               hidden_size=128, intermediate_size=128,
                                                               num_hidden_layers=4))
        trainer = TorchTrainer(TorchTrainerConfig(model_path=path))
        print(f"{'engine dtype':<13} {'tokens':>7} {'|diff| own routes':>18} {'|diff| replayed':>16} "
              f"{'routes differing':>17}")
        for name, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
            samples = generate(path, dtype, args)
            own, replayed, differing = measure(trainer, samples)
            tokens = sum(sample.response_length for sample in samples)
            print(f"{name:<13} {tokens:>7} {own:>18.5f} {replayed:>16.5f} {differing:>16.2%}", flush=True)
        trainer.close()


if __name__ == "__main__":
    main()
