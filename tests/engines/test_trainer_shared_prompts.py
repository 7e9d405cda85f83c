"""Shared prompts: a group's prompt packed once, with the logits, gradients and optimizer step of whole samples."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engines.training import ModelOutputs, PackedBatch, TorchTrainer, TorchTrainerConfig, TrainSample
from engines.training.attention import packed_sdpa_attention, register_packed_attention
from engines.training.micro_batches import (
    check_packing_isolation,
    forward_packed,
    pack_inputs,
    plan_shared_micro_batches,
)
from tools.standins.tiny_model import TinyModelSpec, build_tiny_model, build_tokenizer


def _groups(prompt_lengths: list[int], responses: list[list[int]], seed: int = 0) -> list[TrainSample]:
    """Samples of GRPO groups: each group's members share its prompt tokens and differ in their responses."""
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for prompt_length, lengths in zip(prompt_lengths, responses, strict=True):
        prompt = torch.randint(6, 100, (prompt_length,), generator=generator)
        for length in lengths:
            response = torch.randint(6, 100, (length,), generator=generator)
            samples.append(TrainSample(torch.cat([prompt, response]), length))
    return samples


@pytest.mark.unit
def test_a_group_row_holds_its_prompt_once_and_each_response_after_it() -> None:
    samples = _groups([3, 2], [[2, 1, 2], [1]])
    inputs = pack_inputs(samples, share_prompts=True)
    assert inputs.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 3, 4, 0, 1, 2]]
    assert inputs.input_ids[0].tolist() == [*samples[0].tokens.tolist(), *samples[1].tokens[3:].tolist(),
                                            *samples[2].tokens[3:].tolist(), *samples[3].tokens.tolist()]
    # Every response's first token is predicted from the prompt's last position (row 2), later ones from their own.
    assert inputs.logit_positions.tolist() == [2, 3, 2, 2, 6, 9]
    assert torch.equal(inputs.targets, torch.cat([s.tokens[-s.response_length:] for s in samples]))
    assert pack_inputs(samples).input_ids.shape[1] == sum(s.tokens.numel() for s in samples)


@pytest.mark.unit
def test_only_a_neighbour_with_the_same_prompt_is_shared() -> None:
    first, second = _groups([3], [[2]], seed=1), _groups([3], [[2]], seed=2)
    inputs = pack_inputs([*first, *second, *first], share_prompts=True)
    assert inputs.position_ids.tolist() == [[0, 1, 2, 3, 4] * 3]


@pytest.mark.unit
@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3_moe", "mixtral"])
def test_shared_prompts_give_the_log_probs_and_gradients_of_whole_samples(family: str) -> None:
    register_packed_attention()
    model = build_tiny_model(TinyModelSpec(family=family), build_tokenizer())
    model.config._attn_implementation = "packed_sdpa"
    # Groups of several sizes and response lengths (one empty), a lone sample, and a one-token prompt.
    samples = _groups([5, 1, 7, 4], [[3, 3, 1, 6], [2, 2], [4], [0, 2, 5]])
    results = []
    for share in (False, True):
        model.zero_grad()
        inputs = pack_inputs(samples, share_prompts=share)
        log_probs = torch.log_softmax(forward_packed(model, inputs), -1).gather(-1, inputs.targets[:, None])[:, 0]
        weights = torch.linspace(-1.0, 2.0, log_probs.numel())
        (log_probs * weights).sum().backward()
        results.append((log_probs.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (plain, plain_grads), (shared, shared_grads) = results
    torch.testing.assert_close(shared, plain, atol=1e-5, rtol=0)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.unit
def test_a_continuation_attends_to_its_prompt_within_the_sliding_window() -> None:
    """Row: a 5-token sequence, then two continuations after its first 2 tokens, checked against whole sequences."""
    generator = torch.Generator().manual_seed(0)
    positions = torch.tensor([[0, 1, 2, 3, 4, 2, 3, 4, 2, 3]])
    query = torch.randn(1, 4, 10, 8, generator=generator, requires_grad=True)
    key, value = (torch.randn(1, 2, 10, 8, generator=generator, requires_grad=True) for _ in range(2))
    output, _ = packed_sdpa_attention(nn.Module().eval(), query, key, value, None, position_ids=positions,
                                      sliding_window=2)
    weights = torch.randn(output.shape, generator=generator)
    grads = torch.autograd.grad((output * weights).sum(), (query, key, value))

    pieces = []
    for own in ([0, 1, 2, 3, 4], [5, 6, 7], [8, 9]):
        rows = [0, 1, *own] if own[0] else own  # a continuation's whole sequence: the root's 2 tokens, then its own
        length = len(rows)
        distance = torch.arange(length)[:, None] - torch.arange(length)[None, :]
        band = (distance >= 0) & (distance < 2)
        whole = F.scaled_dot_product_attention(query[:, :, rows], key[:, :, rows], value[:, :, rows],
                                               attn_mask=band, enable_gqa=True)
        pieces.append(whole[:, :, -len(own):].transpose(1, 2))
    expected = torch.cat(pieces, dim=1)
    expected_grads = torch.autograd.grad((expected * weights).sum(), (query, key, value))
    torch.testing.assert_close(output, expected)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected_grad)


@pytest.mark.unit
def test_a_continuation_with_no_long_enough_sequence_before_it_is_refused() -> None:
    tensor = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match=r"restart at 3 \(row position 2\) without segments before it that reach"):
        packed_sdpa_attention(nn.Module(), tensor, tensor, tensor, None, position_ids=torch.tensor([[0, 1, 3, 4]]))


@pytest.mark.unit
def test_the_plan_keeps_a_group_together_and_cuts_one_too_long_for_the_budget() -> None:
    samples = _groups([4, 4, 4], [[2] * 8, [3] * 3, [1]])  # groups of 4 + 16, 4 + 9 and 5 shared tokens
    plan = plan_shared_micro_batches(samples, token_budget=14)
    assert sorted(index for members in plan for index in members) == list(range(len(samples)))
    for members in plan:
        assert pack_inputs([samples[i] for i in members], share_prompts=True).input_ids.shape[1] <= 14
    # The first group (20 tokens shared) is cut in two pieces of 5 and 3 samples; the second stays whole.
    assert [0, 1, 2, 3, 4] in [m[:5] for m in plan] and any(m[:3] == [5, 6, 7] for m in plan)
    assert any({8, 9, 10} <= set(members) for members in plan)


@pytest.mark.unit
def test_the_start_up_check_refuses_an_attention_that_ignores_shared_prompts() -> None:
    register_packed_attention()
    model = build_tiny_model(TinyModelSpec(family="qwen2"), build_tokenizer()).eval()
    model.config._attn_implementation = "packed_sdpa"
    check_packing_isolation(model, "cpu", share_prompts=True)
    model.config._attn_implementation = "sdpa"  # isolates whole samples, but reads a continuation as its own
    check_packing_isolation(model, "cpu")
    with pytest.raises(RuntimeError, match="does not isolate packed sequences or shared prompts"):
        check_packing_isolation(model, "cpu", share_prompts=True)


class _GroupLoss:
    """A token-mean policy-gradient term with fixed per-token advantages, over the step's global token count."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens

    def __call__(self, outputs: ModelOutputs, batch: PackedBatch) -> tuple[Tensor, dict]:
        assert batch.advantages is not None
        return -(batch.advantages * outputs.log_probs).sum() / self.tokens, {}


@pytest.mark.unit
def test_a_trainer_step_with_shared_prompts_updates_the_weights_as_one_without(tiny_model_path: Path) -> None:
    samples = _groups([6, 3, 5], [[2, 4, 1, 3], [2, 2], [3, 1, 1]], seed=3)
    generator = torch.Generator().manual_seed(4)
    for sample in samples:
        sample.advantages = torch.randn(sample.response_length, generator=generator)
    tokens = sum(s.response_length for s in samples)
    weights, micro_batches = [], []
    for share in (False, True):
        # A 24-token budget makes several micro-batches and cuts the first group.
        config = TorchTrainerConfig(model_path=tiny_model_path, micro_batch_tokens=24, lr=1e-2, eps=1.0,
                                    share_prompts=share)
        trainer = TorchTrainer(config)
        result = trainer.train_step(samples, _GroupLoss(tokens), temperature=0.9)
        assert not result.skipped
        weights.append(dict(trainer.named_tensors()))
        micro_batches.append(result.metrics["micro_batches"])
    assert micro_batches == [3, 2]  # 64 tokens whole, 33 with each prompt once
    for name, tensor in weights[0].items():
        torch.testing.assert_close(weights[1][name], tensor, atol=1e-6, rtol=1e-5, msg=name)


def _with_preamble(samples: list[TrainSample], preamble: Tensor) -> list[TrainSample]:
    return [TrainSample(torch.cat([preamble, sample.tokens]), sample.response_length) for sample in samples]


@pytest.mark.unit
def test_a_preamble_every_prompt_starts_with_opens_the_row_once() -> None:
    preamble = torch.arange(10, 20)
    samples = _with_preamble(_groups([3, 2], [[2, 1], [1]]), preamble)
    inputs = pack_inputs(samples, share_prompts=True)
    # the preamble (positions 0-9), group 1's own prompt and first response, its second response, group 2
    assert inputs.position_ids.tolist() == [[*range(10), 10, 11, 12, 13, 14, 13, 10, 11, 12]]
    assert inputs.input_ids[0, :10].tolist() == preamble.tolist()
    assert inputs.logit_positions.tolist() == [12, 13, 12, 17]
    assert torch.equal(inputs.targets, torch.cat([s.tokens[-s.response_length:] for s in samples]))


@pytest.mark.unit
@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3_moe", "mixtral"])
def test_a_shared_preamble_gives_the_log_probs_and_gradients_of_whole_samples(family: str) -> None:
    register_packed_attention()
    model = build_tiny_model(TinyModelSpec(family=family), build_tokenizer())
    model.config._attn_implementation = "packed_sdpa"
    preamble = torch.randint(6, 100, (9,), generator=torch.Generator().manual_seed(5))
    samples = _with_preamble(_groups([5, 1, 7, 4], [[3, 3, 1, 6], [2, 2], [4], [0, 2, 5]]), preamble)
    results = []
    for share in (False, True):
        model.zero_grad()
        inputs = pack_inputs(samples, share_prompts=share)
        log_probs = torch.log_softmax(forward_packed(model, inputs), -1).gather(-1, inputs.targets[:, None])[:, 0]
        (log_probs * torch.linspace(-1.0, 2.0, log_probs.numel())).sum().backward()
        results.append((inputs.input_ids.shape[1], log_probs.detach(),
                        {n: p.grad.clone() for n, p in model.named_parameters()}))
    (plain_length, plain, plain_grads), (shared_length, shared, shared_grads) = results
    # the preamble once, each group's own prompt once, every response
    assert shared_length == 9 + (5 + 1 + 7 + 4) + sum(sample.response_length for sample in samples)
    assert plain_length == sum(sample.tokens.numel() for sample in samples)
    torch.testing.assert_close(shared, plain, atol=1e-5, rtol=0)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.unit
@pytest.mark.parametrize("share", [False, True])
def test_every_token_of_every_sample_is_found_at_its_row_position(share: bool) -> None:
    """The map routing replay reads: the row holds each sample's token t at the position listed for it."""
    samples = _with_preamble(_groups([5, 1, 7], [[3, 1, 2], [2], [4, 0]]), torch.arange(10, 22))
    inputs = pack_inputs(samples, share_prompts=share, with_token_positions=True)
    row = inputs.input_ids[0]
    expected = torch.cat([sample.tokens for sample in samples])
    assert inputs.token_positions.numel() == expected.numel()
    torch.testing.assert_close(row[inputs.token_positions], expected)
    # and at the position a token sits, the row's position id is that token's index in its sample
    indices = torch.cat([torch.arange(sample.tokens.numel()) for sample in samples])
    torch.testing.assert_close(inputs.position_ids[0][inputs.token_positions], indices)
    if share:
        assert row.numel() < expected.numel()  # the prompts and the preamble are packed once
