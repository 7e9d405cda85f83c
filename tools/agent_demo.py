"""The multi-turn tool demo (#18, #58): a model learns, by fully-async GRPO, to reach for its `add` tool on 2-digit
sums (`examples/tool_arithmetic.py`), through the built-in tool loop or through an agent written against the OpenAI
or Anthropic client library, talking to the rollout worker's endpoint.

1. Build the model (the tiny one once, cached; SmolLM2-135M-Instruct fetched and converted once) and the task:
   held-out operand pairs, RL prompts, and SFT episodes of which a share call the tool (the rest answer directly,
   correctly).
2. Warm-start by multi-turn SFT through the same system (`--loss-type sft`; each label is an episode, loss on the
   model's turns only), on the conversation the episodes will hold.
3. GRPO, rewarded on the final answer, with a held-out eval round (greedy) before training, during it and at the end.
   `--api` picks how the episodes run:
   - `loop` (default): the built-in tool loop (`--agent-tools-path`);
   - `chat`, `responses`, `anthropic`: the example agent for that API (`examples/openai_agent.py`,
     `examples/responses_agent.py`, `examples/anthropic_agent.py`, on the real `openai` and `anthropic` clients) as
     `--agent-function-path`. Each ends its episode by asking the model to check its answer once more, so their
     warm start is taught that exchange too; the three share one warm start (one conversation, three wires).
   Several (`--api responses anthropic chat`) train one after the other, each from the same warm start with the
   same seed and settings.
4. Print, per surface, held-out accuracy before and after RL, the tool calls per episode of the first and last
   training batches, and how long the GRPO run took.

`--model tiny` (default: builds in seconds, needs nothing) or `--model smollm2`. Every step is an ordinary launcher
command, printed before it runs. Why each recipe's settings (this 2-core machine):
- tiny: SFT for 100 steps at lr 1e-3 had not learnt to copy the operands into the call (every call was
  `add(12, 12)`); 400 steps at 2e-3 copy them, and answer about 60% of held-out pairs, choosing the tool or a
  (mostly wrong) direct answer. GRPO then needs about 25 steps of 16 x 8 episodes to make the tool the policy's
  choice. Its chat template leaves tools out and its 256-token context could not hold a description of them, so
  the client agents' tools are not described to it (`--no-agent-describe-tools`): it learnt the call by SFT.
- smollm2: its template leaves tools out too, so the endpoint states them in the system message, and its SFT prompts
  carry the same text. It learns the call's format in a few SFT steps (full weights, lr 5e-5): 40 steps with half
  the episodes calling the tool left 95% of held-out sums right before RL (greedy: it mostly calls), little for RL
  to show; 20 steps with a fifth calling leave it answering most sums directly (about half of them right), and
  GRPO (LoRA rank 16, lr 3e-4, 4 x 8 episodes, the README demo's recipe) makes it call within 3-4 steps.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# Run by its path (`python tools/agent_demo.py`, as older notes say), this file runs itself as
# `python -m tools.agent_demo`: `tools` is not an installed package, so only the module form finds it; the
# repository goes on the path.
if not __package__:
    repo = str(Path(__file__).resolve().parents[1])
    path = os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))
    os.execve(sys.executable, [sys.executable, "-m", "tools.agent_demo", *sys.argv[1:]],
              {**os.environ, "PYTHONPATH": path})

from actors.data.tool_prompts import describe_tools
from actors.runtime.logs import quiet_library_output
from actors.runtime.metrics import read_metrics
from examples.openai_agent import REVIEW
from examples.openai_agent import TOOLS as CHAT_TOOLS
from examples.tool_arithmetic import Phrasing, described_tool_call, make_tool_task_data
from tools.demo import run_launcher
from tools.standins.tiny_model import SPECIAL_TOKENS, TinyModelSpec, cached_tiny_model

REPO = Path(__file__).resolve().parent.parent
MODEL_SPEC = TinyModelSpec(family="qwen2", hidden_size=128, intermediate_size=352, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, seed=0)
END_OF_TURN = str(SPECIAL_TOKENS.index("<|im_end|>"))  # the model ends each turn with it: generation stops there
COMMON = ["--custom-rm-path", "examples.tool_arithmetic:final_answer_reward", "--torch-threads", "1",
          "--console-log-level", "warning", "--no-use-tensorboard"]
# Each API's episodes: the example agent that speaks it, with the real client library.
AGENTS = {"chat": "examples.openai_agent:solve", "responses": "examples.responses_agent:solve",
          "anthropic": "examples.anthropic_agent:solve"}
APIS = ("loop", *AGENTS)
SURFACES = {"loop": "built-in tool loop", "chat": "Chat Completions (openai)", "responses": "Responses (openai)",
            "anthropic": "Messages (anthropic)"}


@dataclass(frozen=True)
class Recipe:
    """A model and the settings it learns the task with."""

    name: str
    phrasing: Phrasing
    tool_share: float  # of the SFT episodes
    sft_steps: int
    sft_warmup: int  # steps of SFT learning-rate warmup (fewer in a shorter SFT: the cosine decay needs steps after)
    rl_steps: int
    eval_rounds: int  # during RL, the last at its end (and one before it)
    describes_tools: bool  # whether the endpoint states the tools in the prompt (the tiny model's context is short)
    sft: tuple[str, ...]
    grpo: tuple[str, ...]


TINY = Recipe(
    name="tiny model (3 layers, 128 wide, character tokens)", phrasing=Phrasing(), tool_share=0.5, sft_steps=400,
    sft_warmup=10, rl_steps=60, eval_rounds=4, describes_tools=False,
    sft=("--rollout-stop-token-ids", END_OF_TURN, "--loss-type", "sft", "--loss-agg-mode", "token-mean",
         "--n-samples-per-prompt", "1", "--rollout-batch-size", "32", "--lr", "2e-3", "--lr-decay-style", "cosine",
         "--max-staleness", "4", "--rollout-workers", "1", "--reward-workers", "1"),
    grpo=("--rollout-stop-token-ids", END_OF_TURN, "--advantage-estimator", "grpo", "--loss-agg-mode", "token-mean",
          "--n-samples-per-prompt", "8", "--rollout-batch-size", "16", "--lr", "1e-4", "--lr-decay-style", "cosine",
          "--min-lr", "2e-5", "--use-kl-loss", "--kl-loss-coef", "0.05", "--kl-loss-type", "low_var_kl",
          "--max-staleness", "2", "--off-policy-correction", "tis", "--rollout-temperature", "1.0",
          "--rollout-workers", "2", "--reward-workers", "1", "--n-samples-per-eval-prompt", "1",
          "--rollout-max-response-len", "80"))
SMOLLM2 = Recipe(
    name="SmolLM2-135M-Instruct",
    phrasing=Phrasing(question="What is {a} + {b}?", call=described_tool_call, system=describe_tools(CHAT_TOOLS)),
    tool_share=0.2, sft_steps=20, sft_warmup=2, rl_steps=16, eval_rounds=2, describes_tools=True,
    sft=("--loss-type", "sft", "--loss-agg-mode", "token-mean", "--n-samples-per-prompt", "1",
         "--rollout-batch-size", "16", "--lr", "5e-5", "--lr-decay-style", "cosine", "--max-staleness", "4",
         "--rollout-workers", "1", "--reward-workers", "1"),
    grpo=("--advantage-estimator", "grpo", "--loss-agg-mode", "token-mean", "--n-samples-per-prompt", "8",
          "--rollout-batch-size", "4", "--lr", "3e-4", "--lr-decay-style", "cosine", "--min-lr", "1e-4",
          "--lora-rank", "16", "--lora-alpha", "32", "--max-staleness", "1", "--off-policy-correction", "tis",
          "--rollout-temperature", "0.7", "--rollout-workers", "2", "--reward-workers", "1", "--cpu-budget", "off",
          "--n-samples-per-eval-prompt", "1", "--rollout-max-response-len", "48",
          # An 8k-token micro-batch of these multi-turn episodes held ~10 GB of float32 activations in the learner,
          # beside 7 GB of engines: a 24 GB machine ran out of memory. The same gradient, a quarter of the memory.
          "--micro-batch-tokens", "2048"))
RECIPES = {"tiny": TINY, "smollm2": SMOLLM2}


def review_of(api: str) -> str | None:
    """The question the episode ends with after the model's answer: the client agents ask for a check."""
    return None if api == "loop" else REVIEW


def episode_flags(api: str, recipe: Recipe) -> list[str]:
    """How GRPO's episodes run. The client agents declare their tools in each request, the built-in loop hands the
    chat template the same schemas where the model is to be told of them."""
    if api == "loop":
        schemas = ["--agent-tool-schemas-path", "examples.openai_agent:TOOLS"] if recipe.describes_tools else []
        return ["--agent-tools-path", "examples.tool_arithmetic:FUNCTIONS", "--agent-max-turns", "3", *schemas]
    return ["--agent-function-path", AGENTS[api], *([] if recipe.describes_tools else ["--no-agent-describe-tools"])]


def sft_command(recipe: Recipe, run_dir: Path, model: Path, data: Path, steps: int) -> list[str]:
    return ["--head", "--run-dir", str(run_dir), "--hf-checkpoint", str(model), "--prompt-data", str(data),
            "--num-rollout", str(steps), "--lr-warmup-iters", str(min(recipe.sft_warmup, steps // 2)), *COMMON,
            *recipe.sft]


def grpo_command(api: str, recipe: Recipe, run_dir: Path, warm_start: Path, data: dict[str, Path],
                 steps: int) -> list[str]:
    """The same run for every surface but for how its episodes run (the seed is the launcher's default)."""
    return ["--head", "--run-dir", str(run_dir), "--hf-checkpoint", str(warm_start), "--prompt-data",
            str(data["train"]), "--eval-prompt-data", "heldout", str(data["eval"]), "--eval-interval",
            str(max(1, steps // recipe.eval_rounds)), "--num-rollout", str(steps), *COMMON, *recipe.grpo,
            *episode_flags(api, recipe)]


@dataclass(frozen=True)
class Outcome:
    """What one surface's GRPO run did, read from its metrics."""

    api: str
    before: float  # held-out greedy accuracy of the eval round before training
    after: float  # ... of the last eval round
    after_step: int
    calls_first: float  # tool calls per episode, first training batch
    calls_last: float  # ... last training batch
    seconds: float  # the GRPO run, launch to exit

    @classmethod
    def read(cls, api: str, run_dir: Path, seconds: float) -> Outcome:
        evals = [row for row in read_metrics(run_dir / "metrics" / "eval.jsonl") if "eval/heldout/accuracy" in row]
        train = read_metrics(run_dir / "metrics" / "train.jsonl")
        if len(evals) < 2 or not train:
            raise SystemExit(f"agent demo: the {api} run wrote {len(evals)} held-out eval round(s) and {len(train)} "
                             f"training step(s); see {run_dir / 'logs'}")
        return cls(api, evals[0]["eval/heldout/accuracy"], evals[-1]["eval/heldout/accuracy"], evals[-1]["step"],
                   train[0]["multiturn/tool_calls_mean"], train[-1]["multiturn/tool_calls_mean"], seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--api", nargs="+", choices=APIS, default=["loop"],
                        help="how GRPO's episodes run: the built-in tool loop, or the example agent on the OpenAI "
                             "Chat Completions, OpenAI Responses or Anthropic Messages API; several run one after the "
                             "other from the same warm start")
    parser.add_argument("--model", choices=tuple(RECIPES), default="tiny",
                        help="tiny: a 3-layer model with a character tokenizer, built here in seconds (about 6 "
                             "minutes a surface); smollm2: SmolLM2-135M-Instruct, fetched once (about 7 minutes a "
                             "surface, and 7 for its SFT)")
    parser.add_argument("--workdir", type=Path, default=REPO / "runs" / "agent-demo")
    parser.add_argument("--sft-steps", type=int, default=None, help="default: the model's recipe")
    parser.add_argument("--rl-steps", type=int, default=None, help="default: the model's recipe")
    parser.add_argument("--tool-share", type=float, default=None,
                        help="share of the SFT episodes that call the tool (default: the model's recipe)")
    parser.add_argument("--warm-start", type=Path, default=None,
                        help="an SFT model folder from an earlier run of this demo with the same --model, for the "
                             "same kind of episode (the built-in loop's, or the client agents'): skip the SFT step")
    args = parser.parse_args()
    apis = list(dict.fromkeys(args.api))
    if args.warm_start is not None and len({review_of(api) for api in apis}) > 1:
        parser.error("--warm-start serves one kind of episode: the built-in loop's and the client agents' "
                     "conversations differ (the agents end with a check), so run them separately")
    recipe = RECIPES[args.model]
    sft_steps, rl_steps = args.sft_steps or recipe.sft_steps, args.rl_steps or recipe.rl_steps
    tool_share = recipe.tool_share if args.tool_share is None else args.tool_share
    quiet_library_output()
    started = time.monotonic()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    model = build_model(args.model)
    print(f"model: {model}", flush=True)

    warm_starts: dict[str | None, Path] = {}
    outcomes = []
    for api in apis:
        review = review_of(api)
        kind = "loop" if review is None else "agents"
        data = make_tool_task_data(args.workdir / f"data-{args.model}-{kind}", tool_share=tool_share,
                                   phrasing=recipe.phrasing, review=review)
        if review not in warm_starts:
            warm_starts[review] = args.warm_start or warm_start(
                recipe, args.workdir / f"{stamp}-{args.model}-sft-{kind}", model, data["sft"], sft_steps)
        rl_dir = args.workdir / f"{stamp}-{args.model}-grpo-{api}"
        run_started = time.monotonic()
        run_launcher(grpo_command(api, recipe, rl_dir, warm_starts[review], data, rl_steps))
        outcomes.append(Outcome.read(api, rl_dir, time.monotonic() - run_started))
        print(f"metrics: {rl_dir / 'metrics'}", flush=True)
    report(recipe, outcomes, warm_starts, time.monotonic() - started)


def warm_start(recipe: Recipe, run_dir: Path, model: Path, data: Path, steps: int) -> Path:
    run_launcher(sft_command(recipe, run_dir, model, data, steps))
    return run_dir / "final_model"


def build_model(name: str) -> Path:
    if name == "tiny":
        return cached_tiny_model(REPO / ".cache" / "models", MODEL_SPEC)
    from engines.pretrained import SMOLLM2, ModelUnavailable, cached_pretrained

    try:
        return cached_pretrained(SMOLLM2, REPO / ".cache")
    except ModelUnavailable as error:
        raise SystemExit(f"agent demo: {error}\n(or run it on the tiny model, which needs nothing: --model tiny)"
                         ) from None


def report(recipe: Recipe, outcomes: list[Outcome], warm_starts: dict[str | None, Path], seconds: float) -> None:
    print("\n" + "=" * 93)
    print(f"held-out accuracy (greedy, 100 2-digit sums never trained on), {recipe.name}, fully-async GRPO")
    print(_row("episodes through", "before RL", "after RL", "", "tool calls per episode", "GRPO run"))
    for o in outcomes:
        print(_row(SURFACES[o.api], f"{o.before:.1%}", f"{o.after:.1%}", f"({100 * (o.after - o.before):+.1f})",
                   f"{o.calls_first:.2f} -> {o.calls_last:.2f}", f"{o.seconds:.0f}s"))
    print(f"before RL: after the SFT warm start; after RL: step {outcomes[-1].after_step}; tool calls: first and last "
          "training batch")
    for review, path in warm_starts.items():
        print(f"warm start ({'built-in loop' if review is None else 'client agents'}): {path}")
    print(f"total time: {seconds:.0f}s")
    print("=" * 93)


def _row(surface: str, before: str, after: str, change: str, calls: str, seconds: str) -> str:
    return f"{surface:<28}{before:>10}{after:>10}{change:>9}{calls:>26}{seconds:>10}"


if __name__ == "__main__":
    main()
