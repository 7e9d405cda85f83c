"""Several policies in one run (actors.config.policies): each policy's settings are the run's with its own on top,
what the policies share is refused per policy, and a policy's actors find their own policy's peers."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from actors.config import RunConfig
from actors.config.flags import add_config_flags, config_from_args
from actors.config.policies import own_engine_workers, scoped_actor_id, served_elsewhere, sharing_engines
from actors.config.preflight import preflight
from actors.config.run import policy_names, policy_run_config
from actors.controller.policy_table import PolicyTable
from actors.launch.policy_join import joining_roles, with_joining_policy
from actors.launch.policy_scopes import role_actors
from actors.runtime.peers import alive_members, engine_members
from bus.schema import Member

pytestmark = pytest.mark.unit

TWO = {"solver": {"lr": 1e-4, "max_staleness": 3, "advantage_estimator": "rloo"},
       "proposer": {"prompt_data": "propose.jsonl", "rollout_temperature": 0.7}}


def test_each_policy_reads_the_runs_settings_with_its_own_on_top() -> None:
    config = RunConfig(lora_rank=4, lr=1e-5, max_staleness=1, policies=TWO)
    solver, proposer = policy_run_config(config, "solver"), policy_run_config(config, "proposer")

    assert policy_names(config) == ("solver", "proposer")
    assert (solver.trainer.lr, solver.buffer.max_staleness, solver.policy.advantage_estimator) == (1e-4, 3, "rloo")
    assert (proposer.trainer.lr, proposer.buffer.max_staleness, proposer.policy.advantage_estimator) == (
        1e-5, 1, "grpo")
    assert proposer.data.prompt_data == "propose.jsonl" and proposer.rollout.rollout_temperature == 0.7
    assert solver.lora.lora_rank == proposer.lora.lora_rank == 4  # shared: one adapter shape on shared engines
    assert solver.policies == {} and config.trainer.lr == 1e-5  # the run's own settings are untouched


def test_a_run_of_one_unnamed_policy_keeps_its_actor_ids() -> None:
    assert policy_names(RunConfig()) == ()
    assert scoped_actor_id("learner", None) == "learner"
    assert scoped_actor_id("learner", "solver") == "learner@solver"
    with pytest.raises(KeyError, match="'judge' is not one of the run's policies"):
        policy_run_config(RunConfig(lora_rank=4, policies=TWO), "judge")


@pytest.mark.parametrize(("settings", "expected"), [
    ({"policies": TWO}, "share the base model's engines as LoRA adapters: set --lora-rank"),
    ({"lora_rank": 4, "rollout_engine": "mypkg.engines:make_engine", "policies": TWO},
     "--rollout-engine mypkg.engines:make_engine does not serve several named adapters at once; torch engines or "
     "SGLang servers do"),
    ({"lora_rank": 4, "colocate": True, "policies": TWO}, "policies with --colocate"),
    ({"lora_rank": 4, "learner_ranks": 2, "policies": TWO}, "each policy's learner is one rank for now"),
    ({"lora_rank": 4, "policies": {"Solver B": {}}}, "name 'Solver B' must be lower-case letters"),
    ({"lora_rank": 4, "policies": {"a": {"hf_checkpoint": "other"}}},
     "policies.a.hf_checkpoint: shared by every policy (the model section"),
    ({"lora_rank": 4, "policies": {"a": {"learner_ranks": 2}}}, "policies.a.learner_ranks: shared by every policy"),
    ({"lora_rank": 4, "policies": {"a": {"custom_generate_function_path": "m:f"}}},
     "the shared rollout workers run one generate function for every policy"),
    ({"lora_rank": 4, "rollout_function_path": "m:f", "policies": TWO},
     "policies with --rollout-function-path: a whole-rollout function leases and sends for one policy"),
    ({"lora_rank": 4, "policies": {"a": {"trainer": {"lr": 1}}}}, "policies.a.trainer: a section name"),
    ({"lora_rank": 4, "policies": {"a": {"lrr": 1}}}, "policies.a.lrr: not a setting"),
    ({"lora_rank": 4, "policies": {"a": {"lr": -1}}}, "policies.a.lr: Input should be greater than or equal to 0"),
    ({"lora_rank": 4, "policies": {"a": {"min_lr": 1.0}}}, "policies.a: min_lr 1.0 must be in [0, lr=0.0001]"),
    ({"lora_rank": 4, "policies": {"a": {"advantage_estimator": "nope"}}},
     "policies.a.advantage_estimator: unknown advantage estimator 'nope'"),
    ({"lora_rank": 4, "policies": {"a": {"rollout_engine": "sglang"}}},
     "policies.a.rollout_engine: shared by every policy (the engine section: one base model on shared engines); set "
     "it for the whole run (or give the policy engines of its own: own_engines: true)"),
    ({"lora_rank": 4, "own_engines": 1, "policies": TWO}, "own_engines 1 for the whole run: a policy's setting"),
    ({"policies": {"a": {}, "b": {"own_engines": True}}},
     "policies (a) share the base model's engines as LoRA adapters: set --lora-rank"),
    ({"lora_rank": 4, "policies": {"a": {"own_engines": 1, "learner_ranks": 2}}},
     "policies.a.learner_ranks: shared by every policy"),
    ({"lora_rank": 4, "policies": {"a": {"own_engines": 1, "agent_function_path": "m:f"}}},
     "policies.a.agent_function_path: shared by every policy"),
    ({"lora_rank": 4, "policies": {"a": {"own_engines": -1}}},
     "policies.a.own_engines: Input should be greater than or equal to 0"),
])
def test_a_policy_setting_that_cannot_be_is_refused_naming_the_policy_and_setting(settings: dict,
                                                                                  expected: str) -> None:
    with pytest.raises(ValueError) as refused:
        RunConfig(**settings)
    assert expected in str(refused.value)


def test_policies_come_from_the_yaml_file_beside_flat_settings(tmp_path: Path) -> None:
    run_yaml = tmp_path / "run.yaml"
    settings = {"lora_rank": 4, "lr": 2e-5, "policies": TWO}
    run_yaml.write_text(yaml.safe_dump(settings, sort_keys=False), encoding="utf-8")
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    config = config_from_args(parser.parse_args(["--config", str(run_yaml)]))

    assert policy_names(config) == ("solver", "proposer")
    assert policy_run_config(config, "proposer").trainer.lr == 2e-5


def test_a_policys_actors_find_their_own_policys_members_and_shared_ones_name_one() -> None:
    def member(actor_id: str, role: str, policy: str | None = None) -> Member:
        return Member(actor_id=actor_id, role=role, node="n", pid=1, endpoints={}, policy=policy)

    roster = {m.actor_id: m for m in (member("buffer@solver", "buffer", "solver"),
                                      member("buffer@proposer", "buffer", "proposer"),
                                      member("rollout-0-0", "rollout"))}
    assert [m.actor_id for m in alive_members(roster, "buffer", "solver")] == ["buffer@solver"]
    assert [m.actor_id for m in alive_members(roster, "buffer")] == ["buffer@proposer", "buffer@solver"]
    assert [m.actor_id for m in alive_members(roster, "rollout")] == ["rollout-0-0"]


def test_a_policy_with_engines_of_its_own_sets_its_model_engines_and_lora_and_the_others_share() -> None:
    own = {"own_engines": 2, "hf_checkpoint": "solver-1.5b", "lora_rank": 0, "rollout_max_batch_size": 8,
           "custom_generate_function_path": "m:f", "lr": 1e-5}
    config = RunConfig(lora_rank=4, policies={"proposer": {"lr": 1e-4}, "solver": own})
    solver, proposer = policy_run_config(config, "solver"), policy_run_config(config, "proposer")

    assert (solver.engine.own_engines, solver.model.hf_checkpoint, solver.lora.enabled) == (2, "solver-1.5b", False)
    assert solver.engine.rollout_max_batch_size == 8 and solver.rollout.custom_generate_function_path == "m:f"
    assert (proposer.engine.own_engines, proposer.lora.lora_rank) == (0, 4)  # an adapter on the run's engines
    assert sharing_engines(config.policies) == {"proposer": {"lr": 1e-4}}
    assert own_engine_workers({"own_engines": True}) == 1 and own_engine_workers({"lr": 1}) == 0
    # every policy on engines of its own: the run itself needs no adapter
    RunConfig(policies={"a": {"own_engines": True}, "b": {"own_engines": 1, "lora_rank": 8}})
    # what an episode calling a policy its engine does not serve is told, from either side
    assert served_elsewhere(config.policies, ["proposer"], own_engine=False) == {
        "solver": "on engines of its own (own_engines)"}
    assert served_elsewhere(config.policies, ["solver"], own_engine=True) == {
        "proposer": "on the run's shared engines"}
    assert served_elsewhere(config.policies, [], own_engine=False) == {
        "proposer": "nowhere now: it left the run", "solver": "on engines of its own (own_engines)"}


def test_a_policys_own_rollout_workers_start_on_the_head_as_its_actors_and_the_shared_ones_where_needed() -> None:
    config = RunConfig(lora_rank=4, policies={"proposer": {}, "solver": {"own_engines": 2}})
    found = role_actors("rollout", 1, config, Path("run"), head=True)
    ids = [scope.actor_id(f"rollout-0-{index}") for index, scope in found]

    assert ids == ["rollout-0-0", "rollout-0-0@solver", "rollout-0-1@solver"]
    assert [scope.run_dir for _, scope in found][1:] == [Path("run/policies/solver")] * 2
    assert found[1][1].config.engine.own_engines == 2 and found[0][1].config.policies == config.policies
    assert [scope.actor_id("rollout-1-0") for _, scope in role_actors("rollout", 1, config, Path(), head=False)] == [
        "rollout-1-0"]  # another node runs the shared workers only
    alone = RunConfig(policies={"solver": {"own_engines": 1}})
    assert [scope.policy for _, scope in role_actors("rollout", 1, alone, Path(), head=True)] == ["solver"]
    assert [scope.policy for _, scope in role_actors("learner", 1, config, Path(), head=True)] == [
        "proposer", "solver"]


def test_a_policy_joining_with_engines_of_its_own_starts_them_on_its_node_and_alone_is_refused(tmp_path: Path) -> None:
    """The joining launcher's node runs the policy's actors and, for one with engines of its own, its rollout workers,
    named as the head names a declared policy's, each loading the policy's own checkpoint; the shared workers are
    not its to start."""
    own = {"own_engines": 2, "hf_checkpoint": "solver-1.5b", "lora_rank": 0}
    config = with_joining_policy(RunConfig(lora_rank=4, policies={"proposer": {}}), "solver", own)
    assert joining_roles(config, "solver") == {"buffer": 1, "learner": 1, "rollout": 2}
    assert joining_roles(config, "proposer") == {"buffer": 1, "learner": 1}  # on the run's engines
    found = role_actors("rollout", 2, config, Path("run"), head=False, joining="solver")
    assert [scope.actor_id(f"rollout-0-{index}") for index, scope in found] == ["rollout-0-0@solver",
                                                                                "rollout-0-1@solver"]
    assert {(scope.run_dir, scope.config.model.hf_checkpoint, scope.config.lora.enabled) for _, scope in found} == {
        (Path("run/policies/solver"), "solver-1.5b", False)}
    assert role_actors("rollout", 1, config, Path(), head=False, joining="proposer") == []
    assert [scope.policy for _, scope in role_actors("learner", 1, config, Path(), head=False, joining="solver")] == [
        "solver"]
    assert PolicyTable(RunConfig(lora_rank=4, policies={"proposer": {}}), tmp_path, None).join("solver", own)
    assert preflight(RunConfig(own_engines=1), {})[0].startswith(
        "own_engines 1: a setting of a policy in a run of several (policies.NAME.own_engines)")


def test_a_learner_finds_the_engines_it_pushes_to_by_whose_they_are() -> None:
    def member(actor_id: str, policy: str | None = None) -> Member:
        return Member(actor_id=actor_id, role="rollout", node="n", pid=1, endpoints={}, policy=policy)

    roster = {m.actor_id: m for m in (member("rollout-0-0"), member("rollout-0-0@solver", "solver"),
                                      member("rollout-0-1@solver", "solver"))}
    assert [m.actor_id for m in engine_members(roster, None)] == ["rollout-0-0"]
    assert [m.actor_id for m in engine_members(roster, "solver")] == ["rollout-0-0@solver", "rollout-0-1@solver"]
