"""A teacher for distillation tests: the tiny student fine-tuned on the task, so it is far from the student."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch


def taught_teacher(student: Path, out: Path, *, steps: int = 40) -> Path:
    """`student` fine-tuned to answer "i+i=" with 2i and stop, saved at `out` with the student's tokenizer: a
    teacher that knows the task, far from the random student (a sampled reverse KL of ~8 nats per token)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shutil.copytree(student, out, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(student)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(student)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    examples = []
    for i in range(10):
        prompt = tokenizer(f"{i}+{i}=")["input_ids"]
        ids = torch.tensor([prompt + tokenizer(f"{2 * i}{tokenizer.eos_token}")["input_ids"]])
        labels = ids.clone()
        labels[0, :len(prompt)] = -100
        examples.append((ids, labels))
    for _ in range(steps):
        loss = sum(model(ids, labels=labels).loss for ids, labels in examples) / len(examples)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(out)
    return out
