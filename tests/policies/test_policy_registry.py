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
def test_an_import_error_raised_from_another_names_both(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """slime's retool example wraps its failed import (`raise ImportError("MathDapo is not installed") from e`):
    the message says which import failed, not only the wrapper's words."""
    (tmp_path / "wrapping_plugin.py").write_text(
        "try:\n    import no_such_scorer\n"
        "except ImportError as e:\n    raise ImportError('scorer is not installed') from e\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginError, match=r"ImportError: scorer is not installed \(from ModuleNotFoundError: No "
                                          r"module named 'no_such_scorer'\)"):
        load_object("wrapping_plugin:fn", what="reward function")


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
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'grpo2'; registered: .*grpo, grpo_process"):
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
        "grpo_process",
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


@pytest.mark.unit
def test_the_declared_traits_of_the_builtins_are_what_they_register_with(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Traits are read without importing the built-ins (a config is validated in processes that never run them), so
    a declaration that drifts from the registration must fail where the built-ins load."""
    from policies.registry import ADVANTAGE_ESTIMATORS, LINEAR_IN_ADVANTAGE, NEEDS_CRITIC, POLICY_LOSSES

    assert ADVANTAGE_ESTIMATORS.traits_of("ppo") == {NEEDS_CRITIC}
    assert ADVANTAGE_ESTIMATORS.traits_of("grpo") == frozenset()
    assert POLICY_LOSSES.traits_of("gspo") == {LINEAR_IN_ADVANTAGE} and not POLICY_LOSSES.traits_of("sft")
    ADVANTAGE_ESTIMATORS.names()  # loads the built-ins and compares
    POLICY_LOSSES.names()
    # a registry whose built-in module registers "gae" without the trait its declaration gives it
    (tmp_path / "drifted_builtins.py").write_text(textwrap.dedent("""
        from policies.registry import Registry, NEEDS_CRITIC

        DRIFTED = Registry("estimator", ("drifted_builtins",), ("gae",), {"gae": (NEEDS_CRITIC,)})

        @DRIFTED.register("gae")
        def gae(config, inputs):
            raise NotImplementedError
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    drifted = load_object("drifted_builtins:DRIFTED", what="a registry")
    assert drifted.traits_of("gae") == {NEEDS_CRITIC}  # the declaration, read without loading
    with pytest.raises(RuntimeError, match=r"gae: declared \['needs_critic'\], registered \[\]"):
        drifted.names()


@pytest.mark.unit
def test_a_plugin_estimator_that_reads_values_gets_a_critic_by_its_trait_not_its_name(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from actors.config import build_config
    from actors.learner.trainer_factory import uses_critic

    (tmp_path / "my_estimators.py").write_text(textwrap.dedent("""
        from policies.advantages import ppo
        from policies.registry import NEEDS_CRITIC, with_traits

        gae_again = with_traits(NEEDS_CRITIC)(lambda config, inputs: ppo(config, inputs))

        def plain(config, inputs):
            raise NotImplementedError
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    config = build_config({"advantage_estimator": "my_estimators:gae_again"})
    assert config.policy.needs_critic and uses_critic(config)
    assert not build_config({"advantage_estimator": "my_estimators:plain"}).policy.needs_critic
    with pytest.raises(ValueError, match="advantage_estimator my_estimators:gae_again trains a critic beside the "
                                         "policy, which --train-backend torch does; --train-backend megatron"):
        build_config({"advantage_estimator": "my_estimators:gae_again", "train_backend": "megatron"})
    with pytest.raises(ValueError, match="--critic-lr: a critic is trained only with an estimator that reads values"):
        build_config({"advantage_estimator": "my_estimators:plain", "critic_lr": 1e-5})


@pytest.mark.unit
def test_a_plugin_estimators_traits_pick_its_loss_and_demand_whitening(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from policies.config import PolicyLossConfig

    (tmp_path / "my_sequence_estimators.py").write_text(textwrap.dedent("""
        from policies.advantages import group_relative
        from policies.registry import BATCH_WHITENED, implies_loss, with_traits

        with_cispo = with_traits(implies_loss("cispo"))(lambda config, inputs: group_relative(config, inputs))
        whitened = with_traits(BATCH_WHITENED)(lambda config, inputs: group_relative(config, inputs))
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert PolicyLossConfig(advantage_estimator="my_sequence_estimators:with_cispo").loss_type == "cispo"
    assert PolicyLossConfig(advantage_estimator="my_sequence_estimators:whitened",
                            normalize_advantages=True).loss_type == "ppo"
    with pytest.raises(ValueError, match="my_sequence_estimators:whitened' is defined with batch whitening"):
        PolicyLossConfig(advantage_estimator="my_sequence_estimators:whitened")  # normalize_advantages is off
    for builtin in ("reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        with pytest.raises(ValueError, match=f"{builtin}' is defined with batch whitening"):
            PolicyLossConfig(advantage_estimator=builtin)


@pytest.mark.unit
def test_a_plugin_loss_that_declares_itself_linear_in_the_advantage_lets_zero_advantage_samples_be_skipped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from policies.config import PolicyLossConfig
    from policies.step_loss import zero_advantage_is_zero_gradient

    (tmp_path / "my_losses.py").write_text(textwrap.dedent("""
        from policies.losses import compute_policy_loss
        from policies.registry import LINEAR_IN_ADVANTAGE, with_traits

        scaled = with_traits(LINEAR_IN_ADVANTAGE)(lambda *args, **kwargs: compute_policy_loss(*args, **kwargs))

        def undeclared(*args, **kwargs):
            return compute_policy_loss(*args, **kwargs)
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert zero_advantage_is_zero_gradient(PolicyLossConfig(loss_type="my_losses:scaled"))
    assert not zero_advantage_is_zero_gradient(PolicyLossConfig(loss_type="my_losses:undeclared"))
    assert not zero_advantage_is_zero_gradient(PolicyLossConfig(loss_type="my_losses:scaled", entropy_coef=0.01))
