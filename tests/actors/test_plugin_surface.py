"""The module plugins import (`actors.plugins`) keeps its names, a plugin written against it loads by dotted path and
runs, and a module that moved still imports from its old name with a warning that names the new one."""

from __future__ import annotations

import asyncio
import importlib
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

import actors.plugins
from actors import moved
from actors.extensions.load import load_generate_function
from actors.moved import MOVED
from actors.runtime.roles import resolve_actor_class
from policies.rewards import build_reward, score

# The documented surface. A name may join; one that leaves breaks users' plugins, so it leaves this list only with
# an entry in actors.moved or a release note.
SURFACE = {
    "STATUS_BY_FINISH", "Actor", "ActorCallError", "ActorContext", "ConfigError", "EnvStep", "Environment", "Episode",
    "GenerateFunction", "GenerateOutput", "GenerateRequest", "GeneratedGroup", "NoRoomError", "PromptGroup",
    "RewardInput", "RewardOutcome", "RolloutContext", "Sample", "SamplingParams", "Trajectory", "Turn",
    "call_actor", "default_generate", "failed_samples", "handles", "make_sample", "method", "on_broadcast", "serves",
}

USER_PLUGIN = textwrap.dedent('''
    """A user's plugins, written against actors.plugins only."""
    from actors.plugins import (Actor, GenerateRequest, PromptGroup, RewardInput, RolloutContext, Sample,
                                STATUS_BY_FINISH, handles, make_sample)


    async def two_attempts(context: RolloutContext, group: PromptGroup) -> list[Sample]:
        """Each sample answers twice; the second answer continues after the first."""
        prompt_ids = context.prompt_ids(group.prompt)
        params = context.sampling_params(group, n=1, prompt_tokens=len(prompt_ids))
        samples = []
        for index in range(group.n_samples):
            ids, log_probs, versions = list(prompt_ids), [], []
            for _ in range(2):
                (out,) = await context.engine.generate(
                    GenerateRequest(request_id=context.request_id(group), input_ids=ids, params=params))
                ids += out.output_ids
                log_probs += out.log_probs
                versions += out.versions
            response_ids = ids[len(prompt_ids):]
            samples.append(make_sample(group, index, prompt_ids, response_ids, log_probs, versions,
                                       response=context.decode_response(response_ids),
                                       status=STATUS_BY_FINISH[out.finish_reason]))
        return samples


    def length_reward(sample: RewardInput) -> dict:
        return {"reward": float(len(sample.response_ids) > 0), "response_tokens": len(sample.response_ids)}


    class Echo(Actor):
        @handles(PromptGroup)
        async def on_group(self, sender: str, group: PromptGroup) -> None:
            self.last = group
''')


@pytest.mark.unit
def test_the_plugin_module_keeps_every_documented_name() -> None:
    missing = sorted(SURFACE - set(actors.plugins.__all__))
    assert not missing, f"names gone from actors.plugins: {missing}"
    assert all(hasattr(actors.plugins, name) for name in actors.plugins.__all__)


@pytest.mark.integration
def test_a_plugin_written_against_the_surface_loads_by_path_and_runs(tiny_model_path: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoTokenizer

    from actors.config import build_config
    from engines.inference.torch_engine import TorchEngine

    (tmp_path / "my_plugins.py").write_text(USER_PLUGIN, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    generate = load_generate_function("my_plugins:two_attempts")
    reward = build_reward(custom_rm_path="my_plugins:length_reward")
    assert resolve_actor_class("my_plugins:Echo").__name__ == "Echo"

    config = build_config({"hf_checkpoint": str(tiny_model_path), "rollout_max_response_len": 3,
                           "rollout_temperature": 1.0, "n_samples_per_prompt": 2})
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)

    async def run():
        engine = TorchEngine.from_pretrained(tiny_model_path, max_batch_size=4)
        try:
            context = actors.plugins.RolloutContext(engine=engine, tokenizer=tokenizer, config=config, worker_id="w")
            return await generate(context, actors.plugins.PromptGroup(group_id="g", prompt="1+1=", n_samples=2))
        finally:
            await engine.close()

    samples = asyncio.run(run())
    assert [sample.sample_id for sample in samples] == ["g/0", "g/1"]
    for sample in samples:
        assert len(sample.rollout_log_probs) == sample.response_length == len(sample.tokens) - sample.prompt_tokens
        assert 2 <= sample.response_length <= 6  # two answers of at most 3 tokens each (an EOS may end one early)
    inputs = [actors.plugins.RewardInput(prompt=s.prompt, response=s.response,
                                         response_ids=s.tokens[s.prompt_tokens:].tolist()) for s in samples]
    outcomes = asyncio.run(score(reward.fn, inputs))
    assert [(o.status, o.reward, o.extras["response_tokens"]) for o in outcomes] == [
        ("ok", 1.0, s.response_length) for s in samples]


@pytest.mark.unit
@pytest.mark.parametrize("old_name", sorted(MOVED))
def test_a_moved_module_imports_from_its_old_name_with_a_warning_naming_the_new_one(old_name: str) -> None:
    new = importlib.import_module(MOVED[old_name])
    sys.modules.pop(old_name, None)
    with pytest.warns(FutureWarning, match=f"{old_name} moved to {MOVED[old_name]}"):
        old = importlib.import_module(old_name)
    public = [name for name in vars(new) if not name.startswith("_")]
    assert public and all(getattr(old, name) is getattr(new, name) for name in public)


@pytest.mark.unit
def test_old_names_stop_importing_on_their_end_date_naming_the_new_place(monkeypatch: pytest.MonkeyPatch) -> None:
    old_name = "actors.rollout_generate"
    monkeypatch.delitem(sys.modules, old_name, raising=False)
    with pytest.warns(FutureWarning, match=f"stops importing on {moved.OLD_NAMES_END.isoformat()}"):
        importlib.import_module(old_name)
    monkeypatch.delitem(sys.modules, old_name, raising=False)
    monkeypatch.setattr(moved, "_today", lambda: moved.OLD_NAMES_END)
    with pytest.raises(ImportError, match="moved to actors.rollout.generate, and its old name stopped importing on "
                                          f"{moved.OLD_NAMES_END.isoformat()}"):
        importlib.import_module(old_name)
    assert old_name not in sys.modules


@pytest.mark.unit
def test_a_name_that_exists_is_never_answered_as_moved(monkeypatch: pytest.MonkeyPatch) -> None:
    """The finder is last on sys.meta_path: a real module under a name listed as moved imports as itself."""
    monkeypatch.setitem(MOVED, "actors.report.run_report", "actors.runtime.base")
    monkeypatch.delitem(sys.modules, "actors.report.run_report", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module = importlib.import_module("actors.report.run_report")
    assert module.__file__.endswith("run_report.py") and hasattr(module, "plot_run")
