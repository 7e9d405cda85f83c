"""The built-in inference engines and training backends are their specs (actors/config/engines.py): the config's
choices, the factories, the weight transport, placement and preflight read the spec, so a third built-in is one entry
there."""

from __future__ import annotations

import inspect
from dataclasses import replace
from pathlib import Path

import pytest

from actors.config import build_config
from actors.config.engines import (
    BUILTIN_ENGINES,
    BUILTIN_TRAIN_BACKENDS,
    EngineSpec,
    TrainBackendSpec,
    engine_choices,
    engine_needs_gpu,
)
from actors.config.preflight import preflight
from actors.config.run import RunConfig
from actors.launch.placement import PlacementError, place_node
from actors.learner.publish import transport_name
from actors.rollout.engine_factory import load_engine
from engines.weights.names import TORCH_DISTRIBUTED
from policies.plugins import load_object
from tests.support.inprocess import use_spec
from tools.sim.pipeline import SimSpec, SleepingEngine, SleepingTokenizer

pytestmark = pytest.mark.unit

# A third engine, as one entry: the pipeline benchmark's sleeping engine, which needs no GPU and no checkpoint.
SLEEPY = EngineSpec(factory="tools.sim.pipeline:sleeping_engine", noun="the sleeping engine",
                    plural="sleeping engines", needs_gpu=False, loads_checkpoint=False)


def test_the_built_in_engine_names_are_the_specs_and_each_factory_is_a_callable() -> None:
    assert engine_choices("rollout_engine") == tuple(BUILTIN_ENGINES) == ("torch", "sglang")
    for name, spec in BUILTIN_ENGINES.items():
        assert build_config({"rollout_engine": name}).engine.rollout_engine == name
        assert callable(load_object(spec.factory, what=f"{name}'s factory"))
        if spec.lora_target_check is not None:
            assert callable(load_object(spec.lora_target_check, what=f"{name}'s LoRA target check"))
    help_names = RunConfig.model_fields["engine"].annotation.model_fields["rollout_engine"].metadata
    assert any(str(item).startswith("torch, sglang, or a module:attr") for item in help_names)


def test_an_unregistered_engine_name_is_refused_by_the_config() -> None:
    with pytest.raises(ValueError, match=r"rollout_engine sleepy: expected one of torch, sglang, or a plugin "
                                           "factory path"):
        build_config({"rollout_engine": "sleepy"})


def test_a_third_engine_is_one_spec_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(BUILTIN_ENGINES, "sleepy", SLEEPY)
    use_spec(SimSpec(), tmp_path, monkeypatch)
    config = build_config({"rollout_engine": "sleepy"})  # accepted as a built-in name, not a plugin path

    engine, tokenizer = load_engine(config, "rollout-0-1")  # built by its factory, without --hf-checkpoint
    assert isinstance(engine, SleepingEngine) and isinstance(tokenizer, SleepingTokenizer)
    assert engine_needs_gpu("sleepy") is False
    assert transport_name(config) == TORCH_DISTRIBUTED
    # placement reads its traits: no GPU taken, and no sharing of the learner's GPU it did not declare
    assert place_node(gpus=1, learner_ranks=1, rollout_workers=2, gpus_per_engine=1, rollout_engine="sleepy",
                      rollout_needs_gpu=False).rollout == ((), ())
    with pytest.raises(PlacementError, match="the sleeping engine needs GPUs of its own "
                                             r"\(use --rollout-engine torch to share the learner's GPU\)"):
        place_node(gpus=1, learner_ranks=1, rollout_workers=1, gpus_per_engine=1, rollout_engine="sleepy")
    # preflight neither imports its name as a plugin path nor asks the rollout workers for a model
    assert preflight(config, {"rollout": 1}) == []
    with pytest.raises(ValueError, match=r"colocate: --rollout-engine sleepy; colocated mode runs torch engines or "
                                         "SGLang servers"):
        build_config({"rollout_engine": "sleepy", "colocate": True})
    with pytest.raises(ValueError, match=r"--use-rollout-routing-replay: torch engines and SGLang servers record "
                                         "routed experts; --rollout-engine sleepy does not"):
        build_config({"rollout_engine": "sleepy", "use_rollout_routing_replay": True})


def test_the_sglang_stand_in_defaults_to_what_a_run_would_have_passed_it() -> None:
    """The engine factory passes the stand-in no special arguments: its own defaults are a run's defaults."""
    from tools.standins.sglang_server.args import parse_args

    args = parse_args(["--model-path", "unused"])
    defaults = build_config({})
    assert args.torch_threads == defaults.torch_threads
    assert args.weight_group_timeout == defaults.weights.weight_transfer_timeout


def test_the_built_in_training_backends_are_their_specs_and_each_factory_is_a_callable() -> None:
    assert engine_choices("train_backend") == tuple(BUILTIN_TRAIN_BACKENDS) == ("torch", "megatron")
    for name, spec in BUILTIN_TRAIN_BACKENDS.items():
        assert build_config({"train_backend": name}).trainer.train_backend == name
        factory = load_object(spec.factory, what=f"{name}'s trainer factory")
        assert callable(factory) and list(inspect.signature(factory).parameters) == ["config"]


@pytest.mark.parametrize(("settings", "refusal"), [
    ({"tensor_model_parallel_size": 2, "learner_ranks": 2}, "tensor/pipeline parallelism needs --train-backend"),
    ({"expert_model_parallel_size": 2, "learner_ranks": 2}, "expert parallelism needs --train-backend"),
    ({"advantage_estimator": "ppo"}, "trains a critic beside the policy"),
    ({"use_routing_replay": True}, "--use-routing-replay: the learner's own routes are recorded"),
])
def test_a_training_backends_traits_decide_what_the_config_accepts(
        monkeypatch: pytest.MonkeyPatch, settings: dict, refusal: str) -> None:
    """A third backend is one spec entry: without the trait its run is refused naming the backends that have it;
    the same entry with the trait is accepted."""
    trait = {"tensor_model_parallel_size": "model_parallel", "expert_model_parallel_size": "model_parallel",
             "advantage_estimator": "critic", "use_routing_replay": "routing_replay"}[next(iter(settings))]
    plain = TrainBackendSpec(factory="tools.sim.pipeline:sleeping_trainer")
    monkeypatch.setitem(BUILTIN_TRAIN_BACKENDS, "third", plain)
    with pytest.raises(ValueError, match=refusal):
        build_config({**settings, "train_backend": "third"})
    monkeypatch.setitem(BUILTIN_TRAIN_BACKENDS, "third", replace(plain, **{trait: True}))
    assert build_config({**settings, "train_backend": "third"}).trainer.train_backend == "third"
