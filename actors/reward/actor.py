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
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import msgspec

from actors.config.teachers import run_teachers
from actors.extensions.load import reward_spec
from actors.reward.failures import RewardFailures
from actors.runtime import chaos
from actors.runtime.base import Actor
from actors.runtime.handlers import handles
from bus.episodes import EpisodeKey, by_episode, episode_key, final_segment
from bus.schema import GeneratedGroup, Sample, ScoredGroup
from policies.failed_samples import samples_to_train
from policies.rewards import REWARD_EXTRAS, score, score_group

if TYPE_CHECKING:
    from actors.reward.teacher import TeacherScorer


class RewardWorker(Actor):
    role = "reward"

    async def on_start(self) -> None:
        self.config = self.settings.run
        self.reward = reward_spec(self.config)
        self.failures = RewardFailures(self.log, self.reward.name, limit=self.config.reward.reward_failure_limit)
        self.buffer = self.peer_stream("buffer")
        self.stream_concurrency["on_generated"] = self.config.reward.reward_concurrency
        self.teachers: TeacherScorer | None = None
        if self.config.policy.use_opd:
            from actors.reward.teacher import TeacherScorer  # aiohttp: 0.11 s that only teacher servers need

            distillation = self.config.distillation
            scorer = TeacherScorer(run_teachers(distillation), key=distillation.opd_teacher_key,
                                   timeout_s=distillation.opd_teacher_timeout,
                                   temperature=self.config.rollout.rollout_temperature)
            self.teachers = scorer if scorer.has_servers else None

    async def on_stop(self) -> None:
        self.failures.flush()
        if self.teachers is not None:
            await self.teachers.close()

    @handles(GeneratedGroup, concurrency=4)
    async def on_generated(self, sender: str, group: GeneratedGroup) -> None:
        is_eval = group.is_eval  # an evaluation group: scored with --eval-reward-key, no teacher
        samples = group.samples
        if self.teachers is not None and not is_eval:
            with self.waits.on("distillation teacher", f"scoring group {group.group_id}"):
                samples = await self.score_by_teachers(samples)
        with self.waits.on("reward function", f"scoring group {group.group_id}"):
            scored = await self.score_samples(samples, is_eval=is_eval)
        # Scored and not yet handed on: the same loss as a kill mid-scoring (the group's lease is still open), and
        # the one "mid" an inline reward, which never waits while it scores, has.
        chaos.reached("score.mid")
        self.counters["samples.scored"] += len(scored)
        await self.buffer.send(ScoredGroup(lease_id=group.lease_id, group_id=group.group_id, samples=scored,
                                           worker_id=group.worker_id))
        self.waits.made_progress()

    async def score_by_teachers(self, samples: list[Sample]) -> list[Sample]:
        """Each sample's teacher log-probs from its teacher server; one it could not get fails, named and counted."""
        assert self.teachers is not None
        if self._trains_on(samples) is None:
            return samples  # failed in generation: the buffer drops the group, the teacher need not score it
        annotated = await self.teachers.annotate(samples)  # a sample that failed is passed over
        failed = [sample for sample in annotated if sample.status == "failed"]
        if failed:
            self.counters["samples.teacher_failed"] += len(failed)
            self.log.warning("a distillation teacher could not score samples; they are not trained",
                             sample=failed[0].sample_id, reason=failed[0].error)
        self.counters["samples.teacher_scored"] += len(samples) - len(failed)
        return annotated

    async def score_samples(self, samples: list[Sample], *, is_eval: bool = False) -> list[Sample]:
        """The episodes that did not fail in generation, scored (each on its final segment, the reward then on all
        of its segments); those that did, as they are (none are scored when the buffer will drop the group for
        them)."""
        scorable = self._trains_on(samples)
        if not scorable:  # failed in generation (e.g. no room under the context cap): the buffer counts it
            return list(samples)
        episodes = by_episode(samples)
        finals = [final_segment(episodes[key]) for key in by_episode(scorable)]
        # A reward already set (slime's rollout functions and generate plugins may score their own samples) is kept,
        # as slime's generate_and_rm does; a group reward needs the whole group, so it rescores all if any lacks one.
        unscored = [s for s in finals if not _has_reward(s)]
        if self.reward.is_group and unscored:
            unscored = finals
        self.counters["samples.prescored"] += len(finals) - len(unscored)
        scored = await self._score(unscored, episodes, is_eval=is_eval) if unscored else []
        rescored = {episode_key(sample): sample for sample in [*finals, *scored]}  # the scored after the prescored
        return [_with_episode_reward(sample, rescored.get(episode_key(sample))) for sample in samples]

    def _trains_on(self, samples: list[Sample]) -> list[Sample] | None:
        """The samples of a group that can train, by the buffer's rule; None when it will drop the group."""
        return samples_to_train(samples, self.config.buffer.failed_sample_policy,
                                lambda sample: sample.status == "failed")

    async def _score(self, samples: list[Sample], episodes: dict[EpisodeKey, list[Sample]], *,
                     is_eval: bool) -> list[Sample]:
        """`samples` (one per episode, its final segment) scored, with every segment of its episode at hand."""
        inputs = [self.reward.argument_of(s, episodes[episode_key(s)]) for s in samples]
        reward = self.config.reward
        key = (self.config.eval.eval_reward_key or reward.reward_key) if is_eval else reward.reward_key
        if self.reward.is_group:
            outcomes = await score_group(self.reward.fn, inputs, timeout_s=reward.reward_timeout, key=key)
        else:
            outcomes = await score(self.reward.fn, inputs, timeout_s=reward.reward_timeout, key=key)
        scored = []
        for sample, outcome in zip(samples, outcomes, strict=True):
            self.failures.record(sample.sample_id, outcome)
            # Counted here, before the breaker can end the worker: the failures that trip it are among them.
            self.counters["samples.reward_failed"] += outcome.status != "ok"
            if outcome.status == "ok":
                metadata = {**sample.metadata, REWARD_EXTRAS: outcome.extras} if outcome.extras else sample.metadata
                scored.append(msgspec.structs.replace(sample, reward=float(outcome.reward), metadata=metadata))
            else:
                scored.append(msgspec.structs.replace(sample, reward=None, status="failed",
                                                      error=f"reward: {outcome.reason}"))
        if self.failures.tripped is not None:  # a worker that would fail the same way must not be restarted
            await self.fail_run(self.failures.tripped)
        return scored


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
