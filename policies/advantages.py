"""Advantages and returns from scalar rewards (``--advantage-estimator``), in the packed layout.

Inputs (``B`` samples, ``T`` packed response tokens):

- ``rewards: Tensor[B]``: one scalar per sample (the reward worker's output).
- ``group_ids: LongTensor[B]``: samples of one prompt share an id; groups need not be contiguous or equal-sized.
- ``episode_ids: LongTensor[B]`` (optional): the segments of one episode share an id (an agent that rewrote its
  context trained as several samples, ``bus.episodes``); without it every sample is an episode of its own.
- ``response_lengths: LongTensor[B]``, ``loss_mask: Tensor[T]`` (bool or float, 1 = trained).
- ``steps: GradedSteps`` (optional, ``grpo_process`` only): the steps a reward graded (process supervision), each
  one's sample, the response token it ends on and its reward.
- ``values: Tensor[T]`` (critic, ``ppo`` only), ``log_probs``/``ref_log_probs: Tensor[T]`` (only when
  ``kl_coef != 0``, for the KL reward penalty), ``teacher_log_probs: Tensor[T]`` (only with ``use_opd``, beside
  ``log_probs`` as the student's).

Outputs: ``(advantages: Tensor[T], returns: Tensor[T])``, zero at masked positions, in float32 (float64 if the
rewards are float64).

Decisions worth knowing:

- Group baselines are over episodes, not samples: an episode of three segments counts once in its group's mean,
  std and leave-one-out baseline, with its reward (the mean of its segments', which carry one reward) less the KL
  penalty summed over all its segments; every segment gets its episode's advantage. The token-level estimators
  (reinforce_plus_plus, ppo) place the episode's reward on each segment's last trained token, so each segment ends
  as the episode did. The loss aggregation over tokens does not change: a segment is a sample there.
- Group normalisation uses the unbiased (n - 1) std, like ``torch.std``. A group of one sample
  (``n_samples_per_prompt = 1``) has no baseline: its centred reward is exactly 0, so its advantage is 0 for
  grpo/gspo/cispo/rloo/reinforce_plus_plus_baseline, with or without std division, instead of the NaN an
  unbiased std of one value would give. Use ``reinforce_plus_plus`` (or disable rewards normalisation) to learn
  from single samples.
- ``kl_coef`` (KL as a reward penalty) applies to every estimator: per token for the token-level estimators
  (reinforce_plus_plus, reinforce_plus_plus_baseline, ppo, exactly as slime), and as the sequence's summed KL
  subtracted from its reward before group normalisation for the sequence-level ones (grpo, gspo, cispo, rloo),
  where slime silently ignores it.
- Terminal rewards are placed on each sample's last *masked-in* token, and the per-token KL penalty only on
  trained tokens (slime's ppo uses the last token and penalises every token; they coincide unless a response has
  untrained tokens). ``untrained_token_rewards='keep'`` gives slime's placement.
- Whitening (``normalize_advantages``) divides by the unbiased (n - 1) variance, like slime
  (``whiten_unbiased=False``: population variance).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch
import torch.distributed as dist
from torch import Tensor

from policies.config import PolicyLossConfig
from policies.distillation import opd_advantages
from policies.kl import compute_kl
from policies.packing import (
    as_compute_dtype,
    as_float_mask,
    check_finite,
    check_lengths,
    check_packed,
    discounted_cumsum,
    group_index,
    last_masked_index,
    per_sample_sum,
    to_tokens,
    zero_masked,
)
from policies.registry import (
    BATCH_WHITENED,
    NEEDS_CRITIC,
    implies_loss,
    register_advantage_estimator,
    resolve_advantage_estimator,
)

__all__ = [
    "AdvantageInputs",
    "GradedSteps",
    "compute_advantages",
    "gae",
    "group_normalize",
    "leave_one_out",
    "per_episode",
    "terminal_token_rewards",
    "whiten",
]


@dataclass(frozen=True)
class GradedSteps:
    """The steps rewards graded, over a batch: step ``s`` of sample ``samples[s]`` ends on that sample's response
    token ``ends[s]`` (0-based within the response) and earned ``rewards[s]``; a sample's steps in order."""

    samples: Tensor  # [S] long
    ends: Tensor  # [S] long
    rewards: Tensor  # [S]

    def check(self, response_lengths: Tensor) -> None:
        """A ValueError naming the step at fault: a sample outside the batch, an end outside its response, a
        non-finite reward, or a sample's steps out of order."""
        count = self.samples.numel()
        if self.ends.shape != (count,) or self.rewards.shape != (count,) or self.samples.dim() != 1:
            raise ValueError(f"steps: samples, ends and rewards must be 1-D of one length, got "
                             f"{tuple(self.samples.shape)}, {tuple(self.ends.shape)}, {tuple(self.rewards.shape)}")
        if count == 0:
            return
        if int(self.samples.min()) < 0 or int(self.samples.max()) >= response_lengths.numel():
            raise ValueError(f"steps: a step names sample {int(self.samples.max())}, outside the batch of "
                             f"{response_lengths.numel()}")
        lengths = response_lengths[self.samples]
        outside = (self.ends < 0) | (self.ends >= lengths)
        if bool(outside.any()):
            at = int(outside.nonzero()[0])
            raise ValueError(f"steps: step {at} of sample {int(self.samples[at])} ends on token {int(self.ends[at])}, "
                             f"outside its response of {int(lengths[at])} tokens")
        check_finite("steps' rewards", self.rewards)
        same = self.samples[1:] == self.samples[:-1]
        if bool((same & (self.ends[1:] < self.ends[:-1])).any()) or bool((self.samples[1:] < self.samples[:-1]).any()):
            raise ValueError("steps: a sample's steps must come in order, and samples in batch order")


@dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator (built-in or user plugin) receives; all tensors already validated and upcast.

    ``token_kl`` is the per-token KL penalty source (zeros when ``kl_coef == 0``), masked positions zeroed unless
    ``untrained_token_rewards == 'keep'`` (then it is the KL at every response token, as slime's ppo uses it).
    """

    rewards: Tensor  # [B]
    group_ids: Tensor  # [B]
    response_lengths: Tensor  # [B], int64
    loss_mask: Tensor  # [T], 0/1 float
    token_kl: Tensor  # [T]
    values: Tensor | None  # [T]
    episode_ids: Tensor | None = None  # [B]; None: each sample is its own episode
    steps: GradedSteps | None = None  # the steps rewards graded (process supervision); None: none did


def compute_advantages(
    config: PolicyLossConfig,
    *,
    rewards: Tensor,
    group_ids: Tensor,
    response_lengths: Tensor,
    loss_mask: Tensor,
    values: Tensor | None = None,
    log_probs: Tensor | None = None,
    ref_log_probs: Tensor | None = None,
    teacher_log_probs: Tensor | None = None,
    process_group: dist.ProcessGroup | None = None,
    episode_ids: Tensor | None = None,
    steps: GradedSteps | None = None,
) -> tuple[Tensor, Tensor]:
    """Run the configured estimator (its group baselines over the episodes of ``episode_ids`` when given), then the
    distillation term (``use_opd``: ``log_probs`` is the student's, ``teacher_log_probs`` the teacher's, see
    `policies.distillation`), then optional masked whitening (across ``process_group`` when given). Returns are the
    estimator's: the distillation term is not a reward."""
    inputs = _prepare_inputs(config, rewards=rewards, group_ids=group_ids, response_lengths=response_lengths,
                             loss_mask=loss_mask, values=values, log_probs=log_probs, ref_log_probs=ref_log_probs,
                             episode_ids=episode_ids, steps=steps)
    estimator = resolve_advantage_estimator(config.advantage_estimator)
    advantages, returns = estimator(config, inputs)
    check_packed(f"advantages from estimator {config.advantage_estimator!r}", advantages, inputs.response_lengths)
    check_finite(f"advantages from estimator {config.advantage_estimator!r}", advantages, inputs.loss_mask)
    advantages = zero_masked(advantages, inputs.loss_mask)
    if config.use_opd:
        if log_probs is None or teacher_log_probs is None:
            raise ValueError("use_opd needs log_probs (the student's) and teacher_log_probs")
        advantages = opd_advantages(advantages, student_log_probs=log_probs.detach(),
                                    teacher_log_probs=teacher_log_probs.detach(), coef=config.opd_kl_coef,
                                    loss_mask=inputs.loss_mask, response_lengths=inputs.response_lengths)
    if config.normalize_advantages:
        advantages = whiten(advantages, inputs.loss_mask, process_group=process_group, unbiased=config.whiten_unbiased)
    return advantages, zero_masked(returns, inputs.loss_mask)


def rewards_teach_single_samples(config: PolicyLossConfig) -> bool:
    """Whether the estimator gives a sample alone in its group (--n-samples-per-prompt 1) an advantage that its
    reward moves. A group baseline (GRPO's mean, RLOO's others) is the sample itself there, so every advantage is 0
    and the run trains on nothing but its KL terms, with no error anywhere. Asked of the estimator itself on two
    one-sample groups rewarded 0 and 1, so a plugin estimator is judged as the built-ins are."""
    probe = config.model_copy(update={"kl_coef": 0.0, "use_opd": False, "normalize_advantages": False})
    one_token = torch.ones(2)
    advantages, _ = compute_advantages(probe, rewards=torch.tensor([0.0, 1.0]), group_ids=torch.tensor([0, 1]),
                                       response_lengths=torch.tensor([1, 1]), loss_mask=one_token,
                                       values=torch.zeros(2))
    return bool(advantages.abs().sum() > 0)


def _prepare_inputs(config: PolicyLossConfig, *, rewards: Tensor, group_ids: Tensor, response_lengths: Tensor,
                    loss_mask: Tensor, values: Tensor | None, log_probs: Tensor | None,
                    ref_log_probs: Tensor | None, episode_ids: Tensor | None = None,
                    steps: GradedSteps | None = None) -> AdvantageInputs:
    """`compute_advantages`' arguments checked and upcast, with the KL penalty computed."""
    lengths = check_lengths(response_lengths)
    batch = lengths.numel()
    if rewards.dim() != 1 or rewards.numel() != batch:
        raise ValueError(f"rewards: expected shape [{batch}] (one per sample), got {tuple(rewards.shape)}")
    if group_ids.dim() != 1 or group_ids.numel() != batch:
        raise ValueError(f"group_ids: expected shape [{batch}] (one per sample), got {tuple(group_ids.shape)}")
    if episode_ids is not None and (episode_ids.dim() != 1 or episode_ids.numel() != batch):
        raise ValueError(f"episode_ids: expected shape [{batch}] (one per sample), got {tuple(episode_ids.shape)}")
    check_finite("rewards", rewards)
    rewards = as_compute_dtype(rewards)
    dtype = rewards.dtype
    check_packed("loss_mask", loss_mask, lengths)
    mask = as_float_mask(loss_mask, dtype)
    if values is not None:
        check_packed("values", values, lengths)
        check_finite("values", values)  # GAE reads values at every position, masked or not
        values = as_compute_dtype(values).to(dtype)
    token_kl = torch.zeros(mask.numel(), dtype=dtype, device=mask.device)
    if config.kl_coef != 0:
        if log_probs is None or ref_log_probs is None:
            raise ValueError(f"kl_coef={config.kl_coef} needs log_probs and ref_log_probs for the KL reward penalty")
        check_packed("log_probs", log_probs, lengths)
        check_packed("ref_log_probs", ref_log_probs, lengths)
        keep_untrained = config.untrained_token_rewards == "keep"
        check_finite("log_probs", log_probs, None if keep_untrained else mask)
        check_finite("ref_log_probs", ref_log_probs, None if keep_untrained else mask)
        kl = compute_kl(config.kl_loss_type, log_probs.detach(), ref_log_probs.detach()).to(dtype)
        token_kl = kl if keep_untrained else zero_masked(kl, mask)
    if steps is not None:
        steps.check(lengths)
        steps = GradedSteps(samples=steps.samples.long(), ends=steps.ends.long(), rewards=steps.rewards.to(dtype))
    return AdvantageInputs(rewards=rewards, group_ids=group_ids, response_lengths=lengths, loss_mask=mask,
                           token_kl=token_kl, values=values, episode_ids=episode_ids, steps=steps)


# --------------------------------------------------------------------------------------------------------------
# Building blocks (public so user estimators can compose them)


def group_normalize(rewards: Tensor, group_ids: Tensor, *, divide_by_std: bool, eps: float,
                    episode_ids: Tensor | None = None) -> Tensor:
    """``r - mean_g`` or ``(r - mean_g) / (std_g + eps)`` with the unbiased std; ``[B] -> [B]``.

    A singleton group gives exactly 0 (its centred reward is 0; its std is taken as 0 rather than NaN). With
    ``episode_ids`` the statistics are over episodes (each counts once, however many samples it has), and each
    sample gets its episode's value.
    """
    if episode_ids is not None:
        episode_rewards, episode_groups, inverse = per_episode(rewards, group_ids, episode_ids)
        return group_normalize(episode_rewards, episode_groups, divide_by_std=divide_by_std, eps=eps)[inverse]
    inverse, n_groups = group_index(group_ids)
    zeros = torch.zeros(n_groups, dtype=rewards.dtype, device=rewards.device)
    count = zeros.index_add(0, inverse, torch.ones_like(rewards))
    mean = zeros.index_add(0, inverse, rewards) / count
    centred = rewards - mean[inverse]
    if not divide_by_std:
        return centred
    squares = zeros.index_add(0, inverse, centred**2)
    std = (squares / (count - 1).clamp_min(1)).sqrt()
    return centred / (std[inverse] + eps)


def leave_one_out(rewards: Tensor, group_ids: Tensor, episode_ids: Tensor | None = None) -> Tensor:
    """RLOO: ``r_i - mean(r_j for j != i in the group)``; ``[B] -> [B]``; 0 for a singleton group. With
    ``episode_ids``, over episodes: the baseline is the group's other episodes, each sample gets its episode's."""
    if episode_ids is not None:
        episode_rewards, episode_groups, inverse = per_episode(rewards, group_ids, episode_ids)
        return leave_one_out(episode_rewards, episode_groups)[inverse]
    inverse, n_groups = group_index(group_ids)
    zeros = torch.zeros(n_groups, dtype=rewards.dtype, device=rewards.device)
    count = zeros.index_add(0, inverse, torch.ones_like(rewards))[inverse]
    total = zeros.index_add(0, inverse, rewards)[inverse]
    baseline = (total - rewards) / (count - 1).clamp_min(1)
    return torch.where(count > 1, rewards - baseline, torch.zeros_like(rewards))


def per_episode(values: Tensor, group_ids: Tensor, episode_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``[B]`` per-sample values as ``[E]`` per-episode ones (the mean over each episode's samples), each episode's
    group id ``[E]``, and each sample's episode ``[B]`` (index into ``[E]``)."""
    inverse, n_episodes = group_index(episode_ids)
    zeros = torch.zeros(n_episodes, dtype=values.dtype, device=values.device)
    count = zeros.index_add(0, inverse, torch.ones_like(values))
    groups = torch.zeros(n_episodes, dtype=group_ids.dtype, device=group_ids.device).scatter(0, inverse, group_ids)
    return zeros.index_add(0, inverse, values) / count, groups, inverse


def terminal_token_rewards(
    rewards: Tensor, token_kl: Tensor, kl_coef: float, loss_mask: Tensor, response_lengths: Tensor
) -> Tensor:
    """Per-token rewards ``[T]``: ``-kl_coef * kl`` everywhere, plus each sample's reward on its last trained token."""
    token_rewards = -kl_coef * token_kl
    last = last_masked_index(loss_mask, response_lengths)
    has_tokens = last >= 0
    return token_rewards.index_add(0, last[has_tokens], rewards[has_tokens])


def gae(
    token_rewards: Tensor, values: Tensor, response_lengths: Tensor, *, gamma: float, lambd: float
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation per sample; the value after the last token is 0 (episode ends).

    ``delta_t = r_t + gamma * V_{t+1} - V_t``, ``A_t = sum_k (gamma * lambd)**k * delta_{t+k}``, returns ``A + V``.
    """
    next_values = torch.zeros_like(values)
    if values.numel() > 1:
        next_values[:-1] = values[1:]
    ends = torch.cumsum(response_lengths, 0) - 1
    next_values[ends[response_lengths > 0]] = 0
    deltas = token_rewards + gamma * next_values - values
    advantages = discounted_cumsum(deltas, response_lengths, gamma * lambd)
    return advantages, advantages + values


def whiten(
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    process_group: dist.ProcessGroup | None = None,
    eps: float = 1e-8,
    unbiased: bool = True,
) -> Tensor:
    """Masked whitening ``(A - mean) / sqrt(var + eps)`` over all masked tokens.

    ``unbiased``: the variance divides by ``n - 1`` (Bessel; slime's choice, and the same convention as the group
    std of :func:`group_normalize`), by ``n`` when there is a single token; otherwise by ``n``.

    With ``process_group`` the statistics span every data-parallel rank (two all-reduces: sum/count, then the
    centred sum of squares, which avoids the cancellation of ``E[x^2] - E[x]^2``). Every rank must call this,
    even one that holds no tokens. An entirely masked batch returns zeros.
    """
    mask = as_float_mask(loss_mask, advantages.dtype)
    stats = torch.stack([(advantages * mask).sum(), mask.sum()])
    if process_group is not None:
        dist.all_reduce(stats, group=process_group)
    total, count = stats[0], stats[1]
    mean = total / count.clamp_min(1)
    centred = (advantages - mean) * mask
    square_sum = (centred**2).sum().reshape(1)
    if process_group is not None:
        dist.all_reduce(square_sum, group=process_group)
    var = square_sum[0] / ((count - 1) if unbiased else count).clamp_min(1)
    return centred * torch.rsqrt(var + eps)


def _sequence_rewards_with_kl(config: PolicyLossConfig, inputs: AdvantageInputs) -> Tensor:
    """Each sample's reward less the KL penalty summed over its episode's trained tokens (its own, for a sample
    that is its whole episode)."""
    if config.kl_coef == 0:
        return inputs.rewards
    kl = per_sample_sum(inputs.token_kl, inputs.response_lengths, inputs.loss_mask)
    if inputs.episode_ids is not None:
        inverse, n_episodes = group_index(inputs.episode_ids)
        kl = torch.zeros(n_episodes, dtype=kl.dtype, device=kl.device).index_add(0, inverse, kl)[inverse]
    return inputs.rewards - config.kl_coef * kl


# --------------------------------------------------------------------------------------------------------------
# Registered estimators: fn(config, AdvantageInputs) -> (advantages [T], returns [T])


@register_advantage_estimator("grpo")
@register_advantage_estimator("gspo", traits=(implies_loss("gspo"),))
@register_advantage_estimator("cispo", traits=(implies_loss("cispo"),))
def group_relative(config: PolicyLossConfig, inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """GRPO-family: one group-normalised sequence advantage broadcast to every token (gspo/cispo differ in loss)."""
    rewards = _sequence_rewards_with_kl(config, inputs)
    if config.rewards_normalization:
        rewards = group_normalize(rewards, inputs.group_ids, divide_by_std=config.grpo_std_normalization,
                                  eps=config.reward_norm_eps, episode_ids=inputs.episode_ids)
    advantages = to_tokens(rewards, inputs.response_lengths) * inputs.loss_mask
    return advantages, advantages


@register_advantage_estimator("grpo_process")
def process_group_relative(config: PolicyLossConfig, inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """GRPO with process supervision (DeepSeekMath, 4.1.3): every graded step's reward normalised by the mean and
    std of all the step rewards in its group, and each token's advantage the normalised reward of the step it is
    in plus the later steps', each ``step_discount`` times the one before it (1: DeepSeekMath's sum). A slip in the
    fourth step then costs the fourth step's tokens more than the three right ones before it, which an outcome
    reward cannot tell apart. Tokens after a sample's last step get 0 from the steps. A sample whose reward graded
    no steps counts as one step, its reward, on its last trained token: with no graded steps at all this is GRPO.
    The KL penalty (``kl_coef``) is per token, as reinforce_plus_plus_baseline's."""
    if inputs.episode_ids is not None and torch.unique(inputs.episode_ids).numel() < inputs.episode_ids.numel():
        raise ValueError("grpo_process grades the steps of one response; an episode of several segments (an agent "
                         "that rewrote its context) has no single response to place them on")
    steps = _steps_or_outcomes(inputs)
    rewards = steps.rewards
    if config.rewards_normalization:
        rewards = group_normalize(rewards, inputs.group_ids[steps.samples],
                                  divide_by_std=config.grpo_std_normalization, eps=config.reward_norm_eps)
    advantages = _credit_steps(GradedSteps(steps.samples, steps.ends, rewards), inputs.response_lengths,
                               config.step_discount)
    return (advantages - config.kl_coef * inputs.token_kl) * inputs.loss_mask, advantages


def _steps_or_outcomes(inputs: AdvantageInputs) -> GradedSteps:
    """The graded steps, with each sample that has none as one step: its reward on its last trained token (its last
    token when none is trained); in batch order."""
    graded = inputs.steps
    has_steps = torch.zeros(inputs.rewards.numel(), dtype=torch.bool, device=inputs.rewards.device)
    if graded is not None:
        has_steps[graded.samples] = True
    last = last_masked_index(inputs.loss_mask, inputs.response_lengths)
    offsets = torch.cumsum(inputs.response_lengths, 0) - inputs.response_lengths
    # An empty response still counts in its group's statistics, as in GRPO: its step ends on no token (-1).
    ends = torch.where(last >= 0, last - offsets, torch.full_like(last, -1))
    outcome = (~has_steps).nonzero().flatten()
    parts = [GradedSteps(outcome, ends[outcome], inputs.rewards[outcome])]
    if graded is not None:
        parts.append(graded)
    samples = torch.cat([part.samples for part in parts])
    order = torch.argsort(samples, stable=True)  # each part in order, one sample's steps all in one part
    return GradedSteps(samples[order], torch.cat([part.ends for part in parts])[order],
                       torch.cat([part.rewards for part in parts])[order])


def _credit_steps(steps: GradedSteps, response_lengths: Tensor, discount: float) -> Tensor:
    """``[T]``: each token's discounted sum of the rewards of its step (the first to end at or after it) and the
    later steps of its sample; 0 after the sample's last step."""
    advantages = torch.zeros(int(response_lengths.sum()), dtype=steps.rewards.dtype, device=steps.rewards.device)
    offsets = (torch.cumsum(response_lengths, 0) - response_lengths).tolist()
    bounds = torch.searchsorted(steps.samples, torch.arange(response_lengths.numel() + 1,
                                                            device=steps.samples.device)).tolist()
    for sample, (first, stop) in enumerate(pairwise(bounds)):
        if first == stop:
            continue
        to_go = steps.rewards[first:stop].clone()
        for index in range(to_go.numel() - 2, -1, -1):
            to_go[index] += discount * to_go[index + 1]
        length = int(response_lengths[sample])
        step_of_token = torch.searchsorted(steps.ends[first:stop], torch.arange(length, device=steps.ends.device))
        credit = torch.cat([to_go, to_go.new_zeros(1)])[step_of_token]
        advantages[offsets[sample]:offsets[sample] + length] = credit
    return advantages


@register_advantage_estimator("rloo")
def rloo(config: PolicyLossConfig, inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """REINFORCE leave-one-out: baseline is the mean reward of the other samples of the same prompt."""
    rewards = _sequence_rewards_with_kl(config, inputs)
    if config.rewards_normalization:
        rewards = leave_one_out(rewards, inputs.group_ids, inputs.episode_ids)
    advantages = to_tokens(rewards, inputs.response_lengths) * inputs.loss_mask
    return advantages, advantages


@register_advantage_estimator("reinforce_plus_plus", traits=(BATCH_WHITENED,))
def reinforce_plus_plus(config: PolicyLossConfig, inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """REINFORCE++: per-token ``-kl_coef * kl`` plus the reward on the last token, discounted returns with gamma."""
    token_kl = zero_masked(inputs.token_kl, inputs.loss_mask)  # slime masks the KL here too, whatever the flag
    token_rewards = terminal_token_rewards(
        inputs.rewards, token_kl, config.kl_coef, inputs.loss_mask, inputs.response_lengths
    )
    returns = discounted_cumsum(token_rewards, inputs.response_lengths, config.gamma)
    return returns, returns


@register_advantage_estimator("reinforce_plus_plus_baseline", traits=(BATCH_WHITENED,))
def reinforce_plus_plus_baseline(config: PolicyLossConfig, inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """REINFORCE++-baseline: ``(r - mean_g) - kl_coef * kl_t`` per token (then batch whitening)."""
    rewards = inputs.rewards
    if config.rewards_normalization:
        rewards = group_normalize(rewards, inputs.group_ids, divide_by_std=False, eps=config.reward_norm_eps,
                                  episode_ids=inputs.episode_ids)
    advantages = (to_tokens(rewards, inputs.response_lengths) - config.kl_coef * inputs.token_kl) * inputs.loss_mask
    return advantages, advantages


@register_advantage_estimator("ppo", traits=(NEEDS_CRITIC,))
def ppo(config: PolicyLossConfig, inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """PPO with a critic: GAE(gamma, lambd) over per-token rewards; returns = advantages + values."""
    if inputs.values is None:
        raise ValueError("advantage_estimator='ppo' needs values (the critic's per-token value estimates)")
    if config.untrained_token_rewards == "keep":
        # slime's placement: the penalty on every response token, the reward on the response's very last token.
        ends = torch.cumsum(inputs.response_lengths, 0) - 1
        present = inputs.response_lengths > 0
        token_rewards = (-config.kl_coef * inputs.token_kl).index_add(0, ends[present], inputs.rewards[present])
    else:
        token_rewards = terminal_token_rewards(
            inputs.rewards, inputs.token_kl, config.kl_coef, inputs.loss_mask, inputs.response_lengths
        )
    return gae(token_rewards, inputs.values, inputs.response_lengths, gamma=config.gamma, lambd=config.lambd)
