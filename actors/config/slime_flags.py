"""A slime command line, read with slime's meaning: aliases translated, Ray-only flags explained, the rest refused.

`add_slime_flags` adds a "slime compatibility" group for every slime flag that is not one of our own settings
(`actors/config/slime_table.py` says what each one becomes), each read as slime declares it so a value is always
consumed. `apply_slime_flags` then rewrites the parsed namespace into our settings before the config is built:
the aliases set our names, the explained flags become one start-up note, and the refused ones become one error
that names every refused flag and why. Nothing slime accepts is dropped without a word.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from actors.config.evaluation import read_slime_eval_config
from actors.config.sections import BufferConfig
from actors.config.slime_table import SLIME_FLAGS, SlimeFlag
from actors.runtime.checkpoint_pointer import checkpoint_at_step

ENTRY_POINTS = ("train", "train_async")
SPELLED_AS = "slime_spelled_as"  # args attribute: our setting -> the slime flag that set it
_EXPLAIN_WHEN = {  # refused flags whose listed values mean what Slipstream does anyway
    "--rollout-data-transport": lambda v, a: v == "object-store",
}
_ENV_ALIASES = {"--wandb-key": ("WANDB_API_KEY",), "--wandb-host": ("WANDB_BASE_URL",),
                "--wandb-team": ("WANDB_ENTITY",), "--http-proxy": ("http_proxy", "https_proxy")}


# slime's negative switches for policy settings, accepted as flags and YAML keys (the policy settings' help group
# lists them): switch -> (the setting it turns off, help).
POLICY_SWITCHES: dict[str, tuple[str, str]] = {
    "disable_grpo_std_normalization": ("grpo_std_normalization",
                                       "Dr.GRPO: centre rewards per group without dividing by their std"),
    "disable_rewards_normalization": ("rewards_normalization", "use raw rewards as advantages (no group baseline)"),
}


# slime's --loss-type names for what is a default or a built-in of another name here.
SLIME_LOSS_NAMES: dict[str, str | None] = {"policy_loss": None, "sft_loss": "sft"}


def policy_settings(given: Mapping[str, Any]) -> dict[str, Any]:
    """Flat policy settings with slime's switches and loss names read: a switch given as true turns its setting off
    unless that setting is given itself (which then wins); `policy_loss` is the estimator's default loss and
    `sft_loss` is `sft`; slime's `custom_loss` without its path is refused by name."""
    settings = {key: value for key, value in given.items() if key not in POLICY_SWITCHES}
    for switch, (setting, _) in POLICY_SWITCHES.items():
        if given.get(switch):
            settings.setdefault(setting, False)
    if settings.get("loss_type") in SLIME_LOSS_NAMES:
        settings["loss_type"] = SLIME_LOSS_NAMES[settings["loss_type"]]
    if settings.get("loss_type") == "custom_loss":
        raise ValueError("loss_type='custom_loss' needs custom_loss_function_path (a dotted path to the loss)")
    return settings


def _dest(flag: str) -> str:
    return "slime_" + flag[2:].replace("-", "_")


def _given(args: argparse.Namespace, name: str, default: Any) -> Any:
    value = getattr(args, name, None)
    return default if value is None else value


def add_slime_flags(parser: argparse.ArgumentParser) -> None:
    """Every slime flag the parser lacks, read as slime declares it; call after every section added its flags."""
    group = parser.add_argument_group("slime compatibility (slime's flags that are not our own settings; see "
                                      "actors/config/slime_table.py)")
    group.add_argument("--slime-entry", choices=ENTRY_POINTS, default=None,
                       help="the slime entry point this command line was written for: train (train.py: generate, "
                            "then train on that batch: --max-staleness 0) or train_async (train_async.py: the next "
                            "batch is generated while this one trains, weights pushed every "
                            "--update-weights-interval: --max-staleness = that interval); either sets "
                            "--train-backend megatron, slime's only backend, unless given")
    own = parser._option_string_actions
    if "--wandb-mode" in own and own["--wandb-mode"].choices is not None:
        own["--wandb-mode"].choices = (*own["--wandb-mode"].choices, "disabled")
    for flag, row in SLIME_FLAGS.items():
        if flag in own:
            continue
        _add(group, flag, row)


def _add(group: Any, flag: str, row: SlimeFlag) -> None:
    prefix = {"alias": "slime alias", "explained": "accepted, no effect here", "refused": "refused",
              "owned": "not available yet (owned by: " + row.why + ")", "same": "slime flag"}[row.fate]
    help_text = f"{prefix}: {row.why}" if row.fate != "owned" else prefix
    kwargs: dict[str, Any] = {"dest": _dest(flag), "default": None, "help": help_text.replace("%", "%%")}
    if row.shape == "switch":
        group.add_argument(flag, action="store_const", const=True, **kwargs)
    elif row.shape == "optional_bool":
        group.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
    elif row.shape == "append":
        group.add_argument(flag, action="append", **kwargs)
    elif row.shape in ("list", "list0"):
        group.add_argument(flag, nargs="+" if row.shape == "list" else "*", type=row.type, **kwargs)
    else:
        group.add_argument(flag, type=row.type, **kwargs)


@dataclass
class SlimeTranslation:
    """What a slime command line adds besides settings: environment for the actors, and the start-up note."""

    env: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def note(self) -> str | None:
        if not self.notes:
            return None
        return "slime flags accepted with no effect here: " + "; ".join(self.notes)


def apply_slime_flags(args: argparse.Namespace) -> SlimeTranslation:
    """Rewrite slime's flags in `args` into our settings (in place) and return the environment and notes.

    Raises ValueError naming every refused flag with its reason, and any alias that disagrees with our own flag
    given on the same command line.
    """
    result = SlimeTranslation()
    refused: list[str] = []
    _custom_config_flags(args, result)
    _same_name_values(args)
    _opd_teacher_server(args)
    _rollout_logprobs_alone(args)
    _sft_rollout(args, result)
    _rollout_buffer_example(args)
    _forge_rollout(args)
    for flag, row in SLIME_FLAGS.items():
        value = getattr(args, _dest(flag), None)
        if value is None:
            continue
        if row.fate == "alias":
            _translate(flag, value, args, result)
        elif row.fate == "explained":
            result.notes.append(f"{flag} ({row.why})")
        elif flag in _EXPLAIN_WHEN and _EXPLAIN_WHEN[flag](value, args):
            shown = "" if isinstance(value, bool) else f" {value}"
            result.notes.append(f"{flag}{shown} (what Slipstream does anyway)")
        elif row.fate == "owned":
            refused.append(f"{flag}: not available yet (owned by {row.why}, which does not define it)")
        else:
            refused.append(f"{flag}: {row.why}")
    _sglang_router(args, result)
    _entry_point(args)
    _keep_old_actor(args)
    _checkpoint_steps(args)
    _eval_without_interval(args, result)
    if refused:
        raise ValueError("slime flag(s) not supported: " + "; ".join(refused))
    return result


def _same_name_values(args: argparse.Namespace) -> None:
    """slime spellings of values our own flags read differently."""
    if getattr(args, "rollout_top_k", None) == -1:
        args.rollout_top_k = 0  # slime's "off"
    if getattr(args, "train_backend", None) == "fsdp":
        args.train_backend = "torch"  # the HF model with data parallelism, replicated per rank (FSDP shards it)
    if getattr(args, "wandb_mode", None) == "disabled":
        args.wandb_mode = None
        _set(args, "use_wandb", False, "--wandb-mode disabled")
    for name in ("save_debug_rollout_data", "load_debug_rollout_data", "save_debug_train_data"):
        value = getattr(args, name, None)
        if isinstance(value, str) and "{" in value:
            setattr(args, name, os.path.dirname(value.split("{", 1)[0].rstrip("/") + "/") or ".")


def _rollout_logprobs_alone(args: argparse.Namespace) -> None:
    """--use-rollout-logprobs makes pi_old the engine's log-probs, so a correction's weight pi_old / mu is 1 on
    every token: slime refuses it beside --use-tis, and a custom TIS function would have nothing to correct."""
    if not getattr(args, "use_rollout_logprobs", None):
        return
    for flag in ("--use-tis", "--custom-tis-function-path"):
        if getattr(args, _dest(flag), None) is not None:
            raise ValueError(f"--use-rollout-logprobs and {flag} contradict: with the first, pi_old is the engine's "
                             "log-probs, so the importance weight pi_old / mu is 1 on every token (slime refuses "
                             "--use-tis with it too); give one of them")


SLIME_SFT_ROLLOUT = "slime.rollout.sft_rollout.generate_rollout"


def _sft_rollout(args: argparse.Namespace, result: SlimeTranslation) -> None:
    """slime's SFT rollout function cuts each record's conversation by --loss-mask-type and generates nothing: that
    is our --loss-type sft on a record whose prompt is chat messages (actors/rollout/sft.py), so the path goes.
    Its records have no label (--label-key none unless given), its samples reward 0 as slime sets it (--rm-type
    zero unless given), its groups one sample (slime's --n-samples-per-prompt default), and the
    --debug-train-only slime's SFT scripts set (start no engines) is what SFT does anyway: nothing is generated."""
    if getattr(args, "rollout_function_path", None) != SLIME_SFT_ROLLOUT:
        return
    loss = getattr(args, "loss_type", None)
    if SLIME_LOSS_NAMES.get(loss, loss) != "sft":
        raise ValueError(f"--rollout-function-path {SLIME_SFT_ROLLOUT} is slime's SFT data path: it needs "
                         f"--loss-type sft_loss (got {loss or 'the default policy loss'})")
    args.rollout_function_path = None
    args.label_key = getattr(args, "label_key", None) or "none"
    if getattr(args, "rm_type", None) is None and getattr(args, "custom_rm_path", None) is None:
        args.rm_type = "zero"
    if getattr(args, "n_samples_per_prompt", None) is None:
        args.n_samples_per_prompt = 1
    if getattr(args, "debug_train_only", None) and not getattr(args, "load_debug_rollout_data", None):
        args.debug_train_only = None
        result.notes.append("--debug-train-only (slime's SFT starts no engines; SFT samples here are the data's "
                            "tokens, nothing is generated)")


SLIME_ROLLOUT_BUFFER_CLIENT = "slime_plugins.rollout_buffer.rollout_buffer_example.generate_rollout"


def _rollout_buffer_example(args: argparse.Namespace) -> None:
    """slime's rollout-buffer example names its client as the rollout function; with --rollout-buffer-url ours is
    that client (actors/slime_compat/rollout_buffer.py), so the path goes."""
    if getattr(args, "rollout_function_path", None) != SLIME_ROLLOUT_BUFFER_CLIENT:
        return
    if not getattr(args, "rollout_buffer_url", None):
        raise ValueError(f"--rollout-function-path {SLIME_ROLLOUT_BUFFER_CLIENT} is slime's rollout-buffer client: "
                         "it needs --rollout-buffer-url, the service's URL")
    args.rollout_function_path = None


SLIME_FORGE_ROLLOUT = "slime.rollout.forge_load.generate_rollout"


def _forge_rollout(args: argparse.Namespace) -> None:
    """slime's forge replay names its loader as the rollout function; here the learner reads the dumps
    (--load-forge-rollout-data) in place of the buffer's batches, so the path goes."""
    if getattr(args, "rollout_function_path", None) != SLIME_FORGE_ROLLOUT:
        return
    if not getattr(args, _dest("--load-forge-rollout-data"), None):
        raise ValueError(f"--rollout-function-path {SLIME_FORGE_ROLLOUT} is slime's forge replay: it needs "
                         "--load-forge-rollout-data, the dump's path (a .pt file or a {rollout_id} template)")
    args.rollout_function_path = None


SLIME_OPD_REWARD = "slime.rollout.on_policy_distillation.reward_func"
SLIME_OPD_POST_PROCESS = "slime.rollout.on_policy_distillation.post_process_rewards"


def _opd_teacher_server(args: argparse.Namespace) -> None:
    """slime's `--opd-type sglang` recipe: its OPD reward function asks the `--rm-url` server for the teacher's
    log-probs and its post-process sets every reward to 0. Here the server is the run's teacher (the reward
    worker asks it) and the reward is `zero`: the same run without slime's plugins."""
    if getattr(args, "custom_rm_path", None) != SLIME_OPD_REWARD:
        return
    url = getattr(args, "rm_url", None)
    if getattr(args, "opd_type", None) != "sglang" or not url:
        raise ValueError(f"--custom-rm-path {SLIME_OPD_REWARD} is slime's OPD teacher call: it needs --use-opd "
                         "--opd-type sglang and --rm-url http://TEACHER/generate")
    if getattr(args, "opd_teacher", None):
        raise ValueError(f"--custom-rm-path {SLIME_OPD_REWARD} names the teacher by --rm-url; --opd-teacher was "
                         "also given")
    args.opd_teacher = [f"teacher={url.removesuffix('/').removesuffix('/generate')}"]
    args.custom_rm_path = args.rm_url = None
    _set(args, "rm_type", "zero", "--custom-rm-path")
    if getattr(args, "custom_reward_post_process_path", None) == SLIME_OPD_POST_PROCESS:
        args.custom_reward_post_process_path = None  # its work (teacher log-probs, zero rewards) is done above


def _translate(flag: str, value: Any, args: argparse.Namespace, result: SlimeTranslation) -> None:
    if flag in _ENV_ALIASES:
        for name in _ENV_ALIASES[flag]:
            result.env[name] = str(value)
    elif flag == "--train-env-vars":
        try:
            variables = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"--train-env-vars {value!r}: not JSON ({error})") from None
        if not isinstance(variables, dict):
            raise ValueError(f"--train-env-vars {value!r}: expected a JSON object of NAME: VALUE")
        result.env.update({str(k): str(v) for k, v in variables.items()})
    elif flag == "--apply-chat-template-kwargs":
        _set(args, "apply_chat_template_kwargs", value, flag)  # the JSON string; the data section parses it
    elif flag == "--megatron-config-path":
        _role_overrides(value, args)
    elif flag == "--custom-config-path":
        _set(args, "custom_config", _custom_config(value), flag)
    elif flag == "--eval-config":
        pairs, settings = read_slime_eval_config(value)
        _set(args, "eval_prompt_data", pairs, flag)
        _set(args, "eval_set_settings", settings, flag)
    elif flag == "--disable-rollout-global-dataset":
        _set(args, "rollout_global_dataset", False, flag)
    elif flag == "--ref-load":
        _set(args, "ref_checkpoint", value, flag)
    elif flag == "--load-forge-rollout-data":
        _set(args, "load_debug_rollout_data", value, flag)  # a file or a {rollout_id} template: slime's dumps
    elif flag == "--max-tokens-per-gpu":
        _set(args, "micro_batch_tokens", value, flag)
    elif flag == "--keep-old-actor":
        pass  # read once the entry point has set the staleness bound (_keep_old_actor)
    elif flag in CHECKPOINT_STEPS:
        pass  # read once --ref-load and --opd-teacher-load are (_checkpoint_steps)
    elif flag == "--use-dynamic-batch-size":
        pass  # always on here; --max-tokens-per-gpu (or --micro-batch-tokens) sets the budget
    elif flag == "--update-weight-buffer-size":
        _set(args, "weight_bucket_bytes", value, flag)
    elif flag == "--gradient-checkpointing":
        _set(args, "recompute_granularity", "full", flag)
    elif flag == "--calculate-per-token-loss":
        _set(args, "loss_agg_mode", "token-mean", flag)
    elif flag == "--use-tis":
        if getattr(args, _dest("--custom-tis-function-path"), None) is None:  # slime's pair: the path says which
            _set(args, "off_policy_correction", "tis", flag)
    elif flag == "--check-weight-update-equal":
        _set(args, "weight_check", "strict", flag)
        _set(args, "weight_check_stride", 1, flag)  # slime compares every byte
    elif flag == "--custom-loss-function-path":
        if getattr(args, "loss_type", None) not in (None, "custom_loss", value):
            raise ValueError(f"--custom-loss-function-path {value} needs --loss-type custom_loss (or none), "
                             f"not --loss-type {args.loss_type}")
        args.loss_type = value  # slime's pair (--loss-type custom_loss + the path) is one setting here
    elif flag == "--custom-tis-function-path":
        _set(args, "off_policy_correction", value, flag)
    elif flag == "--rollout-external-engine-addrs":
        _set(args, "sglang_url", list(value), flag)
        _set(args, "rollout_engine", "sglang", flag)
    elif flag in ("--sglang-router-ip", "--sglang-router-port"):
        pass  # read as a pair once every alias is (_sglang_router): --rollout-external-engine-addrs may name servers
    elif flag == "--sglang-router-request-timeout-secs":
        _set(args, "router_request_timeout", float(value), flag)
    elif flag == "--sglang-router-policy":
        _set(args, "router_policy", _router_policy(value), flag)
    elif flag == "--sglang-server-concurrency":
        _set(args, "rollout_max_batch_size", value, flag)
    elif flag == "--update-weight-mode":
        if value not in ("full", "delta"):
            raise ValueError(f"--update-weight-mode {value!r}: expected full or delta")
        if value == "delta":
            _set(args, "weight_delta_sync", True, flag)
    elif flag == "--update-weight-delta-checksum":
        if value not in SLIME_DELTA_CHECKSUMS:
            raise ValueError(f"--update-weight-delta-checksum {value!r}: expected one of "
                             f"{', '.join(SLIME_DELTA_CHECKSUMS)}")
        _set(args, "weight_check_stride", 1, flag)
    elif flag == "--update-weight-transport":
        if value not in ("nccl", "disk"):
            raise ValueError(f"--update-weight-transport {value!r}: expected nccl or disk")
        _set(args, "weight_transport", value, flag)
    elif flag in DISK_SETTINGS:
        _set(args, DISK_SETTINGS[flag], value, flag)
    elif flag == "--update-weight-delta-encoding":
        if value not in ("xor", "overwrite"):
            raise ValueError(f"--update-weight-delta-encoding {value!r}: expected xor or overwrite")
    else:  # a row marked alias without a translation is a bug of this module, never a silent drop
        raise AssertionError(f"{flag}: alias without a translation")


SLIME_DELTA_CHECKSUMS = ("xxh3-128", "blake3", "adler32")  # slime's choices
# slime's disk-sync flags -> our settings of the same meaning (`weights_settings.py`)
DISK_SETTINGS = {"--update-weight-disk-dir": "weight_disk_dir",
                 "--update-weight-disk-keep-files": "weight_disk_keep_files",
                 "--update-weight-local-checkpoint-dir": "weight_disk_local_dir",
                 "--custom-update-weight-post-write-path": "weight_disk_post_write_path"}


# slime's --sglang-router-policy (sglang-router's policies) -> ours.
SGLANG_ROUTER_POLICIES = {"consistent_hashing": "affinity", "manual": "affinity", "cache_aware": "affinity",
                          "prefix_hash": "affinity", "round_robin": "round-robin", "random": "round-robin",
                          "power_of_two": "least-load"}


def _sglang_router(args: argparse.Namespace, result: SlimeTranslation) -> None:
    """slime's external router: its registered servers are the ones to attach to (--sglang-router-url). slime would
    also register the servers it launches or is given with it; here the servers given (--rollout-external-engine-addrs,
    --sglang-url) are attached as they are, and the router is neither asked nor told."""
    ip, port = getattr(args, _dest("--sglang-router-ip"), None), getattr(args, _dest("--sglang-router-port"), None)
    if ip is None:
        if port is not None:
            result.notes.append(f"--sglang-router-port {port} (slime's own router listens there; no router is "
                                "started here: each rollout worker routes its own calls, docs/router.md)")
        return
    if port is None:
        raise ValueError(f"--sglang-router-ip {ip} needs --sglang-router-port, the router's port")
    if "/" in ip:
        raise ValueError(f"--sglang-router-ip {ip}: expected the router's host name or address (slime asks "
                         "http://IP:PORT)")
    if getattr(args, "sglang_url", None):
        result.notes.append("--sglang-router-ip/--sglang-router-port (the SGLang servers are given by "
                            "--rollout-external-engine-addrs or --sglang-url: the run attaches to those and does "
                            "not register them with the router)")
        return
    host = f"[{ip}]" if ":" in ip and not ip.startswith("[") else ip  # an IPv6 address, bracketed as slime does
    _set(args, "sglang_router_url", f"http://{host}:{port}", "--sglang-router-ip")
    _set(args, "rollout_engine", "sglang", "--sglang-router-ip")


def _router_policy(value: str) -> str:
    if value not in SGLANG_ROUTER_POLICIES:
        known = ", ".join(sorted(SGLANG_ROUTER_POLICIES))
        raise ValueError(f"--sglang-router-policy {value}: not a policy Slipstream's router has an equivalent for "
                         f"(known: {known}; bucket routes prefill/decode disaggregation, which is not available)")
    return SGLANG_ROUTER_POLICIES[value]


# slime's role override keys (argparse attribute names) that mean one of our settings, per role.
ROLE_OVERRIDES = {"actor": {"lr": "lr"}, "critic": {"lr": "critic_lr", "load": "critic_load"}}


def _role_overrides(path: str, args: argparse.Namespace) -> None:
    """slime's `--megatron-config-path` YAML: `megatron: [{role: actor|critic, overrides: {...}}]`, at most one
    entry per role, `args` an older name of `overrides`. The keys PPO's roles differ in (learning rates, where
    the critic starts) become our settings; any other is refused with its role and name, never dropped."""
    import yaml

    try:
        loaded = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as error:
        raise ValueError(f"--megatron-config-path {path}: cannot read it ({error})") from None
    entries = loaded.get("megatron") if isinstance(loaded, dict) else None
    if not isinstance(entries, list) or not all(isinstance(entry, dict) for entry in entries):
        raise ValueError(f"--megatron-config-path {path}: expected a top-level 'megatron' list of role entries")
    seen: set[str] = set()
    for entry in entries:
        role = entry.get("role")
        if role not in ROLE_OVERRIDES or role in seen:
            raise ValueError(f"--megatron-config-path {path}: role {role!r} must be actor or critic, once each")
        seen.add(role)
        overrides = entry.get("overrides") or entry.get("args") or {}
        unknown = sorted(set(overrides) - set(ROLE_OVERRIDES[role]))
        if unknown:
            raise ValueError(f"--megatron-config-path {path}: {role} overrides {unknown} are not available here "
                             f"(accepted: {sorted(ROLE_OVERRIDES[role])}; the roles share every other setting)")
        for key, value in overrides.items():
            setting = ROLE_OVERRIDES[role][key]
            _set(args, setting, float(value) if setting.endswith("lr") else str(value),
                 f"--megatron-config-path ({role} {key})")


def _custom_config_flags(args: argparse.Namespace, result: SlimeTranslation) -> None:
    """slime merges its --custom-config-path YAML into its args after parsing, so a key that names one of its flags
    (slime's train/infer mismatch helper sets `use_tis: true` there) overrides that flag: here it is taken as that
    flag given on the command line, and translated with the rest; a key that names a setting of ours (its
    `tis_level`) sets it. Every key stays on the plugins' args too, as in slime."""
    path = getattr(args, _dest("--custom-config-path"), None)
    if path is None:
        return
    for key, value in _custom_config(path).items():
        flag = "--" + key.replace("_", "-")
        if value is None or (flag not in SLIME_FLAGS and not hasattr(args, key)):
            continue  # a plugin's own setting
        dest = _dest(flag) if hasattr(args, _dest(flag)) else key  # a flag of ours is parsed under our name
        if getattr(args, dest, None) not in (None, value):
            result.notes.append(f"--custom-config-path {path}: {key}: {value!r} overrides {flag} (as in slime)")
        setattr(args, dest, value)


def _custom_config(path: str) -> dict[str, Any]:
    """slime's `--custom-config-path` YAML: a mapping of settings for the run's plugins (RunConfig refuses a key
    that names one of ours)."""
    import yaml

    try:
        loaded = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as error:
        raise ValueError(f"--custom-config-path {path}: cannot read it ({error})") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict) or not all(isinstance(key, str) for key in loaded):
        raise ValueError(f"--custom-config-path {path}: expected a mapping of names to values, got "
                         f"{type(loaded).__name__}")
    return loaded


def _set(args: argparse.Namespace, name: str, value: Any, flag: str) -> None:
    """Set our setting from a slime flag; our own flag given with another value is a conflict, not an override."""
    current = getattr(args, name, None)
    if current is not None and current != value and name != "use_wandb":
        raise ValueError(f"{flag} sets --{name.replace('_', '-')} {value!r}, but --{name.replace('_', '-')} "
                         f"{current!r} was also given")
    setattr(args, name, value)
    vars(args).setdefault(SPELLED_AS, {})[name] = flag  # so that an error about the value names the flag typed


# slime's step flags: the setting whose checkpoint folder they pick a step of, and the flag that names the folder
CHECKPOINT_STEPS = {"--ref-ckpt-step": ("ref_checkpoint", "--ref-load"),
                    "--opd-teacher-ckpt-step": ("opd_teacher_load", "--opd-teacher-load")}


def _checkpoint_steps(args: argparse.Namespace) -> None:
    """slime loads iteration N of the reference's (or teacher's) checkpoint folder: so here, the folder's step N
    becomes the model folder read (`checkpoint_at_step`)."""
    for flag, (setting, folder_flag) in CHECKPOINT_STEPS.items():
        step = getattr(args, _dest(flag), None)
        if step is None:
            continue
        folder = getattr(args, setting, None)
        if folder is None:
            raise ValueError(f"{flag} {step} picks a step of {folder_flag}'s checkpoint folder, which was not given")
        setattr(args, setting, str(checkpoint_at_step(Path(folder), step, flag)))


def _keep_old_actor(args: argparse.Namespace) -> None:
    """--keep-old-actor: slime's pi_old is the learner's forward under the weights that generated the batch (a
    resident copy, swapped in). On-policy those are the learner's weights before the update, so the learner's own
    pi_old forward (--use-decoupled-ppo) gives the same numbers; off-policy they are an older version, of which no
    copy is kept here."""
    if getattr(args, _dest("--keep-old-actor"), None) is None:
        return
    staleness = _given(args, "max_staleness", BufferConfig().max_staleness)
    if staleness != 0:
        raise ValueError(f"--keep-old-actor with --max-staleness {staleness}: slime's old actor is a copy of the "
                         "weights that generated the batch; here pi_old is recomputed with the learner's weights "
                         "before the update (--use-decoupled-ppo), which are those weights only on-policy "
                         "(--max-staleness 0, slime's train.py), and no copies of older versions are kept")
    _set(args, "use_decoupled_ppo", True, "--keep-old-actor")


def _eval_without_interval(args: argparse.Namespace, result: SlimeTranslation) -> None:
    """slime evaluates only every --eval-interval rollouts (train.py runs no eval round without one, not even the
    one before training), and its scripts keep --eval-prompt-data with the interval commented out. Our settings
    refuse that pair as a mistake; under --slime-entry it means what it meant in slime: no eval rounds."""
    if getattr(args, "slime_entry", None) is None or getattr(args, "eval_interval", None) is not None:
        return
    given = [f"--{name.replace('_', '-')}" for name in ("eval_prompt_data", "eval_function_path")
             if getattr(args, name, None)]
    if given:
        result.notes.append(f"{' and '.join(given)} without --eval-interval (slime evaluates only every "
                            "--eval-interval rollouts: no eval rounds)")
        args.eval_prompt_data = None
        args.eval_set_settings = None
        args.eval_function_path = None


def _entry_point(args: argparse.Namespace) -> None:
    """--slime-entry: the staleness slime's entry point implies (unless --max-staleness says otherwise).

    train.py generates a batch with the current weights and then trains on it: on-policy, staleness 0.
    train_async.py starts generating batch N+1 before training on batch N and pushes weights every
    --update-weights-interval steps, so a batch is at most that many versions old."""
    entry = getattr(args, "slime_entry", None)
    if entry is None:
        return
    interval = _given(args, "update_weights_interval", 1)
    implied = 0 if entry == "train" else interval
    given = getattr(args, "max_staleness", None)
    if entry == "train" and given not in (None, 0):
        raise ValueError(f"--slime-entry train is synchronous (max_staleness 0), but --max-staleness {given} was "
                         "given; use --slime-entry train_async")
    if given is None:
        args.max_staleness = implied
    if getattr(args, "train_backend", None) is None:
        args.train_backend = "megatron"  # slime's only training backend
    if getattr(args, "off_policy_correction", None) is None:
        args.off_policy_correction = "none"  # slime corrects only when asked (--use-tis, translated above)
