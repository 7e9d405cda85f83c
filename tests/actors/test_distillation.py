"""On-policy distillation: the teacher's log-probs reach the advantages from the learner's teacher and from a teacher
server, the student moves toward the teacher, several teachers are picked per prompt, and bad setups are refused."""

from __future__ import annotations

import argparse
import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from actors.config import build_config
from actors.config.slime_flags import apply_slime_flags
from actors.config.teachers import Teacher, run_teachers
from actors.learner.stages import to_step_batch
from actors.learner.step import TrainingStep
from actors.reward.teacher import TeacherScorer
from actors.rollout.generate import RolloutContext, default_generate
from bus.schema import PromptGroup, Sample
from engines.inference.torch_engine import TorchEngine
from engines.sglang.launch import ServerProcess, ServerSpec
from engines.training.base import teacher_role
from engines.training.config import TorchTrainerConfig
from engines.training.torch_trainer import TorchTrainer
from policies.advantages import compute_advantages
from policies.config import PolicyLossConfig
from tests.actors.test_learner_step import generate, with_rewards
from tests.support.distillation import taught_teacher
from tools.standins.tiny_model import TinyModelSpec, cached_tiny_model


@pytest.fixture(scope="module")
def teacher_path(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return taught_teacher(tiny_model_path, tmp_path_factory.mktemp("teacher"))


def prompt_groups(count: int, *, teachers: list[str] | None = None) -> list[PromptGroup]:
    return [PromptGroup(group_id=f"g{i}", prompt=f"{i}+{i}=", label=str(2 * i), n_samples=4, data_index=i,
                        metadata={} if teachers is None else {"teacher": teachers[i % len(teachers)]})
            for i in range(count)]


# ------------------------------------------------------------------------------------------------------ math
@pytest.mark.unit
def test_the_distillation_term_is_subtracted_per_token_after_the_estimator_and_before_whitening() -> None:
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([3, 4, 2, 5])
    mask = torch.ones(14)
    mask[5] = 0.0
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    groups = torch.tensor([0, 0, 1, 1])
    student, teacher = -torch.rand(14, generator=gen) * 3, -torch.rand(14, generator=gen) * 3
    plain = PolicyLossConfig(advantage_estimator="grpo")
    distilled = plain.model_copy(update={"use_opd": True, "opd_kl_coef": 0.5})
    base, _ = compute_advantages(plain, rewards=rewards, group_ids=groups, response_lengths=lengths, loss_mask=mask)
    ours, returns = compute_advantages(distilled, rewards=rewards, group_ids=groups, response_lengths=lengths,
                                       loss_mask=mask, log_probs=student, teacher_log_probs=teacher)
    expected = (base - 0.5 * (student - teacher)) * mask
    torch.testing.assert_close(ours, expected)
    torch.testing.assert_close(returns, base)  # the term shapes advantages; it is not a reward
    whitened_config = distilled.model_copy(update={"normalize_advantages": True})
    whitened, _ = compute_advantages(whitened_config, rewards=rewards, group_ids=groups, response_lengths=lengths,
                                     loss_mask=mask, log_probs=student, teacher_log_probs=teacher)
    kept = mask.bool()
    centred = expected[kept] - expected[kept].mean()
    torch.testing.assert_close(whitened[kept], centred / (centred.var() + 1e-8).sqrt())


@pytest.mark.unit
def test_distillation_without_teacher_log_probs_is_a_clear_error() -> None:
    config = PolicyLossConfig(use_opd=True)
    with pytest.raises(ValueError, match="use_opd needs log_probs"):
        compute_advantages(config, rewards=torch.zeros(1), group_ids=torch.zeros(1, dtype=torch.long),
                           response_lengths=torch.tensor([2]), loss_mask=torch.ones(2), log_probs=torch.zeros(2))


# -------------------------------------------------------------------------------------------- run settings
@pytest.mark.unit
@pytest.mark.parametrize(("settings", "message"), [
    ({"use_opd": True}, "use_opd needs a teacher"),
    ({"opd_teacher": ["t=/models/t"]}, "use_opd is off"),
    ({"use_opd": True, "opd_type": "megatron"}, "opd_type megatron needs --opd-teacher-load"),
    ({"use_opd": True, "opd_type": "sglang", "opd_teacher_load": "/t"}, "must not be set"),
    ({"use_opd": True, "opd_teacher": ["a=/a", "b=http://h:1"]}, "need --opd-teacher-key"),
    ({"use_opd": True, "opd_teacher": ["a=/a", "a=/b"]}, "given twice"),
    ({"use_opd": True, "opd_teacher": ["=/a"]}, "expected NAME=SOURCE"),
    ({"use_opd": True, "opd_teacher_load": "/t", "train_backend": "tools.sim.pipeline:sleeping_trainer"},
     "need --train-backend torch or megatron; on tools.sim.pipeline:sleeping_trainer give the teacher as a server"),
    ({"use_opd": True, "opd_teacher_load": "/t", "custom_advantage_function_path": "m:f"}, "replaces the estimator"),
])
def test_unusable_distillation_settings_are_refused_by_name(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_config({"hf_checkpoint": "/m", **settings})


@pytest.mark.unit
def test_teachers_are_held_by_the_learner_or_served_by_their_url() -> None:
    config = build_config({"hf_checkpoint": "/m", "use_opd": True, "opd_teacher_load": "/big",
                           "opd_teacher": ["math=http://h:30000/", "code=/code"], "opd_teacher_key": "subject"})
    assert run_teachers(config.distillation) == {"teacher": Teacher("teacher", path="/big"),
                                    "math": Teacher("math", url="http://h:30000"),
                                    "code": Teacher("code", path="/code")}


@pytest.mark.unit
def test_slimes_sglang_distillation_recipe_becomes_a_teacher_server_and_no_task_reward() -> None:
    args = argparse.Namespace(use_opd=True, opd_type="sglang", opd_kl_coef=1.0, rm_url="http://10.0.0.1:13141/generate",
                              custom_rm_path="slime.rollout.on_policy_distillation.reward_func",
                              custom_reward_post_process_path="slime.rollout.on_policy_distillation.post_process_rewards")
    apply_slime_flags(args)
    assert args.opd_teacher == ["teacher=http://10.0.0.1:13141"]
    assert (args.rm_type, args.custom_rm_path, args.rm_url, args.custom_reward_post_process_path) == (
        "zero", None, None, None)


# ------------------------------------------------------------------------------------- teacher in the learner
def trainer_with_teachers(student: Path, teachers: dict[str, Path], *, lr: float = 1e-4) -> TorchTrainer:
    return TorchTrainer(TorchTrainerConfig(model_path=student, teacher_model_paths=teachers, lr=lr, seed=0))


def sampled_reverse_kl(trainer: TorchTrainer, samples: list[Sample], role: str) -> float:
    batch = to_step_batch(samples, rewarded=False).samples
    student = trainer.compute_log_probs(batch, temperature=1.0).log_probs
    teacher = trainer.compute_log_probs(batch, temperature=1.0, model=role).log_probs
    return float((student - teacher).mean())


@pytest.mark.integration
def test_pure_distillation_from_the_learners_teacher_moves_the_student_toward_it(tiny_model_path: Path,
                                                                                teacher_path: Path) -> None:
    """On-policy, as a run does it: each round the engine samples with the newest weights, the learner's teacher
    scores the tokens, a zero-reward step trains, the weights go back. The student's log-ratio to the teacher on
    the first round's tokens must fall well below where it started: the same tokens before and after, since each
    round's sampled KL over 24 fresh short samples moves by more than the 12 rounds move it."""
    config = build_config({"hf_checkpoint": str(tiny_model_path), "n_samples_per_prompt": 4,
                           "rollout_max_response_len": 8, "use_opd": True, "opd_teacher_load": str(teacher_path),
                           "rm_type": "zero", "lr": 1e-2})
    trainer = trainer_with_teachers(tiny_model_path, {"teacher": teacher_path}, lr=1e-2)
    step = TrainingStep(trainer, config)

    async def rounds() -> list[dict[str, float]]:
        from transformers import AutoTokenizer

        engine = TorchEngine.from_pretrained(tiny_model_path, max_batch_size=24, seed=0)
        context = RolloutContext(engine=engine, tokenizer=AutoTokenizer.from_pretrained(tiny_model_path),
                                 config=config, worker_id="w")
        metrics = []
        try:
            for version in range(1, 13):
                groups = await asyncio.gather(*(default_generate(context, g) for g in prompt_groups(6)))
                samples = with_rewards([s for group in groups for s in group], [0.0] * 24)
                if version == 1:
                    first_samples = samples
                    first_kl = sampled_reverse_kl(trainer, samples, teacher_role("teacher"))
                    first_tokens = sum(s.response_length for s in samples)
                report = step.train(samples, [0] * len(samples))
                metrics.append(report.metrics)
                await engine.update_weights(trainer.named_tensors(), version)
        finally:
            await engine.close()
        assert metrics[0]["opd/reverse_kl"] == pytest.approx(first_kl, abs=1e-4)  # the batch's sampled KL
        assert metrics[0]["opd/tokens/teacher"] == first_tokens
        return metrics, first_kl, sampled_reverse_kl(trainer, first_samples, teacher_role("teacher"))

    metrics, first_kl, last_kl = asyncio.run(rounds())
    assert last_kl < 0.85 * first_kl, (first_kl, last_kl, [round(m["opd/reverse_kl"], 3) for m in metrics])


@pytest.mark.integration
def test_each_prompt_is_scored_by_the_teacher_its_dataset_field_names(tiny_model_path: Path, teacher_path: Path,
                                                                      tiny_model_cache: Path) -> None:
    other = cached_tiny_model(tiny_model_cache, TinyModelSpec(family="qwen2", seed=11))
    config = build_config({"hf_checkpoint": str(tiny_model_path), "n_samples_per_prompt": 4,
                           "rollout_max_response_len": 6, "use_opd": True, "opd_teacher_key": "teacher",
                           "opd_teacher": [f"near={teacher_path}", f"far={other}"], "rm_type": "zero"})
    samples = with_rewards(generate(tiny_model_path, config, prompt_groups(4, teachers=["near", "far"])), [0.0] * 16)
    trainer = trainer_with_teachers(tiny_model_path, {"near": teacher_path, "far": other})
    prepared = TrainingStep(trainer, config).prepare(samples, [0] * len(samples))
    assert prepared.batch.teachers == [s.metadata["teacher"] for s in samples]
    for name in ("near", "far"):
        mine = [i for i, s in enumerate(samples) if s.metadata["teacher"] == name]
        alone = trainer.compute_log_probs([prepared.batch.samples[i] for i in mine], temperature=1.0,
                                          model=teacher_role(name)).log_probs
        torch.testing.assert_close(torch.cat([prepared.batch.samples[i].teacher_log_probs for i in mine]), alone)
    report = TrainingStep(trainer, config).train_prepared(prepared)
    assert {"opd/reverse_kl/near", "opd/reverse_kl/far"} <= set(report.metrics)
    assert report.metrics["opd/reverse_kl/near"] != report.metrics["opd/reverse_kl/far"]


# ------------------------------------------------------------------------------------------ teacher servers
@pytest.fixture(scope="module")
def teacher_server(teacher_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    spec = ServerSpec(model_path=str(teacher_path), module="tools.standins.sglang_server", random_seed=3,
                      extra={"torch-threads": "1"})
    process = ServerProcess(spec, startup_timeout=120, log_dir=tmp_path_factory.mktemp("teacher-logs"))
    process.start()
    yield process
    process.stop()


async def annotate(scorer: TeacherScorer, samples: list[Sample]) -> list[Sample]:
    try:
        return await scorer.annotate(samples)
    finally:
        await scorer.close()


@pytest.mark.integration
def test_a_teacher_server_scores_the_students_tokens_as_the_learners_teacher_does(
        tiny_model_path: Path, teacher_path: Path, teacher_server: ServerProcess) -> None:
    config = build_config({"hf_checkpoint": str(tiny_model_path), "n_samples_per_prompt": 4,
                           "rollout_max_response_len": 8, "use_opd": True,
                           "opd_teacher": [f"teacher={teacher_server.url}"], "rm_type": "zero"})
    samples = generate(tiny_model_path, config, prompt_groups(2))
    scorer = TeacherScorer(run_teachers(config.distillation), key=None, timeout_s=30, temperature=1.0)
    scored = asyncio.run(annotate(scorer, samples))
    assert all(s.status != "failed" and len(s.teacher_log_probs) == s.response_length for s in scored), \
        [s.error for s in scored]
    trainer = trainer_with_teachers(tiny_model_path, {"teacher": teacher_path})
    in_learner = trainer.compute_log_probs(to_step_batch(samples, rewarded=False).samples, temperature=1.0,
                                           model=teacher_role("teacher")).log_probs
    served = torch.from_numpy(np.concatenate([s.teacher_log_probs for s in scored]))
    torch.testing.assert_close(served, in_learner, atol=1e-4, rtol=0)


@pytest.mark.integration
def test_an_unreachable_teacher_fails_its_samples_with_the_teacher_named(tiny_model_path: Path) -> None:
    with socket.socket() as closed:  # a port nothing listens on once the socket is closed
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"
    samples = [Sample(sample_id=f"g/{i}", group_id="g", index=i, prompt="1+1=", prompt_tokens=3,
                      tokens=np.array([5, 6, 7, 8, 9], dtype=np.int32), response_length=2) for i in range(2)]
    scorer = TeacherScorer({"big": Teacher("big", url=url)}, key=None, timeout_s=5, temperature=1.0,
                           retry_pause_s=0.0)
    scored = asyncio.run(annotate(scorer, samples))
    assert [s.status for s in scored] == ["failed", "failed"]
    assert scored[0].error is not None and f"teacher 'big' ({url})" in scored[0].error


@pytest.mark.unit
def test_a_prompt_naming_no_known_teacher_fails_with_the_field_and_value() -> None:
    sample = Sample(sample_id="g/0", group_id="g", index=0, prompt="x", prompt_tokens=1,
                    tokens=np.array([5, 6], dtype=np.int32), response_length=1, metadata={"subject": "art"})
    scorer = TeacherScorer({"math": Teacher("math", url="http://h:1")}, key="subject", timeout_s=5, temperature=1.0)
    [scored] = asyncio.run(scorer.annotate([sample]))
    assert scored.status == "failed" and "'subject' is 'art'" in (scored.error or "")


@pytest.mark.unit
def test_the_progress_line_shows_the_kl_to_the_teacher_and_the_critics_explained_variance() -> None:
    from actors.report.progress import describe

    line = describe({"step": 2, "rollout/reward_mean": 0.0, "opd/reverse_kl": 1.25, "critic/explained_variance": 0.5})
    assert "kl-to-teacher 1.250 critic-ev 0.500 stale" in line
    assert "kl-to-teacher" not in describe({"step": 2, "rollout/reward_mean": 0.0})


@pytest.mark.integration
def test_the_engine_scores_a_long_answer_in_windows_as_it_scores_it_whole(tiny_model_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A teacher server scoring a long answer over a large vocabulary must not hold [answer x vocabulary] logits:
    windows of a few positions give the same log-probs as one pass."""
    from engines.inference import scoring

    tokens = [5, 17, 23, 42, 8, 9, 31, 77, 12, 64, 3]

    head_rows: list[int] = []  # positions each forward computed logits for

    async def score() -> list[float]:
        engine = TorchEngine.from_pretrained(tiny_model_path)
        engine.model.get_output_embeddings().register_forward_hook(
            lambda module, inputs, output: head_rows.append(output.shape[-2]))
        try:
            return await engine.score(tokens, start=3, temperature=0.7)
        finally:
            await engine.close()

    from transformers import AutoConfig

    whole = asyncio.run(score())
    vocabulary = AutoConfig.from_pretrained(tiny_model_path).vocab_size
    monkeypatch.setattr(scoring, "SCORE_LOGITS_ELEMENTS", 3 * vocabulary)  # windows of three positions
    head_rows.clear()
    windowed = asyncio.run(score())
    assert head_rows == [4, 4, 3]  # three windows: 8 answer tokens, each window's logits and the one before it
    assert len(whole) == len(tokens) - 3
    np.testing.assert_allclose(windowed, whole, atol=1e-5)
