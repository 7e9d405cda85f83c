"""slime's on-policy distillation scripts run end to end on CPU: the teacher held by the learner (slime's
`--opd-type megatron`), and the teacher a server of its own reached through slime's OPD reward recipe
(`--opd-type sglang`, `--rm-url`), here our SGLang-compatible server over the teacher model.

Each script of `tests/data/slime_scripts/` runs with the tiny student and a teacher fine-tuned on the task
substituted for its model folders, `--train-backend torch` (a Megatron-held teacher is checked against the torch
trainer's in tests/engines/test_megatron_learner_flags.py, in a fraction of a run's time), and its output folders
under the test's tmp dir. The teacher's signal must reach every step: the reverse-KL metrics in train.jsonl.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engines.sglang.launch import ServerProcess, ServerSpec
from tests.support.distillation import taught_teacher
from tests.support.slime_scripts import SCRIPTS, read_slime_script, run_slime_script


def prompts(tmp_path: Path) -> Path:
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "label": str(2 * i)}) + "\n" for i in range(8)),
                    encoding="utf-8")
    return data


@pytest.fixture(scope="module")
def teacher(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One taught teacher for both scripts: neither run writes to its folder."""
    return taught_teacher(tiny_model_path, tmp_path_factory.mktemp("teacher"))


def run_script(argv: list[str], entry: str, tmp_path: Path) -> list[dict]:
    argv[argv.index("--save") + 1] = str(tmp_path / "save")
    return run_slime_script(entry, argv, tmp_path / "run")[1]


@pytest.mark.system
def test_slimes_distillation_script_with_the_teacher_in_the_learner_trains_on_cpu(tiny_model_path: Path, teacher: Path,
                                                                                  tmp_path: Path) -> None:
    entry, argv = read_slime_script(SCRIPTS / "opd-teacher-in-learner.sh", overrides={
        "MODEL_DIR": str(tiny_model_path), "TEACHER_DIR": str(teacher), "DATA_PATH": str(prompts(tmp_path))})
    steps = run_script(argv, entry, tmp_path)
    assert len(steps) == 3
    for step in steps:
        assert step["opd/tokens/teacher"] > 0
        assert step["opd/reverse_kl/teacher"] > 1.0  # the random student is far from the taught teacher


@pytest.mark.system
def test_slimes_distillation_script_with_a_teacher_server_trains_on_cpu(tiny_model_path: Path, teacher: Path,
                                                                         tmp_path: Path) -> None:
    server = ServerProcess(ServerSpec(model_path=str(teacher), module="tools.standins.sglang_server",
                                      random_seed=1, extra={"torch-threads": "1"}),
                           startup_timeout=120, log_dir=tmp_path / "teacher-logs")
    server.start()
    try:
        host, port = server.url.removeprefix("http://").split(":")
        entry, argv = read_slime_script(SCRIPTS / "opd-teacher-server.sh", overrides={
            "MODEL_DIR": str(tiny_model_path), "DATA_PATH": str(prompts(tmp_path)), "TEACHER_IP": host,
            "TEACHER_PORT": port})
        steps = run_script(argv, entry, tmp_path)
    finally:
        server.stop()
    assert len(steps) == 3
    for step in steps:
        assert step["rollout/reward_mean"] == 0.0  # slime's recipe: no task reward, the teacher is the signal
        assert step["opd/tokens/teacher"] > 0
        assert step["opd/reverse_kl/teacher"] > 1.0
