import sys
import textwrap
from pathlib import Path

import pytest

from policies.plugins import PluginError, load_object
from policies.registry import Registry, resolve_advantage_estimator, resolve_reward


@pytest.fixture
def plugin_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A real user module on sys.path, imported by dotted path like a --custom-*-path flag would."""
    (tmp_path / "my_rl_plugins.py").write_text(
        textwrap.dedent(
            """
            SCALE = 3.0

            def reward(inp):
                return SCALE

            class Rewards:
                @staticmethod
                def strict(inp):
                    return 0.0
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rl_plugins"
    sys.modules.pop("my_rl_plugins", None)


@pytest.mark.unit
@pytest.mark.parametrize("spelling", ["{m}:reward", "{m}.reward"])
def test_user_function_resolves_by_dotted_path(plugin_module: str, spelling: str) -> None:
    fn = resolve_reward(spelling.format(m=plugin_module))
    assert fn(None) == 3.0


@pytest.mark.unit
def test_nested_attribute_after_colon(plugin_module: str) -> None:
    assert load_object(f"{plugin_module}:Rewards.strict", what="reward function")(None) == 0.0


@pytest.mark.unit
def test_missing_module_error_names_the_module() -> None:
    with pytest.raises(
        PluginError, match=r"reward function 'no_such_pkg\.mod:fn': cannot import module 'no_such_pkg\.mod'"
    ):
        load_object("no_such_pkg.mod:fn", what="reward function")


@pytest.mark.unit
def test_missing_attribute_error_names_module_and_attribute(plugin_module: str) -> None:
    with pytest.raises(PluginError, match=r"'my_rl_plugins' has no attribute 'rewrd'"):
        resolve_reward(f"{plugin_module}:rewrd")


@pytest.mark.unit
def test_non_callable_plugin_is_rejected(plugin_module: str) -> None:
    with pytest.raises(PluginError, match="float object is not callable"):
        resolve_reward(f"{plugin_module}:SCALE")


@pytest.mark.unit
def test_unknown_name_lists_registered_names() -> None:
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'grpo2'; registered: .*grpo, gspo"):
        resolve_advantage_estimator("grpo2")


@pytest.mark.unit
def test_registering_a_different_function_under_a_taken_name_is_an_error() -> None:
    registry: Registry = Registry("widget", ())
    registry.register("a")(len)
    registry.register("a")(len)  # same object again: harmless (module re-import)
    with pytest.raises(ValueError, match="widget 'a' is already registered"):
        registry.register("a")(abs)


@pytest.mark.unit
def test_every_advertised_builtin_is_selectable_by_name() -> None:
    from policies import registry

    assert set(registry.ADVANTAGE_ESTIMATORS.names()) == {
        "grpo",
        "gspo",
        "cispo",
        "rloo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "ppo",
    }
    assert set(registry.POLICY_LOSSES.names()) == {"ppo", "gspo", "cispo", "sft"}
    assert set(registry.KL_ESTIMATORS.names()) == {"k1", "k2", "k3", "low_var_kl"}
    assert set(registry.CORRECTIONS.names()) == {"none", "tis", "mis", "icepop"}
    assert set(registry.FILTERS.names()) >= {"nonzero_std", "no_reward_errors"}
    assert set(registry.REWARDS.names()) >= {"math", "exact_match", "f1", "gpqa", "multiple_choice", "deepscaler"}
