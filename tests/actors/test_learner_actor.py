"""The real Learner, in process, with the sleeping trainer: it trains served batches, announces, publishes,
checkpoints, and resumes from its checkpoint.

Controller, buffer, reward worker and rollout worker (sleeping engine) are the real actors on real sockets in the
same process, so a batch the learner trains was leased, generated, scored and assembled for real.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import torch
from torch import Tensor

from actors.buffer.actor import Buffer
from actors.config import build_config
from actors.learner.trainer_factory import build_trainer
from actors.runtime.exits import EXIT_RUN_FAILED, exit_report
from actors.runtime.metrics import read_metrics
from bus.codec import decode, encode
from bus.schema import VersionAnnouncement
from engines.training.base import Loss, StepResult, Trainer, TrainSample, WeightLayout
from tests.support.inprocess import SLEEPING, actor_system, use_spec, write_prompts
from tools.audit_run import audit
from tools.sim.learner import SleepingTrainer
from tools.sim.pipeline import SimSpec, VersionOnlyLoader

ROLES = {"controller": "controller", "buffer": "buffer", "reward": "reward", "rollout": "rollout",
         "learner": "learner"}
SPEC = SimSpec(token_seconds=2e-3, train_sample_seconds=0.01, length_min=16, length_max=48)


def _settings(tmp_path: Path, **overrides: object) -> dict[str, object]:
    prompts = tmp_path / "prompts.jsonl"
    if not prompts.exists():
        write_prompts(prompts)
    return {**SLEEPING, "prompt_data": str(prompts), "rollout_batch_size": 2, "n_samples_per_prompt": 2,
            "rollout_max_batch_size": 4, "rollout_max_response_len": 48, "num_rollout": 2, "max_staleness": 1,
            # every sample trained, whatever its advantage: the sleeping trainer's time per sample paces the tests
            "skip_zero_advantage_samples": False, "use_tensorboard": False, "plots": False, **overrides}


async def _run_to_the_end(run_dir: Path, settings: dict[str, object]) -> dict[str, object]:
    """Until the learner ends the run (it stops every actor); returns what the test reads inside the actors. A run
    with eval data has its evaluator, as the launcher starts one."""
    roles = {**ROLES, "evaluator": "evaluator"} if settings.get("eval_prompt_data") else ROLES
    async with actor_system(run_dir, settings, roles) as system:
        await system.wait_for(lambda: all(task.done() for task in system.tasks.values()), 15, "the run to end")
        return {"announced": system["controller"].latest_version.version,
                "announcement": system["controller"].latest_version,
                "engine_version": system["rollout-0-0"].engine.version,
                "exit_codes": {actor_id: task.result() for actor_id, task in system.tasks.items()}}


@pytest.fixture(scope="module")
def two_step_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """One two-step run to its end, read by several tests: what the actors saw, its run directory, and the torch
    settings its learner left in this process. With --deterministic-mode, which the sleeping trainer's steps ignore,
    so one run serves both the mode's test and the tests of what any run does."""
    run_dir = tmp_path_factory.mktemp("two_step_run")
    with pytest.MonkeyPatch.context() as monkeypatch:
        use_spec(SPEC, run_dir, monkeypatch)
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "")
        monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")  # monkeypatch puts back whatever was there before
        assert not torch.are_deterministic_algorithms_enabled()
        try:
            seen = asyncio.run(_run_to_the_end(run_dir, _settings(run_dir, deterministic_mode=True)))
            seen["ordered_kernels"] = (torch.are_deterministic_algorithms_enabled(),
                                       torch.is_deterministic_algorithms_warn_only_enabled(),
                                       os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
        finally:
            torch.use_deterministic_algorithms(False)
    return {**seen, "run_dir": run_dir}


@pytest.mark.integration
@pytest.mark.timeout(30)
def test_learner_trains_served_batches_announces_publishes_and_checkpoints(two_step_run: dict[str, object]) -> None:
    seen, run_dir = two_step_run, two_step_run["run_dir"]
    assert isinstance(run_dir, Path)
    assert set(seen["exit_codes"].values()) == {0}  # type: ignore[union-attr]
    steps = read_metrics(run_dir / "metrics" / "train.jsonl")
    assert [(s["batch_id"], s["version"], s["rollout/samples"]) for s in steps] == [(1, 1, 4.0), (2, 2, 4.0)]
    assert all(s["sim/compute_end"] - s["sim/compute_start"] >= 4 * SPEC.train_sample_seconds for s in steps)
    assert seen["announced"] == 2  # the controller heard every version
    assert seen["engine_version"] == 2  # ... and the engine serves it: weights were published and acknowledged
    checkpoint = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    state = json.loads((checkpoint / "sleeping_trainer.json").read_text())
    assert state["version"] == 2 and state["extra_state"]["trained_batch"] == 2
    assert json.loads((run_dir / "final_model" / "config.json").read_text())["version"] == 2


@pytest.mark.integration
@pytest.mark.timeout(30)
def test_deterministic_mode_switches_the_learner_to_ordered_kernels(two_step_run: dict[str, object]) -> None:
    """--deterministic-mode reaches the torch backend too, not only Megatron's config: ordered kernels wherever
    torch has them, on the learner's ranks (engines/training/determinism.py)."""
    assert set(two_step_run["exit_codes"].values()) == {0}  # type: ignore[union-attr]
    enabled, warn_only, workspace = two_step_run["ordered_kernels"]  # type: ignore[misc]
    assert enabled
    assert warn_only  # a kernel without an ordered twin warns
    assert workspace == ":4096:8"


@pytest.mark.integration
@pytest.mark.timeout(30)
def test_a_version_announced_before_its_weights_landed_is_announced_again_with_them(
        two_step_run: dict[str, object]) -> None:
    """Each step announces its version before pushing its weights, so the announcement carries the previous
    weights; once every engine acknowledged the new ones, everyone must hear so, not a step later (never, for the
    last version), and the announcement must be one the schema accepts on arrival."""
    announcement = two_step_run["announcement"]
    assert isinstance(announcement, VersionAnnouncement)
    assert (announcement.version, announcement.weights_version) == (2, 2)
    assert decode(encode(announcement)) == announcement


@pytest.mark.integration
@pytest.mark.timeout(30)
async def test_learner_resumes_from_its_checkpoint_and_trains_only_the_next_batch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    use_spec(SPEC, tmp_path, monkeypatch)
    await _run_to_the_end(tmp_path, _settings(tmp_path, num_rollout=1))
    seen = await _run_to_the_end(tmp_path, _settings(tmp_path, num_rollout=2))
    steps = read_metrics(tmp_path / "metrics" / "train.jsonl")
    assert [(s["batch_id"], s["version"]) for s in steps] == [(1, 1), (2, 2)]
    assert seen["announced"] == 2


class FirstStepSkipped(SleepingTrainer):
    """Its first step is long and applies no update (as a non-finite gradient would): the version stays 0."""

    def train_step(self, samples: Sequence[TrainSample], loss: Loss, *, temperature: float,
                   with_entropy: bool = False, ends_batch: bool = True) -> StepResult:
        if getattr(self, "skipped_once", False):
            return super().train_step(samples, loss, temperature=temperature, with_entropy=with_entropy,
                                      ends_batch=ends_batch)
        self.skipped_once = True
        time.sleep(1.0)  # long enough for the next batch's groups to be scored and served ahead
        return StepResult(version=self.version, metrics={"sequences": float(len(samples))}, grad_norm=float("nan"),
                          skipped=True, skip_reason="non-finite gradient norm (nan)")


def trainer_plugin(kind: type[SleepingTrainer]) -> Callable[[object], Trainer]:
    """A `--train-backend tests.actors.test_learner_actor:NAME` factory of `kind`, at the spec's training cost."""
    return lambda config: kind(SimSpec.from_env().train_sample_seconds)


first_step_skipped = trainer_plugin(FirstStepSkipped)


class SavesListed(SleepingTrainer):
    """Lists every checkpoint it writes in `saves.txt` beside them, so a test sees each write, a repeat included."""

    def save_checkpoint(self, directory: str | Path, extra_state: dict[str, object]) -> None:
        super().save_checkpoint(directory, extra_state)
        with open(Path(directory).parent / "saves.txt", "a", encoding="utf-8") as listing:
            listing.write(Path(directory).name + "\n")


saves_listed = trainer_plugin(SavesListed)


@pytest.mark.integration
@pytest.mark.timeout(30)
async def test_each_checkpoint_is_written_once_and_only_the_newest_are_kept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The last step falls on --save-interval: the end of the run must not write the same checkpoint again. With
    --keep-last-checkpoints 2 the run ends holding its two newest checkpoints, `latest` naming the last."""
    use_spec(SPEC, tmp_path, monkeypatch)
    settings = _settings(tmp_path, num_rollout=4, save_interval=1, keep_last_checkpoints=2,
                         train_backend=f"{__name__}:saves_listed")
    seen = await _run_to_the_end(tmp_path, settings)
    assert set(seen["exit_codes"].values()) == {0}  # type: ignore[union-attr]
    checkpoints = tmp_path / "checkpoints"
    assert (checkpoints / "saves.txt").read_text().split() == [f"step_00000{n}" for n in (1, 2, 3, 4)]
    assert sorted(path.name for path in checkpoints.iterdir() if path.is_dir()) == ["step_000003", "step_000004"]
    assert (checkpoints / "latest").read_text() == "step_000004"


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_a_batch_served_ahead_of_a_skipped_step_is_measured_at_the_version_it_trains_at(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Batch 2 is asked for while step 1 runs and measured against version 1, the version step 1 was to leave. The
    step applied no update, so batch 2 trains at version 0: the learner's metrics and the buffer's log must say
    so, or the audit finds a batch served at one version and trained at another."""
    use_spec(SPEC, tmp_path, monkeypatch)
    settings = _settings(tmp_path, num_rollout=3, train_backend=f"{__name__}:first_step_skipped")
    seen = await _run_to_the_end(tmp_path, settings)
    assert set(seen["exit_codes"].values()) == {0}  # type: ignore[union-attr]
    steps = {s["batch_id"]: s for s in read_metrics(tmp_path / "metrics" / "train.jsonl")}
    assert [(b, steps[b]["version"], steps[b]["train/skipped"]) for b in (1, 2)] == [(1, 0, 1.0), (2, 1, 0.0)]
    assert steps[2]["staleness/max"] == 0.0  # generated by version 0's weights, trained at version 0
    report = audit(tmp_path)
    assert report.ok, report.problems


@pytest.mark.integration
@pytest.mark.timeout(90)
async def test_an_engine_joining_while_an_eval_round_holds_the_weights_does_not_move_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rollout worker that joins mid-run gets the current weights at once, but not while the engines are held on a
    version whose eval round is still being generated: that push goes to every engine, and the round would come
    from other weights (seen in a loaded test run: a second worker joining after step 3)."""
    use_spec(SimSpec(token_seconds=0.01, train_sample_seconds=0.01, length_min=16, length_max=48), tmp_path,
             monkeypatch)
    evals = write_prompts(tmp_path / "eval.jsonl", count=16)  # a round long enough to join during
    settings = _settings(tmp_path, num_rollout=6, eval_prompt_data=["held", str(evals)], eval_interval=2,
                         n_samples_per_eval_prompt=2)
    async with actor_system(tmp_path, settings, {**ROLES, "evaluator": "evaluator"}) as system:
        learner, engine = system["learner"], system["rollout-0-0"].engine
        await system.wait_for(lambda: learner.cadence.step_push_held, 30, "a push held for an eval round")
        pinned = learner.cadence.pinned
        assert pinned is not None and engine.version == pinned
        await system.start("rollout", "rollout", "rollout-0-1")
        moved: list[int] = []
        while learner.cadence.released_through < pinned and learner.trained_batch < 6:  # (the last push is free)
            if engine.version != pinned:
                moved.append(engine.version)
            await asyncio.sleep(0.01)
        assert not moved, f"the engines left version {pinned} for {moved[0]} before its eval round reported"
        rounds = read_metrics(tmp_path / "metrics" / "eval.jsonl")
        assert [row["eval/held/off_version_samples"] for row in rounds if row["step"] == pinned] == [0]
        await system.wait_for(lambda: system["rollout-0-1"].engine.version > 0, 30, "the new engine's weights")


class LiveWeights(SleepingTrainer):
    """Its weights are one live tensor holding its version, as the torch trainer's are its live parameters, and a
    push takes READ_S to read them (a large model's). Records what each push read and when each step wrote."""

    READ_S = 0.4  # longer than a step computes, so an ungated write would land inside the read

    def __init__(self, train_sample_seconds: float) -> None:
        super().__init__(train_sample_seconds)
        self.weights = torch.zeros(1)
        self.reads: list[tuple[float, float]] = []  # (the value read, when the read ended)
        self.writes: dict[int, float] = {}  # version -> when the step wrote it

    def train_step(self, samples: Sequence[TrainSample], loss: Loss, *, temperature: float,
                   with_entropy: bool = False, ends_batch: bool = True) -> StepResult:
        result = super().train_step(samples, loss, temperature=temperature, with_entropy=with_entropy,
                                    ends_batch=ends_batch)  # computes, then waits at the update gate
        self.weights.fill_(float(self.version))
        self.writes[self.version] = time.time()
        return result

    def named_tensors(self, layout: WeightLayout = "model") -> Iterator[tuple[str, Tensor]]:
        time.sleep(self.READ_S)
        self.reads.append((float(self.weights), time.time()))
        yield "sim.version", self.weights


live_weights = trainer_plugin(LiveWeights)


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_a_push_runs_beside_the_next_step_whose_update_waits_until_the_push_read_the_weights(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The push of version k used to hold the learner until every engine acknowledged it; the next step's forward
    and backward need not wait for that, only its write of the weights does. A write before the read ends would
    push version k+1's weights as version k."""
    use_spec(SimSpec(token_seconds=2e-3, train_sample_seconds=0.05, length_min=16, length_max=48), tmp_path,
             monkeypatch)
    settings = _settings(tmp_path, num_rollout=4, train_backend=f"{__name__}:live_weights")
    async with actor_system(tmp_path, settings, ROLES) as system:
        await system.wait_for(lambda: all(task.done() for task in system.tasks.values()), 30, "the run to end")
        trainer = system["learner"].trainer.local
        assert {task.result() for task in system.tasks.values()} == {0}
    read = {value: ended for value, ended in trainer.reads}  # the last read of each version
    assert sorted(read) == [0.0, 1.0, 2.0, 3.0, 4.0]  # every version was pushed, none as another's
    assert all(trainer.writes[version] >= read[version - 1] for version in (1, 2, 3, 4))
    steps = {s["batch_id"]: s for s in read_metrics(tmp_path / "metrics" / "train.jsonl")}
    overlapped = [batch for batch in (2, 3, 4) if steps[batch]["sim/compute_start"] < read[batch - 1]]
    assert overlapped == [2, 3, 4], "a step waited for the previous version's push before it computed"


@pytest.mark.unit
def test_plugin_trainer_factory_builds_a_trainer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    use_spec(SPEC, tmp_path, monkeypatch)
    trainer = build_trainer(build_config(SLEEPING))  # no --hf-checkpoint: a plugin needs none
    assert isinstance(trainer, Trainer) and trainer.version == 0


@pytest.mark.unit
@pytest.mark.parametrize(("path", "error", "message"), [
    ("builtins:repr", TypeError, r"--train-backend 'builtins:repr': the factory returned a str, not an "
                                 r"engines.training.base.Trainer"),
    ("tools.sim.pipeline:SPEC_ENV", TypeError, r"--train-backend 'tools.sim.pipeline:SPEC_ENV': str is not callable"),
    ("tools.nowhere:factory", ValueError, r"--train-backend 'tools.nowhere:factory': cannot import module"),
])
def test_a_wrong_trainer_plugin_is_named_by_flag_and_path(path: str, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        build_trainer(build_config({"train_backend": path}))


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_a_stopping_learner_does_not_wait_for_a_batch_nobody_will_serve(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The buffer stops with the run and may never answer the learner's open batch request: the learner must reach
    its own stop (and checkpoint) at once, not after the request's timeouts, or its launcher kills it first."""
    use_spec(SPEC, tmp_path, monkeypatch)
    async with actor_system(tmp_path, _settings(tmp_path), {"controller": "controller", "learner": "learner"}
                            ) as system:
        learner = system["learner"]
        await system.wait_for(lambda: learner.waits.snapshot() != [], 15, "the learner to ask for a batch")
        assert [(w.on, w.what) for w in learner.waits.snapshot()][:1] == [("buffer", "batch 1")]
        asked = time.monotonic()
        learner.request_stop("test: the run stops")
        await asyncio.wait_for(asyncio.shield(system.tasks["learner"]), 30)
        assert time.monotonic() - asked < 3.0
        assert system.tasks["learner"].result() == 0


class CommittedThroughBatch5(Buffer):
    """A buffer whose log says batches up to 5 are committed, as a checkpoint after batch 5 would have left it,
    before the learner first asks (set after the start, the first ask waited out an empty long poll first)."""

    async def on_start(self) -> None:
        await super().on_start()
        assert self.core is not None
        self.core.committed_batch = 5


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_a_batch_the_buffer_can_never_serve_fails_the_run_instead_of_asking_forever(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A learner resumed from a checkpoint older than what the buffer committed asked again and again (each time an
    error and a traceback) until the hang detector ended the run 15 minutes later; now it fails at once, saying why."""
    use_spec(SPEC, tmp_path, monkeypatch)
    roles = {"controller": "controller", "buffer": CommittedThroughBatch5, "learner": "learner"}
    async with actor_system(tmp_path, _settings(tmp_path, num_rollout=20), roles) as system:
        ended = await asyncio.wait_for(asyncio.shield(system.tasks["learner"]), 30)
    assert ended == EXIT_RUN_FAILED
    report = exit_report(system["learner"].context)
    assert report is not None and "cannot serve batch 1" in report and "already committed" in report, report


@pytest.mark.integration
@pytest.mark.timeout(90)
async def test_every_eval_round_is_generated_by_weights_the_engines_received_when_a_hold_skips_a_due_version(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Engines slow to load weights and a staleness bound of 3 let the learner train past a due version while an
    earlier round still holds the engines: that version is never pushed. Its round used to be generated by other
    weights (16 of 16 samples off-version); it now goes to the next version the engines receive."""
    use_spec(SimSpec(token_seconds=2e-3, train_sample_seconds=0.01, length_min=16, length_max=48), tmp_path,
             monkeypatch)
    original_apply = VersionOnlyLoader.apply
    received = {0}  # the versions the engine got (it starts from the checkpoint, version 0)

    async def slow_apply(self: VersionOnlyLoader, group: object, version: int, timeout_s: float) -> None:
        await asyncio.sleep(0.3)
        await original_apply(self, group, version, timeout_s)
        received.add(version)

    monkeypatch.setattr(VersionOnlyLoader, "apply", slow_apply)
    off = await _off_version_samples_per_round(tmp_path, num_rollout=8, eval_prompts=8, eval_interval=2)
    assert len(off) >= 3 and not any(off.values()), f"rounds generated by other weights: {off}"
    assert set(off) <= received, (sorted(off), sorted(received))


@pytest.mark.integration
@pytest.mark.timeout(90)
async def test_the_baseline_round_sees_version_0_when_the_evaluator_starts_after_the_first_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The learner trains its first step before the evaluator first asks for a pin: that step's push waits for the
    ask. It used to go at once, and the baseline round (version 0) was generated by version 1's weights (16 of 16
    samples off-version), then evaluated again as a round of version 1."""
    from actors.evaluator.actor import Evaluator
    from actors.learner.actor import Learner

    use_spec(SimSpec(token_seconds=4e-3, train_sample_seconds=0.005, length_min=24, length_max=48), tmp_path,
             monkeypatch)
    first_step = asyncio.Event()
    train, evaluate = Learner.train, Evaluator.run

    async def train_and_tell(self: Learner, *args: object, **kwargs: object) -> object:
        report = await train(self, *args, **kwargs)
        first_step.set()
        return report

    async def start_after_the_first_step(self: Evaluator) -> None:
        await asyncio.wait_for(first_step.wait(), 60)
        await evaluate(self)

    monkeypatch.setattr(Learner, "train", train_and_tell)
    monkeypatch.setattr(Evaluator, "run", start_after_the_first_step)
    off = await _off_version_samples_per_round(tmp_path, num_rollout=5, eval_prompts=8, eval_interval=4)
    assert sorted(off) == [0, 4, 5] and not any(off.values()), f"rounds and their off-version samples: {off}"


async def _off_version_samples_per_round(tmp_path: Path, *, num_rollout: int, eval_prompts: int,
                                         eval_interval: int) -> dict[int, int]:
    """A run to its end with a held-out set (staleness 3, 2 samples per eval prompt): each round's version, and
    how many of its samples had a token from other weights."""
    evals = write_prompts(tmp_path / "eval.jsonl", count=eval_prompts)
    settings = _settings(tmp_path, num_rollout=num_rollout, max_staleness=3, eval_prompt_data=["held", str(evals)],
                         eval_interval=eval_interval, n_samples_per_eval_prompt=2)
    outcome = await _run_to_the_end(tmp_path, settings)
    assert set(outcome["exit_codes"].values()) == {0}, outcome["exit_codes"]
    return {r["step"]: r["eval/held/off_version_samples"] for r in read_metrics(tmp_path / "metrics" / "eval.jsonl")}


@pytest.mark.integration
@pytest.mark.timeout(90)
async def test_the_final_push_waits_for_the_round_that_holds_the_engines(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The last step ends while the round of an earlier due version is still being generated: the final weights
    must not reach the engines before that round reports. finish() used to push them at once, and the round's
    remaining samples were generated by the final weights."""
    use_spec(SimSpec(token_seconds=4e-3, train_sample_seconds=0.005, length_min=24, length_max=48), tmp_path,
             monkeypatch)
    off = await _off_version_samples_per_round(tmp_path, num_rollout=5, eval_prompts=16, eval_interval=4)
    assert 4 in off and 5 in off, f"rounds: {sorted(off)}"  # the held round, and the final version's
    assert not any(off.values()), f"rounds generated by other weights: {off}"
