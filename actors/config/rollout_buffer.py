"""What a run with slime's rollout-buffer service (`--rollout-buffer-url`) needs of its other settings.

The service hands back chat messages and a reward per trajectory, as slime's generators write them: no engine
log-probs and no per-token weight versions. So nothing that reads the engine's log-probs (mu) can train on its
samples, and the learner must compute pi_old itself, as slime does for these runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from policies.pi_old import pi_old_source

if TYPE_CHECKING:
    from actors.config.run import RunConfig

WHY = "the rollout-buffer service returns chat messages and rewards, no engine log-probs"


def rollout_buffer_problems(config: RunConfig) -> list[str]:
    """Why `config` cannot train on the service's trajectories; empty without `--rollout-buffer-url`."""
    if config.agent.rollout_buffer_url is None:
        return []
    problems = []
    policy = config.policy
    if policy.use_rollout_logprobs:
        problems.append(f"--rollout-buffer-url with --use-rollout-logprobs: {WHY} to take pi_old from; drop "
                        "--use-rollout-logprobs (pi_old is then the learner's)")
    elif policy.off_policy_correction not in (None, "none"):
        problems.append(f"--rollout-buffer-url with --off-policy-correction {policy.off_policy_correction}: {WHY} "
                        "(mu) to correct with; give --off-policy-correction none, as slime's rollout-buffer runs "
                        "have it")
    elif pi_old_source(policy, decoupled=config.learner.use_decoupled_ppo,
                       steps_per_batch=config.optimizer_steps_per_batch) == "rollout" \
            and config.optimizer_steps_per_batch > 1:
        problems.append(f"--rollout-buffer-url with {config.optimizer_steps_per_batch} optimizer steps per batch: "
                        f"{WHY}, so pi_old must be the learner's before the batch; add --use-decoupled-ppo")
    if config.rollout.custom_generate_function_path:
        problems.append("--rollout-buffer-url and --custom-generate-function-path: the service generates the "
                        "trajectories, so the generate function would never be called; give one")
    if any((config.agent.agent_function_path, config.agent.agent_tools_path, config.agent.agent_environment_path)):
        problems.append("--rollout-buffer-url and an --agent-* episode: the service runs the agents; give one")
    return problems
