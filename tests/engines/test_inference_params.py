"""The request/response types of the inference interface: validation names the field, resuming is exact."""

from __future__ import annotations

import pytest

from engines.inference import GenerateOutput, GenerateRequest, SamplingParams, continuation_request
from engines.inference.base import derive_sample_seed


@pytest.mark.unit
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -1),
        ("max_new_tokens", 0),
        ("n", 0),
        ("seed", 1.5),
        ("stop", ("",)),
        ("stop_token_ids", (-3,)),
        ("ignore_eos", "yes"),
    ],
)
def test_bad_sampling_param_error_names_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} "):
        SamplingParams(**{field: value})


@pytest.mark.unit
def test_single_stop_string_is_rejected_rather_than_split_into_characters() -> None:
    with pytest.raises(ValueError, match="stop must be a tuple"):
        SamplingParams(stop="###")  # type: ignore[arg-type]


@pytest.mark.unit
def test_stop_lists_from_the_wire_are_frozen_into_tuples() -> None:
    params = SamplingParams(stop=["a", "b"], stop_token_ids=[5])  # type: ignore[arg-type]
    assert params.stop == ("a", "b")
    assert params.stop_token_ids == (5,)
    hash(params)


@pytest.mark.unit
def test_request_with_empty_prompt_is_rejected_with_its_id() -> None:
    with pytest.raises(ValueError, match="request 'q7': input_ids is empty"):
        GenerateRequest("q7", [])


@pytest.mark.unit
def test_request_with_negative_token_is_rejected_with_the_token() -> None:
    with pytest.raises(ValueError, match="holds -1"):
        GenerateRequest("q7", [4, -1])


@pytest.mark.unit
def test_continuation_request_carries_prompt_plus_partial_and_the_remaining_budget() -> None:
    request = GenerateRequest("q", [1, 2, 3], SamplingParams(max_new_tokens=10, n=4, temperature=0.5))
    partial = GenerateOutput("q", [7, 8], [-0.1, -0.2], [3, 3], "abort", sample_index=2, prompt_len=3)
    resumed = continuation_request(request, partial)
    assert resumed.input_ids == [1, 2, 3, 7, 8]
    assert resumed.params.max_new_tokens == 8
    assert resumed.params.n == 1
    assert resumed.params.temperature == 0.5
    assert resumed.request_id != request.request_id


@pytest.mark.unit
def test_continuation_of_an_exhausted_sample_is_refused() -> None:
    request = GenerateRequest("q", [1], SamplingParams(max_new_tokens=2))
    partial = GenerateOutput("q", [7, 8], [-0.1, -0.2], [0, 0], "abort")
    with pytest.raises(ValueError, match="nothing left to resume"):
        continuation_request(request, partial)


@pytest.mark.unit
def test_sample_seeds_differ_for_neighbouring_seed_and_index_pairs() -> None:
    seeds = {derive_sample_seed(seed, index) for seed in range(50) for index in range(50)}
    assert len(seeds) == 2500
    assert all(0 <= seed < 2**63 for seed in seeds)
