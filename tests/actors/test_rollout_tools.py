"""The multi-turn calculator rollout: a real tiny model taught (by SFT, in the test) to call the tool."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from actors.config import build_config
from actors.learner.step import TrainingStep
from actors.rollout.generate import RolloutContext, make_sample
from bus.schema import PromptGroup
from engines.inference.torch_engine import TorchEngine
from engines.training.config import TorchTrainerConfig
from engines.training.torch_trainer import TorchTrainer
from examples.calculator_env import ToolError, calculator_generate, evaluate_arithmetic, run_tool


@pytest.mark.unit
def test_calculator_evaluates_arithmetic_and_refuses_anything_else() -> None:
    assert evaluate_arithmetic("2 + 3 * (4 - 1)") == 11
    assert evaluate_arithmetic("-7 // 2") == -4
    assert run_tool("so <calc>6/3</calc>") == "<result>2</result>"
    for hostile in ("__import__('os').system('true')", "2 ** 999999", "x + 1", "1/0"):
        with pytest.raises(ToolError):
            evaluate_arithmetic(hostile)
    assert run_tool("<calc>open('f')</calc>").startswith("<result>error:")


@pytest.mark.integration
def test_tool_reply_is_in_the_sequence_but_masked_out_of_the_loss(tiny_model_path: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    target = "<calc>2+3</calc><result>5</result>5"
    config = build_config({"hf_checkpoint": str(tiny_model_path), "loss_type": "sft", "lr": 1e-2,
                           "n_samples_per_prompt": 1})
    group = PromptGroup(group_id="g", prompt="2+3=", label="5", n_samples=1)
    prompt_ids = tokenizer(group.prompt)["input_ids"]
    response_ids = tokenizer(target, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    teach = make_sample(group, 0, prompt_ids, response_ids, [0.0] * len(response_ids), [0] * len(response_ids),
                        response=target, status="completed")
    trainer = TorchTrainer(TorchTrainerConfig(model_path=tiny_model_path, lr=1e-2))
    step = TrainingStep(trainer, config)
    for _ in range(150):
        if step.train([teach], staleness=[0]).metrics["loss"] < 0.01:
            break
    trainer.export_hf(tmp_path / "taught")

    async def rollout():
        engine = TorchEngine.from_pretrained(tmp_path / "taught", max_batch_size=4)
        rollout_config = build_config({"hf_checkpoint": str(tiny_model_path), "rollout_max_response_len": 40,
                                       "eval_temperature": 0.0})
        context = RolloutContext(engine=engine, tokenizer=tokenizer, config=rollout_config, worker_id="w")
        try:
            return await calculator_generate(context, PromptGroup(group_id="g", prompt="2+3=", label="5",
                                                                  n_samples=1, is_eval=True))
        finally:
            await engine.close()

    (sample,) = asyncio.run(rollout())
    assert sample.metadata["tool_calls"] == 1
    assert sample.response.startswith("<calc>2+3</calc><result>5</result>")
    reply = tokenizer("<result>5</result>", add_special_tokens=False)["input_ids"]
    called = len(tokenizer("<calc>2+3</calc>", add_special_tokens=False)["input_ids"])
    mask = sample.loss_mask.tolist()
    assert mask[:called] == [1] * called
    assert mask[called:called + len(reply)] == [0] * len(reply)
    assert all(m == 1 for m in mask[called + len(reply):])
    response_tokens = sample.tokens[sample.prompt_tokens:].tolist()
    assert response_tokens[called:called + len(reply)] == reply
