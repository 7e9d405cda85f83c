"""What a run with slime's rollout-buffer service (`--rollout-buffer-url`) needs of its other settings.

The service hands back chat messages and a reward per trajectory, as slime's generators write them: no engine
log-probs and no per-token weight versions. So nothing that reads the engine's log-probs (mu) can train on its
samples, and the learner must compute pi_old itself, as slime does for these runs.
"""

from __future__ import annotations

from actors.config.sections import AgentConfig, RolloutConfig
from policies.config import PolicyLossConfig
from policies.pi_old import pi_old_source

WHY = "the rollout-buffer service returns chat messages and rewards, no engine log-probs"


def rollout_buffer_problems(agent: AgentConfig, rollout: RolloutConfig, policy: PolicyLossConfig, *,
                            decoupled: bool, steps_per_batch: int) -> list[str]:
    """Why a run of these settings cannot train on the service's trajectories; empty without
    `--rollout-buffer-url`. `decoupled` is --use-decoupled-ppo, `steps_per_batch` the optimizer steps per batch."""
    if agent.rollout_buffer_url is None:
        return []
    problems = []
    if policy.use_rollout_logprobs:
        problems.append(f"--rollout-buffer-url with --use-rollout-logprobs: {WHY} to take pi_old from; drop "
                        "--use-rollout-logprobs (pi_old is then the learner's)")
    elif policy.off_policy_correction not in (None, "none"):
        problems.append(f"--rollout-buffer-url with --off-policy-correction {policy.off_policy_correction}: {WHY} "
                        "(mu) to correct with; give --off-policy-correction none, as slime's rollout-buffer runs "
                        "have it")
    elif steps_per_batch > 1 and pi_old_source(policy, decoupled=decoupled,
                                                  steps_per_batch=steps_per_batch) == "rollout":
        problems.append(f"--rollout-buffer-url with {steps_per_batch} optimizer steps per batch: "
                        f"{WHY}, so pi_old must be the learner's before the batch; add --use-decoupled-ppo")
    if rollout.custom_generate_function_path:
        problems.append("--rollout-buffer-url and --custom-generate-function-path: the service generates the "
                        "trajectories, so the generate function would never be called; give one")
    if any((agent.agent_function_path, agent.agent_tools_path, agent.agent_environment_path)):
        problems.append("--rollout-buffer-url and an --agent-* episode: the service runs the agents; give one")
    return problems
