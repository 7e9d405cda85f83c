"""The Megatron trainer's device rules: batches on the model's device, NCCL worlds on CUDA, collective tensors on
the device their backend carries, and the layer spec / kernels the runtime offers.

The GPU itself is exercised in `test_megatron_gpu.py`; here every rule is a function of an explicit device or
backend, so the CUDA branch is checked without CUDA.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from engines.megatron import parallel
from engines.megatron.batches import QKV_FORMATS, plan_micro_batches
from engines.training import TrainSample

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")


def _samples() -> list[TrainSample]:
    generator = torch.Generator().manual_seed(1)
    batch = []
    for length in (9, 23, 14, 5):
        response = length // 2
        tokens = torch.randint(6, 100, (length,), generator=generator)
        batch.append(TrainSample(tokens, response, advantages=torch.randn(response, generator=generator),
                                 loss_mask=torch.ones(response), reward=1.0))
    return batch


@pytest.mark.unit
def test_a_cuda_model_gets_an_nccl_world_and_a_cpu_model_a_gloo_one() -> None:
    # NCCL for CUDA tensors, with gloo beside it: mbridge scatters CPU tensors through the default group.
    assert parallel.backend_for_device(torch.device("cuda", 3)) == "cpu:gloo,cuda:nccl"
    assert parallel.backend_for_device("cuda") == "cpu:gloo,cuda:nccl"
    assert parallel.backend_for_device("cpu") == "gloo"
    with pytest.raises(ValueError, match="'meta'"):
        parallel.backend_for_device("meta")


@pytest.mark.unit
def test_collective_tensors_go_to_the_gpu_under_nccl_and_to_the_cpu_under_gloo() -> None:
    assert parallel.collective_device("nccl", "cuda:1") == torch.device("cuda", 1)
    assert parallel.collective_device("NCCL", torch.device("cuda", 0)) == torch.device("cuda", 0)
    assert parallel.collective_device("gloo", "cuda:0") == torch.device("cpu")
    assert parallel.collective_device("gloo", "cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="carries"):
        parallel.collective_device("nccl", "cpu")
    assert parallel.collective_device("cpu:gloo,cuda:nccl", "cuda:0") == torch.device("cpu")


@pytest.mark.unit
def test_a_registered_cuda_only_backend_gets_gpu_tensors() -> None:
    """The rule reads torch's backend capabilities, so a third-party CUDA-only backend is treated like NCCL."""
    name = "slipstream_cuda_only_test"
    if name not in dist.Backend.backend_capability:
        dist.Backend.register_backend(name, lambda *args: None, devices=["cuda"])
    assert parallel.collective_device(name, "cuda:2") == torch.device("cuda", 2)


@pytest.mark.unit
def test_an_existing_gloo_world_is_refused_for_a_cuda_model() -> None:
    with pytest.raises(ValueError, match=r"carries cuda tensors .*got 'gloo'"):
        parallel.check_world_backend("gloo", torch.device("cuda", 0))
    parallel.check_world_backend("nccl", torch.device("cuda", 0))
    parallel.check_world_backend("cpu:gloo,cuda:nccl", torch.device("cuda", 0))
    parallel.check_world_backend("gloo", torch.device("cpu"))


@pytest.mark.unit
def test_every_micro_batch_tensor_is_built_on_the_requested_device() -> None:
    samples = _samples()
    meta = torch.device("meta")
    for with_batch, qkv_format in itertools.product((False, True), QKV_FORMATS):
        micro_batches = plan_micro_batches(
            samples, [0, 1, 2, 3], 30, qkv_format=qkv_format, with_batch=with_batch, device=meta
        )
        assert len(micro_batches) > 1
        for micro_batch in micro_batches:
            tensors = micro_batch.tensors()
            assert ("batch.advantages" in tensors) is with_batch
            assert ("cu_seqlens" in tensors) is (qkv_format == "thd")
            assert {name: t.device for name, t in tensors.items()} == {name: meta for name in tensors}


@pytest.mark.unit
def test_rows_padded_to_the_tensor_parallel_size_keep_every_selection() -> None:
    """Sequence parallelism splits rows over TP ranks: widths become multiples of TP, nothing else changes."""
    samples = _samples()
    plain = plan_micro_batches(samples, [0, 1, 2, 3], 1000, with_batch=False, qkv_format="bshd")
    padded = plan_micro_batches(samples, [0, 1, 2, 3], 1000, with_batch=False, pad_multiple=4, qkv_format="bshd")
    assert [mb.members for mb in padded] == [mb.members for mb in plain]
    for before, after in zip(plain, padded, strict=True):
        assert after.input_ids.shape[1] % 4 == 0 and after.input_ids.shape[1] >= before.input_ids.shape[1]
        width = before.input_ids.shape[1]
        assert torch.equal(after.input_ids[:, :width], before.input_ids)
        assert (after.input_ids[:, width:] == 0).all()
        for name in ("logit_rows", "logit_columns", "targets"):
            assert torch.equal(getattr(after, name), getattr(before, name)), name
        assert after.response_lengths == before.response_lengths


@pytest.mark.unit
def test_layer_spec_and_kernels_follow_the_runtime() -> None:
    from engines.megatron.attention import SdpaAttention
    from engines.megatron.bridge import Runtime, config_overrides, layer_spec

    cpu = Runtime(cuda=False, transformer_engine=True, apex_gradient_fusion=True)
    gpu_te = Runtime(cuda=True, transformer_engine=True, apex_gradient_fusion=False)
    gpu_local = Runtime(cuda=True, transformer_engine=False, apex_gradient_fusion=True)
    assert (cpu.layer_spec, gpu_te.layer_spec, gpu_local.layer_spec) == ("local", "transformer_engine", "local")

    on_cpu = config_overrides(torch.float32, cpu, tensor_parallel=2)
    fused = ("bias_activation_fusion", "bias_dropout_fusion", "apply_rope_fusion", "gradient_accumulation_fusion")
    assert not any(on_cpu[key] for key in (*fused, "sequence_parallel", "masked_softmax_fusion"))

    with_te = config_overrides(torch.bfloat16, gpu_te, tensor_parallel=2)
    assert with_te["sequence_parallel"] and with_te["apply_rope_fusion"] and with_te["bias_activation_fusion"]
    assert with_te["bf16"] and with_te["params_dtype"] == torch.bfloat16
    assert not with_te["gradient_accumulation_fusion"]  # megatron's own output layer needs apex for it
    assert not config_overrides(torch.bfloat16, gpu_te, tensor_parallel=1)["sequence_parallel"]

    local = config_overrides(torch.float32, gpu_local, tensor_parallel=2)
    assert not local["sequence_parallel"] and not local["apply_rope_fusion"]  # torch norms, no TE rope kernel
    assert local["gradient_accumulation_fusion"] and local["bias_dropout_fusion"]
    for overrides in (on_cpu, with_te, local):
        assert overrides["hidden_dropout"] == overrides["attention_dropout"] == 0.0

    dense = SimpleNamespace(qk_layernorm=False, num_moe_experts=None, moe_grouped_gemm=False, sequence_parallel=False)
    spec = layer_spec(gpu_local, dense)
    assert spec.submodules.self_attention.submodules.core_attention is SdpaAttention


@pytest.fixture
def trainer(tiny_model_path: Path) -> Iterator[Any]:
    from engines.megatron import MegatronTrainer, MegatronTrainerConfig

    trainer = MegatronTrainer(MegatronTrainerConfig(model_path=tiny_model_path, micro_batch_tokens=40))
    try:
        yield trainer
    finally:
        trainer.close()


@pytest.mark.integration
def test_the_trainer_builds_its_world_and_batches_for_its_model_device(trainer: Any) -> None:
    from engines.megatron.attention import SdpaAttention

    parameter_device = next(trainer._stage.parameters()).device
    assert parameter_device == parallel.compute_device()  # the CPU here, the current GPU on a CUDA machine
    assert dist.get_backend() == parallel.backend_for_device(parameter_device)
    assert parallel.world_collective_device() == parallel.collective_device(dist.get_backend(), parameter_device)
    for micro_batch in trainer._micro_batches(_samples(), with_batch=True):
        assert {t.device for t in micro_batch.tensors().values()} == {parameter_device}
    assert any(isinstance(module, SdpaAttention) for module in trainer._stage.modules())
    outputs = trainer.compute_log_probs(_samples(), temperature=1.0, with_entropy=True)
    assert outputs.log_probs.device == torch.device("cpu") and outputs.entropy is not None
    assert outputs.log_probs.shape == (sum(s.response_length for s in _samples()),)


@pytest.mark.unit
def test_tensor_collectives_are_only_issued_where_their_device_is_chosen() -> None:
    """A tensor collective written anywhere else in the trainer would bypass `collective_device` (the bug this
    guards against: a CPU flag or log-prob vector handed to NCCL). `logprobs.py` reduces tensors derived from the
    model's logits, which already sit on the model's GPU; `bridge.py` scatters expert weight shards made on their
    parameter's device (as mbridge's own load does); `cpu_compat.py` runs only without CUDA, on gloo."""
    import ast

    tensor_collectives = {
        "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
        "reduce", "scatter", "gather", "all_to_all", "send", "recv", "isend", "irecv",
    }  # fmt: skip
    package = Path(parallel.__file__).parent
    found: dict[str, set[str]] = {}
    for source in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(source.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in tensor_collectives
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "dist"
            ):
                found.setdefault(source.name, set()).add(node.func.attr)
    assert found == {"collectives.py": {"all_reduce"}, "logprobs.py": {"all_reduce"}, "bridge.py": {"scatter"},
                     "cpu_compat.py": {"all_reduce", "all_gather"}}
