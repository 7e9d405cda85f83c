"""The smallest inputs the launcher's preflight accepts, for tests that only plan a run (`launcher.prepare`)."""

from __future__ import annotations

from pathlib import Path


def minimal_inputs(directory: Path) -> list[str]:
    """`--hf-checkpoint` and `--prompt-data` flags naming a model folder with a config.json and a one-line prompt
    file under `directory`: enough to plan a run, not to load a model."""
    model, prompts = directory / "model", directory / "prompts.jsonl"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text("{}", encoding="utf-8")
    prompts.write_text('{"input": "1+1=", "label": "2"}\n', encoding="utf-8")
    return ["--hf-checkpoint", str(model), "--prompt-data", str(prompts)]
