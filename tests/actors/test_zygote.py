"""Actors forked from the pre-imported template: exit codes, signals and the template's death reach the launcher."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import launcher
from actors.launch import node_roles
from actors.launch.supervisor import holds_a_model
from actors.launch.zygote_client import EarlyTemplate, Zygote, actor_environment
from actors.runtime.context import ActorContext
from actors.runtime.roles import BUILTIN_ROLES
from bus.address import free_port
from tests.support.launch_inputs import minimal_inputs
from tests.support.processes import alive
from tools.bench.pipeline import SLEEPING_FLAGS

REPO = Path(__file__).resolve().parents[2]


def controller_context(tmp_path: Path) -> Path:
    """A controller waits for members that never come: a child that lives until it is told otherwise."""
    context = ActorContext(actor_id="controller", role="controller", actor_class=BUILTIN_ROLES["controller"],
                           node_rank=0, head_address=f"tcp://127.0.0.1:{free_port('127.0.0.1')}", run_dir=tmp_path)
    path = tmp_path / "controller.json"
    path.write_text(context.to_json(), encoding="utf-8")
    return path


@pytest.mark.integration
def test_a_forked_actor_reports_its_exit_code_and_the_signal_that_ended_it(tmp_path: Path) -> None:
    async def scenario() -> tuple[int, int, int]:
        zygote = await Zygote.start(dict(os.environ))
        try:
            bad = await zygote.spawn(str(tmp_path / "missing.json"), dict(os.environ), heavy=False)
            bad_code = await asyncio.wait_for(bad.wait(), 30)
            live = await zygote.spawn(str(controller_context(tmp_path)), dict(os.environ), heavy=False)
            await asyncio.sleep(1.0)
            assert live.returncode is None
            live.kill()
            killed = await asyncio.wait_for(live.wait(), 30)
            with pytest.raises(ProcessLookupError):
                live.send_signal(signal.SIGTERM)  # ended: its pid is no longer ours to signal
            return bad_code, killed, live.pid
        finally:
            await zygote.close()

    bad_code, killed, pid = asyncio.run(scenario())
    assert bad_code == 2  # actors.runtime.main: the context file could not be read
    assert killed == -signal.SIGKILL and not alive(pid)


@pytest.mark.integration
def test_a_forked_actor_runs_its_exit_handlers(tmp_path: Path) -> None:
    """Exit handlers stop what an actor started (a checkpoint writer's helper process); skipped, such a helper
    outlived its actor holding the launcher's console pipes, and whoever read them waited forever."""
    context = ActorContext(actor_id="marker", role="marker", actor_class="tests.support.exit_marker:Missing",
                           node_rank=0, head_address="tcp://127.0.0.1:1", run_dir=tmp_path)
    path = tmp_path / "marker.json"
    path.write_text(context.to_json(), encoding="utf-8")
    marker = tmp_path / "exited"

    async def scenario() -> int:
        zygote = await Zygote.start(dict(os.environ))
        try:
            child = await zygote.spawn(str(path), {**os.environ, "EXIT_MARKER": str(marker)}, heavy=False)
            return await asyncio.wait_for(child.wait(), 30)
        finally:
            await zygote.close()

    assert asyncio.run(scenario()) == 2  # no such class: a bad configuration, after the module was imported
    assert marker.read_text(encoding="utf-8") == "exit handlers ran"


@pytest.mark.integration
def test_when_the_template_dies_its_actors_end_and_the_launcher_hears_of_it(tmp_path: Path) -> None:
    async def scenario() -> tuple[int, int]:
        zygote = await Zygote.start(dict(os.environ))
        child = await zygote.spawn(str(controller_context(tmp_path)), dict(os.environ), heavy=False)
        await asyncio.sleep(1.0)
        zygote.process.kill()
        code = await asyncio.wait_for(child.wait(), 30)
        await zygote.close()
        return code, child.pid

    code, pid = asyncio.run(scenario())
    assert code == -signal.SIGTERM
    deadline = time.monotonic() + 20
    while alive(pid) and time.monotonic() < deadline:  # its death signal is SIGTERM: a graceful stop
        time.sleep(0.2)
    assert not alive(pid), "an actor outlived the template it was forked from"


def _has_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.integration
def test_a_template_started_early_is_adopted_and_forks_light_actors_before_it_imports_torch(tmp_path: Path) -> None:
    """A head node's launcher starts the template before it reads its settings, and the supervisor adopts it. A
    light actor (controller, buffer) is forked before torch is imported: forked after, it would carry torch's
    objects through every garbage collection of its event loop (a buffer's heartbeats then came late in CI)."""
    async def scenario() -> tuple[bool, bool]:
        early = EarlyTemplate(dict(os.environ))
        zygote = await Zygote.start(dict(os.environ), early)
        try:
            live = await zygote.spawn(str(controller_context(tmp_path)), dict(os.environ), heavy=False)
            await asyncio.sleep(1.0)
            light_without_torch = alive(live.pid) and not _has_torch(live.pid) and not _has_torch(early.pid)
            live.kill()
            await asyncio.wait_for(live.wait(), 30)
            return light_without_torch, alive(early.pid)
        finally:
            await zygote.close()

    light_without_torch, adopted_alive = asyncio.run(scenario())
    assert light_without_torch, "the light actor (or the template before a heavy order) has torch loaded"
    assert adopted_alive


@pytest.mark.unit
def test_only_a_launcher_that_runs_a_learner_and_forks_every_actor_starts_its_template_early() -> None:
    for argv in (["--node-rank", "1"], ["--head", "--no-fork-actors"], ["--head", "--roles", "controller"],
                 ["--head-address", "tcp://h:1", "--leave-policy", "sums"]):
        assert EarlyTemplate.for_learner(argv) is None, argv
    for argv in (["--head", "--prompt-data", "x"], ["--head-address", "tcp://h:1", "--join-policy", "sums"]):
        early = EarlyTemplate.for_learner(argv)
        assert early is not None and alive(early.pid), argv
        early.close()
        assert early.process.returncode is not None


@pytest.mark.unit
def test_an_actor_starts_unbuffered_unless_the_user_chose_and_with_only_its_placements_gpus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The template and the actors started without it share one environment rule (it was written twice)."""
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    assert actor_environment()["PYTHONUNBUFFERED"] == "1"
    assert actor_environment()["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    assert actor_environment("2,3")["CUDA_VISIBLE_DEVICES"] == "2,3"
    monkeypatch.setenv("PYTHONUNBUFFERED", "0")
    assert actor_environment()["PYTHONUNBUFFERED"] == "0"


@pytest.mark.unit
def test_an_actor_starts_with_glibcs_mmap_threshold_fixed_unless_the_user_set_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    assert actor_environment()["MALLOC_MMAP_THRESHOLD_"] == str(8 << 20)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    assert actor_environment()["MALLOC_MMAP_THRESHOLD_"] == "131072"


@pytest.mark.unit
def test_the_template_preloads_the_model_stack_for_a_real_engine_and_trainer_and_not_for_stand_ins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plugin engine or trainer (the pipeline benchmark's sleeping ones) imports its own module, not the torch
    engine, trainer and transformers: preloading those cost each such launch seconds of CPU for nothing."""
    monkeypatch.setattr(node_roles, "visible_gpus", lambda: 0)

    def preloaded(name: str, *flags: str) -> dict[str, bool]:
        contexts, _, _ = launcher.prepare(["--head", "--run-dir", str(tmp_path / name), *minimal_inputs(tmp_path),
                                           *flags])
        return {context.actor_id: holds_a_model(context) for context in contexts}

    light = {"controller": False, "buffer": False, "reward-0-0": False}
    assert preloaded("real") == {**light, "rollout-0-0": True, "learner": True}
    assert preloaded("stand-ins", *SLEEPING_FLAGS) == {**light, "rollout-0-0": False, "learner": False}
    assert preloaded("stand-in-engine", *SLEEPING_FLAGS[:2]) == {**light, "rollout-0-0": False, "learner": True}


@pytest.mark.integration
@pytest.mark.parametrize("flags", [
    (),  # reads the checkpoint's config.json for an FP8 quantisation
    ("--rollout-engine", "sglang", "--sglang-server-module", "tools.standins.sglang_server", "--lora-rank", "4",
     "--colocate"),  # checks the LoRA targets against SGLang's
    ("--train-backend", "megatron"),  # looks for a vision tower that backend cannot train
], ids=["torch-engine", "sglang-lora", "megatron"])
def test_the_launcher_checks_a_run_without_importing_torch(tmp_path: Path, flags: tuple[str, ...]) -> None:
    """The template imports torch beside the launcher's own start; a launcher that imported it too while it checked
    the settings took the same CPU seconds again, in front of every launch (1.7 s of a 7.7 s run here)."""
    argv = ["--head", "--run-dir", str(tmp_path / "run"), *minimal_inputs(tmp_path), *flags]
    code = (f"import sys, launcher; launcher.prepare({argv!r}); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines()[-1] == "[]"
