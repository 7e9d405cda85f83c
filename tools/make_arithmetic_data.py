"""Make the demos' verifiable tasks locally: integer addition prompts with their answers, as JSONL.

`python -m tools.make_arithmetic_data OUT_DIR --max-operand 49` writes train.jsonl, eval.jsonl (held-out
operand pairs never seen in training) and sft.jsonl (a small labelled subset for the warm start). Each line is
`{"input": "12+7=", "label": "19"}`: the tiny model's task, scored by an exact match of the response.

`--style question` writes what a chat model is asked instead: `{"input": "What is 47 + 8? Answer with just the
number.", "label": "55"}` for every two-digit number plus a one-digit one (`--second-operand two-digit`: both of two
digits), with held-out pairs in eval.jsonl; the run wraps it in the model's chat template (`--apply-chat-template`)
and scores it with `--rm-type final_number`.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any


def addition_problems(max_operand: int) -> list[dict[str, str]]:
    return [{"input": f"{a}+{b}=", "label": str(a + b)}
            for a in range(max_operand + 1) for b in range(max_operand + 1)]


ONE_DIGIT, TWO_DIGITS = range(1, 10), range(10, 100)
SECOND_OPERANDS = {"one-digit": ONE_DIGIT, "two-digit": TWO_DIGITS}


def sum_questions(first: range = TWO_DIGITS, second: range = ONE_DIGIT) -> list[dict[str, str]]:
    return [{"input": f"What is {a} + {b}? Answer with just the number.", "label": str(a + b)}
            for a in first for b in second]


WORD_PROBLEM_NAMES = ("Tom", "Anna", "Lee", "Maria", "Sam", "Nina", "Omar", "Julia")
WORD_PROBLEM_ITEMS = ("apples", "books", "marbles", "stickers", "pencils", "cookies", "shells", "cards")


def word_problems(seed: int = 0) -> list[dict[str, str]]:
    """One-step word problems the model is asked to reason through before it answers (its answers run to 100-190
    tokens): every pair of a in 10..59 and b in 2..9, each told of its own person and things."""
    rng = random.Random(seed)
    problems = []
    for a in range(10, 60):
        for b in range(2, 10):
            name, item = rng.choice(WORD_PROBLEM_NAMES), rng.choice(WORD_PROBLEM_ITEMS)
            problems.append({"input": f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have "
                                      "now? Explain your reasoning, then give the final answer.",
                             "label": str(a + b)})
    return problems


# Each change as a phrase (what the problem says, what the working says) and its sign; the numbers changed are
# 2..9, and the running count stays in 10..99.
STEP_CHANGES = (("buys {n} more", "buys {n} more {item}", 1), ("finds {n} more", "finds {n} more {item}", 1),
                ("gets {n} more from a friend", "gets {n} more {item} from a friend", 1),
                ("gives {n} away", "gives {n} {item} away", -1), ("loses {n}", "loses {n} {item}", -1),
                ("uses {n}", "uses {n} {item}", -1))


def multi_step_problems(count: int = 1200, *, steps: range = range(4, 7), seed: int = 0) -> list[dict[str, Any]]:
    """Word problems of 4-6 changes to a count, to be worked one sentence per change (`--rm-type worked_steps`).

    The label is the chain of running counts, the last the answer; `solution` is the working written out, one line
    a step, for an SFT warm start (SmolLM2-135M asked cold states a right running count in 2 of 96 samples, 1 of 64
    with a worked example in the prompt). Every count differs from every number in the prompt and from the others,
    so a sentence's result says unambiguously which step (if any) it states. Each problem is new (its start and
    changes), so held-out problems are never seen in training."""
    rng = random.Random(seed)
    problems: list[dict[str, Any]] = []
    seen: set[tuple[int, ...]] = set()
    while len(problems) < count:
        start, changes = rng.randint(10, 59), []
        counts = [start]
        for _ in range(rng.choice(steps)):
            told, worked, sign = rng.choice(STEP_CHANGES)
            amount = rng.randint(2, 9)
            changes.append((told, worked, sign, amount))
            counts.append(counts[-1] + sign * amount)
        key = (start, *counts[1:])
        if key in seen or len(set(counts)) < len(counts) or {start, *(c[3] for c in changes)} & set(counts[1:]) \
                or min(counts) < 10:
            continue
        seen.add(key)
        name, item = rng.choice(WORD_PROBLEM_NAMES), rng.choice(WORD_PROBLEM_ITEMS)
        story = ", then ".join(told.format(n=amount) for told, _, _, amount in changes)
        numbered = enumerate(zip(changes, counts, counts[1:], strict=False), 1)
        lines = [f"Step {i}: {name} {worked.format(n=amount, item=item)}. {name} had {before} {item}, and {before} "
                 f"{'+' if sign > 0 else '-'} {amount} = {after}, so now {name} has {after} {item}."
                 for i, ((_, worked, sign, amount), before, after) in numbered]
        problems.append({"input": f"{name} has {start} {item}. {name} {story}. How many {item} does {name} have "
                                  f"now? Work it out one step per change: after each change, say how many {item} "
                                  f"{name} has then. Then give the final answer.",
                         "label": counts[1:], "solution": "\n".join([*lines, f"The final answer is {counts[-1]}."])})
    return problems


def make_multi_step_problems(out_dir: Path, *, eval_size: int = 100, sft_size: int = 480,
                             seed: int = 0) -> dict[str, Path]:
    """train.jsonl and eval.jsonl of multi-step word problems (`multi_step_problems`), and sft.jsonl: the first
    `sft_size` training problems with their worked solutions as the label (the warm start's targets)."""
    paths = _split(multi_step_problems(seed=seed), out_dir, eval_size=eval_size, seed=seed)
    train = [json.loads(line) for line in paths["train"].read_text(encoding="utf-8").splitlines()]
    paths["sft"] = out_dir / "sft.jsonl"
    write_jsonl(paths["sft"], [{"input": p["input"], "label": p["solution"]} for p in train[:sft_size]])
    return paths


def make_word_problems(out_dir: Path, *, eval_size: int = 100, seed: int = 0) -> dict[str, Path]:
    """train.jsonl and eval.jsonl of word problems; the eval pairs of numbers never appear in training."""
    return _split(word_problems(seed), out_dir, eval_size=eval_size, seed=seed)


def make_sum_questions(out_dir: Path, *, second: range = ONE_DIGIT, eval_size: int = 100,
                       seed: int = 0) -> dict[str, Path]:
    """train.jsonl and eval.jsonl of a two-digit number plus `second`; the eval pairs never appear in training."""
    return _split(sum_questions(TWO_DIGITS, second), out_dir, eval_size=eval_size, seed=seed)


def make_two_digit_sum_questions(out_dir: Path, *, eval_size: int = 100, seed: int = 0) -> dict[str, Path]:
    """Both operands of two digits: SmolLM2's carries in the tens hold it near 75% after RL (docs/real-model.md)."""
    return make_sum_questions(out_dir, second=TWO_DIGITS, eval_size=eval_size, seed=seed)


def _split(questions: list[dict[str, Any]], out_dir: Path, *, eval_size: int, seed: int) -> dict[str, Path]:
    """One question per pair of numbers: the first `eval_size` of a shuffle are held out."""
    questions = list(questions)
    random.Random(seed).shuffle(questions)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"train": out_dir / "train.jsonl", "eval": out_dir / "eval.jsonl"}
    write_jsonl(paths["eval"], questions[:eval_size])
    write_jsonl(paths["train"], questions[eval_size:])
    return paths


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def make_arithmetic_data(out_dir: Path, *, max_operand: int = 49, eval_size: int = 200, sft_size: int = 600,
                         seed: int = 0) -> dict[str, Path]:
    problems = addition_problems(max_operand)
    random.Random(seed).shuffle(problems)
    held_out, train = problems[:eval_size], problems[eval_size:]
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"train": out_dir / "train.jsonl", "eval": out_dir / "eval.jsonl", "sft": out_dir / "sft.jsonl"}
    write_jsonl(paths["train"], train)
    write_jsonl(paths["eval"], held_out)
    write_jsonl(paths["sft"], train[:sft_size])
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--max-operand", type=int, default=49)
    parser.add_argument("--eval-size", type=int, default=200)
    parser.add_argument("--sft-size", type=int, default=600)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--style", choices=("equation", "question", "word", "steps"), default="equation",
                        help="equation: '12+7=' for the tiny model; question: chat questions of sums; "
                             "word: word problems to reason through; steps: word problems of 4-6 changes, "
                             "worked one sentence per change (--rm-type worked_steps)")
    parser.add_argument("--second-operand", choices=tuple(SECOND_OPERANDS), default="one-digit",
                        help="with --style question: the second number's digits (the first has two)")
    args = parser.parse_args()
    if args.style == "question":
        paths = make_sum_questions(args.out_dir, second=SECOND_OPERANDS[args.second_operand],
                                   eval_size=args.eval_size, seed=args.seed)
    elif args.style == "steps":
        paths = make_multi_step_problems(args.out_dir, eval_size=args.eval_size, seed=args.seed)
    elif args.style == "word":
        paths = make_word_problems(args.out_dir, eval_size=args.eval_size, seed=args.seed)
    else:
        paths = make_arithmetic_data(args.out_dir, max_operand=args.max_operand, eval_size=args.eval_size,
                                     sft_size=args.sft_size, seed=args.seed)
    for name, path in paths.items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
