"""The launcher's preflight: every problem at once, each naming the flag and the value; only what the node reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from actors.config import RunConfig
from actors.config.preflight import PREFIX_ROWS, ROLE_PLUGINS, preflight
from policies.registry import REWARDS

HEAD = {"controller": 1, "buffer": 1, "learner": 1, "rollout": 1, "reward": 1}


def prompts(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def good_prompts(tmp_path: Path, name: str = "train.jsonl") -> Path:
    return prompts(tmp_path / name, [json.dumps({"input": "1+1=", "label": "2"})])


@pytest.mark.unit
def test_a_sound_configuration_has_no_problem(tmp_path: Path, tiny_model_path: Path) -> None:
    config = RunConfig(prompt_data=str(good_prompts(tmp_path)), hf_checkpoint=str(tiny_model_path),
                       eval_prompt_data=["heldout", str(good_prompts(tmp_path, "eval.jsonl"))], eval_interval=5,
                       custom_rm_path="policies.rewards.text:exact_match_reward")
    assert preflight(config, HEAD) == []


@pytest.mark.unit
def test_every_problem_is_reported_at_once_with_its_flag_and_value(tmp_path: Path) -> None:
    empty = prompts(tmp_path / "empty.jsonl", [])
    wrong_key = prompts(tmp_path / "eval.jsonl", [json.dumps({"question": "1+1="})] * 3)
    config = RunConfig(prompt_data=str(empty), hf_checkpoint=str(tmp_path / "missing-model"),
                       eval_prompt_data=["heldout", str(wrong_key)], eval_interval=5,
                       custom_rm_path="no_such_package.rewards:score",
                       custom_generate_function_path="examples.calculator_env:no_such_function")
    assert preflight(config, HEAD) == [
        f"--prompt-data {empty}: no records (the file is empty)",
        f"--eval-prompt-data heldout {wrong_key}: no usable records in its first {PREFIX_ROWS} lines (3 malformed, "
        "the first at line 1: key 'input' missing (its keys: 'question'))",
        f"--hf-checkpoint {tmp_path / 'missing-model'}: not found: no such directory",
        "--custom-generate-function-path 'examples.calculator_env:no_such_function': 'examples.calculator_env' has "
        "no attribute 'no_such_function'",
        "--custom-rm-path 'no_such_package.rewards:score': cannot import module 'no_such_package.rewards': "
        "ModuleNotFoundError: No module named 'no_such_package'",
    ]


@pytest.mark.unit
def test_a_node_checks_only_what_its_own_actors_read(tmp_path: Path) -> None:
    """A worker node with reward workers only: the head's data, model and learner plugins need not be here."""
    config = RunConfig(prompt_data=str(tmp_path / "on-the-head.jsonl"), hf_checkpoint="/on/the/head/only",
                       custom_advantage_function_path="no_such_package:advantages", rm_type="no_such_reward")
    assert preflight(config, {"rollout": 0, "reward": 2}) == [
        "--rm-type no_such_reward: unknown reward function 'no_such_reward'; "
        f"registered: {', '.join(REWARDS.names())}; or give a dotted path 'package.module:attr'",
    ]
    assert {"math", "exact_match", "final_number"} <= set(REWARDS.names())


@pytest.mark.unit
def test_the_model_is_required_by_whoever_loads_it() -> None:
    problems = preflight(RunConfig(), {"learner": 1, "rollout": 2})
    assert problems == ["--hf-checkpoint: required: the learner (--train-backend torch) and the rollout workers "
                        "(--rollout-engine torch) load the model from it"]


@pytest.mark.unit
def test_a_model_folder_needs_a_config(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    problems = preflight(RunConfig(hf_checkpoint=str(tmp_path / "model")), {"rollout": 1})
    assert problems == [f"--hf-checkpoint {tmp_path / 'model'}: the folder has no config.json (not a Hugging Face "
                        "model folder)"]


@pytest.mark.unit
def test_a_hub_id_loads_only_from_this_machines_cache(tmp_path: Path) -> None:
    """No download happens at start-up: an id is fine when its files are cached, a clear error when not."""
    cache = tmp_path / "hub"
    snapshot = cache / "models--acme--tiny" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}", encoding="utf-8")
    (cache / "models--acme--tiny" / "refs").mkdir()
    (cache / "models--acme--tiny" / "refs" / "main").write_text("0123abcd", encoding="utf-8")
    assert preflight(RunConfig(hf_checkpoint="acme/tiny"), {"rollout": 1}, hub_cache=cache) == []
    assert preflight(RunConfig(hf_checkpoint="acme/other"), {"rollout": 1}, hub_cache=cache) == [
        f"--hf-checkpoint acme/other: not found: no such directory, and no Hugging Face model 'acme/other' in this "
        f"machine's cache ({cache}); download it first (huggingface-cli download acme/other) or give the model's "
        "folder"]


@pytest.mark.unit
def test_a_dataset_needs_a_usable_record_among_its_first_rows_only(tmp_path: Path) -> None:
    record = json.dumps({"input": "1+1=", "label": "2"})
    late = prompts(tmp_path / "late.jsonl", ["{broken"] * PREFIX_ROWS + [record])
    early = prompts(tmp_path / "early.jsonl", [record] + ["{broken"] * 2 * PREFIX_ROWS)
    assert preflight(RunConfig(prompt_data=str(early)), {"buffer": 1}) == []
    assert preflight(RunConfig(prompt_data=str(late)), {"buffer": 1}) == [
        f"--prompt-data {late}: no usable records in its first {PREFIX_ROWS} lines ({PREFIX_ROWS} malformed, the "
        "first at line 1: not valid JSON: Expecting property name enclosed in double quotes at column 2)"]


@pytest.mark.unit
def test_a_training_only_run_needs_its_recording_not_prompts(tmp_path: Path, tiny_model_path: Path) -> None:
    config = RunConfig(hf_checkpoint=str(tiny_model_path), debug_train_only=True,
                       load_debug_rollout_data=str(tmp_path / "recording"))
    assert preflight(config, {"controller": 1, "buffer": 1, "learner": 1}) == [
        f"--load-debug-rollout-data {tmp_path / 'recording'}: no recorded batch there (batch_000001.msgpack, as "
        "--save-debug-rollout-data writes)"]
    (tmp_path / "recording").mkdir()
    (tmp_path / "recording" / "batch_000001.msgpack").write_bytes(b"")
    assert preflight(config, {"controller": 1, "buffer": 1, "learner": 1}) == []
    dumps = str(tmp_path / "dumps" / "{rollout_id}.pt")  # slime's rollout dumps (--load-forge-rollout-data)
    config = config.with_settings(load_debug_rollout_data=dumps)
    assert preflight(config, {"learner": 1}) == [
        f"--load-debug-rollout-data {dumps}: no rollout dump {tmp_path / 'dumps' / '0.pt'} (slime's "
        "--load-forge-rollout-data file, or a {rollout_id} template's 0 file)"]
    (tmp_path / "dumps").mkdir()
    (tmp_path / "dumps" / "0.pt").write_bytes(b"")
    assert preflight(config, {"learner": 1}) == []


@pytest.mark.unit
@pytest.mark.parametrize("transport", ["nccl", "cuda_ipc"])
def test_a_gpu_weight_transport_on_a_node_without_gpus_is_refused_before_the_learner_loops(
        tmp_path: Path, tiny_model_path: Path, transport: str) -> None:
    """slime's scripts say `--update-weight-transport nccl`; on a CPU node the learner died at its first push and
    was restarted into the same death six times (tests hide any GPU from tests not marked gpu)."""
    config = RunConfig(prompt_data=str(good_prompts(tmp_path)), hf_checkpoint=str(tiny_model_path),
                       weight_transport=transport)
    assert preflight(config, HEAD) == [f"--weight-transport {transport}: it moves CUDA tensors, and this node has no "
                                       "GPU (auto picks gloo, or shared memory when colocated)"]
    assert preflight(config, {"buffer": 1, "reward": 1}) == []  # nothing on this node pushes or receives weights


@pytest.mark.unit
def test_a_memory_recorder_is_refused_where_what_it_records_cannot_exist(tmp_path: Path,
                                                                         tiny_model_path: Path) -> None:
    """slime's --record-memory-history records CUDA's allocator (torch) or the host's (memray, a package): on a
    node without a GPU, or without memray, the learner could not start recording (GPUs are hidden from tests not
    marked gpu)."""
    config = RunConfig(prompt_data=str(good_prompts(tmp_path)), hf_checkpoint=str(tiny_model_path),
                       record_memory_history=True)
    assert preflight(config, HEAD) == ["--record-memory-history (--memory-recorder torch): it records CUDA's "
                                       "allocator, and this node has no GPU (on CPU, --memory-recorder memray "
                                       "records host memory)"]
    assert preflight(config, {"buffer": 1, "rollout": 1}) == []  # no learner on this node
    memray = config.with_settings(memory_recorder="memray", memory_snapshot_num_steps=2)
    import importlib.util

    expected = [] if importlib.util.find_spec("memray") else [
        "--record-memory-history with --memory-recorder memray: the memray package is not installed on this node "
        "(pip install memray)"]
    assert preflight(memray, HEAD) == expected
    assert preflight(config.with_settings(use_pytorch_profiler=True, record_memory_history=False), HEAD) == []


@pytest.mark.unit
def test_a_misspelled_label_key_is_refused_before_any_actor_starts(tmp_path: Path) -> None:
    data = good_prompts(tmp_path)
    held = prompts(tmp_path / "held.jsonl", [json.dumps({"question": "2+2=", "answer": "4"})])
    config = RunConfig(prompt_data=str(data), label_key="lable", eval_prompt_data=["held", str(held)],
                       eval_input_key="question", eval_label_key="answer", eval_interval=1)
    [problem] = preflight(config, {"buffer": 1})
    assert problem.startswith(f"--prompt-data {data}: no usable records in its first {PREFIX_ROWS} lines (1 "
                              "malformed, the first at line 1: label key 'lable' missing (its keys: 'input', "
                              "'label')); name the label's key with --label-key")
    assert preflight(config.with_settings(label_key="label"), {"buffer": 1}) == []


# The roles each plugin setting is loaded by, as the launcher's hand table said before the fields were marked.
LOADED_BY = {
    **dict.fromkeys(("custom_generate_function_path", "rollout_function_path", "rollout_sample_hook_path",
                     "agent_function_path", "agent_tools_path", "agent_environment_path", "agent_tool_schemas_path",
                     "rollout_engine", "eval_function_path"), ("rollout",)),
    "weight_transport": ("rollout", "learner"),
    **dict.fromkeys(("buffer_filter_path", "dynamic_sampling_filter_path", "rollout_all_samples_process_path",
                     "data_source_path"), ("buffer",)),
    **dict.fromkeys(("custom_reward_post_process_path", "custom_advantage_function_path",
                     "custom_convert_samples_to_train_data_path", "train_backend", "custom_megatron_init_path",
                     "custom_megatron_before_log_prob_hook_path", "custom_megatron_before_train_step_hook_path",
                     "custom_rollout_log_function_path", "rollout_data_postprocess_path",
                     "custom_pg_loss_reducer_function_path", "rollout_sample_filter_path"),
                    ("learner",)),
    "custom_eval_rollout_log_function_path": ("evaluator",),
    **dict.fromkeys(("rm_type", "custom_rm_path"), ("reward",)),
}


@pytest.mark.unit
def test_the_plugin_settings_are_read_from_the_marks_on_their_fields() -> None:
    assert ROLE_PLUGINS == LOADED_BY


@pytest.mark.unit
@pytest.mark.parametrize("setting", sorted(set(LOADED_BY) - {"rm_type", "rollout_sample_hook_path"}))
def test_a_plugin_setting_is_imported_on_the_nodes_of_the_roles_that_load_it(setting: str) -> None:
    config = RunConfig(**{setting: "no_such_package.plugins:thing"}, hf_checkpoint=".", prompt_data=".",
                       eval_interval=1)  # eval_function_path needs one
    flag = f"--{setting.replace('_', '-')}"
    for role in ("buffer", "learner", "rollout", "reward", "evaluator"):
        problems = [problem for problem in preflight(config, {role: 1}) if problem.startswith(flag)]
        expected = role in LOADED_BY[setting]
        assert bool(problems) == expected, f"{flag} on a {role} node: {problems}"
        if expected:
            assert "no_such_package" in problems[0] and len(problems) == 1


@pytest.mark.unit
def test_a_dynamic_sampling_filter_is_built_as_the_buffer_builds_it() -> None:
    config = RunConfig(dynamic_sampling_filter_path="no_such_filter")
    assert preflight(config, {"buffer": 1, "reward": 1})[-1:] == [
        "--dynamic-sampling-filter-path no_such_filter: unknown sample filter 'no_such_filter'; registered: "
        "no_reward_errors, nonzero_std; or give a dotted path 'package.module:attr'"]
    assert preflight(config, {"reward": 1}) == []


@pytest.mark.unit
def test_each_policys_own_settings_are_checked_and_its_problems_name_it(tmp_path: Path) -> None:
    """A policy's data and its reward are its own: checked on its settings, the policy named; a problem every policy
    has (the shared model) is the run's, said once."""
    missing = tmp_path / "missing.jsonl"
    config = RunConfig(lora_rank=4, hf_checkpoint=str(tmp_path / "no-model"), policies={
        "solver": {"prompt_data": str(missing)},
        "proposer": {"prompt_data": str(good_prompts(tmp_path)), "custom_rm_path": "no_such_package.rewards:score"},
    })
    assert preflight(config, HEAD) == [
        f"--hf-checkpoint {tmp_path / 'no-model'}: not found: no such directory",
        f"policies.solver: --prompt-data {missing}: no such file",
        "policies.proposer: --custom-rm-path 'no_such_package.rewards:score': cannot import module "
        "'no_such_package.rewards': ModuleNotFoundError: No module named 'no_such_package'",
    ]
    # the reward workers are shared, and score each policy's samples with its reward: checked where they run
    assert preflight(config, {"reward": 1}) == [preflight(config, HEAD)[-1]]


@pytest.mark.unit
def test_two_policies_may_not_save_their_checkpoints_in_one_folder(tmp_path: Path, tiny_model_path: Path) -> None:
    data = {"prompt_data": str(good_prompts(tmp_path)), "hf_checkpoint": str(tiny_model_path), "lora_rank": 4}
    shared = RunConfig(**data, save=str(tmp_path / "ckpt"), policies={"a": {}, "b": {}, "c": {"save": "elsewhere"}})
    assert preflight(shared, HEAD) == [
        f"--save {tmp_path / 'ckpt'}: policies a, b would save their checkpoints in the same folder; give each its "
        "own (policies.<name>.save) or leave --save out (each saves in RUN_DIR/policies/<name>)"]
    assert preflight(RunConfig(**data, policies={"a": {}, "b": {}}), HEAD) == []
