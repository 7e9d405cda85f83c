"""`tools/evaluate.py` scores a model as a run's eval round does: the launcher's data flags, the prompt tokenized
as the rollout workers tokenize it, the reward given what the reward workers give it, and bad input said in a
line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from actors.data.prompt_tokens import encode_prompt
from tests.support import reward_plugins
from tests.support.console import PROGRESS_BAR, env_without_quiet_switches
from tools.evaluate import evaluate_model
from tools.repo_env import with_repo_on_path

REPO = Path(__file__).resolve().parents[2]


def _slime_keyed_data(path: Path) -> Path:
    rows = [{"prompt": "12+30=", "answer": "42", "extra": {"source": "a"}},
            {"prompt": [{"role": "user", "content": "7+8="}], "answer": "15", "extra": {"source": "b"}}]
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n{not json\n", encoding="utf-8")
    return path


@pytest.mark.integration
async def test_the_reward_sees_what_a_reward_worker_would_see(tmp_path: Path, tiny_model_path: Path) -> None:
    data = _slime_keyed_data(tmp_path / "eval.jsonl")
    reward_plugins.SEEN.clear()
    result = await evaluate_model(tiny_model_path, data, reward="tests.support.reward_plugins:record",
                                  input_key="prompt", label_key="answer", metadata_key="extra",
                                  apply_chat_template=True, max_new_tokens=4, samples_out=tmp_path / "out.jsonl")
    assert result["prompts"] == 2 and result["skipped"] == 1
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    seen = reward_plugins.SEEN
    assert [(inp.prompt, inp.label, inp.metadata) for inp in seen] == [
        ("12+30=", "42", {"source": "a"}), ("7+8=", "15", {"source": "b"})]
    assert seen[0].prompt_ids == encode_prompt(tokenizer, "12+30=", chat_template=True)
    assert seen[0].prompt_ids != encode_prompt(tokenizer, "12+30=", chat_template=False)
    assert seen[1].prompt_ids == encode_prompt(tokenizer, [{"role": "user", "content": "7+8="}], chat_template=False)
    for inp in seen:
        assert 0 < len(inp.response_ids) <= 4 and inp.finish_reason in ("stop", "length")
        assert inp.response == tokenizer.decode(inp.response_ids, skip_special_tokens=True)
    written = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [(row["response"], row["tokens"]) for row in written] == [(i.response, len(i.response_ids)) for i in seen]
    lengths = [len(inp.response_ids) for inp in seen]
    assert (result["response_length_median"], result["response_length_mean"]) == (sum(lengths) / 2, sum(lengths) / 2)


@pytest.fixture(scope="module")
def scored_in_another_folder(tmp_path_factory: pytest.TempPathFactory,
                             tiny_model_path: Path) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """One scoring run of the command, started in a folder other than the repository's with a reward module of that
    folder: the two tests below read its output (each run loads the model, so they share one)."""
    folder = tmp_path_factory.mktemp("evaluate")
    (folder / "my_reward.py").write_text("def half(inp):\n    return 0.5\n", encoding="utf-8")
    data = _slime_keyed_data(folder / "eval.jsonl")
    scored = subprocess.run([sys.executable, "-m", "tools.evaluate", str(tiny_model_path), str(data),
                             "--input-key", "prompt", "--label-key", "answer", "--apply-chat-template",
                             "--reward", "my_reward:half", "--max-new-tokens", "2"],
                            cwd=folder, env=with_repo_on_path(env_without_quiet_switches()), capture_output=True,
                            text=True, timeout=240, check=False)
    assert scored.returncode == 0, scored.stderr[-3000:]
    return data, scored


@pytest.mark.integration
def test_the_command_prints_its_scores_names_what_it_dropped_and_refuses_bad_input_in_a_line(
    tiny_model_path: Path, scored_in_another_folder: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    data, scored = scored_in_another_folder
    assert "prompts=2.0000 skipped=1.0000" in scored.stdout
    assert f"evaluate: skipped {data} line 3: not valid JSON" in scored.stderr
    assert "evaluate: generated 2/2 prompts in" in scored.stderr  # progress, and its last line once all are
    assert not PROGRESS_BAR.search(scored.stderr), scored.stderr

    refused = subprocess.run([sys.executable, "-m", "tools.evaluate", str(tiny_model_path), str(data),
                              "--input-key", "prompt", "--label-key", "answer", "--reward", "no_such_reward"],
                             cwd=REPO, env=with_repo_on_path(env_without_quiet_switches()), capture_output=True,
                             text=True, timeout=240, check=False)
    assert refused.returncode == 2
    assert refused.stderr.startswith("evaluate: unknown reward function 'no_such_reward'"), refused.stderr
    assert "Traceback" not in refused.stderr


@pytest.mark.integration
def test_a_reward_module_in_the_working_directory_loads_as_the_launcher_loads_it(
    scored_in_another_folder: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    """The launcher's actors import plugins from the folder the run was started in, so evaluate, started in another
    folder than the repository's, must find them there too."""
    _, scored = scored_in_another_folder
    assert "mean_reward=0.5000 prompts=2.0000" in scored.stdout
