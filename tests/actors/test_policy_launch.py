"""The head of a run of several policies (actors.config.policies) starts each policy's buffer, learner and evaluator
with the policy's settings in the policy's own run directory, and the shared actors once with the whole run's."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

import launcher
from actors.config import RunConfig
from actors.config.run import policy_run_config
from actors.launch import node_roles
from actors.launch.policy_join import joining_roles, with_joining_policy
from actors.launch.supervisor import Supervisor
from actors.runtime.context import ActorContext
from actors.runtime.cpu_budget import CpuShare, describe_cpu_budget, plan_cpu_budget
from tests.support.launch_inputs import minimal_inputs

pytestmark = pytest.mark.unit


def two_policies(tmp_path: Path) -> Path:
    """A run file of two policies on the tiny inputs: `solver` with its own prompts and learning rate, `proposer`
    with its own prompts and an eval set (so only it has an evaluator)."""
    for name in ("solve", "propose", "held"):
        (tmp_path / f"{name}.jsonl").write_text('{"input": "1+1=", "label": "2"}\n', encoding="utf-8")
    run_file = tmp_path / "run.yaml"
    run_file.write_text(yaml.safe_dump({"lora_rank": 4, "lr": 1e-5, "policies": {
        "solver": {"prompt_data": str(tmp_path / "solve.jsonl"), "lr": 3e-4},
        "proposer": {"prompt_data": str(tmp_path / "propose.jsonl"), "eval_interval": 2,
                     "eval_prompt_data": ["held", str(tmp_path / "held.jsonl")]},
    }}, sort_keys=False), encoding="utf-8")
    return run_file


def prepare(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *flags: str, cores: tuple[int, ...] = (0, 1),
            ) -> tuple[dict[str, ActorContext], Path]:
    monkeypatch.setattr(node_roles, "visible_gpus", lambda: 0)
    monkeypatch.setattr(launcher, "usable_cores", lambda: cores)
    contexts, _, run_dir = launcher.prepare(["--head", "--run-dir", str(tmp_path / "run"), *minimal_inputs(tmp_path),
                                             *flags])
    return {context.actor_id: context for context in contexts}, run_dir


def test_each_policy_gets_its_own_buffer_learner_and_evaluator_with_its_settings_and_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    actors, run_dir = prepare(tmp_path, monkeypatch, "--config", str(two_policies(tmp_path)))
    run = actors["controller"].settings.run

    assert list(actors) == ["controller", "buffer@solver", "buffer@proposer", "evaluator@proposer", "learner@solver",
                            "learner@proposer", "rollout-0-0", "reward-0-0"]
    for policy in ("solver", "proposer"):
        own = policy_run_config(run, policy)
        for role in ("buffer", "learner"):
            actor = actors[f"{role}@{policy}"]
            assert (actor.role, actor.policy, actor.run_dir) == (role, policy, run_dir / "policies" / policy)
            assert actor.settings.run == own and actor.settings.run.policies == {}
        written = yaml.safe_load((run_dir / "policies" / policy / "config.yaml").read_text(encoding="utf-8"))
        assert RunConfig(**written) == own  # the policy's effective settings, where its files are
    assert actors["learner@solver"].settings.run.trainer.lr == 3e-4
    assert actors["learner@proposer"].settings.run.trainer.lr == 1e-5
    assert actors["buffer@proposer"].settings.run.data.prompt_data == str(tmp_path / "propose.jsonl")
    for shared in ("controller", "rollout-0-0", "reward-0-0"):  # the whole run's settings, policies included
        assert (actors[shared].policy, actors[shared].run_dir, actors[shared].settings.run) == (None, run_dir, run)
    assert set(run.policies) == {"solver", "proposer"}
    assert actors["controller"].settings.expected_roles == {"buffer": 2, "learner": 2, "evaluator": 1, "rollout": 1,
                                                            "reward": 1}


def test_a_run_of_one_policy_starts_the_actors_it_always_did(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    actors, run_dir = prepare(tmp_path, monkeypatch)
    assert list(actors) == ["controller", "buffer", "learner", "rollout-0-0", "reward-0-0"]
    assert {(actor.policy, actor.run_dir) for actor in actors.values()} == {(None, run_dir)}
    assert not (run_dir / "policies").exists()


def test_roles_on_the_head_start_those_roles_of_every_policy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_file = two_policies(tmp_path)
    actors, _ = prepare(tmp_path, monkeypatch, "--config", str(run_file), "--roles", "controller,learner")
    assert list(actors) == ["controller", "learner@solver", "learner@proposer"]
    assert actors["controller"].settings.expected_roles == {"learner": 2}


def test_a_policy_joining_with_engines_of_its_own_runs_its_workers_on_the_joining_node(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan of `launcher.py --join-policy solver` for solver with own_engines 2: its buffer and learner, then its
    two rollout workers, named as the head names a declared policy's, loading solver's own checkpoint in solver's
    directory; nothing of the run's shared actors or of the other policy."""
    monkeypatch.setattr(node_roles, "visible_gpus", lambda: 0)
    monkeypatch.setattr(launcher, "usable_cores", lambda: (0, 1))
    own = {"own_engines": 2, "hf_checkpoint": str(tmp_path / "solver-model"), "lora_rank": 0}
    config = with_joining_policy(RunConfig(lora_rank=4, policies={"proposer": {}}), "solver", own)
    head, run_dir = "tcp://127.0.0.1:5555", tmp_path / "run"
    args = launcher.build_parser().parse_args(["--head-address", head, "--run-dir", str(run_dir),
                                               "--join-policy", "solver"])
    args.host = "127.0.0.1"
    contexts, _ = launcher.plan_actors(args, {}, joining_roles(config, "solver"), head, run_dir, config)

    assert [context.actor_id for context in contexts] == ["buffer@solver", "learner@solver", "rollout-0-0@solver",
                                                          "rollout-0-1@solver"]
    workers = [context for context in contexts if context.role == "rollout"]
    assert {(worker.policy, worker.run_dir, worker.settings.run.model.hf_checkpoint) for worker in workers} == {
        ("solver", run_dir / "policies" / "solver", own["hf_checkpoint"])}
    assert workers[0].settings.run == policy_run_config(config, "solver")  # an engine of its model, trained in full


def test_the_supervisor_removes_the_ipc_sockets_each_policys_actors_bound_in_their_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    actors, run_dir = prepare(tmp_path, monkeypatch, "--config", str(two_policies(tmp_path)), "--transport", "ipc")
    bound = [Path(actors[actor].bind_address("inbox").removeprefix("ipc://")) for actor in actors]
    for path in bound:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()  # as a process killed before it could close its socket leaves it
    assert bound[1].parent != bound[0].parent  # the solver's buffer's folder is not the controller's
    Supervisor(list(actors.values()), run_dir=run_dir)._remove_stale_sockets()
    assert [path for path in bound if path.exists()] == []


def test_two_learners_on_two_cores_take_turns_on_the_learner_core_and_the_others_keep_theirs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    actors, _ = prepare(tmp_path, monkeypatch, "--config", str(two_policies(tmp_path)))
    shares = {actor: (context.cpu_cores, context.torch_threads) for actor, context in actors.items()}
    assert shares["learner@solver"] == shares["learner@proposer"] == ((0, 1), 1)
    assert {shares[actor] for actor in shares if not actor.startswith("learner")} == {((0,), None)}


def test_several_learners_split_the_learners_half_of_the_cores() -> None:
    roles = {"controller": "controller", "learner@a": "learner", "learner@b": "learner", "learner@c": "learner",
             "rollout-0-0": "rollout"}
    plan = plan_cpu_budget(cores=range(8), roles=roles, gpus=0, learner_ranks=1, synchronous=False)
    assert plan["rollout-0-0"] == plan["controller"] == CpuShare(cores=(0, 1, 2, 3))
    assert plan["learner@a"] == CpuShare(cores=(0, 1, 2, 3, 4, 5), torch_threads=2)
    assert plan["learner@b"] == CpuShare(cores=(0, 1, 2, 3, 6), torch_threads=1)
    assert plan["learner@c"] == CpuShare(cores=(0, 1, 2, 3, 7), torch_threads=1)
    assert describe_cpu_budget(plan, range(8), roles) == (
        "cpu budget: learner@a trains on core(s) 4,5 (2 torch threads); learner@b trains on core(s) 6 (1 torch "
        "threads); learner@c trains on core(s) 7 (1 torch threads); the other actors share core(s) 0,1,2,3")
    synchronous = plan_cpu_budget(cores=range(8), roles=roles, gpus=0, learner_ranks=1, synchronous=True)
    assert synchronous == {learner: CpuShare(torch_threads=2) for learner in ("learner@a", "learner@b", "learner@c")}
