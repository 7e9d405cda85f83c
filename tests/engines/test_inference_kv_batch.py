"""Left-padded KV batches: rows that leave and join must not change any row's next-token logits."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engines.inference.kv_batch import MIN_RESERVED_COLUMNS, KVBatch, ReservedColumnsLayer

SEQUENCES = [[5, 9, 14, 20, 33, 41, 7], [60, 61], [12, 13, 14, 15]]


@pytest.fixture(scope="module")
def model(tiny_model_path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


def _next_logits(model: torch.nn.Module, sequence: list[int]) -> torch.Tensor:
    """What the trainer sees: a plain unpadded forward of the whole sequence."""
    with torch.no_grad():
        return model(torch.tensor([sequence])).logits[0, -1]


@pytest.mark.unit
def test_prefill_of_different_lengths_gives_each_row_its_unpadded_logits(model: torch.nn.Module) -> None:
    with torch.no_grad():
        batch, logits = KVBatch.prefill(model, SEQUENCES, pad_token_id=0)
    assert batch.columns == max(len(sequence) for sequence in SEQUENCES)
    for row, sequence in enumerate(SEQUENCES):
        torch.testing.assert_close(logits[row], _next_logits(model, sequence), rtol=0, atol=1e-5)


@pytest.mark.unit
def test_decoding_after_a_row_left_and_a_row_joined_matches_unpadded_forwards(model: torch.nn.Module) -> None:
    with torch.no_grad():
        batch, _ = KVBatch.prefill(model, SEQUENCES[:2], pad_token_id=0)
        batch.decode(model, torch.tensor([3, 4]))
        batch.select(torch.tensor([1]))  # the long row leaves: its padding columns must go with it
        assert batch.columns == len(SEQUENCES[1]) + 1
        joined, _ = KVBatch.prefill(model, [SEQUENCES[2]], pad_token_id=0)
        batch.extend(joined)
        logits = batch.decode(model, torch.tensor([8, 9]))
    torch.testing.assert_close(logits[0], _next_logits(model, [*SEQUENCES[1], 4, 8]), rtol=0, atol=1e-5)
    torch.testing.assert_close(logits[1], _next_logits(model, [*SEQUENCES[2], 9]), rtol=0, atol=1e-5)


@pytest.mark.unit
def test_repeated_rows_get_independent_copies_of_a_shared_prefill(model: torch.nn.Module) -> None:
    with torch.no_grad():
        batch, _ = KVBatch.prefill(model, [SEQUENCES[0]], pad_token_id=0)
        batch.select(torch.tensor([0, 0]))
        logits = batch.decode(model, torch.tensor([10, 11]))
    torch.testing.assert_close(logits[0], _next_logits(model, [*SEQUENCES[0], 10]), rtol=0, atol=1e-5)
    torch.testing.assert_close(logits[1], _next_logits(model, [*SEQUENCES[0], 11]), rtol=0, atol=1e-5)


@pytest.mark.unit
def test_selecting_no_rows_leaves_an_empty_batch_that_can_be_refilled(model: torch.nn.Module) -> None:
    with torch.no_grad():
        batch, _ = KVBatch.prefill(model, SEQUENCES[:1], pad_token_id=0)
        batch.select(torch.tensor([], dtype=torch.int64))
        assert (batch.rows, batch.columns) == (0, 0)
        refill, _ = KVBatch.prefill(model, [SEQUENCES[1]], pad_token_id=0)
        batch.extend(refill)
        logits = batch.decode(model, torch.tensor([2]))
    torch.testing.assert_close(logits[0], _next_logits(model, [*SEQUENCES[1], 2]), rtol=0, atol=1e-5)


@pytest.mark.unit
def test_prefill_and_decode_use_no_deprecated_transformers_argument(model: torch.nn.Module) -> None:
    """`past_key_values` warns on every forward of current transformers (and is gone in 5.40): the cache goes in
    under the name the model declares."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        with torch.no_grad():
            batch, _ = KVBatch.prefill(model, SEQUENCES[:2], pad_token_id=0)
            logits = batch.decode(model, torch.tensor([3, 4]))
    torch.testing.assert_close(logits[1], _next_logits(model, [*SEQUENCES[1], 4]), rtol=0, atol=1e-5)


PREAMBLE = [4, 5, 6, 7, 8, 9, 10, 11, 12, 13]  # a system prompt every request starts with


@pytest.mark.unit
def test_a_prefix_every_sequence_shares_runs_once_and_changes_no_row(model: torch.nn.Module) -> None:
    sequences = [[*PREAMBLE, *tail] for tail in ([30, 31, 32], [40], [50, 51, 52, 53, 54])]
    fed: list[int] = []  # tokens each forward ran
    hook = model.get_input_embeddings().register_forward_pre_hook(lambda module, args: fed.append(args[0].numel()))
    try:
        with torch.no_grad():
            shared, logits = KVBatch.prefill(model, sequences, pad_token_id=0)
            tokens = [8, 9, 10]
            after_joining = shared.decode(model, torch.tensor(tokens))
            shared.select(torch.tensor([1, 2]))  # the first row leaves
            after_leaving = shared.decode(model, torch.tensor([11, 12]))
    finally:
        hook.remove()
    assert fed[:2] == [len(PREAMBLE), 3 * 5]  # the preamble once, then each row's own tokens, padded to the longest
    for row, sequence in enumerate(sequences):
        torch.testing.assert_close(logits[row], _next_logits(model, sequence), rtol=0, atol=1e-5)
        torch.testing.assert_close(after_joining[row], _next_logits(model, [*sequence, tokens[row]]), rtol=0,
                                   atol=1e-5)
    for row, (sequence, token) in enumerate(zip(sequences[1:], [9, 10], strict=True)):
        torch.testing.assert_close(after_leaving[row], _next_logits(model, [*sequence, token, 11 + row]), rtol=0,
                                   atol=1e-5)


@pytest.mark.unit
def test_a_short_or_absent_shared_prefix_is_prefilled_with_the_rest(model: torch.nn.Module) -> None:
    fed: list[int] = []
    hook = model.get_input_embeddings().register_forward_pre_hook(lambda module, args: fed.append(args[0].numel()))
    try:
        with torch.no_grad():
            KVBatch.prefill(model, [[*PREAMBLE[:4], 30, 31], [*PREAMBLE[:4], 40]], pad_token_id=0)
            # shared in full by a sequence of 8: it would keep no token of its own, so nothing is shared
            KVBatch.prefill(model, [PREAMBLE[:8], [*PREAMBLE[:8], 40]], pad_token_id=0)
    finally:
        hook.remove()
    assert fed == [2 * 6, 2 * 9]


@pytest.mark.unit
def test_decoding_writes_each_new_column_in_place_and_gives_the_unpadded_logits(model: torch.nn.Module) -> None:
    """transformers' own layer concatenates the whole cache every token; ours appends into reserved columns, so
    the keys stay in one buffer step after step, through a row leaving, and still give every row its logits."""
    with torch.no_grad():
        batch, _ = KVBatch.prefill(model, SEQUENCES, pad_token_id=0)
        batch.decode(model, torch.tensor([3, 30, 4]))
        storage = [layer.keys.data_ptr() for layer in batch.cache.layers]
        batch.decode(model, torch.tensor([5, 31, 6]))
        assert [layer.keys.data_ptr() for layer in batch.cache.layers] == storage
        batch.select(torch.tensor([0, 2]))  # a row leaves: new storage, then in place again
        batch.decode(model, torch.tensor([7, 8]))
        storage = [layer.keys.data_ptr() for layer in batch.cache.layers]
        logits = batch.decode(model, torch.tensor([9, 10]))
        assert [layer.keys.data_ptr() for layer in batch.cache.layers] == storage
    assert all(isinstance(layer, ReservedColumnsLayer) for layer in batch.cache.layers)
    expected = [[*SEQUENCES[0], 3, 5, 7, 9], [*SEQUENCES[2], 4, 6, 8, 10]]
    for row, sequence in enumerate(expected):
        torch.testing.assert_close(logits[row], _next_logits(model, sequence), rtol=0, atol=1e-5)


@pytest.mark.unit
def test_a_reserved_columns_layer_holds_what_concatenation_would_past_its_reserve() -> None:
    generator = torch.Generator().manual_seed(0)
    layer = ReservedColumnsLayer()
    first = torch.randn(2, 3, 5, 4, generator=generator)
    keys, values = layer.update(first, -first)
    expected = first
    for _ in range(MIN_RESERVED_COLUMNS + 10):  # past the first reserve: the layer moves into a larger buffer
        column = torch.randn(2, 3, 1, 4, generator=generator)
        keys, values = layer.update(column, -column)
        expected = torch.cat([expected, column], dim=-2)
    assert torch.equal(keys, expected) and torch.equal(values, -expected)
    assert layer.get_seq_length() == 5 + MIN_RESERVED_COLUMNS + 10
    layer.keys, layer.values = keys[:1].clone(), values[:1].clone()  # replaced by someone else (an eviction)
    column = torch.randn(1, 3, 1, 4, generator=generator)
    keys, _ = layer.update(column, -column)
    assert torch.equal(keys, torch.cat([expected[:1], column], dim=-2))
