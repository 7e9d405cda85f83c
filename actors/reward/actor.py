"""Reward worker: score generated groups and pass them to the buffer.

Scoring runs several groups at once (`--reward-concurrency`), which matters for remote reward models and
LLM judges that spend their time waiting. A reward function that raises, times out or returns NaN marks that
sample failed with the reason; the group still goes to the buffer, which leaves the failed sample out (or drops
the group, `--failed-sample-policy`) and counts why, so nothing disappears silently and the worker keeps serving.
A sample that failed in generation is not scored; the others of its group are, if the group can still train.
Failures are logged at a bounded rate, and a function that fails on `--reward-failure-limit` samples in a row
ends the run as failed, with its last error (`actors.reward.failures`): a broken reward trains nothing, and would
otherwise go on failing forever.

The function is given what its loader says it reads (`RewardSpec.argument_of`): for ours, each sample's token ids
and finish reason besides its text (`policies.rewards.reward_input`). It is called once per episode: an agent's
episode that rewrote its context is several samples (segments, `bus.episodes`), scored on its final segment with
every segment's messages at hand, and each segment carries that reward (or its failure).

In a run of several policies the worker is shared: each group names its policy (`GeneratedGroup.policy`), which
picks the reward it is scored with (the policy's own settings: reward function, keys, teachers, failure limit)
and the buffer it goes to, the policy's own. Each policy's scoring is built at start, so a bad reward setting of
any policy fails the start-up. A group naming no policy of the run is dropped, counted and logged by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from actors.config import RunConfig
from actors.config.run import policy_names, policy_run_config
from actors.config.teachers import run_teachers
from actors.extensions.load import reward_spec
from actors.reward.failures import RewardFailures
from actors.reward.step_tokens import StepPlacer
from actors.runtime import chaos
from actors.runtime.base import Actor
from actors.runtime.context import ActorContext
from actors.runtime.handlers import handles
from actors.runtime.peers import PeerStream
from bus.episodes import EpisodeKey, by_episode, episode_key, final_segment
from bus.schema import GeneratedGroup, Roster, Sample, ScoredGroup
from policies.failed_samples import samples_to_train
from policies.rewards import REWARD_EXTRAS, RewardOutcome, RewardSpec, score, score_group

if TYPE_CHECKING:
    from actors.reward.teacher import TeacherScorer

UNKNOWN_POLICY_LOGGED = 3  # groups of an unknown policy logged one by one; then every 100th


@dataclass(eq=False)
class PolicyScoring:
    """How one policy's groups are scored and where they go: the policy's settings (the run's in a run of one),
    its reward function and failure breaker, its distillation teachers (None: no teacher server) and its buffer."""

    policy: str | None
    config: RunConfig
    reward: RewardSpec
    failures: RewardFailures
    buffer: PeerStream
    teachers: TeacherScorer | None = None
    eval_rewards: dict[str, tuple[RunConfig, RewardSpec]] = field(default_factory=dict)  # sets of their own reward
    steps: StepPlacer | None = None  # places a reward's graded steps on tokens (process supervision)

    def of_set(self, eval_set: str | None) -> tuple[RunConfig, RewardSpec]:
        """The settings and reward a group is scored by: its eval set's own (`--eval-config`), else the policy's."""
        return self.eval_rewards.get(eval_set, (self.config, self.reward)) if eval_set else (self.config, self.reward)


class RewardWorker(Actor):
    role = "reward"

    def __init__(self, context: ActorContext) -> None:
        super().__init__(context)
        self.scorings: dict[str | None, PolicyScoring] = {}  # by policy; None: the run's one unnamed policy
        self.left_policies: set[str] = set()  # policies that left the running job

    async def on_start(self) -> None:
        self.config = self.settings.run
        self.stream_concurrency["on_generated"] = self.config.reward.reward_concurrency
        policies = policy_names(self.config) or (None,)
        self.scorings = {policy: self._scoring(policy) for policy in policies}

    def _scoring(self, policy: str | None, overrides: dict | None = None) -> PolicyScoring:
        """`policy`'s scoring from its own settings (`overrides`: a policy that joined the running job's); None: the
        run's single policy."""
        config = self.config if policy is None else policy_run_config(self.config, policy, overrides)
        log = self.log if policy is None else self.log.bind(policy=policy)
        reward = reward_spec(config)
        failures = RewardFailures(log, reward.name, limit=config.reward.reward_failure_limit)
        steps = StepPlacer(config.model.hf_checkpoint, skip_special_tokens=config.rollout.rollout_skip_special_tokens)
        return PolicyScoring(policy, config, reward, failures, self.peer_stream("buffer", policy=policy),
                             _teachers(config), _eval_set_rewards(config, reward), steps)

    async def on_roster(self, roster: Roster) -> None:
        """Policies join and leave the running job (actors.controller.policy_table): a scoring for each that joined;
        none for one that left, whose groups still on their way are dropped, counted (its buffer gives them out
        again if it comes back)."""
        if not roster.policies:
            return
        for policy in [name for name in self.scorings if name is not None and name not in roster.policies]:
            self.left_policies.add(policy)
            await self._close(self.scorings.pop(policy))
            self.log.info("policy left the run: no more scoring for it", policy=policy)
        for policy, overrides in roster.policies.items():
            if policy not in self.scorings:
                self.left_policies.discard(policy)
                self.scorings[policy] = self._scoring(policy, overrides)
                self.log.info("policy joined the run: scoring for it", policy=policy)

    @staticmethod
    async def _close(scoring: PolicyScoring) -> None:
        scoring.failures.flush()
        if scoring.teachers is not None:
            await scoring.teachers.close()

    async def on_stop(self) -> None:
        for scoring in self.scorings.values():
            await self._close(scoring)

    @handles(GeneratedGroup, concurrency=4)
    async def on_generated(self, sender: str, group: GeneratedGroup) -> None:
        scoring = self.scorings.get(group.policy)
        if scoring is None:
            self._drop_unknown_policy(group)
            return
        is_eval = group.is_eval  # an evaluation group: scored with --eval-reward-key, no teacher
        samples = group.samples
        if scoring.teachers is not None and not is_eval:
            with self.waits.on("distillation teacher", f"scoring group {group.group_id}"):
                samples = await self.score_by_teachers(samples, policy=group.policy)
        with self.waits.on("reward function", f"scoring group {group.group_id}"):
            scored = await self.score_samples(samples, is_eval=is_eval, policy=group.policy, eval_set=group.eval_set)
        # Scored and not yet handed on: the same loss as a kill mid-scoring (the group's lease is still open), and
        # the one "mid" an inline reward, which never waits while it scores, has.
        chaos.reached("score.mid")
        self.counters["samples.scored"] += len(scored)
        await scoring.buffer.send(ScoredGroup(lease_id=group.lease_id, group_id=group.group_id, samples=scored,
                                              worker_id=group.worker_id, host_group=group.host_group))
        self.waits.made_progress()

    def _drop_unknown_policy(self, group: GeneratedGroup) -> None:
        """A group no policy of the run owns has no reward and no buffer: dropped (its lease times out at whichever
        buffer leased it), counted, and named in the log (the first few, then every 100th). One of a policy that
        left the run is expected (generated as it left): counted apart."""
        if group.policy in self.left_policies:
            self.counters["groups.dropped.policy_left"] += 1
            return
        self.counters["groups.dropped.unknown_policy"] += 1
        count = self.counters["groups.dropped.unknown_policy"]
        if count <= UNKNOWN_POLICY_LOGGED or count % 100 == 0:
            known = [policy for policy in self.scorings if policy is not None]
            self.log.error("group dropped: it names no policy of this run", policy=group.policy,
                           policies=known or "none: the run has one unnamed policy", group=group.group_id,
                           worker=group.worker_id, dropped_so_far=int(count))

    async def score_by_teachers(self, samples: list[Sample], *, policy: str | None = None) -> list[Sample]:
        """Each sample's teacher log-probs from its teacher server; one it could not get fails, named and counted."""
        scoring = self.scorings[policy]
        assert scoring.teachers is not None
        if self._trains_on(samples, scoring) is None:
            return samples  # failed in generation: the buffer drops the group, the teacher need not score it
        annotated = await scoring.teachers.annotate(samples)  # a sample that failed is passed over
        failed = [sample for sample in annotated if sample.status == "failed"]
        if failed:
            self.counters["samples.teacher_failed"] += len(failed)
            self.log.warning("a distillation teacher could not score samples; they are not trained",
                             sample=failed[0].sample_id, reason=failed[0].error)
        self.counters["samples.teacher_scored"] += len(samples) - len(failed)
        return annotated

    async def score_samples(self, samples: list[Sample], *, is_eval: bool = False, policy: str | None = None,
                            eval_set: str | None = None) -> list[Sample]:
        """The episodes that did not fail in generation, scored by `policy`'s reward (each on its final segment, the
        reward then on all of its segments); those that did, as they are (none are scored when the buffer will drop
        the group for them)."""
        scoring = self.scorings[policy]
        scorable = self._trains_on(samples, scoring)
        if not scorable:  # failed in generation (e.g. no room under the context cap): the buffer counts it
            return list(samples)
        episodes = by_episode(samples)
        finals = [final_segment(episodes[key]) for key in by_episode(scorable)]
        # A reward already set (slime's rollout functions and generate plugins may score their own samples) is kept,
        # as slime's generate_and_rm does; a group reward needs the whole group, so it rescores all if any lacks one.
        unscored = [s for s in finals if not _has_reward(s)]
        if scoring.of_set(eval_set)[1].is_group and unscored:
            unscored = finals
        self.counters["samples.prescored"] += len(finals) - len(unscored)
        scored = await self._score(unscored, episodes, scoring, is_eval=is_eval, eval_set=eval_set) if unscored else []
        rescored = {episode_key(sample): sample for sample in [*finals, *scored]}  # the scored after the prescored
        return [_with_episode_reward(sample, rescored.get(episode_key(sample))) for sample in samples]

    @staticmethod
    def _trains_on(samples: list[Sample], scoring: PolicyScoring) -> list[Sample] | None:
        """The samples of a group that can train, by the policy's buffer's rule; None when it will drop the group."""
        return samples_to_train(samples, scoring.config.buffer.failed_sample_policy,
                                lambda sample: sample.status == "failed")

    async def _score(self, samples: list[Sample], episodes: dict[EpisodeKey, list[Sample]], scoring: PolicyScoring,
                     *, is_eval: bool, eval_set: str | None) -> list[Sample]:
        """`samples` (one per episode, its final segment) scored, with every segment of its episode at hand."""
        config, function = scoring.of_set(eval_set)
        inputs = [function.argument_of(s, episodes[episode_key(s)]) for s in samples]
        reward = config.reward
        key = (config.eval.eval_reward_key or reward.reward_key) if is_eval else reward.reward_key
        if function.is_group:
            outcomes = await score_group(function.fn, inputs, timeout_s=reward.reward_timeout, key=key)
        else:
            outcomes = await score(function.fn, inputs, timeout_s=reward.reward_timeout, key=key)
        scored = []
        for sample, outcome in zip(samples, outcomes, strict=True):
            graded = _graded_steps(sample, outcome, scoring.steps) if outcome.steps and not is_eval else {}
            if isinstance(graded, RewardOutcome):  # steps that cannot be placed: the reward's error, as a raise is
                outcome, graded = graded, {}
            scoring.failures.record(sample.sample_id, outcome)
            # Counted here, before the breaker can end the worker: the failures that trip it are among them.
            self.counters["samples.reward_failed"] += outcome.status != "ok"
            if outcome.status == "ok":
                metadata = {**sample.metadata, REWARD_EXTRAS: outcome.extras} if outcome.extras else sample.metadata
                scored.append(msgspec.structs.replace(sample, reward=float(outcome.reward), metadata=metadata,
                                                      **graded))
            else:
                scored.append(msgspec.structs.replace(sample, reward=None, status="failed",
                                                      error=f"reward: {outcome.reason}"))
        tripped = scoring.failures.tripped
        if tripped is not None:  # a worker that would fail the same way must not be restarted
            await self.fail_run(tripped if scoring.policy is None else f"policy {scoring.policy}: {tripped}")
        return scored


def _graded_steps(sample: Sample, outcome: RewardOutcome, placer: StepPlacer | None
                  ) -> dict[str, np.ndarray] | RewardOutcome:
    """The sample's `step_ends` and `step_rewards` from the steps its reward graded (training groups only: an eval
    round does not train); an error outcome naming why when they cannot be placed on its tokens."""
    try:
        if placer is None:
            raise ValueError("step_rewards: this worker places no steps on tokens")
        ends = placer.place(sample.response, np.asarray(sample.tokens)[sample.prompt_tokens:].tolist(),
                            [end for end, _ in outcome.steps])
    except (ValueError, OSError) as error:  # OSError: the tokenizer did not load
        return RewardOutcome.error(str(error))
    return {"step_ends": ends, "step_rewards": np.asarray([reward for _, reward in outcome.steps], dtype=np.float32)}


def _eval_set_rewards(config: RunConfig, reward: RewardSpec) -> dict[str, tuple[RunConfig, RewardSpec]]:
    """Each eval set's own settings, with its own reward function where it names one (`--eval-config`'s rm_type,
    custom_rm_path); loaded at start, so a bad one fails the start-up."""
    sets = {}
    for name in config.eval.eval_set_settings:
        own = config.for_eval_set(name)
        sets[name] = (own, reward_spec(own) if own.reward != config.reward else reward)
    return sets


def _teachers(config: RunConfig) -> TeacherScorer | None:
    """The distillation teacher servers `config` scores with; None without --use-opd or without a server teacher."""
    if not config.policy.use_opd:
        return None
    from actors.reward.teacher import TeacherScorer  # aiohttp: 0.11 s that only teacher servers need

    distillation = config.distillation
    scorer = TeacherScorer(run_teachers(distillation), key=distillation.opd_teacher_key,
                           timeout_s=distillation.opd_teacher_timeout,
                           temperature=config.rollout.rollout_temperature)
    return scorer if scorer.has_servers else None


def _with_episode_reward(sample: Sample, final: Sample | None) -> Sample:
    """`sample` with its episode's outcome (`final`, its scored final segment): the reward and its extras, or the
    reward's failure. A sample of an episode that was not scored (it failed in generation) stays as it is."""
    if final is None or final.sample_id == sample.sample_id:
        return final or sample
    if final.status == "failed":
        return msgspec.structs.replace(sample, reward=None, status="failed", error=final.error)
    extras = final.metadata.get(REWARD_EXTRAS)
    metadata = {**sample.metadata, REWARD_EXTRAS: extras} if extras is not None else sample.metadata
    return msgspec.structs.replace(sample, reward=final.reward, metadata=metadata)


def _has_reward(sample: Sample) -> bool:
    return sample.reward is not None and math.isfinite(sample.reward)
