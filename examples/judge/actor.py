"""An LLM judge as an actor of its own: `--custom-actor judge=examples.judge.actor:Judge`, `--judge-workers N`.

The judge loads a Hugging Face causal LM once and answers `score(prompt, response, label)` with the probability
the model gives "yes" rather than "no" when asked whether the response is right: the log-likelihood of each answer
after a judging prompt, normalised over the two. Calls that arrive together are scored in one forward pass, so a
judge under load serves a batch per pass, not one call at a time. Every verdict is appended to
RUN_DIR/judge/ACTOR_ID.jsonl: what the judge saw and said, to read when a reward looks wrong.

Its settings come from the environment the launcher was started in, which every actor inherits (the launcher has
no flags for a custom actor's own settings):

- JUDGE_MODEL: an HF model folder or hub id (required);
- JUDGE_DEVICE: where the model runs, default "cpu" ("cuda:0" on a node whose GPU no learner or engine holds);
- JUDGE_MAX_BATCH: calls scored in one forward pass at most, default 8.

A setting it cannot work with is a ConfigError: the run fails with the reason instead of restarting the judge.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from actors.plugins import Actor, ConfigError, method

JUDGING_PROMPT = ("Grade the answer to the question.\n\nQuestion: {prompt}\n{reference}Answer: {response}\n\n"
                  "Is the answer correct? Reply with yes or no.")


@dataclass(frozen=True)
class JudgeSettings:
    model: str
    device: str = "cpu"
    max_batch: int = 8

    @classmethod
    def from_environment(cls) -> JudgeSettings:
        model = os.environ.get("JUDGE_MODEL", "").strip()
        if not model:
            raise ConfigError("JUDGE_MODEL is not set: the judge needs a Hugging Face causal LM, a folder or a hub "
                              "id (JUDGE_MODEL=HuggingFaceTB/SmolLM2-135M-Instruct python launcher.py ...)")
        max_batch = os.environ.get("JUDGE_MAX_BATCH", "8")
        if not max_batch.isdigit() or int(max_batch) < 1:
            raise ConfigError(f"JUDGE_MAX_BATCH={max_batch!r}: expected a whole number >= 1")
        return cls(model=model, device=os.environ.get("JUDGE_DEVICE", "cpu"), max_batch=int(max_batch))


class YesNoScorer:
    """P("yes") against P("no") as the answer to a judging prompt, for a batch of prompts in one forward pass."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.chat = bool(getattr(tokenizer, "chat_template", None))
        # After a chat template's assistant header the answer starts a turn; after plain text it is a next word.
        self.answers = [self._ids(word if self.chat else " " + word) for word in ("yes", "no")]
        if self.answers[0] == self.answers[1]:
            raise ConfigError("the judge model's tokenizer spells 'yes' and 'no' alike")
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    @classmethod
    def load(cls, name: str, device: str) -> YesNoScorer:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(name)
            model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32).to(device).eval()
        except (OSError, ValueError, RuntimeError) as error:
            raise ConfigError(f"JUDGE_MODEL={name} (JUDGE_DEVICE={device}): cannot load it as a Hugging Face causal "
                              f"LM: {error}") from None
        return cls(model, tokenizer)

    def prompt_ids(self, prompt: str, response: str, label: Any = None) -> list[int]:
        reference = f"Reference answer: {label}\n" if label not in (None, "") else ""
        text = JUDGING_PROMPT.format(prompt=prompt, reference=reference, response=response)
        if self.chat:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                      add_generation_prompt=True)
            return self._ids(text)
        return list(self.tokenizer(text + "\n", add_special_tokens=True)["input_ids"])

    @torch.inference_mode()
    def yes_probabilities(self, prompts: list[list[int]]) -> list[float]:
        """One P("yes") per prompt (token ids from `prompt_ids`). Each prompt is followed by each answer; the rows
        are left-padded, so every answer ends at the last position and only the last few positions' logits are
        computed, not a vocabulary-wide row per token of every prompt."""
        rows = [prompt + answer for prompt in prompts for answer in self.answers]
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for index, row in enumerate(rows):
            ids[index, width - len(row):] = torch.tensor(row)
            mask[index, width - len(row):] = 1
        longest = max(map(len, self.answers))
        device = self.model.device
        logits = self.model(input_ids=ids.to(device), attention_mask=mask.to(device),
                            position_ids=(mask.cumsum(-1) - 1).clamp(min=0).to(device),
                            logits_to_keep=longest + 1).logits
        log_probs = logits.float().log_softmax(-1).cpu()  # position j predicts the token at j + 1
        totals = []
        for index in range(len(rows)):
            answer = self.answers[index % 2]
            predicted = log_probs[index, longest - len(answer):longest]
            totals.append(predicted.gather(-1, torch.tensor(answer).unsqueeze(-1)).sum())
        return torch.stack(totals).view(-1, 2).softmax(-1)[:, 0].tolist()

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


class Judge(Actor):
    """Serves `score`; a background task scores what is waiting, a batch per forward pass."""

    async def on_start(self) -> None:
        settings = JudgeSettings.from_environment()
        self.scorer = await asyncio.to_thread(YesNoScorer.load, settings.model, settings.device)
        self.waiting: asyncio.Queue[tuple[list[int], asyncio.Future[float]]] = asyncio.Queue()
        self.verdicts = self.context.run_dir / "judge" / f"{self.actor_id}.jsonl"
        self.verdicts.parent.mkdir(parents=True, exist_ok=True)
        self.spawn(self.score_waiting(settings.max_batch), name=f"{self.actor_id}.score")

    @method
    async def score(self, prompt: str, response: str, label: Any = None) -> float:
        """The probability that `response` answers `prompt` correctly (given the reference `label`, if any)."""
        verdict: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self.waiting.put_nowait((self.scorer.prompt_ids(prompt, response, label), verdict))
        p_yes = await verdict
        self.counters["judge.verdicts"] += 1
        with self.verdicts.open("a", encoding="utf-8") as ledger:
            ledger.write(json.dumps({"prompt": prompt, "response": response, "label": label, "p_yes": p_yes}) + "\n")
        return p_yes

    async def score_waiting(self, max_batch: int) -> None:
        while True:
            batch = [await self.waiting.get()]
            while len(batch) < max_batch and not self.waiting.empty():
                batch.append(self.waiting.get_nowait())
            try:  # in a thread: the heartbeat and the next calls go on meanwhile
                p_yes = await asyncio.to_thread(self.scorer.yes_probabilities, [ids for ids, _ in batch])
            except Exception as error:  # the callers' ActorCallError says what went wrong; the judge goes on
                self.counters["judge.failed_batches"] += 1
                for _, verdict in batch:
                    if not verdict.done():  # done: its call was cancelled (the judge is stopping)
                        verdict.set_exception(error)
                continue
            self.counters["judge.batches"] += 1
            for (_, verdict), value in zip(batch, p_yes, strict=True):
                if not verdict.done():
                    verdict.set_result(value)
