"""Learner: pull a batch, train, publish the new version and weights, checkpoint; until `--num-rollout` batches.

The learner never waits for generation except when the buffer has no batch ready: rollouts of the next
batches run while it trains (bounded by `--max-staleness`). Exactly-once training rests on two numbers kept in
the checkpoint, `trained_batch` and the version: a restarted learner loads them and asks the buffer for the
batch after the checkpoint, which re-serves it identically if it was served before.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TextIO, TypeVar

import msgspec

from actors.config import RunConfig
from actors.learner.modes import BatchRefused, Progress, Training, pick_source, pick_training
from actors.learner.publish import ATTEMPTS, WeightPublisher, live_engines, publisher_for, sent_layout
from actors.learner.ranks import CollectiveTrainer, LearnerRanks, bind_device
from actors.learner.rollout_log import RolloutLog
from actors.learner.step import CRITIC_ONLY_REASON, ROUTELESS_SAMPLES, PreparedBatch, StepReport, TrainingStep
from actors.learner.trainer_factory import build_trainer
from actors.learner.weight_checks import WeightCheckLog, WeightsCorrupted
from actors.runtime import chaos
from actors.runtime.base import Actor
from actors.runtime.checkpoint_pointer import (
    checkpoint_dir,
    latest_checkpoint,
    point_latest_at,
    prune_checkpoints,
    resume_source,
    step_checkpoint,
)
from actors.runtime.context import ActorContext
from actors.runtime.handlers import serves
from actors.runtime.metrics import MetricsWriter
from actors.runtime.peers import engine_members
from actors.runtime.roles import has_weight_pinners
from actors.runtime.stopping import unless_stopped
from bus.codec import validate
from bus.schema import Batch, Control, Roster, VersionAnnouncement, WeightPin, WeightPinState
from policies.staleness import staleness_of_samples
from policies.weight_versions import Decision, Hold, Nothing, Push, WeightCadence

T = TypeVar("T")
STOPPED_PUSH_WAIT_S = 5.0  # a push a stop aborted ends at once; this bounds the wait if it does not


class Learner(Actor):
    role = "learner"
    drain_timeout = 120.0  # a stop lets the step in hand finish and the checkpoint land

    def __init__(self, context: ActorContext) -> None:
        """What `on_start` builds exists from here, as None or zero: a learner stopped before it started (a bad
        setting, a signal during start-up) reports and stops without guessing which parts it has."""
        super().__init__(context)
        self.trainer: CollectiveTrainer | None = None
        self.training: Training | None = None
        self.step: TrainingStep | None = None  # rank 0's; it holds the profiler a stop must close
        self.weights: WeightPublisher | None = None
        self.metrics_writer: MetricsWriter | None = None
        self.rollout_log: RolloutLog | None = None
        self.audit: TextIO | None = None
        self.push_in_flight: asyncio.Task[None] | None = None
        self.upcoming: asyncio.Task[tuple[Batch | None, PreparedBatch | None]] | None = None  # the next batch
        self.cadence = WeightCadence()  # when to push; `on_start` gives it the run's interval
        self.trained_batch = 0
        self.checkpointed_batch = 0
        # whose engines it pushes to: the policy's own (own_engines), its weights theirs; else the run's (None), the
        # policy's adapter on them in a run of several
        self.engines_of = context.policy if context.settings.run.engine.own_engines else None

    async def on_start(self) -> None:
        import torch

        self.config = config = run_paths(self.settings.run, self.context.run_dir)
        torch.set_num_threads(self.context.torch_threads or config.torch_threads)  # the CPU budget's, if any
        if config.megatron.deterministic_mode:
            from engines.training.determinism import use_deterministic_kernels

            use_deterministic_kernels()  # before any CUDA work: cuBLAS reads its workspace setting once
        self.ranks = LearnerRanks(config, self.context.run_dir, self.context.host, self.log,
                                  heartbeat_interval=self.context.heartbeat_interval)
        self.ranks.spawn()
        await asyncio.to_thread(self.ranks.join)
        local_trainer = await asyncio.to_thread(_bound_to_rank_zero, build_trainer, config)
        self.trainer = CollectiveTrainer(local_trainer, self.ranks)
        # The debug modes are these two choices, made once: where batches come from, and what training means.
        self.source = pick_source(config, self.peer_rpc("buffer"), self.counters, self.log)
        self.step = TrainingStep(local_trainer, config)
        self.training = pick_training(config, self.trainer, self.step)
        if config.learner.dump_details:  # slime saves the tokenizer beside its dumps, to read their tokens
            await asyncio.to_thread(save_tokenizer, config, Path(config.learner.dump_details) / "tokenizer")
        self.checkpoint_dir = checkpoint_dir(config.learner.save, self.context.run_dir)
        if (blind := rewards_unseen_because(config)) is not None:
            self.log.warning(blind)
        await self._restore()
        self.metrics_writer = self.open_metrics("train", tensorboard=config.logging.use_tensorboard)
        self.rollout_log = RolloutLog(config, self.log, self.counters)
        self.audit = open(self.context.run_dir / "metrics" / "trained_samples.jsonl", "a", buffering=1)  # noqa: SIM115
        self.weights = publisher_for(
            config, self.context.host, engines=lambda: live_engines(engine_members(self.roster, self.engines_of)),
            tensors=functools.partial(self.trainer.named_tensors, sent_layout(config)), zmq=self.zmq,
            security=self.security, client_id=f"{self.actor_id}.weights", counters=self.counters, log=self.log,
            waits=self.waits, sender_name=self.actor_id, adapter=None if self.engines_of else self.context.policy,
            check_log=WeightCheckLog(self.context.run_dir / "metrics", clock_origin=self.settings.clock_origin))
        if self.ranks.world == 1 and local_trainer.gates_updates:  # pushes run beside the next step
            gate_s = config.weights.weight_transfer_timeout * ATTEMPTS + 30.0
            local_trainer.update_gate = lambda: self.weights.wait_for_reads(gate_s)
        # A pin (the evaluator's, over WeightPin) holds the engines on its version until released, or this long.
        self.cadence = WeightCadence(update_interval=config.weights.update_weights_interval,
                                     hold_timeout_s=config.eval.final_eval_timeout)
        if self.trained_batch == 0 and self.version == 0:  # a fresh run: the engines load these weights themselves
            self.cadence.engines_serve(0)
        if has_weight_pinners(config):
            self.cadence.expect_pins()
        self.pin_released = asyncio.Event()  # a push held for a pin may go now, even while a batch is awaited
        self.busy_seconds = 0.0
        self.started_at = self.batch_arrived_at = time.monotonic()
        self.batch_period = 0.0  # seconds between the last batch's arrival and the one before (or the start)

    async def run(self) -> None:
        """pull → train → act on the weight cadence → checkpoint, until num_rollout batches are trained.

        While a batch trains, the next one is already asked for (`pull`) and, where the trainer allows, put
        through the stages that do not read the policy (conversion, reference log-probs) on a second thread: the
        learner never idles between steps on the buffer's round trip or on the reference model.
        """
        try:
            await self.publish_weights()  # engines start from our weights, which matters on resume
            while self.trained_batch < self.config.learner.num_rollout and not self.stopping:
                await self.act(self.cadence.between_steps)  # an engine that joined, a push held for an eval round
                batch, prepared = await self.pull()
                if batch is None:
                    await self.act(self.cadence.on_empty_batch)  # the batch may wait for a push that failed
                    continue
                report = await self.train(batch, prepared)
                await self.announce_version()
                # The push runs beside the next step only when that step can start now. Otherwise the learner waits
                # for its batch anyway, and a push beside nothing has the learner's core to itself: the engines get
                # the weights, and so the batch after next, sooner.
                await self.act(functools.partial(self.cadence.after_step, self.version),
                               beside_next_step=self.upcoming is not None and self.upcoming.done())
                await self.maybe_checkpoint()
                self.log_step(batch, report)
            if self.trained_batch >= self.config.learner.num_rollout:
                await self.finish()
        except (BatchRefused, WeightsCorrupted) as error:  # going on cannot help: say why, on every node, and stop
            await self.fail_run(str(error))
        finally:
            if self.upcoming is not None:
                self.upcoming.cancel()  # a batch served but not trained is served again after a restart

    def request_stop(self, reason: str) -> None:
        super().request_stop(reason)
        if self.weights is not None:
            self.weights.stop(f"the learner is stopping ({reason})")

    async def _unless_stopped(self, awaitable: Awaitable[T]) -> T | None:
        """`awaitable`'s result, or None once a stop is asked for: a stopping learner does not wait on a buffer that
        is stopping too (it may never answer), it checkpoints, within its launcher's grace before SIGKILL."""
        # Cancelled when stopped: a batch served but not trained is served again after the restart.
        return (await unless_stopped(awaitable, self._stop_requested))[1]

    async def _fetch_ahead(self, progress: Progress) -> tuple[Batch | None, PreparedBatch | None]:
        """The batch after `progress.trained_batch` (training now), prepared as far as it can be before that ends."""
        batch = await self.source.next(progress, ahead=True)
        if batch is None:
            return None, None
        return batch, await self.training.prepare(batch)

    async def pull(self) -> tuple[Batch | None, PreparedBatch | None]:
        """The next batch (None: the buffer answered empty), and the batch after it asked for at once (`upcoming`).

        The batch wait stays open across the buffer's empty long-poll answers, so the hang report says how long it
        has been."""
        self.waits.begin("batch", "buffer", f"batch {self.trained_batch + 1}")
        prefetched = self.upcoming is not None
        fetch, self.upcoming = self.upcoming or asyncio.ensure_future(self._fetch(self.progress())), None
        batch, prepared = await self._unless_stopped(self._await_batch(fetch)) or (None, None)
        if prefetched and batch is not None and batch.learner_version != self.version:
            batch, prepared = measured_at(batch, self.version), None  # see measured_at
        if batch is None:
            return None, None
        self.waits.end("batch")
        arrived = time.monotonic()
        self.batch_period, self.batch_arrived_at = arrived - self.batch_arrived_at, arrived
        if batch.batch_id < self.config.learner.num_rollout:  # asked as of now: version before this step
            ahead = Progress(learner_version=self.version, trained_batch=batch.batch_id,
                             checkpointed_batch=self.checkpointed_batch)
            self.upcoming = asyncio.create_task(self._fetch_ahead(ahead))
        return batch, prepared

    async def _fetch(self, progress: Progress) -> tuple[Batch | None, PreparedBatch | None]:
        return await self.source.next(progress), None

    async def _await_batch(self, fetch: asyncio.Future[tuple[Batch | None, PreparedBatch | None]]
                           ) -> tuple[Batch | None, PreparedBatch | None]:
        """`fetch`'s batch; meanwhile a push held for a pin goes out as soon as the pin is released, not after the
        buffer's long poll (the batch may be waiting for those very weights). Cancelled, it cancels the fetch: a
        batch served but not trained is served again after a restart."""
        try:
            while True:
                released = asyncio.ensure_future(self.pin_released.wait())
                await asyncio.wait({fetch, released}, return_when=asyncio.FIRST_COMPLETED)
                released.cancel()
                if fetch.done():
                    return fetch.result()
                self.pin_released.clear()
                await self.act(self.cadence.between_steps)
        except asyncio.CancelledError:
            fetch.cancel()
            raise

    async def act(self, ask: Callable[[], Decision], *, beside_next_step: bool = False) -> Decision:
        """Ask the cadence, and push if it says so. A push under way may be the one that pins the engines: it is
        over before the answer counts."""
        if isinstance(decision := ask(), Nothing):
            return decision
        await self.settle_push()
        decision = ask()
        self.cadence.acted(decision)
        if isinstance(decision, Hold):
            self.counters["weights.held_pushes"] += 1
        elif isinstance(decision, Push):
            if decision.expired_hold is not None:
                self.counters["weights.pin_timeouts"] += 1
                self.log.warning("pinned weights not released in time; pushing newer weights anyway (an eval "
                                 "round's remaining samples count as off-version)", version=decision.expired_hold,
                                 timeout_s=self.cadence.hold_timeout_s)
            await self.publish_weights(beside_next_step=beside_next_step)
        return decision

    async def maybe_checkpoint(self) -> None:
        if self.config.learner.save_interval and self.trained_batch % self.config.learner.save_interval == 0:
            await self.save_checkpoint()
            await self.export_hf_copy()

    # --------------------------------------------------------------------------------------------- steps
    def progress(self) -> Progress:
        return Progress(learner_version=self.version, trained_batch=self.trained_batch,
                        checkpointed_batch=self.checkpointed_batch)

    async def train(self, batch: Batch, prepared: PreparedBatch | None = None) -> StepReport | None:
        started = time.monotonic()
        with self.waits.on("trainer", f"training batch {batch.batch_id}"):
            report = await self.training.train(batch, prepared)
        self.busy_seconds += time.monotonic() - started
        self.trained_batch = batch.batch_id
        self.waits.made_progress()
        self.audit.write(json.dumps({"batch_id": batch.batch_id, "version": self.version,
                                     "sample_ids": [s.sample_id for s in batch.samples]}) + "\n")
        return report

    @property
    def version(self) -> int:
        return self.training.version

    async def announce_version(self) -> None:
        """The version and the weights every engine has, to everyone through the controller. Checked against the
        wire schema first: a value the schema refuses is an error named here, not a frame dropped on arrival."""
        assert self._controller is not None
        announcement = VersionAnnouncement(version=self.version, weights_version=self.weights.committed_version,
                                           step=self.trained_batch, timestamp=time.time(), policy=self.context.policy)
        self.cadence.announcement_sent(announcement.version)
        try:
            await self._controller.call(validate(announcement), timeout=2.0, retries=2)
        except Exception as error:  # the next announcement carries the same information
            self.log.warning("version announcement failed", error=repr(error))
            return
        self.cadence.announcement_taken(announcement.version, announcement.weights_version)

    async def publish_weights(self, *, beside_next_step: bool = False) -> None:
        """Push this version's weights; once every engine has them, a version already announced without them (or
        not heard) is announced again, so everyone hears it with its weights, not one step later or never.

        `beside_next_step` (after a step, where the trainer gates its updates): the push runs as a task while the
        learner goes on to the next step, whose forward and backward overlap the transfer; the trainer holds its
        optimizer write until the push has read the weights. The next push, or anything that needs the engines
        to have these weights, waits for it first (`settle_push`).

        A push that failed (an engine stalled past the transfer timeout, an order lost) is tried again whenever the
        buffer answers a batch request empty, not only after the next step: rollout workers do not generate with
        weights older than --max-staleness allows, so a synchronous run, or one whose pushes failed max-staleness + 1
        times in a row, gets no next batch until the engines have this version."""
        if not self.training.publishes:
            return
        await self.settle_push()  # one push at a time, in version order
        if beside_next_step and self.trainer.local.update_gate is not None:
            self.weights.reads_begin()  # before the next step can reach its update
            self.counters["weights.pushed_beside_step"] += 1
            self.push_in_flight = asyncio.create_task(self._push(self.version, beside_training=True))
        else:
            await self._push(self.version)

    async def _push(self, version: int, *, beside_training: bool = False) -> None:
        self.cadence.push_started()
        reached = await self.weights.publish(version, beside_training=beside_training)
        self.cadence.push_ended(version, reached_every_engine=reached)
        committed = self.weights.committed_version
        if reached and self.cadence.announce_again(pushed=version, current=self.version, committed=committed):
            await self.announce_version()

    async def settle_push(self) -> None:
        """Until the push running beside a step (`publish_weights(beside_next_step=True)`) is over."""
        push, self.push_in_flight = self.push_in_flight, None
        if push is not None:
            await push

    async def push_final_weights(self) -> None:
        """Like any push, the final one waits while the engines are pinned; the pin's own deadline bounds the
        wait."""
        while not self.stopping and isinstance(await self.act(self.cadence.final), Hold):
            await asyncio.sleep(0.2)

    async def wait_while_pinned(self) -> None:
        """The run ends once nothing holds the engines: the evaluator pins the final version (WeightPin.final) and
        releases it when its round has reported, or the pin's deadline (--final-eval-timeout) passes."""
        self.cadence.finishing(self.version)
        if self.cadence.holding() is not None:
            self.log.info("training done; waiting for the pinned weights to be released", version=self.version)
        while not self.stopping and self.cadence.holding() is not None:
            await asyncio.sleep(0.2)
        if self.cadence.pinned is not None and self.cadence.pinned > self.cadence.released_through:
            self.counters["weights.pin_timeouts"] += 1
            self.log.warning("final pinned weights not released in time; ending the run (the final eval round is "
                             "cut off)", version=self.cadence.pinned, timeout_s=self.cadence.hold_timeout_s)

    @serves(WeightPin)
    async def on_weight_pin(self, sender: str, request: WeightPin) -> WeightPinState:
        """Served once `on_start` is done (the RPC endpoint opens after it): the cadence and the training exist."""
        assert self.training is not None
        held = self.cadence.holds_pushes()
        self.cadence.release(request.release_through)
        self.cadence.pin(request.at_least, final=request.final)
        if held and not self.cadence.holds_pushes():
            self.pin_released.set()
        return WeightPinState(pinned=self.cadence.holding(), publishes=self.training.publishes, version=self.version)

    async def save_checkpoint(self) -> None:
        """Write the checkpoint of the batches trained so far, point `latest` at it, then drop the oldest beyond
        --keep-last-checkpoints."""
        extra = {"trained_batch": self.trained_batch, "run_dir": str(self.context.run_dir)}
        target = step_checkpoint(self.checkpoint_dir, self.trained_batch)
        with self.waits.on("disk", f"checkpoint {target}"):
            await asyncio.to_thread(self.trainer.save_checkpoint, target, extra)
        chaos.reached("checkpoint.mid")  # written, `latest` not yet moved to it
        point_latest_at(self.checkpoint_dir, target)
        self.checkpointed_batch = self.trained_batch
        self.log.info("checkpoint saved", path=str(target), version=self.trainer.version)
        keep = self.config.learner.keep_last_checkpoints
        if keep is not None:
            with self.waits.on("disk", f"deleting checkpoints older than the last {keep}"):
                try:
                    deleted = await asyncio.to_thread(prune_checkpoints, self.checkpoint_dir, keep, target)
                except OSError as error:  # the new checkpoint stands; the next save tries again
                    self.log.warning("could not delete old checkpoints", error=repr(error), keep=keep)
                    return
            if deleted:
                self.log.info("old checkpoints deleted", paths=[path.name for path in deleted], keep=keep)

    async def export_hf_copy(self) -> None:
        """slime's --save-hf: the checkpoint just saved, also as a Hugging Face folder (slime's `{rollout_id}`, the
        batch's 0-based id, names one per checkpoint). Not on a stop's checkpoint: the launcher's grace before
        SIGKILL is for the checkpoint that makes the run resumable."""
        template = self.config.learner.save_hf
        if template is None:
            return
        target = Path(template.format(rollout_id=self.trained_batch - 1))
        with self.waits.on("disk", f"HF export {target}"):
            await asyncio.to_thread(self.trainer.export_hf, target)
        self.log.info("HF export saved", path=str(target), batch=self.trained_batch)

    async def finish(self) -> None:
        """Make the result durable, export it, and end the run for everyone (for our policy, in a run of several:
        this learner exits, the other policies' go on)."""
        await self.settle_push()
        if self.training.keeps_model:
            if self.checkpointed_batch < self.trained_batch:  # the last step's --save-interval may have written it
                await self.save_checkpoint()
                await self.export_hf_copy()
            await asyncio.to_thread(self.trainer.export_hf, self.context.run_dir / "final_model")
            if self.weights.committed_version != self.version:
                await self.push_final_weights()  # the final eval round must see the final weights
        await self.wait_while_pinned()
        await self.source.finish(self.progress())
        assert self._controller is not None
        # In a run of several policies this ends our policy only; the run stops once every policy's learner is done.
        await self._controller.call(Control(command="stop", reason=f"trained {self.trained_batch} batches",
                                            policy=self.context.policy), timeout=5.0, retries=2)
        self.log.info("run finished", batches=self.trained_batch, version=self.version)

    async def _restore(self) -> None:
        learner = self.config.learner
        directory = latest_checkpoint(resume_source(learner.load, learner.save, self.context.run_dir))
        if directory is None:
            return
        extra = await asyncio.to_thread(self.trainer.load_checkpoint, directory)
        self.trained_batch = self.checkpointed_batch = int(extra.get("trained_batch", 0))
        self.log.info("resumed from checkpoint", path=str(directory), version=self.trainer.version,
                      trained_batch=self.trained_batch)

    async def on_roster(self, roster: Roster) -> None:
        if self.weights is not None:
            self.weights.roster_changed()  # a push waiting on a member that died or was replaced ends now
        rollouts = {e.kind: e.actor_id for e in roster.events
                    if e.actor_id in self.roster and self.roster[e.actor_id].role == "rollout"
                    and self.roster[e.actor_id].policy == self.engines_of}
        if "joined" in rollouts or "returned" in rollouts:
            self.cadence.on_engine_joined()
        if "died" in rollouts and not engine_members(self.roster, self.engines_of):
            self.log.warning("no live rollout worker; generation and weight pushes wait until one (re)joins",
                             last_died=rollouts["died"])

    # ------------------------------------------------------------------------------------------ reporting
    def log_step(self, batch: Batch, report: StepReport | None) -> None:
        elapsed = time.monotonic() - self.started_at
        metrics: dict[str, Any] = {"version": self.version, "batch_id": batch.batch_id,
                                   "rollout/samples_left_out": float(batch.left_out_samples),
                                   "learner/busy_fraction": self.busy_seconds / max(elapsed, 1e-9),
                                   "weights/committed_version": self.weights.committed_version}
        metrics.update(self.rollout_log(batch, report.rollout if report is not None else {}, self.batch_period))
        if report is not None:
            metrics.update({key: value for key, value in report.metrics.items() if key not in report.rollout})
            metrics["train/grad_norm"] = report.result.grad_norm
            metrics["train/skipped"] = float(report.result.skipped)
            if report.result.skipped and CRITIC_ONLY_REASON in (report.result.skip_reason or ""):
                self.counters["steps.critic_only"] += 1  # planned, not a failure: counted, not warned about
            elif report.result.skipped:
                self.counters["steps.skipped"] += 1
                self.log.warning("step skipped", reason=report.result.skip_reason, batch=batch.batch_id)
            if report.metrics.get(ROUTELESS_SAMPLES):
                self.log.warning("--use-rollout-routing-replay: samples without the engine's routes; the batch "
                                 "trained without replay (does the rollout function pass routed_experts on?)",
                                 samples=int(report.metrics[ROUTELESS_SAMPLES]), batch=batch.batch_id)
        self.counters["samples.trained"] += len(batch.samples)
        self.counters["tokens.trained"] += sum(int(s.response_length) for s in batch.samples)
        metrics["throughput/samples_per_s"] = self.counters["samples.trained"] / max(elapsed, 1e-9)
        metrics["throughput/response_tokens_per_s"] = self.counters["tokens.trained"] / max(elapsed, 1e-9)
        self.metrics_writer.write(self.trained_batch, metrics)

    async def on_stop(self) -> None:
        """A stop on purpose keeps what was trained: checkpoint whatever the last checkpoint does not cover."""
        trained_more = self.trained_batch > self.checkpointed_batch
        keeps_model = self.training is not None and self.training.keeps_model
        if trained_more and keeps_model and self.trained_batch < self.config.learner.num_rollout:
            try:
                await self.save_checkpoint()
            except Exception:
                self.log.exception("checkpoint at stop failed; the run resumes from the previous one")
        for opened in (self.audit, self.metrics_writer):
            if opened is not None:
                opened.close()
        push = self.push_in_flight
        if push is not None:  # stopped by request_stop, which aborted it: it ends at once
            await asyncio.wait({push}, timeout=STOPPED_PUSH_WAIT_S)
            push.cancel()
        if self.weights is not None:
            self.weights.close()
            self.weights.check_log.close()
        if self.step is not None and self.step.profiler is not None:
            self.step.profiler.close()  # a memory recording not yet written is written now
        if self.trainer is not None:
            await asyncio.to_thread(self.trainer.close)


def run_paths(config: RunConfig, run_dir: Path) -> RunConfig:
    """The run's settings with the profiler's folder made absolute in RUN_DIR, before the learner's other ranks
    get them."""
    profiling = config.profiling
    if (profiling.use_pytorch_profiler or profiling.record_memory_history) and profiling.profile_dir is None:
        return config.with_settings(profile_dir=str(run_dir / "profile"))
    return config


def save_tokenizer(config: RunConfig, folder: Path) -> None:
    """The model's tokenizer, saved where `--dump-details` puts the dumps."""
    from transformers import AutoTokenizer

    path = config.model.hf_checkpoint
    if path is None:
        return
    AutoTokenizer.from_pretrained(path).save_pretrained(folder)


def rewards_unseen_because(config: RunConfig) -> str | None:
    """Why no reward will move the policy, for a setting that starts and trains on nothing without an error."""
    from policies.advantages import rewards_teach_single_samples

    policy = config.policy
    if config.rollout.n_samples_per_prompt > 1 or policy.loss_type == "sft" or rewards_teach_single_samples(policy):
        return None
    return (f"--advantage-estimator {policy.advantage_estimator} with --n-samples-per-prompt 1: each sample is its "
            "own group, so its group baseline is its own reward and every advantage is 0; rewards will teach "
            "nothing. Sample several responses per prompt (GRPO is usually run with 4 to 16), or use an estimator "
            "without a group baseline (reinforce_plus_plus, ppo)")


def _bound_to_rank_zero(function: Any, *args: Any) -> Any:
    """CUDA's current device is per thread: whatever thread builds or drives the trainer uses rank 0's GPU."""
    bind_device(0)
    return function(*args)


def measured_at(batch: Batch, version: int) -> Batch:
    """`batch` with its staleness measured against `version`. A prefetched batch is measured against the version
    the step in hand is to leave; a skipped update keeps the old one, and the batch trains at that (the buffer
    measures its own record again when the step is announced)."""
    staleness = staleness_of_samples(version, [sample.token_versions for sample in batch.samples])
    return msgspec.structs.replace(batch, staleness=staleness, learner_version=version)
