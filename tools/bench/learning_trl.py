"""TRL's `GRPOTrainer` on the benchmark task, as `tools/bench/learning.py` runs it: one child process per run.

    python -m tools.bench.learning_trl --model M --train train.jsonl --out DIR --seed 0 --steps 300 ...

Same start checkpoint, prompts, reward function (our `exact_match`, called on TRL's completions) and
hyperparameters as the Slipstream runs it is compared with. Every `--snapshot-every` steps the policy's weights
are written to `DIR/snapshots/step_NNNNNN.safetensors` and the wall-clock time to `DIR/timeline.jsonl`; the
benchmark scores the snapshots afterwards with the same evaluator for every system, so no system's own eval
loop sits inside its timing. TRL generates in-process with `model.generate` (no vLLM on CPU), so it has no
off-policy correction to set: its rollouts are on-policy.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--train", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--snapshot-every", type=int, required=True)
    parser.add_argument("--prompts-per-step", type=int, required=True)
    parser.add_argument("--samples-per-prompt", type=int, required=True)
    parser.add_argument("--max-new-tokens", type=int, required=True)
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--min-lr", type=float, required=True)
    parser.add_argument("--kl-coef", type=float, required=True)
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0 leaves torch's default")
    args = parser.parse_args()
    run(args)


def run(args: argparse.Namespace) -> None:
    import torch
    from datasets import Dataset
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from policies.rewards import RewardInput
    from policies.rewards.text import exact_match_reward

    if args.threads:
        torch.set_num_threads(args.threads)
    records = [json.loads(line) for line in args.train.read_text(encoding="utf-8").splitlines() if line.strip()]
    dataset = Dataset.from_list([{"prompt": r["input"], "label": r["label"]} for r in records])

    def exact_match(completions: list[str], label: list[str], **_: object) -> list[float]:
        return [exact_match_reward(RewardInput(prompt="", response=c, label=gold))
                for c, gold in zip(completions, label, strict=True)]

    config = GRPOConfig(
        output_dir=str(args.out / "trl"), use_cpu=True, bf16=False, seed=args.seed, data_seed=args.seed,
        max_steps=args.steps, per_device_train_batch_size=args.prompts_per_step * args.samples_per_prompt,
        gradient_accumulation_steps=1, num_generations=args.samples_per_prompt,
        max_completion_length=args.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=args.lr, lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr": args.min_lr},
        warmup_steps=0, max_grad_norm=1.0, weight_decay=0.0, beta=args.kl_coef, epsilon=0.2, loss_type="dapo",
        scale_rewards="group", save_strategy="no", report_to=[], logging_steps=max(1, args.snapshot_every),
        disable_tqdm=True, dataloader_num_workers=0,
    )
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    snapshots = args.out / "snapshots"
    snapshots.mkdir(parents=True, exist_ok=True)
    timeline = (args.out / "timeline.jsonl").open("a", buffering=1)

    class Snapshots(TrainerCallback):
        def on_step_end(self, _args, state, _control, **kwargs):  # type: ignore[no-untyped-def]
            step = state.global_step
            timeline.write(json.dumps({"step": step, "wall": time.time()}) + "\n")
            if step % args.snapshot_every == 0 or step == args.steps:
                save_model(kwargs["model"], str(snapshots / f"step_{step:06d}.safetensors"))

    trainer = GRPOTrainer(model=model, reward_funcs=exact_match, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Snapshots()])
    trainer.train()
    timeline.close()


if __name__ == "__main__":
    main()
