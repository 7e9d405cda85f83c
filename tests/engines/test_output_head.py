"""The fused output head: the plain path's log-probs, entropy and gradients, without a [tokens x vocabulary] tensor."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig, AutoModelForCausalLM

from engines.training import TorchTrainer, TorchTrainerConfig, output_head
from engines.training.base import TrainSample
from engines.training.logprobs import token_log_probs
from engines.training.micro_batches import forward_packed, pack_inputs
from engines.training.output_head import fuse_output_head, fused_head, head_log_probs, hidden_states_only
from tests.support.training import seeded_batch, step_loss
from tools.standins.tiny_model import TinyModelSpec, cached_tiny_model

pytestmark = pytest.mark.unit
TOKENS, HIDDEN, VOCAB = 37, 16, 101


class LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an operation produced while active: what a computation materialises."""

    def __init__(self) -> None:
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for value in result if isinstance(result, (tuple, list)) else [result]:
            if isinstance(value, Tensor):
                self.elements = max(self.elements, value.numel())
        return result


def _loss_and_grads(outputs, hidden: Tensor, head: nn.Linear, weights: tuple[Tensor, Tensor]) -> list[Tensor]:
    loss = (outputs.log_probs * weights[0]).sum()
    if outputs.entropy is not None:
        loss = loss + (outputs.entropy * weights[1]).sum()
    wanted = [hidden, *(p for p in head.parameters() if p.requires_grad)]
    return list(torch.autograd.grad(loss, wanted))


@pytest.mark.parametrize("trainable_head", [True, False], ids=["trained-head", "frozen-head"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("with_entropy", [False, True], ids=["log-probs", "entropy"])
def test_fused_head_matches_the_plain_path_in_values_and_gradients(
    monkeypatch: pytest.MonkeyPatch, trainable_head: bool, bias: bool, with_entropy: bool
) -> None:
    monkeypatch.setattr(output_head, "CHUNK_ELEMENTS", 10 * VOCAB)  # 10 rows a chunk: several chunks and a short one
    torch.manual_seed(0)
    head = nn.Linear(HIDDEN, VOCAB, bias=bias).requires_grad_(trainable_head)
    hidden = torch.randn(TOKENS, HIDDEN, requires_grad=True)
    targets = torch.randint(0, VOCAB, (TOKENS,))
    weights = (torch.randn(TOKENS), torch.randn(TOKENS))

    fused = head_log_probs(hidden, head, targets, temperature=0.7, with_entropy=with_entropy)
    plain = token_log_probs(head(hidden), targets, temperature=0.7, with_entropy=with_entropy)

    torch.testing.assert_close(fused.log_probs, plain.log_probs, atol=2e-6, rtol=0)
    if with_entropy:
        torch.testing.assert_close(fused.entropy, plain.entropy, atol=4e-6, rtol=0)
    else:
        assert fused.entropy is None
    for got, expected in zip(_loss_and_grads(fused, hidden, head, weights),
                             _loss_and_grads(plain, hidden, head, weights), strict=True):
        torch.testing.assert_close(got, expected, atol=4e-6, rtol=1e-5)


@pytest.mark.parametrize("trainable_head", [True, False], ids=["trained-head", "frozen-head"])
def test_fused_head_never_holds_a_tokens_by_vocabulary_tensor(monkeypatch: pytest.MonkeyPatch,
                                                              trainable_head: bool) -> None:
    monkeypatch.setattr(output_head, "CHUNK_ELEMENTS", 8 * VOCAB)
    head = nn.Linear(HIDDEN, VOCAB).requires_grad_(trainable_head)
    hidden = torch.randn(TOKENS, HIDDEN, requires_grad=True)
    targets = torch.randint(0, VOCAB, (TOKENS,))
    for fused in (True, False):
        with LargestTensor() as largest:
            outputs = (head_log_probs(hidden, head, targets, temperature=1.0, with_entropy=True) if fused
                       else token_log_probs(head(hidden), targets, temperature=1.0, with_entropy=True))
            (outputs.log_probs.sum() + outputs.entropy.sum()).backward()
        if fused:
            assert largest.elements <= max(8 * VOCAB, head.weight.numel())
        else:  # the measure sees the plain path's logits, so the bound above means something
            assert largest.elements >= TOKENS * VOCAB


@pytest.fixture(scope="module")
def tied_model_path(tiny_model_cache: Path) -> Path:
    return cached_tiny_model(tiny_model_cache, TinyModelSpec(family="llama", tie_word_embeddings=True, seed=3))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_fused_model_gives_hidden_states_only_inside_the_switch(tiny_model_path: Path, tied_model_path: Path,
                                                                 tied: bool) -> None:
    model = AutoModelForCausalLM.from_pretrained(tied_model_path if tied else tiny_model_path,
                                                 dtype=torch.float32).eval()
    samples = [TrainSample(torch.arange(6, 20), response_length=5), TrainSample(torch.arange(30, 39), 4)]
    inputs = pack_inputs(samples)
    with torch.no_grad():
        before = forward_packed(model, inputs)
        assert fuse_output_head(model)
        after = forward_packed(model, inputs)
        with hidden_states_only():
            hidden = forward_packed(model, inputs)
    assert torch.equal(before, after)  # outside the switch the model is what it was
    assert hidden.shape == (9, model.config.hidden_size)
    head = fused_head(model)
    assert head is not None and (head.weight is model.get_input_embeddings().weight) == tied
    log_probs = head_log_probs(hidden, head, inputs.targets, temperature=0.7, with_entropy=False).log_probs
    torch.testing.assert_close(log_probs, token_log_probs(before, inputs.targets, temperature=0.7,
                                                          with_entropy=False).log_probs, atol=1e-5, rtol=0)


def test_a_model_that_changes_its_logits_after_the_head_keeps_the_plain_path() -> None:
    config = AutoConfig.for_model("gemma2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                  final_logit_softcapping=0.5)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    assert not fuse_output_head(model)
    assert type(model.get_output_embeddings()) is nn.Linear and fused_head(model) is None


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_trainer_never_holds_a_tokens_by_vocabulary_tensor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               lora: bool) -> None:
    """A wide vocabulary beside a narrow model, so the logits of a micro-batch would be its largest tensor."""
    vocab = 4096
    monkeypatch.setattr(output_head, "CHUNK_ELEMENTS", 8 * vocab)
    config = AutoConfig.for_model("qwen2", vocab_size=vocab, hidden_size=16, intermediate_size=64,
                                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path)
    from engines.training.lora import LoraSettings

    trainer = TorchTrainer(TorchTrainerConfig(model_path=tmp_path, check_packing=False, micro_batch_tokens=4096,
                                              lora=LoraSettings(rank=4, alpha=8.0) if lora else None))
    batch = seeded_batch()
    response_tokens = sum(sample.response_length for sample in batch)
    assert response_tokens > 2 * 16  # the logits would outgrow the embedding and the head
    with LargestTensor() as largest:
        trainer.compute_log_probs(batch, temperature=0.8, with_entropy=True)
        trainer.train_step(batch, step_loss(batch), temperature=0.8, with_entropy=True)
    assert largest.elements <= 16 * vocab
