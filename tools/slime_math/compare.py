"""Compare Slipstream's RL math with slime's, function by function, on seeded random packed batches.

    python -m tools.slime_math.compare --slime /tmp/slime_src

``--slime`` is a slime source tree (e.g. ``git -C <mirror> archive HEAD | tar -x -C /tmp/slime_src``). slime's
functions are loaded from its files, not imported as a package: ``slime/utils/ppo_utils.py`` is executed as a
module (with ``torch.compile`` turned into a no-op so nothing is compiled), and the few functions we need from
files whose imports pull in Megatron or Ray (``loss.py``, ``cp_utils.py``, ``distributed_utils.py``,
``ray/rollout.py``) are lifted out of the file by name with :mod:`ast` and run in a namespace where Megatron's
``mpu`` is a single-rank stand-in. This is why it is a maintainer's tool and not a test: CI has no slime tree.

Each row runs both sides on the same inputs (masks with holes, untrained tails, an all-masked sample, extreme
log-ratios) and compares them on the trained tokens. ``agree`` means max |ours - slime| / max(1, |slime|) <= 1e-6;
rows that name a flag run our side with that flag (the setting that gives slime's behaviour). Every ``differ`` row
is explained in docs/policies.md, "Where we differ from slime".
"""

from __future__ import annotations

import argparse
import math
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from policies.advantages import compute_advantages
from policies.aggregation import aggregate
from policies.config import PolicyLossConfig
from policies.corrections import icepop, mis, opsm_keep_mask, tis
from policies.kl import compute_kl
from policies.losses import PolicyLossInputs, cispo_loss, compute_policy_loss, compute_value_loss, gspo_loss, ppo_loss
from tools.slime_math.loader import load_slime

TOLERANCE = 1e-6

# ----------------------------------------------------------------------------------------------------------------
# Inputs


class Batch:
    """A seeded packed batch: 2 prompts x 3 samples; holes, untrained tails, one all-masked sample, extreme ratios."""

    def __init__(self, seed: int, *, extreme: bool, with_empty: bool = True) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.lengths = [5, 7, 3, 6, 4, 8]
        masks = []
        for i, n in enumerate(self.lengths):
            m = (torch.rand(n, generator=gen) > 0.3).double()
            m[0] = 1.0
            if i == 2 and with_empty:
                m[:] = 0.0  # all-masked sample
            if i == 3:
                m[-2:] = 0.0  # untrained tail (e.g. a tool's output after the last turn)
            masks.append(m)
        self.masks = masks
        self.group_ids = torch.tensor([0, 0, 0, 1, 1, 1])
        self.rewards = torch.rand(6, generator=gen, dtype=torch.float64) * 2 - 0.5
        t = sum(self.lengths)

        def lp() -> torch.Tensor:
            return -torch.rand(t, generator=gen, dtype=torch.float64) * 3

        self.log_probs, self.old_log_probs, self.rollout_log_probs, self.ref_log_probs = lp(), lp(), lp(), lp()
        self.old_log_probs = self.log_probs + torch.randn(t, generator=gen, dtype=torch.float64) * 0.3
        self.rollout_log_probs = self.old_log_probs + torch.randn(t, generator=gen, dtype=torch.float64) * 0.5
        if extreme:  # trained tokens far off-policy, both ways, and one whole sequence (the last) beyond e^20
            self.old_log_probs[[1, 8, 16]] += torch.tensor([30.0, -25.0, 40.0], dtype=torch.float64)
            self.old_log_probs[25:] -= 25.0
            self.rollout_log_probs[[4, 12]] -= 30.0
            flat = torch.cat(self.masks)
            flat[[1, 4, 8, 12, 16]] = 1.0
            self.masks = list(flat.split(self.lengths))
        self.values = torch.randn(t, generator=gen, dtype=torch.float64)
        self.token_advantages = torch.randn(t, generator=gen, dtype=torch.float64)
        self.teacher_log_probs = lp()  # drawn last: the other fields keep the values they had before it existed
        self.response_lengths = torch.tensor(self.lengths)
        self.loss_mask = torch.cat(self.masks)

    def split(self, x: torch.Tensor) -> list[torch.Tensor]:
        return list(x.split(self.lengths))

    def seq_advantages(self) -> torch.Tensor:
        """One advantage per sample broadcast to its tokens (what GRPO gives), negative for half the samples."""
        per_sample = torch.tensor([0.7, -1.2, 0.4, -0.3, 1.1, -0.8], dtype=torch.float64)
        return per_sample.repeat_interleave(self.response_lengths)


def _compare(ours: torch.Tensor, theirs: torch.Tensor, mask: torch.Tensor | None) -> float:
    ours, theirs = ours.detach().double(), theirs.detach().double()
    if mask is not None:
        keep = mask > 0
        ours, theirs = ours[keep], theirs[keep]
    if ours.numel() == 0:
        return 0.0
    if torch.isnan(theirs).any() or torch.isinf(theirs).any() or torch.isnan(ours).any():
        both_nan = torch.isnan(ours) & torch.isnan(theirs)
        same_inf = torch.isinf(ours) & (ours == theirs)
        if not (both_nan | same_inf | (ours - theirs).abs().le(TOLERANCE)).all():
            return math.inf
        keep = ~(both_nan | same_inf)
        ours, theirs = ours[keep], theirs[keep]
        if ours.numel() == 0:
            return 0.0
    return float(((ours - theirs).abs() / theirs.abs().clamp_min(1)).max())


# ----------------------------------------------------------------------------------------------------------------
# Rows: each returns (our tensor, slime's tensor, mask to compare on or None)


def _only_set(**kw: Any) -> dict[str, Any]:
    """Keyword arguments that differ from the callee's default, so the tool also runs against older checkouts."""
    return {k: v for k, v in kw.items() if v not in (None, False)}


def _args(**kw: Any) -> argparse.Namespace:
    defaults = dict(
        use_rollout_logprobs=False,
        kl_coef=0.0,
        kl_loss_type="k1",
        custom_advantage_function_path=None,
        advantage_estimator="grpo",
        gamma=1.0,
        lambd=1.0,
        use_opd=False,
        normalize_advantages=False,
        rewards_normalization=True,
        grpo_std_normalization=True,
        n_samples_per_prompt=3,
        rollout_batch_size=2,
        eps_clip=0.2,
        eps_clip_high=0.28,
        eps_clip_c=None,
        tis_clip=2.0,
        tis_clip_low=0.5,
        opsm_delta=1e-4,
    )
    defaults.update(kw)
    return argparse.Namespace(**defaults)


def _kl_row(slime: Any, b: Batch, kind: str, weighted: bool, flags: dict[str, Any]) -> tuple:
    cfg = PolicyLossConfig(**flags)
    ratio_slime = torch.exp(b.log_probs - b.old_log_probs) if weighted else None
    clamp = getattr(cfg, "log_ratio_clamp", 20.0)
    log_ratio = b.log_probs - b.old_log_probs
    ratio_ours = (log_ratio.clamp(-clamp, clamp) if clamp is not None else log_ratio).exp() if weighted else None
    theirs = slime.ppo.compute_approx_kl(b.log_probs, b.ref_log_probs, kind, importance_ratio=ratio_slime)
    after = _only_set(clamp_after_weight=getattr(cfg, "low_var_kl_clamp_after_weight", False))
    ours = compute_kl(kind, b.log_probs, b.ref_log_probs, importance_ratio=ratio_ours, **after)
    return ours, theirs, b.loss_mask


def _loss_inputs(b: Batch, advantages: torch.Tensor) -> PolicyLossInputs:
    return PolicyLossInputs(
        log_probs=b.log_probs.clone().requires_grad_(True),
        old_log_probs=b.old_log_probs,
        advantages=advantages * b.loss_mask,
        loss_mask=b.loss_mask,
        response_lengths=b.response_lengths,
    )


def _loss_row(slime: Any, b: Batch, kind: str, flags: dict[str, Any], token_adv: bool) -> tuple:
    adv = b.token_advantages if token_adv else b.seq_advantages()
    cfg = PolicyLossConfig(eps_clip_high=0.28, **flags)
    inputs = _loss_inputs(b, adv)
    ours_fn = {"ppo": ppo_loss, "gspo": gspo_loss, "cispo": cispo_loss}[kind]
    ours = ours_fn(cfg, inputs).per_token_loss
    log_probs = b.log_probs.clone()
    if kind == "gspo":
        ppo_kl = slime.ppo.compute_gspo_kl(b.split(log_probs), b.split(b.old_log_probs), b.split(log_probs), b.masks)
    else:
        ppo_kl = b.old_log_probs - log_probs
    if kind == "cispo":
        theirs, _ = slime.ppo.compute_cispo_loss(ppo_kl, log_probs, adv, cfg.eps_clip, cfg.eps_clip_high)
    else:
        theirs, _ = slime.ppo.compute_policy_loss(ppo_kl, adv, cfg.eps_clip, cfg.eps_clip_high, cfg.eps_clip_c)
    return ours, theirs, b.loss_mask


def _gspo_grad_row(slime: Any, b: Batch, flags: dict[str, Any]) -> tuple:
    """GSPO's gradient: our token form vs slime's sequence ratio, both reduced by seq-mean-token-mean."""
    adv = b.seq_advantages()
    cfg = PolicyLossConfig(eps_clip_high=0.28, **flags)
    inputs = _loss_inputs(b, adv)
    loss = aggregate(gspo_loss(cfg, inputs).per_token_loss, b.loss_mask, b.response_lengths, "seq-mean-token-mean")
    (ours,) = torch.autograd.grad(loss, inputs.log_probs)
    log_probs = b.log_probs.clone().requires_grad_(True)
    ppo_kl = slime.ppo.compute_gspo_kl(b.split(log_probs), b.split(b.old_log_probs), b.split(log_probs), b.masks)
    per_token, _ = slime.ppo.compute_policy_loss(ppo_kl, adv, cfg.eps_clip, cfg.eps_clip_high, None)
    slime_loss = aggregate(per_token, b.loss_mask, b.response_lengths, "seq-mean-token-mean")
    (theirs,) = torch.autograd.grad(slime_loss, log_probs)
    return ours, theirs, b.loss_mask


def _correction_row(slime: Any, b: Batch, kind: str, flags: dict[str, Any]) -> tuple:
    cfg = PolicyLossConfig(tis_clip_low=0.5, **flags)
    kw = dict(
        old_log_probs=b.old_log_probs,
        rollout_log_probs=b.rollout_log_probs,
        loss_mask=b.loss_mask,
        response_lengths=b.response_lengths,
    )
    ours = {"tis": tis, "icepop": icepop}[kind](cfg, **kw).weights
    fn = {"tis": slime.vanilla_tis, "icepop": slime.icepop}[kind]
    theirs, _, _ = fn(
        _args(),
        pg_loss=torch.ones_like(b.loss_mask),
        train_log_probs=b.split(b.old_log_probs),
        rollout_log_probs=b.split(b.rollout_log_probs),
        loss_masks=b.masks,
    )
    return ours, theirs, b.loss_mask



def _slime_mis(slime: Any, b: Any, level: str) -> tuple[Any, Any]:
    """slime's example MIS in mask mode with the bounds every row uses: (per-sample weights, per-sample masks)."""
    args = argparse.Namespace(
        use_tis=True, tis_mode="mask", tis_level=level, tis_upper_bound=2.0, tis_lower_bound=0.5,
        rs_lower_bound=None, rs_upper_bound=None, use_rs=False, rs_veto_threshold=None, tis_batch_normalize=False,
    )  # fmt: skip
    weights, masks, _ = slime.mis.compute_mis_weights(
        args, train_log_probs=b.split(b.old_log_probs), rollout_log_probs=b.split(b.rollout_log_probs),
        loss_masks=b.masks,
    )  # fmt: skip
    return weights, masks

def _mis_row(slime: Any, b: Batch, level: str, part: str) -> tuple:
    cfg = PolicyLossConfig(off_policy_correction="mis", mis_level=level, mis_upper_bound=2.0, mis_lower_bound=0.5)
    result = mis(
        cfg,
        old_log_probs=b.old_log_probs,
        rollout_log_probs=b.rollout_log_probs,
        loss_mask=b.loss_mask,
        response_lengths=b.response_lengths,
    )
    weights, masks = _slime_mis(slime, b, level)
    keep = torch.cat(masks)
    if part == "keep":
        return result.keep_mask, keep, b.loss_mask
    return result.weights * result.keep_mask, torch.cat(weights) * keep, b.loss_mask


def _opsm_row(slime: Any, b: Batch, token_adv: bool, flags: dict[str, Any]) -> tuple:
    adv = (b.token_advantages if token_adv else b.seq_advantages()) * b.loss_mask
    cfg = PolicyLossConfig(use_opsm=True, opsm_delta=0.05, **flags)
    ours, _ = opsm_keep_mask(
        advantages=adv,
        log_probs=b.log_probs,
        rollout_log_probs=b.old_log_probs,  # slime's OPSM reads pi_old; feed ours the same tensor
        loss_mask=b.loss_mask,
        response_lengths=b.response_lengths,
        delta=cfg.opsm_delta,
        **({"per_token": False} if "opsm_token_advantage" in flags else {}),
    )
    theirs, _ = slime.ppo.compute_opsm_mask(
        _args(opsm_delta=0.05), b.split(b.log_probs), b.split(b.old_log_probs), b.split(adv), b.masks
    )
    return ours, theirs, b.loss_mask


def _advantage_row(slime: Any, b: Batch, estimator: str, flags: dict[str, Any]) -> tuple:
    cfg = PolicyLossConfig(advantage_estimator=estimator, **flags)
    ours, _ = compute_advantages(
        cfg,
        rewards=b.rewards,
        group_ids=b.group_ids,
        response_lengths=b.response_lengths,
        loss_mask=b.loss_mask,
        values=b.values if estimator == "ppo" else None,
        log_probs=b.log_probs,
        ref_log_probs=b.ref_log_probs,
        teacher_log_probs=b.teacher_log_probs if cfg.use_opd else None,
    )
    args = _args(
        use_opd=cfg.use_opd,
        opd_kl_coef=cfg.opd_kl_coef,
        opd_type="megatron",
        advantage_estimator=estimator,
        kl_coef=cfg.kl_coef,
        kl_loss_type=cfg.kl_loss_type,
        gamma=cfg.gamma,
        lambd=cfg.lambd,
        normalize_advantages=cfg.normalize_advantages,
        rewards_normalization=cfg.rewards_normalization,
        grpo_std_normalization=cfg.grpo_std_normalization,
    )
    manager = types.SimpleNamespace(args=args, custom_reward_post_process_func=None)
    samples = [types.SimpleNamespace(get_reward_value=lambda a, r=float(r): r) for r in b.rewards]
    _, rewards = slime.post_process_rewards(manager, samples)
    data: dict[str, Any] = {
        "log_probs": b.split(b.log_probs.float()),
        "ref_log_probs": b.split(b.ref_log_probs.float()),
        "rewards": rewards,
        "values": b.split(b.values) if estimator == "ppo" else None,
        "response_lengths": b.lengths,
        "loss_masks": [m.float() for m in b.masks],
        "total_lengths": [n + 10 for n in b.lengths],
    }
    if cfg.use_opd:
        data["teacher_log_probs"] = b.split(b.teacher_log_probs.float())
    slime.compute_advantages_and_returns(args, data)
    return ours, torch.cat(data["advantages"]), b.loss_mask


def _value_loss_row(slime: Any, b: Batch, flags: dict[str, Any]) -> tuple:
    """The critic's clipped value loss, summed over per-sample means: slime's ``value_loss_function`` reduces with
    ``sum_of_sample_mean``, which our seq-mean-token-mean gives with a denominator of 1 (the learner's is the
    step's sample count, which slime's loss wrapper divides by afterwards)."""
    cfg = PolicyLossConfig(value_clip=0.2, **flags)
    predicted = b.old_log_probs  # any per-token values: far enough from the old ones that the clip bites
    old_values, returns = b.values, b.token_advantages
    ours, _ = compute_value_loss(cfg, values=predicted, returns=returns, loss_mask=b.loss_mask,
                                 response_lengths=b.response_lengths, old_values=old_values, denominator=1.0)
    slime.loss_namespace["get_values"] = lambda logits, **_: (None, {"values": logits})
    reduce = slime.sum_of_sample_mean([n + 10 for n in b.lengths], b.lengths, b.masks)
    batch = {"values": b.split(old_values), "returns": b.split(returns), "unconcat_tokens": None,
             "total_lengths": None, "response_lengths": b.lengths}
    theirs, _ = slime.value_loss_function(_args(value_clip=cfg.value_clip), batch, b.split(predicted), reduce)
    return ours.reshape(1), theirs.reshape(1), None


def _aggregation_row(slime: Any, b: Batch, mode: str, flags: dict[str, Any]) -> tuple:
    cfg = PolicyLossConfig(loss_agg_mode=mode, **flags)
    per_token = b.values
    empty = _only_set(count_empty_samples=getattr(cfg, "count_empty_samples", False))
    ours = aggregate(per_token, b.loss_mask, b.response_lengths, mode, **empty)
    per_token_loss = mode == "token-mean"
    args = argparse.Namespace(
        calculate_per_token_loss=per_token_loss,
        loss_type="custom_loss",
        custom_loss_function_path=lambda args, batch, logits, reduce: (reduce(per_token), {}),
        recompute_loss_function=False,
        allgather_cp=False,
    )
    batch = {
        "loss_masks": b.masks,
        "response_lengths": b.lengths,
        "total_lengths": [n + 10 for n in b.lengths],
        "rollout_mask_sums": [m.sum() for m in b.masks],
    }
    loss, normalizer, _ = slime.loss_function(args, batch, 1, len(b.lengths), torch.zeros(1))
    theirs = loss / normalizer
    return ours.reshape(1), theirs.reshape(1), None


def _mis_loss_row(slime: Any, b: Batch, flags: dict[str, Any]) -> tuple:
    """PPO's pg_loss with token MIS under seq-mean-token-mean: where rejected tokens go in the denominators."""
    adv = b.seq_advantages() * b.loss_mask
    cfg = PolicyLossConfig(
        off_policy_correction="mis", mis_upper_bound=2.0, mis_lower_bound=0.5, eps_clip_high=0.28, **flags
    )
    _, metrics = compute_policy_loss(
        cfg,
        log_probs=b.log_probs,
        old_log_probs=b.old_log_probs,
        rollout_log_probs=b.rollout_log_probs,
        advantages=adv,
        loss_mask=b.loss_mask,
        response_lengths=b.response_lengths,
    )
    weights, masks = _slime_mis(slime, b, "token")
    per_token, _ = slime.ppo.compute_policy_loss(b.old_log_probs - b.log_probs, adv, cfg.eps_clip, 0.28, None)
    reduce = slime.sum_of_sample_mean(
        [n + 10 for n in b.lengths], b.lengths, masks, [m.sum() for m in b.masks], False
    )  # slime rebuilds the reducer with the rejection masks but the original per-sample denominators
    theirs = reduce(per_token * torch.cat(weights)) / len(b.lengths)
    return torch.tensor([metrics["pg_loss"]]), theirs.reshape(1), None


def _whiten_row(slime: Any, b: Batch, flags: dict[str, Any]) -> tuple:
    from policies.advantages import whiten

    PolicyLossConfig(**flags)  # the flag exists and is valid
    ours = whiten(b.values, b.loss_mask, **({"unbiased": False} if "whiten_unbiased" in flags else {}))
    theirs = slime.whiten(b.values, b.loss_mask, process_group=None, shift_mean=True)
    return ours, theirs, b.loss_mask


def rows(slime: Any, seed: int) -> Iterator[tuple[str, Callable[[], tuple]]]:
    """(label, thunk) for every comparison; the label names our flags where they are not the defaults."""
    mild, wild = Batch(seed, extreme=False), Batch(seed, extreme=True)
    full = Batch(seed, extreme=False, with_empty=False)
    clamp_off = {"log_ratio_clamp": None}
    for kind in ("k1", "k2", "k3", "low_var_kl"):
        yield f"kl {kind}", lambda k=kind: _kl_row(slime, wild, k, False, {})
    yield "kl low_var_kl x IS ratio (use_unbiased_kl), extreme", lambda: _kl_row(slime, wild, "low_var_kl", True, {})
    yield (
        "  same [log_ratio_clamp=None, low_var_kl_clamp_after_weight]",
        lambda: _kl_row(slime, wild, "low_var_kl", True, {**clamp_off, "low_var_kl_clamp_after_weight": True}),
    )
    for kind in ("ppo", "gspo", "cispo"):
        yield f"loss {kind}, |log-ratio| < 2", lambda k=kind: _loss_row(slime, mild, k, {}, False)
        yield f"loss {kind}, extreme log-ratios", lambda k=kind: _loss_row(slime, wild, k, {}, False)
        yield "  same [log_ratio_clamp=None]", lambda k=kind: _loss_row(slime, wild, k, clamp_off, False)
    yield (
        "loss ppo dual-clip (eps_clip_c=3), extreme",
        lambda: _loss_row(slime, wild, "ppo", {"eps_clip_c": 3.0}, True),
    )
    yield "loss ppo per-token advantages", lambda: _loss_row(slime, mild, "ppo", {}, True)
    yield "grad gspo (seq-mean-token-mean)", lambda: _gspo_grad_row(slime, mild, {})
    yield "tis token weights, extreme", lambda: _correction_row(slime, wild, "tis", {})
    yield "icepop weights, extreme", lambda: _correction_row(slime, wild, "icepop", {})
    for level in ("token", "sequence", "geometric"):
        yield f"mis {level} keep mask (example mis.py, mask mode)", lambda lv=level: _mis_row(slime, wild, lv, "keep")
        yield f"mis {level} kept weights", lambda lv=level: _mis_row(slime, wild, lv, "weights")
    yield (
        "pg_loss ppo + mis token, all-masked sample",
        lambda: _mis_loss_row(slime, wild, {"count_empty_samples": True}),
    )
    yield (
        "  same [rejected_tokens_in_denominator, count_empty_samples]",
        lambda: _mis_loss_row(slime, wild, {"count_empty_samples": True, "rejected_tokens_in_denominator": True}),
    )
    yield "opsm mask, sequence advantages", lambda: _opsm_row(slime, mild, False, {})
    yield "opsm mask, per-token advantages", lambda: _opsm_row(slime, mild, True, {})
    yield (
        "  previous rule [opsm_token_advantage=False], differs",
        lambda: _opsm_row(slime, mild, True, {"opsm_token_advantage": False}),
    )
    yield "whiten (normalize_advantages)", lambda: _whiten_row(slime, mild, {})
    yield (
        "  previous rule [whiten_unbiased=False], differs",
        lambda: _whiten_row(slime, mild, {"whiten_unbiased": False}),
    )
    for est in ("grpo", "gspo", "cispo"):
        yield f"adv {est}", lambda e=est: _advantage_row(slime, mild, e, {})
    yield "adv grpo, Dr.GRPO (no std)", lambda: _advantage_row(slime, mild, "grpo", {"grpo_std_normalization": False})
    yield "adv grpo, kl_coef=0.1", lambda: _advantage_row(slime, mild, "grpo", {"kl_coef": 0.1})
    yield (
        "adv grpo + normalize_advantages",
        lambda: _advantage_row(slime, mild, "grpo", {"normalize_advantages": True}),
    )
    opd = {"use_opd": True, "opd_kl_coef": 0.7}
    yield "adv grpo + opd (on-policy distillation)", lambda: _advantage_row(slime, mild, "grpo", opd)
    yield (
        "adv grpo + opd + normalize_advantages",
        lambda: _advantage_row(slime, mild, "grpo", {**opd, "normalize_advantages": True}),
    )
    rpp = {"normalize_advantages": True, "kl_coef": 0.05, "gamma": 0.9}
    yield "adv reinforce_plus_plus (no empty sample)", lambda: _advantage_row(slime, full, "reinforce_plus_plus", rpp)
    yield (
        "adv reinforce_plus_plus_baseline",
        lambda: _advantage_row(
            slime, mild, "reinforce_plus_plus_baseline", {"normalize_advantages": True, "kl_coef": 0.05}
        ),
    )
    yield "value loss (critic), clipped", lambda: _value_loss_row(slime, wild, {})
    ppo = {"kl_coef": 0.05, "gamma": 0.95, "lambd": 0.9}
    yield "adv ppo (GAE), untrained tail, kl_coef", lambda: _advantage_row(slime, mild, "ppo", ppo)
    yield (
        "  same [untrained_token_rewards=keep]",
        lambda: _advantage_row(slime, mild, "ppo", {**ppo, "untrained_token_rewards": "keep"}),
    )
    for mode in ("token-mean", "seq-mean-token-mean"):
        yield f"agg {mode}, all-masked sample", lambda m=mode: _aggregation_row(slime, mild, m, {})
        yield (
            "  same [count_empty_samples]",
            lambda m=mode: _aggregation_row(slime, mild, m, {"count_empty_samples": True}),
        )
        yield f"agg {mode}, no all-masked sample", lambda m=mode: _aggregation_row(slime, full, m, {})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slime", type=Path, required=True, help="root of a slime source tree")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_default_dtype(torch.float64)
    slime = load_slime(args.slime)
    print(f"{'function pair':<58} {'max rel diff':>13}  result")
    differ = 0
    for label, thunk in rows(slime, args.seed):
        try:
            ours, theirs, mask = thunk()
            diff = _compare(ours, theirs, mask)
            verdict = "agree" if diff <= TOLERANCE else "DIFFER"
            shown = f"{diff:13.2e}"
        except Exception as exc:  # a row that cannot run (e.g. slime asserts) is reported, not fatal
            verdict, shown = f"ERROR {type(exc).__name__}: {str(exc)[:60]}", f"{'-':>13}"
        differ += verdict != "agree"
        print(f"{label:<58} {shown}  {verdict}")
    print(f"{differ} row(s) differ; each is explained in docs/policies.md, 'Where we differ from slime'.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
