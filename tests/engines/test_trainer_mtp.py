"""Multi-token-prediction layers trained beside the policy (`engines.training.mtp`, slime's --enable-mtp-training):
the loss each depth reports is the cross-entropy of the token it should predict, the policy trains exactly as
without them, they learn, and they survive checkpoints and HF exports in the family's layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor
from transformers import AutoModelForCausalLM

from engines.training import TorchTrainer, TorchTrainerConfig, mtp
from engines.training.config import MtpSettings
from engines.training.lora import LoraSettings
from engines.training.micro_batches import forward_packed, pack_inputs
from tests.support.training import seeded_batch, step_loss

SETTINGS = {"lr": 1e-2, "grad_clip": None, "check_packing": False, "share_prompts": False}


def _trainer(path: Path, depths: int | None = 2, **overrides: object) -> TorchTrainer:
    settings = MtpSettings(num_layers=depths) if depths else None
    return TorchTrainer(TorchTrainerConfig(model_path=path, **{**SETTINGS, **overrides}, mtp=settings))


def _step(trainer: TorchTrainer, batch: list | None = None) -> dict[str, float]:
    batch = batch if batch is not None else seeded_batch()
    result = trainer.train_step(batch, step_loss(batch), temperature=1.0, with_entropy=True)
    assert not result.skipped, result.skip_reason
    return result.metrics


def _reference(trainer: TorchTrainer, batch: list, depth_count: int) -> tuple[list[float], list[float]]:
    """Each depth's loss and top-1 agreement written out per sample, by absolute text positions: the depth-k output
    at position t-1-k predicts the token at t. Loss: summed over trained response tokens, divided by the step's
    trained tokens; agreement: over every response token that has such a position."""
    predictor, model = trainer._mtp, trainer._model
    assert predictor is not None
    head = model.get_output_embeddings().weight
    totals, hits, counts = [0.0] * depth_count, [0] * depth_count, [0] * depth_count
    trained = sum(int((sample.loss_mask != 0).sum()) for sample in batch)
    with torch.no_grad():
        for sample in batch:
            tokens = sample.tokens
            with predictor.capturing():
                forward_packed(model, pack_inputs([sample], share_prompts=False))
            hidden, kwargs = predictor._hidden, predictor._layer_kwargs
            for depth, layer in enumerate(predictor.module, start=1):
                ahead = torch.cat([tokens[depth:], tokens.new_zeros(depth)])
                hidden = layer(hidden, model.get_input_embeddings()(ahead[None]), kwargs)
                log_probs = torch.log_softmax(hidden[0] @ head.T, dim=-1)
                prompt = len(tokens) - sample.response_length
                for index in range(sample.response_length):
                    position = prompt + index
                    if position - 1 - depth < 0:
                        continue
                    hits[depth - 1] += int(log_probs[position - 1 - depth].argmax() == tokens[position])
                    counts[depth - 1] += 1
                    if sample.loss_mask[index] != 0:
                        totals[depth - 1] -= float(log_probs[position - 1 - depth, tokens[position]])
    return [total / trained for total in totals], [hit / count for hit, count in zip(hits, counts, strict=True)]


@pytest.mark.integration
def test_each_depths_loss_is_the_cross_entropy_of_the_token_it_predicts(tiny_model_path: Path) -> None:
    """Packed rows of several samples (micro-batches of whole samples) against each sample on its own, indexed by
    absolute position: a depth that looked across a sample boundary or one token off would differ. Its top-1
    agreement with the samples' tokens too (what greedy speculative decoding would accept)."""
    trainer = _trainer(tiny_model_path, micro_batch_tokens=80)
    batch = seeded_batch()
    expected, agreement = _reference(trainer, batch, 2)
    assert trainer.mtp_agreement(batch) == pytest.approx(agreement)
    metrics = _step(trainer, batch)
    assert metrics["micro_batches"] < len(batch)  # samples were packed together
    for depth in (1, 2):
        assert metrics[f"mtp_{depth}_loss"] == pytest.approx(expected[depth - 1], rel=1e-4)
    assert metrics["mtp_loss"] == pytest.approx(sum(expected), rel=1e-4)
    for _ in range(2):
        _step(trainer, batch)
    _, agreement = _reference(trainer, batch, 2)
    assert min(agreement) > 0 and trainer.mtp_agreement(batch) == pytest.approx(agreement)


@pytest.mark.integration
def test_the_policy_trains_exactly_as_without_mtp_and_only_the_mtp_layers_learn(tiny_model_path: Path) -> None:
    plain, drafted = _trainer(tiny_model_path, depths=None), _trainer(tiny_model_path)
    before = {name: tensor.clone() for name, tensor in drafted._mtp.state_dict().items()}
    agreement = drafted.mtp_agreement(seeded_batch())
    losses = [_step(drafted)["mtp_loss"]]
    _step(plain)
    for (name, expected), (_, got) in zip(plain.named_tensors(), drafted.named_tensors(), strict=True):
        assert torch.equal(expected, got), name  # no gradient from the MTP loss reached the policy
    after = drafted._mtp.state_dict()
    assert all(not torch.equal(before[name], after[name]) for name in before)
    for _ in range(5):
        losses.append(_step(drafted)["mtp_loss"])
    assert losses[-1] < 0.7 * losses[0], losses  # the draft learns the batch it keeps seeing
    assert [after > first for first, after in zip(agreement, drafted.mtp_agreement(seeded_batch()), strict=True)] \
        == [True, True]


@pytest.mark.integration
def test_mtp_layers_and_their_optimizer_state_survive_a_checkpoint(tiny_model_path: Path, tmp_path: Path) -> None:
    trainer = _trainer(tiny_model_path)
    _step(trainer)
    trainer.save_checkpoint(tmp_path / "ckpt", {})
    resumed = _trainer(tiny_model_path)
    resumed.load_checkpoint(tmp_path / "ckpt")
    _step(trainer), _step(resumed)
    for name, tensor in trainer._mtp.state_dict().items():
        assert torch.equal(tensor, resumed._mtp.state_dict()[name]), name
    without = _trainer(tiny_model_path, depths=None)
    without.save_checkpoint(tmp_path / "plain", {})
    with pytest.raises(FileNotFoundError, match="saved by a run without --enable-mtp-training"):
        _trainer(tiny_model_path).load_checkpoint(tmp_path / "plain")


def _export_tensors(directory: Path) -> dict[str, Tensor]:
    with safe_open(str(directory / mtp.WEIGHTS_FILE), framework="pt") as handle:
        return {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118


@pytest.mark.integration
def test_an_export_carries_the_layers_in_deepseeks_layout_and_a_run_from_it_starts_with_them(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    trainer = _trainer(tiny_model_path)
    assert trainer._mtp.source == "fresh"
    _step(trainer)
    trainer.export_hf(tmp_path / "export")
    written = _export_tensors(tmp_path / "export")
    # two decoder layers, so the depths are layers 2 and 3, each with the policy's embedding and head repeated
    for layer in (2, 3):
        for part in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "self_attn.q_proj", "embed_tokens",
                     "shared_head.head"):
            assert f"model.layers.{layer}.{part}.weight" in written
    assert torch.equal(written["model.layers.2.shared_head.head.weight"],
                       trainer._model.get_output_embeddings().weight.detach())
    assert json.loads((tmp_path / "export" / "config.json").read_text())["num_nextn_predict_layers"] == 2
    AutoModelForCausalLM.from_pretrained(tmp_path / "export")  # the policy still loads as any HF model
    restarted = _trainer(tmp_path / "export")
    assert restarted._mtp.source == "checkpoint"
    for name, tensor in trainer._mtp.state_dict().items():
        assert torch.equal(tensor, restarted._mtp.state_dict()[name]), name


@pytest.mark.integration
def test_deepseeks_projection_reads_the_embedding_first(tiny_model_path: Path, tmp_path: Path) -> None:
    """DeepSeek-V3's eh_proj (and SGLang's NextN drafts) takes [enorm(embedding), hnorm(hidden)]: a checkpoint whose
    first half is zero gives a draft blind to the token embeddings and no other."""
    _trainer(tiny_model_path, depths=1).export_hf(tmp_path / "export")
    written = _export_tensors(tmp_path / "export")
    written["model.layers.2.eh_proj.weight"][:, :64] = 0
    save_file(written, str(tmp_path / "export" / mtp.WEIGHTS_FILE))
    trainer = _trainer(tmp_path / "export", depths=1)
    predictor = trainer._mtp
    with torch.no_grad():
        with predictor.capturing():
            forward_packed(trainer._model, pack_inputs(seeded_batch()[:1], share_prompts=False))
        hidden, kwargs, depth = predictor._hidden, predictor._layer_kwargs, predictor.module[0]
        embedded = torch.randn_like(hidden)
        blind = depth(hidden, embedded, kwargs)
        assert torch.equal(blind, depth(hidden, 2 * embedded + 1, kwargs))
        assert not torch.allclose(blind, depth(2 * hidden + 1, embedded, kwargs))


@pytest.mark.integration
def test_mimos_layout_reads_the_hidden_state_first(tiny_model_path: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """MiMo names its depths model.mtp_layers.{k}.* and concatenates [hidden, embedding]: its projection's halves are
    ours swapped, and a run from a MiMo-layout export computes the same draft."""
    monkeypatch.setitem(mtp.LAYOUT_OF_MODEL_TYPE, "qwen2", mtp.MIMO)
    trainer = _trainer(tiny_model_path, depths=1)
    trainer.export_hf(tmp_path / "export")
    written = _export_tensors(tmp_path / "export")
    ours = trainer._mtp.state_dict()["0.eh_proj.weight"]
    stored = written["model.mtp_layers.0.input_proj.weight"]
    assert torch.equal(stored, torch.cat([ours[:, 64:], ours[:, :64]], dim=1))
    assert {"model.mtp_layers.0.token_layernorm.weight", "model.mtp_layers.0.final_layernorm.weight",
            "model.mtp_layers.0.mlp.down_proj.weight"} <= written.keys()
    assert not any("embed_tokens" in name for name in written)
    restarted = _trainer(tmp_path / "export", depths=1)
    assert torch.equal(restarted._mtp.state_dict()["0.eh_proj.weight"], ours)


@pytest.mark.integration
def test_a_mixture_of_experts_depth_is_exported_one_expert_at_a_time_and_read_back(tiny_model_cache: Path,
                                                                                    tmp_path: Path) -> None:
    """transformers 5 stacks a layer's experts; checkpoints (and SGLang) hold one tensor per expert and projection."""
    from tools.standins.tiny_model import TinyModelSpec, cached_tiny_model

    trainer = _trainer(cached_tiny_model(tiny_model_cache, TinyModelSpec(family="qwen3_moe")), depths=1)
    _step(trainer)
    trainer.export_hf(tmp_path / "export")
    written = _export_tensors(tmp_path / "export")
    assert {f"model.layers.2.mlp.experts.{expert}.{projection}.weight" for expert in range(4)
            for projection in ("gate_proj", "up_proj", "down_proj")} <= written.keys()
    assert not any("gate_up_proj" in name for name in written)
    restarted = _trainer(tmp_path / "export", depths=1)
    assert restarted._mtp.source == "checkpoint"
    for name, tensor in trainer._mtp.state_dict().items():
        assert torch.equal(tensor, restarted._mtp.state_dict()[name]), name


@pytest.mark.integration
def test_a_checkpoint_with_part_of_the_depths_is_refused_by_name(tiny_model_path: Path, tmp_path: Path) -> None:
    _trainer(tiny_model_path, depths=1).export_hf(tmp_path / "export")
    with pytest.raises(ValueError, match=r"holds some MTP weights of the nextn layout but not \['model\.layers\.3\."):
        _trainer(tmp_path / "export", depths=2)


@pytest.mark.unit
def test_mtp_is_refused_where_its_rows_or_weights_are_not_whole(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--enable-mtp-training with LoRA"):
        TorchTrainerConfig(model_path=tmp_path, mtp=MtpSettings(num_layers=1), lora=LoraSettings(rank=4, alpha=8))
    with pytest.raises(ValueError, match="--context-parallel-size 2: the MTP layers need each row whole"):
        TorchTrainerConfig(model_path=tmp_path, mtp=MtpSettings(num_layers=1), context_parallel_size=2)
