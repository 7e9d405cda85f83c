"""examples/policies/proposer_solver: its config is a valid run of two policies, its episode puts the proposer's
question to the solver as a group of the solver's own and grades the answers, and the proposer's reward peaks at
questions the solver gets right half the time."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from actors.config import RunConfig
from actors.config.flags import add_config_flags, config_from_args
from actors.config.run import policy_names, policy_run_config
from actors.rollout.generate import RolloutContext
from actors.rollout.lanes import AdapterEngine
from bus.schema import PromptGroup
from engines.inference import TorchEngine
from examples.policies.proposer_solver import edge_of_ability, question_of, solve
from policies.rewards import RewardInput

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.unit
def test_the_example_config_is_a_run_of_a_proposer_and_a_solver_each_with_its_own_reward() -> None:
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    config = config_from_args(parser.parse_args(["--config", str(REPO / "examples/policies/proposer_solver.yaml"),
                                                 "--hf-checkpoint", "MODEL"]))
    assert policy_names(config) == ("proposer", "solver")
    assert config.rollout.custom_generate_function_path == "examples.policies.proposer_solver:episode"
    proposer, solver = (policy_run_config(config, name) for name in ("proposer", "solver"))
    assert proposer.reward.custom_rm_path == "examples.policies.proposer_solver:edge_of_ability"
    assert (solver.reward.rm_type, solver.reward.custom_rm_path) == ("final_number", None)


@pytest.mark.unit
def test_the_proposer_is_rewarded_most_for_questions_at_the_edge_of_the_solvers_ability() -> None:
    assert question_of("Sure! What is 37 + 45? Good luck.") == (37, 45) and question_of("37 plus 45") is None
    rewards = [edge_of_ability(RewardInput(prompt="", response="", metadata={"solve_rate": rate}))
               for rate in (0.0, 0.25, 0.5, 1.0)]
    assert rewards == pytest.approx([0.2, 0.8, 1.0, 0.2])
    assert edge_of_ability(RewardInput(prompt="", response="")) == 0.0  # no question written


@pytest.mark.integration
async def test_a_proposers_question_goes_to_the_solver_as_a_group_of_its_own_graded(tiny_model_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    engine = TorchEngine(model, None, adapters=("proposer", "solver"))  # type: ignore[arg-type]
    configs = {name: RunConfig(hf_checkpoint="unused", n_samples_per_prompt=3, rollout_max_response_len=4)
               for name in ("proposer", "solver")}
    context = RolloutContext(engine=AdapterEngine(engine, "proposer"),
                             tokenizer=AutoTokenizer.from_pretrained(tiny_model_path), config=configs["proposer"],
                             worker_id="rollout-0-0", policy="proposer",
                             policy_engines={name: AdapterEngine(engine, name) for name in configs},
                             policy_configs=configs)
    group = PromptGroup(group_id="0:1", prompt="Write an addition question.", n_samples=3)
    try:
        answers, rate = await solve(context, group, "0", 12, 30)
    finally:
        await engine.close()
    assert [answer.group_id for answer in answers] == ["0:1@solver.0"] * 3
    assert answers[0].prompt == "What is 12 + 30? Answer with just the number." and answers[0].label == "42"
    right = [answer.response.strip() == "42" for answer in answers]  # the tiny model's answers are not 42
    assert rate == sum(right) / 3
