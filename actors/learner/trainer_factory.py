"""Which trainer a learner runs: `--train-backend` picks the implementation behind the `Trainer` interface.

Kept apart from the learner so a backend (and its heavy imports) loads only when chosen. `--train-backend` is
a built-in (`actors.config.engines.BUILTIN_TRAIN_BACKENDS` names each one's factory here) or `module:attr`: a
plugin factory with `build_trainer`'s signature (the pipeline benchmark's sleeping trainer is one).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from actors.config import RunConfig
from actors.config.engines import train_backend_spec
from actors.config.teachers import run_teachers
from engines.fp8_checkpoint import trainable
from engines.training.base import Trainer
from policies.plugins import load_object

TrainerFactory = Callable[[RunConfig], Trainer]


def build_trainer(config: RunConfig) -> Trainer:
    spec = train_backend_spec(config.trainer.train_backend)
    if spec is None:
        return build_plugin_trainer(config.trainer.train_backend, config)
    if config.model.hf_checkpoint is None:
        raise ValueError("--hf-checkpoint is required for the learner")
    return load_object(spec.factory, what="--train-backend")(config)


def build_plugin_trainer(path: str, config: RunConfig) -> Trainer:
    """Call the factory `path` names; anything but a `Trainer` back is an error naming the flag and the path."""
    factory = load_object(path, what="--train-backend")
    if not callable(factory):
        raise TypeError(f"--train-backend {path!r}: {type(factory).__name__} is not callable; expected a factory "
                        "(config) -> Trainer")
    trainer = factory(config)
    if not isinstance(trainer, Trainer):
        raise TypeError(f"--train-backend {path!r}: the factory returned a {type(trainer).__name__}, not an "
                        "engines.training.base.Trainer")
    return trainer


def uses_critic(config: RunConfig) -> bool:
    """An estimator that reads values (PPO's GAE, as slime's use_critic; or a plugin that declares NEEDS_CRITIC)."""
    return config.policy.needs_critic


def _needs_ref(config: RunConfig) -> bool:
    return config.policy.needs_ref  # the policy config decides; the learner step reads the same property


def _shared_settings(config: RunConfig) -> dict[str, Any]:
    """The `TrainerOptimizerConfig` fields, which every backend's config takes from the same flags."""
    model, trainer = config.model, config.trainer
    assert model.hf_checkpoint is not None  # build_trainer checked it
    return {
        "model_path": trainable(model.hf_checkpoint),
        "ref_model_path": trainable(model.ref_checkpoint or model.hf_checkpoint) if _needs_ref(config) else None,
        "teacher_model_paths": {name: trainable(teacher.path) for name, teacher
                                in run_teachers(config.distillation).items() if teacher.path is not None},
        "lr": trainer.lr,
        "betas": (trainer.adam_beta1, trainer.adam_beta2),
        "weight_decay": trainer.weight_decay,
        "lr_schedule": trainer.lr_decay_style,
        "warmup_steps": _warmup_steps(config),
        "eps": config.megatron.adam_eps,
        # The schedule counts optimizer steps (several per batch with --num-steps-per-rollout), as slime's does.
        "total_steps": (config.learner.num_rollout * config.optimizer_steps_per_batch
                        if trainer.lr_decay_style == "cosine" else None),
        "min_lr_ratio": trainer.min_lr / trainer.lr if trainer.lr > 0 else 0.0,
        "grad_clip": trainer.clip_grad,
        "micro_batch_tokens": trainer.micro_batch_tokens,
        "save_optimizer": not config.learner.no_save_optim,
        "stateless_adam": trainer.use_stateless_adam,
        "dtype": "bfloat16" if model.bf16 else "float32",
        "seed": config.seed,
        "only_train_params_name_list": tuple(trainer.only_train_params_name_list),
        "freeze_params_name_list": tuple(trainer.freeze_params_name_list),
    }


def build_torch_trainer(config: RunConfig) -> Trainer:
    import torch

    from engines.training.config import CriticSettings, MtpSettings, TorchTrainerConfig
    from engines.training.lora import LoraSettings
    from engines.training.torch_trainer import TorchTrainer

    # "cuda" resolves to cuda:LOCAL_RANK in the trainer; each learner rank sets LOCAL_RANK (actors/learner/ranks.py).
    device = "cuda" if torch.cuda.is_available() else "cpu"
    flags = _checked_megatron_flags(config)
    # Megatron's activation recompute, on this backend: HF gradient checkpointing (every layer).
    recompute = flags.get("recompute_granularity") is not None
    critic = None
    if uses_critic(config):
        assert config.model.hf_checkpoint is not None
        critic = CriticSettings(model_path=trainable(config.trainer.critic_load or config.model.hf_checkpoint),
                                lr=config.trainer.critic_lr or config.trainer.lr,
                                stateless_adam=config.trainer.use_stateless_adam)
    settings = TorchTrainerConfig(**_shared_settings(config), device=device, gradient_checkpointing=recompute,
                                  critic=critic,
                                  lora=LoraSettings.of_run(config.lora),
                                  # colocated: the engines generate on this device between our steps
                                  offload_optimizer=config.placement.colocate,
                                  share_prompts=config.trainer.share_prompts,
                                  fused_output_head=config.trainer.fused_output_head,
                                  freeze_vision_tower=config.trainer.freeze_vision_tower,
                                  use_routing_replay=config.trainer.use_routing_replay,
                                  context_parallel_size=config.megatron.context_parallel_size,
                                  mtp=(MtpSettings(num_layers=config.megatron.mtp_num_layers,
                                                   loss_scaling_factor=config.megatron.mtp_loss_scaling_factor)
                                       if config.megatron.enable_mtp_training else None),
                                  **_router_loss_settings(flags))
    return TorchTrainer(settings)


def _router_loss_settings(flags: dict[str, Any]) -> dict[str, float]:
    """megatron's router losses: its load-balancing type "none" turns the aux loss off whatever its coefficient."""
    balancing = flags.get("moe_router_load_balancing_type") or "aux_loss"
    aux = 0.0 if balancing == "none" else float(flags.get("moe_aux_loss_coeff") or 0.0)
    return {"moe_aux_loss_coeff": aux, "moe_z_loss_coeff": float(flags.get("moe_z_loss_coeff") or 0.0)}



def _checked_megatron_flags(config: RunConfig) -> dict[str, Any]:
    """A slime script's Megatron flags on the torch backend: its model-shape flags must match the checkpoint (the
    same check the Megatron backend makes), what changes the computation and cannot happen here is refused, and
    Megatron-only performance settings have nothing to act on."""
    from transformers import AutoConfig

    from engines.megatron.model_flags import check_against_hf, refuse_unsupported

    flags = config.megatron.set_flags()
    refuse_unsupported(flags, megatron_core=False)
    assert config.model.hf_checkpoint is not None  # build_trainer checked it
    # a vision-language model's shape flags describe its language model (the nested text config)
    check_against_hf(flags, AutoConfig.from_pretrained(config.model.hf_checkpoint).get_text_config())
    return flags


def _warmup_steps(config: RunConfig) -> int:
    """--lr-warmup-iters, or Megatron's --lr-warmup-fraction of the run's optimizer steps (one or the other)."""
    fraction, iters = config.megatron.lr_warmup_fraction, config.trainer.lr_warmup_iters
    if fraction is None:
        return iters
    if iters:
        raise ValueError(f"--lr-warmup-fraction {fraction} and --lr-warmup-iters {iters}: set one of them")
    return int(fraction * config.learner.num_rollout * config.optimizer_steps_per_batch)


def _megatron_flags(config: RunConfig) -> Any:
    """The `megatron` section as the Megatron trainer takes it: plain values, and the init hook's namespace (slime
    calls it with its whole argument namespace; ours holds every flat setting of the run)."""
    from actors.config.run import SECTIONS
    from engines.megatron.model_flags import MegatronFlags

    hook_args: dict[str, Any] = {"seed": config.seed, "torch_threads": config.torch_threads,
                                 **config.policy.model_dump(mode="json")}
    for section in SECTIONS:
        hook_args.update(getattr(config, section).model_dump(mode="json"))
    return MegatronFlags(flags=config.megatron.set_flags(), init_hook_path=config.megatron.custom_megatron_init_path,
                         hook_args=hook_args)


def build_megatron_trainer(config: RunConfig) -> Trainer:
    """Every learner rank builds one; the trainer makes its own world-size-1 group if none exists yet.

    Unlike the torch trainer, the Megatron trainer wants the WHOLE batch on every rank (it shards itself).
    """
    try:
        from engines.megatron import MegatronTrainer, MegatronTrainerConfig
    except ImportError as error:  # pragma: no cover - depends on the install
        raise ImportError(f"--train-backend megatron needs the megatron extra installed: {error}") from error

    trainer = config.trainer
    return MegatronTrainer(
        MegatronTrainerConfig(
            **_shared_settings(config),
            initial_checkpoint=Path(trainer.megatron_checkpoint) if trainer.megatron_checkpoint else None,
            tensor_model_parallel_size=trainer.tensor_model_parallel_size,
            pipeline_model_parallel_size=trainer.pipeline_model_parallel_size,
            expert_model_parallel_size=config.megatron.expert_model_parallel_size,
            expert_tensor_parallel_size=config.megatron.expert_tensor_parallel_size,
            use_distributed_optimizer=trainer.use_distributed_optimizer,
            qkv_format=trainer.qkv_format,
            model_flags=_megatron_flags(config),
            use_routing_replay=trainer.use_routing_replay,
        )
    )
