"""The JSON mapping between our types and SGLang's HTTP API (engines/sglang/protocol.py)."""

from __future__ import annotations

import pytest

from engines.inference.base import GenerateRequest, SamplingParams, derive_sample_seed
from engines.sglang import protocol


@pytest.mark.unit
def test_top_k_off_is_sent_as_sglang_minus_one_and_outputs_are_asked_untrimmed() -> None:
    body = protocol.generate_json(GenerateRequest("r", [1, 2], SamplingParams(top_k=0, stop=("x",))))
    params = body["sampling_params"]
    assert params["top_k"] == -1
    assert params["no_stop_trim"] is True and params["skip_special_tokens"] is False
    assert body["return_logprob"] is True and body["rid"] == "r" and params["stop"] == ["x"]
    assert protocol.parse_sampling_params(params, where="x").top_k == 0


@pytest.mark.unit
def test_seeded_request_of_several_samples_is_a_batch_with_one_seed_per_sample() -> None:
    body = protocol.generate_json(GenerateRequest("r", [5], SamplingParams(n=3, seed=7)))
    assert body["rid"] == ["r/0", "r/1", "r/2"]
    assert body["input_ids"] == [[5], [5], [5]]
    seeds = [params["sampling_seed"] for params in body["sampling_params"]]
    assert seeds == [derive_sample_seed(7, index) for index in range(3)]
    single = protocol.generate_json(GenerateRequest("s", [5], SamplingParams(seed=7)))
    assert single["sampling_params"]["sampling_seed"] == 7


@pytest.mark.unit
def test_response_item_yields_tokens_log_probs_finish_reason_and_version() -> None:
    item = {
        "text": "ab",
        "output_ids": [11, 12],
        "meta_info": {
            "id": "r",
            "finish_reason": {"type": "stop", "matched": 12},
            "output_token_logprobs": [[-0.5, 11, None], [-1.25, 12, None]],
            "weight_version": "4",
        },
    }
    parsed = protocol.parse_output_json(item, where="test")
    assert parsed.output_ids == [11, 12] and parsed.log_probs == [-0.5, -1.25]
    assert parsed.finish_reason == "stop" and parsed.matched_stop == 12 and parsed.weight_version == 4


@pytest.mark.unit
def test_response_without_log_probs_is_an_error_naming_the_field() -> None:
    with pytest.raises(protocol.ProtocolError, match="output_token_logprobs"):
        protocol.parse_output_json({"meta_info": {"finish_reason": {"type": "length"}}}, where="test")


@pytest.mark.unit
def test_unknown_finish_reason_is_rejected() -> None:
    item = {"meta_info": {"finish_reason": {"type": "exploded"}, "output_token_logprobs": []}}
    with pytest.raises(protocol.ProtocolError, match="finish_reason"):
        protocol.parse_output_json(item, where="test")


@pytest.mark.unit
def test_initial_weight_version_string_reads_as_zero_and_free_text_as_unknown() -> None:
    assert protocol.parse_weight_version("default") == 0
    assert protocol.parse_weight_version("12") == 12
    assert protocol.parse_weight_version("v2-final") is None


@pytest.mark.unit
def test_server_side_parse_expands_a_batch_and_names_bad_items() -> None:
    names = iter(["auto-0", "auto-1"])
    items, batch = protocol.parse_generate_json(
        {"input_ids": [[1], [2]], "sampling_params": {"temperature": 0}}, new_rid=lambda: next(names)
    )
    assert batch and [item.rid for item in items] == ["auto-0", "auto-1"]
    assert [item.input_ids for item in items] == [[1], [2]]
    with pytest.raises(protocol.ProtocolError, match="item 1"):
        protocol.parse_generate_json({"input_ids": [[1], []]}, new_rid=lambda: "x")
