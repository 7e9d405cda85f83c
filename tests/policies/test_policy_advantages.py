import math
import re

import pytest
import torch
from policy_reference import (
    Batch,
    discounted_returns,
    flat,
    gae,
    group_normalize,
    kl,
    last_masked,
    leave_one_out,
    packed_random,
    per_sample,
    random_batch,
    whiten,
)

from policies.advantages import GradedSteps, compute_advantages
from policies.config import PolicyLossConfig


def _rewards(batch: Batch, seed: int, zero_std_group: bool = True) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 3, (len(batch.groups),), generator=gen).double()
    if zero_std_group:  # every sample of the largest group gets the same reward
        largest = max(set(batch.groups), key=batch.groups.count)
        rewards[torch.tensor(batch.groups) == largest] = 1.0
    return rewards


def _broadcast(per_seq: list[float], batch: Batch) -> torch.Tensor:
    return flat([[a * m for m in mask] for a, mask in zip(per_seq, batch.masks, strict=True)])


@pytest.mark.unit
@pytest.mark.parametrize("estimator", ["grpo", "gspo", "cispo"])
@pytest.mark.parametrize("std_normalization", [True, False])
def test_group_relative_estimators_match_loop_reference(estimator: str, std_normalization: bool) -> None:
    batch = random_batch(10)
    rewards = _rewards(batch, 11)
    config = PolicyLossConfig(advantage_estimator=estimator, grpo_std_normalization=std_normalization)
    advantages, returns = compute_advantages(
        config,
        rewards=rewards,
        group_ids=batch.group_ids,
        response_lengths=batch.response_lengths,
        loss_mask=batch.loss_mask,
    )
    expected = group_normalize(rewards.tolist(), batch.groups, std_normalization, config.reward_norm_eps)
    torch.testing.assert_close(advantages, _broadcast(expected, batch), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(returns, advantages)


@pytest.mark.unit
def test_singleton_group_gets_zero_advantage_not_nan() -> None:
    config = PolicyLossConfig()
    advantages, _ = compute_advantages(
        config,
        rewards=torch.tensor([3.0, 1.0, 0.0]),
        group_ids=torch.tensor([0, 1, 1]),
        response_lengths=torch.tensor([2, 1, 1]),
        loss_mask=torch.ones(4),
    )
    assert advantages[:2].tolist() == [0.0, 0.0]
    assert advantages[2] > 0 > advantages[3]


@pytest.mark.unit
def test_zero_std_group_gets_zero_advantage() -> None:
    advantages, _ = compute_advantages(
        PolicyLossConfig(),
        rewards=torch.tensor([0.7, 0.7, 0.7]),
        group_ids=torch.tensor([5, 5, 5]),
        response_lengths=torch.tensor([1, 2, 1]),
        loss_mask=torch.ones(4),
    )
    assert torch.all(advantages.abs() < 1e-6)


@pytest.mark.unit
def test_disabled_rewards_normalization_passes_raw_rewards_through() -> None:
    batch = random_batch(12)
    rewards = _rewards(batch, 13)
    config = PolicyLossConfig(rewards_normalization=False)
    advantages, _ = compute_advantages(
        config,
        rewards=rewards,
        group_ids=batch.group_ids,
        response_lengths=batch.response_lengths,
        loss_mask=batch.loss_mask,
    )
    torch.testing.assert_close(advantages, _broadcast(rewards.tolist(), batch))


@pytest.mark.unit
def test_rloo_uses_leave_one_out_baseline() -> None:
    batch = random_batch(14)
    rewards = _rewards(batch, 15)
    advantages, _ = compute_advantages(
        PolicyLossConfig(advantage_estimator="rloo"),
        rewards=rewards,
        group_ids=batch.group_ids,
        response_lengths=batch.response_lengths,
        loss_mask=batch.loss_mask,
    )
    expected = leave_one_out(rewards.tolist(), batch.groups)
    torch.testing.assert_close(advantages, _broadcast(expected, batch), rtol=1e-10, atol=1e-10)


def _token_rewards(
    batch: Batch, rewards: list[float], kl_rows: list[list[float]], kl_coef: float
) -> list[list[float]]:
    rows = []
    for r, kl_row, mask in zip(rewards, kl_rows, batch.masks, strict=True):
        row = [-kl_coef * k * m for k, m in zip(kl_row, mask, strict=True)]
        row[last_masked(mask)] += r
        rows.append(row)
    return rows


def _kl_rows(batch: Batch, log_probs: torch.Tensor, ref: torch.Tensor, kind: str) -> list[list[float]]:
    return [
        [kl(kind, a, b) for a, b in zip(lp, rp, strict=True)]
        for lp, rp in zip(per_sample(log_probs, batch), per_sample(ref, batch), strict=True)
    ]


@pytest.mark.unit
def test_reinforce_plus_plus_discounts_kl_penalised_token_rewards() -> None:
    batch = random_batch(16)
    rewards = _rewards(batch, 17)
    log_probs, ref = packed_random(batch, 18, 0.3, -1.0), packed_random(batch, 19, 0.3, -1.0)
    config = PolicyLossConfig(
        advantage_estimator="reinforce_plus_plus",
        normalize_advantages=True,
        kl_coef=0.1,
        gamma=0.9,
        kl_loss_type="k3",
    )
    advantages, returns = compute_advantages(
        config,
        rewards=rewards,
        group_ids=batch.group_ids,
        response_lengths=batch.response_lengths,
        loss_mask=batch.loss_mask,
        log_probs=log_probs,
        ref_log_probs=ref,
    )
    token_rewards = _token_rewards(batch, rewards.tolist(), _kl_rows(batch, log_probs, ref, "k3"), 0.1)
    expected_returns = [discounted_returns(row, 0.9) for row in token_rewards]
    masked_returns = [
        [x * m for x, m in zip(r, k, strict=True)] for r, k in zip(expected_returns, batch.masks, strict=True)
    ]
    torch.testing.assert_close(returns, flat(masked_returns), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(advantages, flat(whiten(expected_returns, batch.masks)), rtol=1e-8, atol=1e-8)


@pytest.mark.unit
def test_reinforce_plus_plus_baseline_subtracts_group_mean_and_token_kl() -> None:
    batch = random_batch(20)
    rewards = _rewards(batch, 21)
    log_probs, ref = packed_random(batch, 22, 0.3, -1.0), packed_random(batch, 23, 0.3, -1.0)
    config = PolicyLossConfig(
        advantage_estimator="reinforce_plus_plus_baseline", normalize_advantages=True, kl_coef=0.05
    )
    advantages, _ = compute_advantages(
        config,
        rewards=rewards,
        group_ids=batch.group_ids,
        response_lengths=batch.response_lengths,
        loss_mask=batch.loss_mask,
        log_probs=log_probs,
        ref_log_probs=ref,
    )
    centred = group_normalize(rewards.tolist(), batch.groups, False, 0.0)
    kl_rows = _kl_rows(batch, log_probs, ref, "k1")
    raw = [[c - 0.05 * k for k in kl_row] for c, kl_row in zip(centred, kl_rows, strict=True)]
    torch.testing.assert_close(advantages, flat(whiten(raw, batch.masks)), rtol=1e-8, atol=1e-8)


@pytest.mark.unit
@pytest.mark.parametrize(("gamma", "lambd"), [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0)])
def test_ppo_gae_matches_backward_loop_and_returns_are_advantage_plus_value(gamma: float, lambd: float) -> None:
    batch = random_batch(24)
    rewards = _rewards(batch, 25)
    values = packed_random(batch, 26, 0.5)
    log_probs, ref = packed_random(batch, 27, 0.3, -1.0), packed_random(batch, 28, 0.3, -1.0)
    config = PolicyLossConfig(advantage_estimator="ppo", gamma=gamma, lambd=lambd, kl_coef=0.2, kl_loss_type="k2")
    advantages, returns = compute_advantages(
        config,
        rewards=rewards,
        group_ids=batch.group_ids,
        response_lengths=batch.response_lengths,
        loss_mask=batch.loss_mask,
        values=values,
        log_probs=log_probs,
        ref_log_probs=ref,
    )
    token_rewards = _token_rewards(batch, rewards.tolist(), _kl_rows(batch, log_probs, ref, "k2"), 0.2)
    expected_adv, expected_ret = [], []
    for row, value_row, mask in zip(token_rewards, per_sample(values, batch), batch.masks, strict=True):
        adv, ret = gae(row, value_row, gamma, lambd)
        expected_adv.append([a * m for a, m in zip(adv, mask, strict=True)])
        expected_ret.append([r * m for r, m in zip(ret, mask, strict=True)])
    torch.testing.assert_close(advantages, flat(expected_adv), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(returns, flat(expected_ret), rtol=1e-10, atol=1e-10)


@pytest.mark.unit
def test_kl_reward_penalty_reduces_sequence_reward_before_group_normalization() -> None:
    batch = random_batch(29)
    rewards = _rewards(batch, 30, zero_std_group=False)
    log_probs, ref = packed_random(batch, 31, 0.3, -1.0), packed_random(batch, 32, 0.3, -1.0)
    config = PolicyLossConfig(kl_coef=0.3, kl_loss_type="k3")
    advantages, _ = compute_advantages(
        config,
        rewards=rewards,
        group_ids=batch.group_ids,
        response_lengths=batch.response_lengths,
        loss_mask=batch.loss_mask,
        log_probs=log_probs,
        ref_log_probs=ref,
    )
    kl_rows = _kl_rows(batch, log_probs, ref, "k3")
    penalised = [
        r - 0.3 * sum(k * m for k, m in zip(kl_row, mask, strict=True))
        for r, kl_row, mask in zip(rewards.tolist(), kl_rows, batch.masks, strict=True)
    ]
    expected = group_normalize(penalised, batch.groups, True, config.reward_norm_eps)
    torch.testing.assert_close(advantages, _broadcast(expected, batch), rtol=1e-10, atol=1e-10)


@pytest.mark.unit
def test_normalize_advantages_whitens_over_masked_tokens_only() -> None:
    batch = random_batch(33)
    rewards = _rewards(batch, 34)
    advantages, _ = compute_advantages(
        PolicyLossConfig(normalize_advantages=True, grpo_std_normalization=False),
        rewards=rewards,
        group_ids=batch.group_ids,
        response_lengths=batch.response_lengths,
        loss_mask=batch.loss_mask,
    )
    raw = group_normalize(rewards.tolist(), batch.groups, False, 0.0)
    expected = whiten([[a] * len(mask) for a, mask in zip(raw, batch.masks, strict=True)], batch.masks)
    torch.testing.assert_close(advantages, flat(expected), rtol=1e-8, atol=1e-8)


@pytest.mark.unit
def test_nan_reward_is_a_clear_error_naming_the_sample() -> None:
    with pytest.raises(ValueError, match=r"rewards: non-finite value nan at index 1"):
        compute_advantages(
            PolicyLossConfig(),
            rewards=torch.tensor([1.0, math.nan]),
            group_ids=torch.tensor([0, 0]),
            response_lengths=torch.tensor([1, 1]),
            loss_mask=torch.ones(2),
        )


@pytest.mark.unit
def test_inf_log_prob_for_kl_penalty_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"ref_log_probs: non-finite value -inf at index 0"):
        compute_advantages(
            PolicyLossConfig(kl_coef=0.1),
            rewards=torch.tensor([1.0, 0.0]),
            group_ids=torch.tensor([0, 0]),
            response_lengths=torch.tensor([1, 1]),
            loss_mask=torch.ones(2),
            log_probs=torch.zeros(2),
            ref_log_probs=torch.tensor([-math.inf, 0.0]),
        )


@pytest.mark.unit
def test_ppo_without_values_says_what_is_missing() -> None:
    with pytest.raises(ValueError, match="needs values"):
        compute_advantages(
            PolicyLossConfig(advantage_estimator="ppo"),
            rewards=torch.tensor([1.0]),
            group_ids=torch.tensor([0]),
            response_lengths=torch.tensor([1]),
            loss_mask=torch.ones(1),
        )


@pytest.mark.unit
def test_reward_count_must_match_samples() -> None:
    with pytest.raises(ValueError, match=r"rewards: expected shape \[2\]"):
        compute_advantages(
            PolicyLossConfig(),
            rewards=torch.tensor([1.0]),
            group_ids=torch.tensor([0, 0]),
            response_lengths=torch.tensor([1, 1]),
            loss_mask=torch.ones(2),
        )


@pytest.mark.unit
def test_bfloat16_rewards_are_computed_in_float32() -> None:
    advantages, _ = compute_advantages(
        PolicyLossConfig(),
        rewards=torch.tensor([1.0, 0.0], dtype=torch.bfloat16),
        group_ids=torch.tensor([0, 0]),
        response_lengths=torch.tensor([1, 1]),
        loss_mask=torch.ones(2, dtype=torch.bool),
    )
    assert advantages.dtype == torch.float32


@pytest.mark.unit
@pytest.mark.parametrize(("flags", "taught"), [
    ({"advantage_estimator": "grpo"}, False), ({"advantage_estimator": "gspo"}, False),
    ({"advantage_estimator": "rloo"}, False),
    ({"advantage_estimator": "reinforce_plus_plus_baseline", "normalize_advantages": True}, False),
    ({"advantage_estimator": "grpo", "rewards_normalization": False}, True),
    ({"advantage_estimator": "reinforce_plus_plus", "normalize_advantages": True}, True),
    ({"advantage_estimator": "ppo"}, True)])
def test_single_sample_groups_are_taught_only_by_estimators_without_a_group_baseline(
        flags: dict, taught: bool) -> None:
    from policies.advantages import rewards_teach_single_samples

    assert rewards_teach_single_samples(PolicyLossConfig(**flags)) is taught


@pytest.mark.unit
def test_a_run_whose_rewards_cannot_teach_is_told_so_at_the_start() -> None:
    from actors.config import RunConfig
    from actors.learner.actor import rewards_unseen_because

    alone = rewards_unseen_because(RunConfig(n_samples_per_prompt=1))
    assert alone is not None and alone.startswith("--advantage-estimator grpo with --n-samples-per-prompt 1: ")
    assert rewards_unseen_because(RunConfig(n_samples_per_prompt=2)) is None
    sft = RunConfig(n_samples_per_prompt=1, policy=PolicyLossConfig(loss_type="sft"))
    assert rewards_unseen_because(sft) is None


@pytest.mark.unit
@pytest.mark.parametrize("estimator", ["grpo", "gspo", "cispo", "rloo", "reinforce_plus_plus_baseline"])
@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_an_episode_split_into_segments_gives_every_token_the_advantage_it_has_whole(estimator: str,
                                                                                      kl_coef: float) -> None:
    """An agent that rewrote its context trains its episode as several segments: the group baseline counts the
    episode once (its reward less the KL of all its segments), so each token's advantage is what it would be had
    the episode been one sample, whitening included."""
    gen = torch.Generator().manual_seed(5)
    groups = [0, 0, 0, 0, 1, 1, 1]
    lengths = torch.randint(3, 9, (len(groups),), generator=gen)
    rewards = torch.randint(0, 3, (len(groups),), generator=gen).double()
    tokens = int(lengths.sum())
    mask = (torch.rand(tokens, generator=gen) > 0.3).double()
    log_probs, ref_log_probs = -torch.rand(tokens, generator=gen).double(), -torch.rand(tokens, generator=gen).double()
    config = PolicyLossConfig(advantage_estimator=estimator, kl_coef=kl_coef, normalize_advantages=True)
    inputs = {"loss_mask": mask, "log_probs": log_probs, "ref_log_probs": ref_log_probs}
    whole, _ = compute_advantages(config, rewards=rewards, group_ids=torch.tensor(groups), response_lengths=lengths,
                                  **inputs)
    pieces: list[tuple[int, int]] = []  # (episode, length) per segment, in order: an episode cut in 1 to 3
    for episode, length in enumerate(lengths.tolist()):
        cuts = sorted(torch.randperm(length - 1, generator=gen)[:episode % 3].add(1).tolist())
        pieces += [(episode, end - start) for start, end in zip([0, *cuts], [*cuts, length], strict=True)]
    episodes = torch.tensor([episode for episode, _ in pieces])
    split = {"rewards": rewards[episodes], "group_ids": torch.tensor(groups)[episodes],
             "response_lengths": torch.tensor([length for _, length in pieces]), **inputs}
    assert len(pieces) > len(groups)
    segmented, _ = compute_advantages(config, episode_ids=episodes, **split)
    torch.testing.assert_close(segmented, whole, rtol=1e-10, atol=1e-10)
    counted_as_samples, _ = compute_advantages(config, **split)  # each segment a sample of its own: not the same
    assert not torch.allclose(counted_as_samples, whole)


# ---------------------------------------------------------------- process supervision (grpo_process)


def _random_steps(batch: Batch, seed: int) -> tuple[list[list[tuple[int, float]] | None], GradedSteps]:
    """Graded steps for most samples (in order, two of them possibly on one token), none for every third."""
    gen = torch.Generator().manual_seed(seed)
    per_sample: list[list[tuple[int, float]] | None] = []
    for index, length in enumerate(batch.lengths):
        if index % 3 == 2:
            per_sample.append(None)
            continue
        count = int(torch.randint(1, 4, (1,), generator=gen))
        ends = sorted(int(e) for e in torch.randint(0, length, (count,), generator=gen))
        per_sample.append([(end, float(torch.randint(0, 2, (1,), generator=gen))) for end in ends])
    graded = [(index, end, reward) for index, steps in enumerate(per_sample) if steps for end, reward in steps]
    return per_sample, GradedSteps(samples=torch.tensor([g[0] for g in graded]),
                                   ends=torch.tensor([g[1] for g in graded]),
                                   rewards=torch.tensor([g[2] for g in graded], dtype=torch.float64))


def _process_reference(batch: Batch, rewards: list[float], steps: list[list[tuple[int, float]] | None], *,
                       discount: float, divide_by_std: bool, eps: float) -> torch.Tensor:
    """DeepSeekMath's process supervision, written out: every step of a group normalised together, a token's
    advantage its step's normalised reward plus the later ones', discounted per step."""
    own = [found if found else [(last_masked(mask), reward)]
           for found, mask, reward in zip(steps, batch.masks, rewards, strict=True)]
    flat_steps = [(index, end, reward) for index, sample_steps in enumerate(own) for end, reward in sample_steps]
    normalised = group_normalize([r for _, _, r in flat_steps], [batch.groups[i] for i, _, _ in flat_steps],
                                 divide_by_std, eps)
    rows = []
    for index, (length, mask) in enumerate(zip(batch.lengths, batch.masks, strict=True)):
        mine = [(end, value) for (owner, end, _), value in zip(flat_steps, normalised, strict=True) if owner == index]
        row = []
        for token in range(length):
            later = [value for end, value in mine if end >= token]
            row.append(sum(discount**k * value for k, value in enumerate(later)) * mask[token])
        rows.append(row)
    return flat(rows)


@pytest.mark.unit
@pytest.mark.parametrize("discount", [1.0, 0.5, 0.0])
@pytest.mark.parametrize("std_normalization", [True, False])
def test_grpo_process_matches_deepseekmath_process_supervision_written_out(discount: float,
                                                                         std_normalization: bool) -> None:
    batch = random_batch(21, n_groups=5)
    rewards = _rewards(batch, 22)
    per_sample, steps = _random_steps(batch, 23)
    config = PolicyLossConfig(advantage_estimator="grpo_process", step_discount=discount,
                              grpo_std_normalization=std_normalization)
    advantages, _ = compute_advantages(config, rewards=rewards, group_ids=batch.group_ids,
                                       response_lengths=batch.response_lengths, loss_mask=batch.loss_mask,
                                       steps=steps)
    expected = _process_reference(batch, rewards.tolist(), per_sample, discount=discount,
                                  divide_by_std=std_normalization, eps=config.reward_norm_eps)
    torch.testing.assert_close(advantages, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.unit
def test_grpo_process_without_graded_steps_is_grpo() -> None:
    batch = random_batch(31)
    rewards = _rewards(batch, 32)
    inputs = {"rewards": rewards, "group_ids": batch.group_ids, "response_lengths": batch.response_lengths,
              "loss_mask": batch.loss_mask}
    empty = {"rewards": torch.tensor([1.0, 0.0, 0.5]), "group_ids": torch.tensor([0, 0, 0]),  # an empty response
             "response_lengths": torch.tensor([2, 0, 3]), "loss_mask": torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0])}
    for batch_inputs in (inputs, empty):  # counts in its group's statistics, as in GRPO
        process, _ = compute_advantages(PolicyLossConfig(advantage_estimator="grpo_process"), **batch_inputs)
        grpo, _ = compute_advantages(PolicyLossConfig(advantage_estimator="grpo"), **batch_inputs)
        torch.testing.assert_close(process, grpo, rtol=1e-12, atol=1e-12)


@pytest.mark.unit
def test_a_slip_costs_its_own_step_not_the_right_steps_before_it() -> None:
    # Two answers to one problem of three links: one right throughout, one right twice and then wrong. GRPO gives
    # every token of the second the same negative advantage; per-step credit pushes its two right steps up.
    lengths = torch.tensor([6, 6])
    steps = GradedSteps(samples=torch.tensor([0, 0, 0, 1, 1, 1]), ends=torch.tensor([1, 3, 5, 1, 3, 5]),
                        rewards=torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.0]))
    inputs = {"rewards": torch.tensor([1.0, 2 / 3]), "group_ids": torch.tensor([0, 0]), "response_lengths": lengths,
              "loss_mask": torch.ones(12)}
    grpo, _ = compute_advantages(PolicyLossConfig(advantage_estimator="grpo"), **inputs)
    assert (grpo[6:] < 0).all()
    own_step, _ = compute_advantages(PolicyLossConfig(advantage_estimator="grpo_process", step_discount=0.0),
                                     steps=steps, **inputs)
    assert (own_step[:10] > 0).all() and (own_step[10:] < 0).all()
    to_go, _ = compute_advantages(PolicyLossConfig(advantage_estimator="grpo_process"), steps=steps, **inputs)
    assert (to_go[6:] < 0).all() and to_go[10] < to_go[8] < to_go[6]  # the sum runs to the last step: each
    # later right step adds to the tokens before it


@pytest.mark.unit
@pytest.mark.parametrize(("steps", "message"), [
    (GradedSteps(torch.tensor([0]), torch.tensor([3]), torch.tensor([1.0])),
     "step 0 of sample 0 ends on token 3, outside its response of 3 tokens"),
    (GradedSteps(torch.tensor([2]), torch.tensor([0]), torch.tensor([1.0])), "names sample 2, outside the batch"),
    (GradedSteps(torch.tensor([0, 0]), torch.tensor([2, 1]), torch.tensor([1.0, 0.0])), "must come in order"),
    (GradedSteps(torch.tensor([1, 0]), torch.tensor([0, 0]), torch.tensor([1.0, 0.0])), "must come in order"),
    (GradedSteps(torch.tensor([0]), torch.tensor([0]), torch.tensor([float("nan")])), "steps' rewards"),
])
def test_graded_steps_that_do_not_fit_the_batch_are_refused_naming_the_step(steps: GradedSteps,
                                                                            message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        compute_advantages(PolicyLossConfig(advantage_estimator="grpo_process"), rewards=torch.tensor([1.0, 0.0]),
                           group_ids=torch.tensor([0, 0]), response_lengths=torch.tensor([3, 2]),
                           loss_mask=torch.ones(5), steps=steps)


@pytest.mark.unit
def test_grpo_process_refuses_an_episode_of_several_segments() -> None:
    with pytest.raises(ValueError, match="an episode of several segments"):
        compute_advantages(PolicyLossConfig(advantage_estimator="grpo_process"), rewards=torch.tensor([1.0, 1.0]),
                           group_ids=torch.tensor([0, 0]), response_lengths=torch.tensor([2, 2]),
                           loss_mask=torch.ones(4), episode_ids=torch.tensor([5, 5]))
