"""The JSON mapping between our types and SGLang's HTTP API (engines/sglang/protocol.py)."""

from __future__ import annotations

import pytest

from engines.inference.base import GenerateRequest, SamplingParams, derive_sample_seed
from engines.sglang import protocol
from tools.standins.sglang_server import parsing


@pytest.mark.unit
def test_top_k_off_is_sent_as_sglang_minus_one_and_outputs_are_asked_untrimmed() -> None:
    body = protocol.generate_json(GenerateRequest("r", [1, 2], SamplingParams(top_k=0, stop=("x",))))
    params = body["sampling_params"]
    assert params["top_k"] == -1
    assert params["no_stop_trim"] is True and params["skip_special_tokens"] is False
    assert body["return_logprob"] is True and body["rid"] == protocol.wire_rid("r", 0) and params["stop"] == ["x"]
    assert parsing.parse_sampling_params(params, where="x").top_k == 0


@pytest.mark.unit
def test_seeded_request_of_several_samples_is_a_batch_with_one_seed_per_sample() -> None:
    body = protocol.generate_json(GenerateRequest("r", [5], SamplingParams(n=3, seed=7)))
    assert body["rid"] == [protocol.wire_rid("r", index) for index in range(3)]
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
    items, batch = parsing.parse_generate_json(
        {"input_ids": [[1], [2]], "sampling_params": {"temperature": 0}}, new_rid=lambda: next(names)
    )
    assert batch and [item.rid for item in items] == ["auto-0", "auto-1"]
    assert [item.input_ids for item in items] == [[1], [2]]
    with pytest.raises(protocol.ProtocolError, match="item 1"):
        parsing.parse_generate_json({"input_ids": [[1], []]}, new_rid=lambda: "x")


@pytest.mark.unit
def test_wire_rids_are_prefix_free_so_an_abort_by_prefix_hits_one_request() -> None:
    """SGLang aborts every rid that STARTS WITH the one given: ours must never be a prefix of another."""
    ids = ["w/g/1", "w/g/10", "w/g/1/resume0-5", "a#b", "a", "a%23b", "a%b", "#", "%"]
    rids = [protocol.wire_rid(request_id, index) for request_id in ids for index in (0, 1, 10)]
    assert len(set(rids)) == len(rids)
    for rid in rids:
        assert [other for other in rids if other.startswith(rid)] == [rid]
    with pytest.raises(ValueError, match="request id"):
        protocol.wire_rid("", 0)


@pytest.mark.unit
def test_request_bodies_hold_only_fields_of_the_protocol_table() -> None:
    body = protocol.generate_json(GenerateRequest("r", [1], SamplingParams(stop=("x",), stop_token_ids=(3,), seed=1)))
    assert set(body) <= set(protocol.GENERATE.sends)
    assert set(body["sampling_params"]) <= set(protocol.SAMPLING_FIELDS)
    with pytest.raises(protocol.ProtocolError, match="not in the protocol table"):
        protocol.request_body(protocol.PAUSE, mode="abort", retract=True)


@pytest.mark.unit
def test_abort_before_prefill_without_log_probs_is_an_aborted_sample_not_an_error() -> None:
    """Older 0.5.x answer a request aborted before its prefill with no log-probs and no weight_version."""
    item = {"text": "", "output_ids": [], "meta_info": {"id": "r", "finish_reason": {"type": "abort", "message": "x"}}}
    parsed = protocol.parse_output_json(item, where="test")
    assert parsed.finish_reason == "abort" and parsed.output_ids == [] and parsed.log_probs == []
    assert parsed.weight_version is None


@pytest.mark.unit
def test_weight_version_spans_give_each_token_its_own_version() -> None:
    """SGLang 0.5.23: meta_info.weight_versions = [{version, start, end}] over the output tokens, end exclusive."""
    item = {
        "output_ids": [1, 2, 3, 4],
        "meta_info": {
            "finish_reason": {"type": "length", "length": 4},
            "output_token_logprobs": [[-0.1, 1, None], [-0.2, 2, None], [-0.3, 3, None], [-0.4, 4, None]],
            "weight_version": "3",
            "weight_versions": [{"version": "default", "start": 0, "end": 1}, {"version": "3", "start": 1, "end": 4}],
        },
    }
    parsed = protocol.parse_output_json(item, where="test")
    assert parsed.token_versions == [0, 3, 3, 3] and parsed.weight_version == 3
    assert parsing.version_spans(["default", "3", "3", "3"]) == item["meta_info"]["weight_versions"]
    with pytest.raises(protocol.ProtocolError, match=r"weight_versions\[1\] starts at 2, expected 1"):
        protocol.token_versions([{"version": "1", "start": 0, "end": 1}, {"version": "2", "start": 2, "end": 4}], 4,
                                where="test")


@pytest.mark.unit
def test_a_request_names_its_adapter_in_lora_path_and_the_server_side_reads_it_per_item() -> None:
    body = protocol.generate_json(GenerateRequest("r", [5], SamplingParams(n=2, seed=3)), adapter="slipstream-v4-ab")
    assert body["lora_path"] == "slipstream-v4-ab"
    assert "lora_path" not in protocol.generate_json(GenerateRequest("r", [5], SamplingParams()))
    items, _ = parsing.parse_generate_json(body, new_rid=lambda: "x")
    assert [item.lora_path for item in items] == ["slipstream-v4-ab"] * 2
    body["lora_path"] = ["a", 7]
    with pytest.raises(protocol.ProtocolError, match="lora_path of item 1 must be an adapter's name, got 7"):
        parsing.parse_generate_json(body, new_rid=lambda: "x")


@pytest.mark.unit
def test_target_modules_map_to_sglangs_names_and_ones_it_cannot_adapt_are_named() -> None:
    assert protocol.lora_target_modules(("all-linear",)) == ["all"]
    assert protocol.lora_target_modules(["q_proj", "down_proj"]) == ["q_proj", "down_proj"]
    with pytest.raises(ValueError, match=r"\['c_attn'\]: SGLang cannot adapt these"):
        protocol.lora_target_modules(["q_proj", "c_attn"])


@pytest.mark.unit
def test_a_requests_images_go_as_data_urls_per_item_and_the_server_side_reads_back_the_same_bytes() -> None:
    png, jpeg = b"\x89PNG\r\n\x1a\n" + bytes(range(40)), b"\xff\xd8\xff\xe0" + bytes(20)
    request = GenerateRequest("vlm", [5, 6, 6, 7], SamplingParams(temperature=0, max_new_tokens=4), images=(png, jpeg))
    single = protocol.generate_json(request)
    assert single["image_data"][0].startswith("data:image/png;base64,")
    assert single["image_data"][1].startswith("data:image/jpeg;base64,")
    items, _ = parsing.parse_generate_json(single, new_rid=lambda: "x")
    assert [item.images for item in items] == [(png, jpeg)]
    batch = protocol.generate_json(GenerateRequest("vlm", [5, 6, 6, 7], SamplingParams(n=3), images=(png,)))
    items, is_batch = parsing.parse_generate_json(batch, new_rid=lambda: "x")
    assert is_batch and [item.images for item in items] == [(png,)] * 3
    assert "image_data" not in protocol.generate_json(GenerateRequest("text", [5], SamplingParams()))
    with pytest.raises(protocol.ProtocolError, match="image_data of item 0 must be data: URLs"):
        parsing.parse_generate_json({**single, "image_data": ["/etc/passwd"]}, new_rid=lambda: "x")
