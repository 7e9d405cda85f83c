"""A search-augmented generate in slime's style (search-r1-like), over a local in-memory corpus.

Retrieve first: the question's best passages come back as ``<information>...</information>`` (loss mask 0), then
the model answers; whenever it writes ``<search>query</search>`` it gets another ``<information>`` block, up to
``MAX_SEARCHES``. Run with ``--custom-generate-function-path examples.slime_style.search_generate:generate``.
The corpus is a dataset field (``metadata["corpus"]``: a list of passages) or, without one, ``CORPUS`` below.

Written as a slime plugin; it imports ``Sample`` and ``GenerateState`` from ``actors.slime_compat``, where slime's
``slime.*`` import lines would load the same classes (`actors.slime_compat.imports`).
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from actors.slime_compat import GenerateState, Sample
from examples.slime_style.turns import append_observation, model_turn, prompt_ids

MAX_SEARCHES = 2
TOP_K = 1
SEARCH = re.compile(r"<search>(.*?)</search>", re.DOTALL)
CORPUS = (
    "Addition combines two numbers into their sum.",
    "The sum of two single-digit numbers is at most 18.",
    "Adding zero to a number leaves it unchanged.",
)


def retrieve(query: str, corpus: list[str] | tuple[str, ...], k: int = TOP_K) -> list[str]:
    """The ``k`` passages sharing the most words (and digits) with ``query``; ties keep corpus order."""
    words = Counter(re.findall(r"\w+", query.lower()))
    scored = [(sum(min(words[w], c) for w, c in Counter(re.findall(r"\w+", p.lower())).items()), -i, p)
              for i, p in enumerate(corpus)]
    return [p for _, _, p in sorted(scored, reverse=True)[:k]]


def information(query: str, corpus: list[str] | tuple[str, ...]) -> str:
    return "<information>" + " ".join(retrieve(query, corpus)) + "</information>"


async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    state = GenerateState(args)
    corpus = sample.metadata.get("corpus") or CORPUS
    question = sample.prompt if isinstance(sample.prompt, str) else str(sample.prompt[-1]["content"])
    if not sample.tokens:
        sample.tokens = prompt_ids(state.tokenizer, sample.prompt)
    append_observation(args, sample, state.tokenizer, information(question, corpus))
    budget = sampling_params["max_new_tokens"]
    for searches in range(MAX_SEARCHES + 1):
        remaining = budget - sample.response_length
        if remaining <= 0:
            sample.status = Sample.Status.TRUNCATED
            break
        text = await model_turn(args, sample, {**sampling_params, "stop": ["</search>"]}, remaining)
        match = SEARCH.search(text if text.rstrip().endswith("</search>") else text + "</search>")
        if sample.status == Sample.Status.ABORTED or match is None or searches == MAX_SEARCHES:
            break
        append_observation(args, sample, state.tokenizer, information(match.group(1), corpus))
    return sample
