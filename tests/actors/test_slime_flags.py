"""Every slime flag is accepted with slime's meaning, explained, or refused with a reason; slime run scripts parse.

`tests/data/slime_flags.txt` lists the flags slime declares at HEAD 624b824a (2026-08-21): every `add_argument` and
`reset_arg` call with a `--flag` in `slime/utils/arguments.py`, plus the slime-own router/engine flags of
`slime/backends/sglang_utils/arguments.py` (`--sglang-router-*`, `--sglang-server-concurrency`, `--sglang-config`,
`--prefill-num-servers`; the rest of that file forwards SGLang's server flags), and `--sglang-router-policy`, which
that file declares since (slime's agentic recipes route by `consistent_hashing` with it). It was made once with a short
script that walks the file's AST (`ast.walk`, calls named add_argument/reset_arg) and writes "FLAG KIND" per line,
KIND being the argparse action (store_true, store_false, append, bool_optional), nargs=+ / nargs=*, or value.

The run scripts in `tests/data/slime_scripts/` are written for these tests from slime's scripts and docs (a dense
Qwen3-4B-shaped GRPO run, a 30B-A3B MoE run, a fully async 0.5B run); `read_slime_script` expands their
`NAME=( ... )` arrays and variables as bash would and returns the argv after `python3 train[_async].py`
(tests/support/slime_scripts.py).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from actors.config import config_from_args, split_sglang_args
from actors.config.flags import build_config
from actors.config.run import RunConfig
from actors.config.settings_errors import SettingsError
from actors.config.slime_table import FSDP_BACKEND_FLAGS, SLIME_FLAGS
from launcher import build_parser
from tests.support.slime_scripts import SCRIPTS, read_slime_script

DATA = Path(__file__).resolve().parents[1] / "data"


def _kinds(name: str) -> dict[str, str]:
    return dict(line.split() for line in (DATA / name).read_text().splitlines() if line.strip())


HEAD_KINDS = _kinds("slime_flags.txt")
# slime's FSDP backend's flags: the fields of `FSDPArgs` (slime/backends/fsdp_utils/arguments.py at 16b83e1, made
# the same way: a bool field is a store_true switch, any other a value; `config` left out, the YAML its parser
# reads) and `--fsdp-full-params` (removed from it in 9f04d49e, still named by slime's VLM script).
FSDP_KINDS = _kinds("slime_fsdp_flags.txt")
SLIME_KINDS = {**HEAD_KINDS, **FSDP_KINDS}
def parse(argv: list[str]) -> argparse.Namespace:
    rest, passthrough = split_sglang_args(argv)
    args = build_parser().parse_args(["--head", *rest])
    args.sglang_passthrough = passthrough
    return args


def configure(argv: list[str]) -> tuple[RunConfig, argparse.Namespace]:
    args = parse(argv)
    return config_from_args(args), args


def _action(parser: argparse.ArgumentParser, flag: str) -> argparse.Action:
    return parser._option_string_actions[flag]


@pytest.mark.unit
def test_every_slime_flag_at_head_has_a_row() -> None:
    assert len(HEAD_KINDS) == 230
    assert sorted(set(HEAD_KINDS) - set(SLIME_FLAGS)) == []
    assert sorted(set(SLIME_FLAGS) - set(HEAD_KINDS)) == sorted(FSDP_BACKEND_FLAGS)


@pytest.mark.unit
def test_every_flag_of_slimes_fsdp_backend_is_ours_or_has_a_row() -> None:
    """Its Megatron-named fields (--lr, --adam-eps, --context-parallel-size, ...) are our own settings or rows of
    slime's main flags; the rest are rows of FSDP_BACKEND_FLAGS, read and decided like slime's other flags."""
    parser = build_parser()
    own = {flag for flag in FSDP_KINDS if not _action(parser, flag).dest.startswith("slime_")}
    assert sorted(set(FSDP_KINDS) - own - set(HEAD_KINDS)) == sorted(FSDP_BACKEND_FLAGS)
    assert own >= {"--lr", "--adam-eps", "--weight-decay", "--context-parallel-size", "--deterministic-mode"}


@pytest.mark.unit
def test_every_slime_flag_is_read_as_slime_declares_it() -> None:
    """A switch takes no value, a value flag exactly one, a list flag one or more: the next flag is never eaten."""
    parser = build_parser()
    wrong = []
    for flag, kind in SLIME_KINDS.items():
        action = _action(parser, flag)
        if kind in ("store_true", "store_false"):
            ok = action.nargs == 0
        elif kind == "bool_optional":
            ok = isinstance(action, argparse.BooleanOptionalAction)
        elif kind.startswith("nargs="):
            ok = action.nargs in ("+", "*")
        elif kind == "append":
            ok = isinstance(action, argparse._AppendAction) or action.nargs in ("+", "*")
        else:
            ok = action.nargs is None and action.const is None
        if not ok:
            wrong.append(f"{flag} ({kind}: nargs={action.nargs})")
    assert wrong == []


@pytest.mark.unit
def test_same_name_rows_are_our_own_settings() -> None:
    parser = build_parser()
    for flag, row in SLIME_FLAGS.items():
        dest = _action(parser, flag).dest
        if row.fate == "same":
            assert not dest.startswith("slime_"), flag
        elif row.fate != "owned":
            assert dest.startswith("slime_"), f"{flag} is now one of our settings: mark its row 'same'"


def _sample_argv(flag: str) -> list[str]:
    """A value for the flag that is not one of the accepted 'means what we do anyway' values."""
    row, kind = SLIME_FLAGS[flag], SLIME_KINDS[flag]
    if kind in ("store_true", "store_false", "bool_optional"):
        return [flag]
    value = {int: "3", float: "0.5"}.get(row.type, "x")
    value = {"--update-weight-mode": "delta", "--rollout-data-transport": "nixl",
             "--apply-chat-template-kwargs": '{"enable_thinking": false}'}.get(flag, value)
    return [flag, value]


@pytest.mark.unit
@pytest.mark.parametrize("flag", sorted(f for f, row in SLIME_FLAGS.items() if row.fate == "refused"))
def test_refused_flag_names_itself_and_the_reason(flag: str) -> None:
    with pytest.raises(ValueError) as raised:
        configure(_sample_argv(flag))
    assert flag in str(raised.value)
    assert SLIME_FLAGS[flag].why.split(" (")[0] in str(raised.value)


@pytest.mark.unit
def test_owned_flag_is_refused_until_its_section_defines_it() -> None:
    parser = build_parser()
    for flag, row in SLIME_FLAGS.items():
        if row.fate != "owned" or not _action(parser, flag).dest.startswith("slime_"):
            continue
        with pytest.raises(ValueError, match=re.escape(flag) + ".*not available yet"):
            configure(_sample_argv(flag))


@pytest.mark.unit
def test_explained_flags_are_accepted_and_listed_in_one_note() -> None:
    explained = [f for f, row in SLIME_FLAGS.items() if row.fate == "explained"]
    argv = [token for flag in explained for token in _sample_argv(flag)]
    config, args = configure(argv)
    note = args.slime_translation.note()
    assert config.buffer.max_staleness == RunConfig().buffer.max_staleness
    assert all(flag in note for flag in explained)
    assert "--use-distributed-post (Ray-only" in note


@pytest.mark.unit
def test_slimes_delta_sync_flags_map_onto_delta_pushes_and_the_weight_check() -> None:
    config, _ = configure(["--update-weight-mode", "delta", "--update-weight-delta-encoding", "overwrite",
                           "--update-weight-delta-checksum", "xxh3-128"])
    assert config.weights.weight_delta_sync and config.weights.weight_check_stride == 1
    full, _ = configure(["--update-weight-mode", "full"])
    assert not full.weights.weight_delta_sync
    # slime's default, xor, is served by our own encoding: the same end state, certified by the weight check
    xor, _ = configure(["--update-weight-mode", "delta", "--update-weight-delta-encoding", "xor",
                        "--update-weight-delta-checksum", "xxh3-128"])
    assert xor.weights.weight_delta_sync and xor.weights == config.weights
    with pytest.raises(ValueError, match="--update-weight-delta-encoding 'zstd': expected xor or overwrite"):
        configure(["--update-weight-delta-encoding", "zstd"])
    with pytest.raises(ValueError, match="--update-weight-delta-checksum 'md5': expected one of xxh3-128, blake3"):
        configure(["--update-weight-delta-checksum", "md5"])
    with pytest.raises(ValueError, match="--update-weight-mode 'partial': expected full or delta"):
        configure(["--update-weight-mode", "partial"])


@pytest.mark.unit
def test_a_slime_delta_disk_script_with_sglang_servers_gets_deltas_through_each_hosts_local_checkpoint(
        tmp_path: Path) -> None:
    from actors.learner.publish import publisher_for
    from engines.sglang.disk_weights import SglangDiskSender
    from engines.weights.names import SGLANG_DISK

    argv = ["--rollout-external-engine-addrs", "http://a:1", "--bf16", "--update-weight-mode", "delta",
            "--update-weight-transport", "disk", "--update-weight-disk-dir", str(tmp_path / "pushes"),
            "--update-weight-delta-encoding", "overwrite", "--update-weight-delta-checksum", "xxh3-128"]
    wiring = {"engines": dict, "tensors": lambda: iter(()), "zmq": None, "security": None, "client_id": "learner",
              "counters": None, "log": None}
    config, _ = configure([*argv, "--update-weight-local-checkpoint-dir", str(tmp_path / "local")])
    publisher = publisher_for(config, "127.0.0.1", **wiring)
    sender = publisher.transport.make_sender(publisher.options)
    assert publisher.transport.name == SGLANG_DISK and isinstance(sender, SglangDiskSender)
    assert sender.delta_sync and sender.local_directory == str(tmp_path / "local")
    # slime requires the local checkpoint for disk deltas too: SGLang reloads checkpoints whole
    without, _ = configure(argv)
    refusal = ("--weight-delta-sync over the sglang_disk weight transport needs --weight-disk-local-dir (slime's "
               "--update-weight-local-checkpoint-dir)")
    with pytest.raises(ValueError, match=re.escape(refusal)):
        publisher_for(without, "127.0.0.1", **wiring)


@pytest.mark.unit
def test_values_that_mean_what_we_do_anyway_are_accepted() -> None:
    config, args = configure(["--no-offload-train", "--no-offload-rollout", "--update-weight-mode", "full",
                              "--rollout-data-transport", "object-store", "--rollout-top-k", "-1"])
    assert config.rollout.rollout_top_k == 0
    assert "--offload-train" in args.slime_translation.note()
    sft, _ = configure(["--loss-type", "sft_loss", "--disable-compute-advantages-and-returns"])
    assert sft.policy.loss_type == "sft"


@pytest.mark.unit
def test_aliases_translate_into_our_settings() -> None:
    config, args = configure([
        "--ref-load", "/ckpt/ref", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096", "--use-tis",
        "--calculate-per-token-loss", "--rollout-external-engine-addrs", "http://a:1", "http://b:2",
        "--sglang-server-concurrency", "128", "--update-weight-transport", "nccl", "--wandb-key", "k",
        "--wandb-team", "team", "--http-proxy", "http://proxy:3128", "--train-env-vars", '{"NCCL_DEBUG": "INFO"}',
    ])
    assert config.model.ref_checkpoint == "/ckpt/ref"
    assert config.trainer.micro_batch_tokens == 4096
    assert config.policy.off_policy_correction == "tis"
    assert config.policy.loss_agg_mode == "token-mean"
    assert config.engine.sglang_url == ["http://a:1", "http://b:2"] and config.engine.rollout_engine == "sglang"
    assert config.engine.rollout_max_batch_size == 128
    assert config.weights.weight_transport == "nccl"
    assert args.slime_translation.env == {"WANDB_API_KEY": "k", "WANDB_ENTITY": "team", "NCCL_DEBUG": "INFO",
                                          "http_proxy": "http://proxy:3128", "https_proxy": "http://proxy:3128"}


@pytest.mark.unit
def test_check_weight_update_equal_is_the_strict_weight_check_and_our_default_checks_too() -> None:
    assert configure(["--check-weight-update-equal"])[0].weights.weight_check == "strict"
    assert configure(["--check-weight-update-equal"])[0].weights.weight_check_stride == 1  # slime compares every byte
    assert configure([])[0].weights.weight_check == "repush"
    assert configure([])[0].weights.weight_check_stride == 16
    with pytest.raises(ValueError, match="--check-weight-update-equal sets --weight-check 'strict', but "
                                         "--weight-check 'off' was also given"):
        configure(["--check-weight-update-equal", "--weight-check", "off"])


@pytest.mark.unit
def test_custom_tis_function_path_becomes_the_correction() -> None:
    config, _ = configure(["--custom-tis-function-path", "icepop"])
    assert config.policy.off_policy_correction == "icepop"


@pytest.mark.unit
def test_custom_tis_function_path_wins_over_use_tis() -> None:
    """slime enables its correction by --use-tis and names the function by --custom-tis-function-path: one setting."""
    for argv in (["--use-tis", "--custom-tis-function-path", "icepop"],
                 ["--custom-tis-function-path", "icepop", "--use-tis"]):
        assert configure(argv)[0].policy.off_policy_correction == "icepop"


@pytest.mark.unit
def test_slimes_negative_switches_turn_their_setting_off_unless_the_setting_is_given() -> None:
    config, _ = configure(["--disable-grpo-std-normalization", "--disable-rewards-normalization"])
    assert not config.policy.grpo_std_normalization and not config.policy.rewards_normalization
    assert configure(["--disable-rewards-normalization", "--rewards-normalization"])[0].policy.rewards_normalization
    assert build_config({"disable_grpo_std_normalization": True}).policy.grpo_std_normalization is False  # YAML key
    assert build_config({"disable_grpo_std_normalization": False}).policy.grpo_std_normalization is True


@pytest.mark.unit
def test_slimes_custom_loss_without_its_path_is_refused_by_name() -> None:
    with pytest.raises(SettingsError, match=r"loss_type='custom_loss' needs custom_loss_function_path"):
        build_config({"loss_type": "custom_loss"})


@pytest.mark.unit
def test_slimes_loss_names_are_read_at_the_edge_and_policies_know_only_their_own() -> None:
    from pydantic import ValidationError

    from policies.config import PolicyLossConfig

    assert configure(["--loss-type", "policy_loss", "--advantage-estimator", "gspo"])[0].policy.loss_type == "gspo"
    assert build_config({"loss_type": "policy_loss"}).policy.loss_type == "ppo"  # a YAML key reads the same
    assert build_config({"loss_type": "sft_loss"}).policy.loss_type == "sft"
    with pytest.raises(ValidationError, match="sft_loss"):
        PolicyLossConfig(loss_type="sft_loss")


@pytest.mark.unit
def test_slime_entry_points_keep_slimes_correction_default() -> None:
    assert configure(["--slime-entry", "train_async"])[0].policy.off_policy_correction == "none"
    assert configure(["--slime-entry", "train_async", "--use-tis"])[0].policy.off_policy_correction == "tis"
    assert configure([])[0].policy.off_policy_correction == "tis"  # Slipstream's own fully-async default


@pytest.mark.unit
def test_slime_custom_loss_pair_becomes_our_loss_type() -> None:
    path = "examples.slime_style.custom_loss:reinforce_loss"
    config, _ = configure(["--loss-type", "custom_loss", "--custom-loss-function-path", path])
    assert config.policy.loss_type == path
    assert configure(["--custom-loss-function-path", path])[0].policy.loss_type == path
    with pytest.raises(ValueError, match=r"--custom-loss-function-path .* needs --loss-type custom_loss"):
        configure(["--loss-type", "gspo", "--custom-loss-function-path", path])


@pytest.mark.unit
def test_alias_that_disagrees_with_our_own_flag_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"--ref-load.*--ref-checkpoint"):
        configure(["--ref-load", "/a", "--ref-checkpoint", "/b"])
    with pytest.raises(ValueError, match="--update-weight-transport sets --weight-transport 'disk', but "
                                         "--weight-transport 'gloo' was also given"):
        configure(["--update-weight-transport", "disk", "--weight-transport", "gloo"])


@pytest.mark.unit
def test_slimes_disk_sync_flags_become_the_disk_transport_and_its_settings(tmp_path: Path) -> None:
    config, _ = configure(["--update-weight-mode", "full", "--update-weight-transport", "disk",
                           "--update-weight-disk-dir", str(tmp_path), "--update-weight-disk-keep-files",
                           "--update-weight-local-checkpoint-dir", "/nvme/ckpt",
                           "--custom-update-weight-post-write-path", "my_hooks:publish"])
    weights = config.weights
    assert (weights.weight_transport, weights.weight_disk_dir, weights.weight_disk_keep_files) == (
        "disk", str(tmp_path), True)
    assert (weights.weight_disk_local_dir, weights.weight_disk_post_write_path) == ("/nvme/ckpt", "my_hooks:publish")
    with pytest.raises(ValueError, match="--weight-transport disk needs --weight-disk-dir"):
        configure(["--update-weight-transport", "disk"])
    with pytest.raises(ValueError, match="weight_disk_keep_files: only with --weight-transport disk"):
        configure(["--update-weight-disk-keep-files"])
    with pytest.raises(ValueError, match="--update-weight-transport 'rdma': expected nccl or disk"):
        configure(["--update-weight-transport", "rdma"])


@pytest.mark.unit
def test_slime_spellings_of_our_own_flags() -> None:
    config, _ = configure(["--use-wandb", "--wandb-mode", "disabled", "--rollout-top-k", "-1",
                           "--save-debug-rollout-data", "/tmp/dbg/{rollout_id}.pt"])
    assert config.logging.use_wandb is False
    assert config.rollout.rollout_top_k == 0
    assert config.learner.save_debug_rollout_data == "/tmp/dbg"


@pytest.mark.unit
def test_slimes_own_sglang_flags_are_not_forwarded_to_the_server() -> None:
    rest, forwarded = split_sglang_args(["--sglang-router-ip", "10.0.0.1", "--sglang-mem-fraction-static", "0.7",
                                         "--sglang-server-concurrency", "64", "--sglang-config", "g.yaml"])
    assert forwarded == {"mem-fraction-static": "0.7"}
    assert rest == ["--sglang-router-ip", "10.0.0.1", "--sglang-server-concurrency", "64", "--sglang-config",
                    "g.yaml"]
    config, _ = configure(["--sglang-router-ip", "10.0.0.1", "--sglang-router-port", "30000"])
    assert config.engine.sglang_router_url == "http://10.0.0.1:30000" and config.engine.sglang_args == {}


@pytest.mark.unit
@pytest.mark.parametrize(("ip", "url"), [("10.0.0.1", "http://10.0.0.1:3000"), ("fd00::7", "http://[fd00::7]:3000"),
                                         ("router.local", "http://router.local:3000")])
def test_slimes_external_router_names_the_servers_to_attach_to(ip: str, url: str) -> None:
    config, args = configure(["--sglang-router-ip", ip, "--sglang-router-port", "3000"])
    assert config.engine.sglang_router_url == url and config.engine.rollout_engine == "sglang"
    assert config.engine.sglang_url == [] and args.slime_translation.note() is None


@pytest.mark.unit
def test_slimes_router_flags_beside_given_servers_or_alone_have_no_effect_and_say_so() -> None:
    config, args = configure(["--sglang-router-ip", "10.0.0.1", "--sglang-router-port", "3000",
                              "--rollout-external-engine-addrs", "http://a:1", "http://b:2"])
    assert config.engine.sglang_url == ["http://a:1", "http://b:2"] and config.engine.sglang_router_url is None
    assert "the SGLang servers are given by --rollout-external-engine-addrs" in args.slime_translation.note()
    config, args = configure(["--sglang-router-port", "3000"])
    assert config.engine.sglang_router_url is None and config.engine.rollout_engine == "torch"
    assert "--sglang-router-port 3000 (slime's own router listens there; no router is started here" in (
        args.slime_translation.note())


@pytest.mark.unit
@pytest.mark.parametrize(("argv", "error"), [
    (["--sglang-router-ip", "10.0.0.1"], "--sglang-router-ip 10.0.0.1 needs --sglang-router-port"),
    (["--sglang-router-ip", "http://10.0.0.1", "--sglang-router-port", "3000"],
     "expected the router's host name or address"),
    (["--sglang-router-ip", "10.0.0.1", "--sglang-router-port", "3000", "--rollout-engine", "torch"],
     "--sglang-router-ip sets --rollout-engine 'sglang', but --rollout-engine 'torch' was also given"),
    (["--sglang-router-url", "http://r:3000", "--sglang-url", "http://a:1", "--rollout-engine", "sglang"],
     "--sglang-router-url http://r:3000 and --sglang-url both name the SGLang servers"),
    (["--sglang-router-url", "http://r:3000"], "it needs --rollout-engine sglang"),
    (["--sglang-router-url", "r:3000", "--rollout-engine", "sglang"], "not a router's address"),
])
def test_a_router_given_wrong_is_an_error_naming_it(argv: list[str], error: str) -> None:
    with pytest.raises((ValueError, SettingsError), match=re.escape(error)):
        configure(argv)


@pytest.mark.unit
@pytest.mark.parametrize(("slime", "ours"), [("consistent_hashing", "affinity"), ("cache_aware", "affinity"),
                                             ("round_robin", "round-robin"), ("power_of_two", "least-load")])
def test_slimes_router_policy_and_timeout_map_onto_our_router(slime: str, ours: str) -> None:
    config, _ = configure(["--sglang-router-policy", slime, "--sglang-router-request-timeout-secs", "14400"])
    assert config.router.router_policy == ours
    assert config.router.router_request_timeout == 14400.0


@pytest.mark.unit
def test_a_router_policy_we_lack_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match=r"--sglang-router-policy bucket: .*prefill/decode disaggregation"):
        configure(["--sglang-router-policy", "bucket"])
    with pytest.raises(ValueError, match="--sglang-router-policy sets --router-policy 'affinity', but "
                                         "--router-policy 'local'"):
        configure(["--sglang-router-policy", "consistent_hashing", "--router-policy", "local"])


@pytest.mark.unit
@pytest.mark.parametrize(("argv", "staleness"), [
    (["--slime-entry", "train"], 0),
    (["--slime-entry", "train_async"], 1),
    (["--slime-entry", "train_async", "--update-weights-interval", "2"], 2),
    (["--slime-entry", "train_async", "--max-staleness", "4"], 4),
])
def test_slime_entry_point_sets_the_staleness_bound(argv: list[str], staleness: int) -> None:
    config, _ = configure(argv)
    assert config.buffer.max_staleness == staleness


@pytest.mark.unit
def test_synchronous_entry_point_refuses_a_staleness_bound() -> None:
    with pytest.raises(ValueError, match="--slime-entry train is synchronous"):
        configure(["--slime-entry", "train", "--max-staleness", "2"])


@pytest.mark.unit
def test_help_has_a_slime_compatibility_group() -> None:
    text = build_parser().format_help()
    assert "slime compatibility" in text and "--slime-entry" in text and "--use-opd" in text


def _megatron_section_exists() -> bool:
    return (Path(__file__).resolve().parents[2] / "actors" / "config" / "megatron.py").exists()


@pytest.mark.unit
@pytest.mark.parametrize("script", ["dense-qwen3-4b-grpo.sh", "moe-qwen3-30b-a3b.sh", "fully-async-qwen2.5-0.5b.sh"])
def test_slime_run_script_parses_and_builds_a_config(script: str) -> None:
    if not _megatron_section_exists():
        pytest.xfail("Megatron's model flags need the megatron section (actors/config/megatron.py)")
    entry, argv = read_slime_script(SCRIPTS / script)
    assert entry in ("train", "train_async") and len(argv) > 40
    config, _ = configure(["--slime-entry", entry, *argv])
    assert config.buffer.max_staleness == (0 if entry == "train" else 1)
    assert config.model.ref_checkpoint == config.model.hf_checkpoint
    assert config.trainer.train_backend == "megatron"
    for setting, expected in SCRIPT_EXPECTATIONS[script].items():
        section, name = setting.split(".")
        assert getattr(getattr(config, section), name) == expected, setting


SCRIPT_EXPECTATIONS = {
    "dense-qwen3-4b-grpo.sh": {"trainer.micro_batch_tokens": 8192, "policy.off_policy_correction": "tis",
                               "policy.loss_agg_mode": "token-mean", "data.rollout_seed": 7,
                               "eval.skip_eval_before_train": True, "engine.rollout_max_batch_size": 256,
                               "rollout.rollout_top_k": 0, "megatron.num_layers": 36},
    "moe-qwen3-30b-a3b.sh": {"megatron.num_experts": 128, "megatron.expert_model_parallel_size": 8,
                             "logging.use_wandb": False, "weights.weight_transport": "nccl",
                             "trainer.micro_batch_tokens": 20480},
    "fully-async-qwen2.5-0.5b.sh": {"learner.save_debug_rollout_data": "/tmp/slime_fully_async/debug",
                                    "trainer.learner_ranks": 1, "placement.rollout_num_gpus": 1},
}


@pytest.mark.unit
def test_script_reader_expands_arrays_and_variables() -> None:
    entry, argv = read_slime_script(SCRIPTS / "moe-qwen3-30b-a3b.sh", overrides={"MODEL": "/m"})
    assert entry == "train"
    assert argv[argv.index("--hf-checkpoint") + 1] == "/m"
    assert argv[argv.index("--moe-layer-freq") + 1] == "[1]*48"
    assert argv[argv.index("--sglang-cuda-graph-bs") + 1: argv.index("--sglang-cuda-graph-bs") + 6] == [
        "1", "2", "4", "8", "16"]
    assert "mixture" not in argv  # comments inside arrays are dropped


@pytest.mark.unit
def test_slimes_vlm_fsdp_script_runs_on_the_torch_backend_with_each_flag_taken_or_explained() -> None:
    """slime's Qwen3-VL FSDP script as it is: FSDP is our torch backend, gradient checkpointing its recompute, the
    weight buffer its bucket size, geo3k a built-in reward; the attention kernel choices, and the SGLang server's
    arguments on a torch engine, are named in the start-up note."""
    entry, argv = read_slime_script(SCRIPTS / "vlm-qwen3-vl-8b-fsdp.sh")
    bucket = argv.index("--update-weight-buffer-size")
    assert argv[bucket + 1] == str(512 * 1024 * 1024)  # $((512 * 1024 * 1024))
    graphs = argv.index("--sglang-cuda-graph-bs")
    assert argv[graphs + 1 : graphs + 7] == ["1", "2", "4", "8", "16", "24"] and "256" in argv  # $(seq 16 8 256)
    config, args = configure(["--slime-entry", entry, *argv])
    assert (config.trainer.train_backend, config.megatron.recompute_granularity) == ("torch", "full")
    assert config.weights.weight_bucket_bytes == 512 * 1024 * 1024
    assert (config.reward.rm_type, config.eval.eval_top_p, config.placement.colocate) == ("geo3k", 0.7, True)
    assert config.data.multimodal_keys == {"image": "images"} and config.buffer.max_staleness == 0
    assert config.engine.sglang_args["attention-backend"] == "fa3"
    note = args.slime_translation.note()
    assert "--attn-implementation (the torch trainer's language model attends with its own packed attention" in note
    assert ("--sglang-mem-fraction-static, --sglang-cuda-graph-bs, --sglang-attention-backend (SGLang server "
            "arguments; the rollout engine is torch") in note
    assert "--update-weight-buffer-size" not in note and "--gradient-checkpointing" not in note


@pytest.mark.unit
def test_sglang_server_arguments_are_noted_only_where_no_server_reads_them() -> None:
    _, torch_engine = configure(["--sglang-attention-backend", "fa3", "--sglang-disable-radix-cache"])
    assert torch_engine.slime_translation.note() == (
        "slime flags accepted with no effect here: --sglang-attention-backend (SGLang server arguments; the "
        "rollout engine is torch: they reach SGLang servers with --rollout-engine sglang)")
    config, server = configure(["--rollout-engine", "sglang", "--sglang-attention-backend", "fa3"])
    assert server.slime_translation.note() is None and config.engine.sglang_args == {"attention-backend": "fa3"}


@pytest.mark.unit
def test_train_backend_fsdp_is_the_torch_backend_and_gradient_checkpointing_its_recompute() -> None:
    config, _ = configure(["--train-backend", "fsdp", "--gradient-checkpointing"])
    assert (config.trainer.train_backend, config.megatron.recompute_granularity) == ("torch", "full")
    with pytest.raises(ValueError, match="--gradient-checkpointing sets --recompute-granularity 'full', but "
                                         "--recompute-granularity 'selective' was also given"):
        configure(["--gradient-checkpointing", "--recompute-granularity", "selective"])
    with pytest.raises(ValueError, match="--update-weight-buffer-size sets --weight-bucket-bytes 4096, but "
                                         "--weight-bucket-bytes 8192 was also given"):
        configure(["--update-weight-buffer-size", "4096", "--weight-bucket-bytes", "8192"])


@pytest.mark.unit
def test_eval_rounds_honour_skip_eval_before_train_and_eval_keys(tmp_path: Path) -> None:
    """--skip-eval-before-train drops only the version-0 round; --eval-input-key/--eval-label-key read eval sets."""
    import structlog

    from actors.buffer.core import BufferCore
    from actors.data.prompts import PromptRecord, PromptSource
    from actors.evaluator.rounds import EvalRounds, next_due

    eval_set = tmp_path / "aime.jsonl"
    eval_set.write_text('{"question": "1+1=", "answer": "2"}\n{"question": "2+2=", "answer": "4"}\n')
    config, _ = configure(["--eval-prompt-data", "aime", str(eval_set), "--eval-interval", "2",
                           "--skip-eval-before-train", "--eval-input-key", "question", "--eval-label-key", "answer"])
    core = BufferCore(source=PromptSource([PromptRecord(0, "0+1=", "1", {})], seed=1), n_samples=1,
                      groups_per_batch=1, max_staleness=0, lease_timeout=10.0)
    rounds = EvalRounds(config, core.guest_queue, writer=None, log=structlog.get_logger("eval"))
    assert next_due(config, None) == 2  # no round before training
    rounds.start(2)
    assert [(g.prompt, g.label) for g in core.guest_queue] == [("1+1=", "2"), ("2+2=", "4")]


@pytest.mark.integration
def test_no_rollout_shuffle_leases_prompts_in_file_order(tmp_path: Path) -> None:
    """slime's default order (file order) with --no-rollout-shuffle; shuffled with --rollout-shuffle --rollout-seed."""
    import asyncio
    import json

    from actors.buffer.actor import Buffer
    from actors.runtime.context import ActorContext

    prompts = tmp_path / "train.jsonl"
    prompts.write_text("".join(json.dumps({"input": f"{i}+1=", "label": str(i + 1)}) + "\n" for i in range(20)))

    async def first_prompts(shuffle: bool, seed: int) -> list[str]:
        run = {"prompt_data": str(prompts), "rollout_batch_size": 20, "n_samples_per_prompt": 1,
               "rollout_shuffle": shuffle, "rollout_seed": seed}
        context = ActorContext(actor_id="buffer-0", role="buffer", actor_class="actors.buffer.actor:Buffer",
                               node_rank=0, head_address="tcp://127.0.0.1:1",
                               run_dir=tmp_path / f"run-{len(list(tmp_path.iterdir()))}", settings={"run": run})
        buffer = Buffer(context)
        await buffer.on_start()
        try:
            leased = buffer.core.lease("w", 20)
            assert leased is not None
            return [group.prompt for group in leased[1]]
        finally:
            await buffer.on_stop()

    in_order = asyncio.run(first_prompts(False, 1))
    assert in_order == [f"{i}+1=" for i in range(20)]
    seeded = asyncio.run(first_prompts(True, 5))
    assert seeded != in_order and sorted(seeded) == sorted(in_order)
    assert asyncio.run(first_prompts(True, 5)) == seeded
    assert asyncio.run(first_prompts(True, 6)) != seeded


@pytest.mark.unit
def test_the_counts_in_docs_slime_md_are_the_tables() -> None:
    """docs/slime.md's first table counts slime's flags by fate (same, alias, owned, explained, refused, unknown, in
    that order); they are computed here from SLIME_FLAGS so the page cannot fall behind the table."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "slime.md").read_text(encoding="utf-8")
    head = page.split("| slime's flags (", 1)[1]
    total = int(head.split(")", 1)[0])
    shown = [int(line.rsplit("|", 2)[1]) for line in head.split("\n\n", 1)[0].splitlines()[2:]]
    fates = [row.fate for flag, row in SLIME_FLAGS.items() if flag not in FSDP_BACKEND_FLAGS]
    counted = [fates.count(fate) for fate in ("same", "alias", "owned", "explained", "refused")]
    assert (total, shown) == (len(HEAD_KINDS), [*counted, len(set(HEAD_KINDS) - set(SLIME_FLAGS))])


@pytest.mark.unit
def test_dump_details_is_slimes_pair_of_dumps_and_a_train_data_template_its_folder(tmp_path: Path) -> None:
    config, _ = configure(["--dump-details", str(tmp_path / "d")])
    assert (config.learner.save_debug_rollout_data, config.learner.save_debug_train_data) == (
        f"{tmp_path}/d/rollout_data", f"{tmp_path}/d/train_data")
    given, _ = configure(["--dump-details", str(tmp_path / "d"),
                          "--save-debug-train-data", str(tmp_path / "t" / "{rollout_id}_{rank}.pt")])
    assert (given.learner.save_debug_rollout_data, given.learner.save_debug_train_data) == (
        f"{tmp_path}/d/rollout_data", f"{tmp_path}/t")  # given apart wins; slime's template is read as its folder


def test_slimes_fully_async_rollout_function_is_our_rollout_workers() -> None:
    """slime's fully async example names its rollout function (an in-flight pool across batch boundaries): ours."""
    config, _ = configure(["--slime-entry", "train_async", "--rollout-function-path",
                           "slime.rollout.fully_async_rollout.generate_rollout_fully_async"])
    assert config.rollout.rollout_function_path is None


@pytest.mark.unit
def test_eval_data_without_an_interval_is_no_eval_under_a_slime_entry_and_an_error_otherwise() -> None:
    """slime evaluates only every --eval-interval rollouts; its scripts keep the data with the interval commented."""
    config, args = configure(["--slime-entry", "train", "--eval-prompt-data", "aime", "/data/aime.jsonl"])
    assert config.eval.eval_prompt_data == [] and config.eval.eval_interval is None
    assert "--eval-prompt-data without --eval-interval (slime evaluates only" in args.slime_translation.note()
    with pytest.raises(ValueError, match="eval_prompt_data needs eval_interval"):
        configure(["--eval-prompt-data", "aime", "/data/aime.jsonl"])
    config, args = configure(["--slime-entry", "train", "--eval-function-path", "my.evals:generate_rollout"])
    assert config.eval.eval_function_path is None
    assert "--eval-function-path without --eval-interval" in args.slime_translation.note()


@pytest.mark.unit
def test_megatrons_fp8_flags_are_settings_the_learner_refuses_and_transformer_impl_is_accepted() -> None:
    from engines.megatron.model_flags import refuse_unsupported

    config, _ = configure(["--transformer-impl", "transformer_engine", "--fp8-format", "e4m3",
                           "--fp8-recipe", "blockwise"])
    flags = config.megatron.set_flags()
    assert flags["transformer_impl"] == "transformer_engine"
    with pytest.raises(ValueError, match=r"--fp8-format e4m3: FP8 training is not implemented.*--fp8-recipe"):
        refuse_unsupported(flags, megatron_core=True)
    refuse_unsupported(configure(["--transformer-impl", "local"])[0].megatron.set_flags(), megatron_core=True)


@pytest.mark.unit
def test_slimes_rollout_buffer_flags_select_our_client_of_the_service() -> None:
    example = "slime_plugins.rollout_buffer.rollout_buffer_example.generate_rollout"
    config, args = configure(["--rollout-function-path", example, "--rollout-buffer-url", "http://svc:8889/",
                              "--rollout-task-type", "agent", "--fetch-trajectory-retry-times", "4",
                              "--min-batch-collection-ratio", "0.5", "--rollout-engine", "sglang",
                              "--off-policy-correction", "none"])
    assert config.rollout.rollout_function_path is None  # slime's client named: ours runs in its place
    assert (config.agent.rollout_buffer_url, config.agent.rollout_task_type,
            config.agent.fetch_trajectory_retry_times) == ("http://svc:8889", "agent", 4)
    assert any(note.startswith("--min-batch-collection-ratio") for note in args.slime_translation.notes)
    with pytest.raises(ValueError, match="slime's rollout-buffer client: it needs --rollout-buffer-url"):
        configure(["--rollout-function-path", example])


@pytest.mark.unit
def test_slimes_forge_replay_is_our_replay_of_its_dumps_and_its_loader_goes() -> None:
    """slime's forge pair (its loader as the rollout function, the dump's path) is the learner's replay of the
    dumps; the loader without a dump is slime's own error; the hooks of slime's default rollout are settings."""
    loader = "slime.rollout.forge_load.generate_rollout"
    config, _ = configure(["--rollout-function-path", loader, "--load-forge-rollout-data", "/d/{rollout_id}.pt",
                           "--rollout-sample-filter-path", "m:f", "--rollout-all-samples-process-path", "m:g"])
    assert config.rollout.rollout_function_path is None
    assert config.learner.load_debug_rollout_data == "/d/{rollout_id}.pt"  # kept a template: slime's files
    assert (config.learner.rollout_sample_filter_path, config.buffer.rollout_all_samples_process_path) == ("m:f",
                                                                                                         "m:g")
    with pytest.raises(ValueError, match="slime's forge replay: it needs --load-forge-rollout-data"):
        configure(["--rollout-function-path", loader])
    with pytest.raises(ValueError, match="--load-forge-rollout-data sets --load-debug-rollout-data"):
        configure(["--load-forge-rollout-data", "/d/0.pt", "--load-debug-rollout-data", "/e"])
