"""The weight check of pushes to SGLang servers: SGLang's own checksums, compared across engines and versions.

Unit tests of the verdict (`engines/sglang/checksums.py`), of reading a `/weights_checker` answer and of the
loader's report; then real processes: the compatible server's checksum against one computed here as SGLang's
source computes it, and checked pushes to two servers, one of which silently drops updates after its first.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from aiohttp import web
from transformers import AutoModelForCausalLM

from bus.address import free_port
from engines.sglang import protocol
from engines.sglang.checksums import (
    FROZEN_NAMES,
    Baseline,
    ServedChecksum,
    ServedHistory,
    check_checksums,
    feeders,
)
from engines.sglang.client import SglangEngine, SglangError
from engines.sglang.launch import ServerProcess, ServerSpec
from engines.sglang.store_sender import SglangStoreSender
from engines.sglang.tensor_weights import SglangTensorLoader, SglangTensorSender
from engines.sglang.weights import SglangWeightLoader, SglangWeightSender
from engines.weights.base import TransferReport, WeightsDiffer
from engines.weights.fingerprint import FingerprintCheck

SENT = {"a": 1, "b": 2, "c": 3}
CHANGED = {"a": 1, "b": 20, "c": 30}
X, Y, Z = "a" * 64, "b" * 64, "c" * 64


def served(**checksums: str | None) -> dict[str, ServedChecksum]:
    return {engine: ServedChecksum(checksum, "" if checksum else "its server has no /weights_checker")
            for engine, checksum in checksums.items()}


# ------------------------------------------------------------------------------------------------- the verdict


@pytest.mark.unit
def test_engines_that_agree_on_a_first_push_are_matched() -> None:
    check = check_checksums("xxh3", SENT, served(e0=X, e1=X, e2=X), None)
    assert check == FingerprintCheck("xxh3", matched=("e0", "e1", "e2"))


@pytest.mark.unit
def test_the_engine_outside_the_agreeing_group_differs_naming_the_engines_it_disagrees_with() -> None:
    check = check_checksums("xxh3", SENT, served(e0=X, e1=Y, e2=X), None)
    assert check.matched == ("e0", "e2") and check.differ == {"e1": []} and not check.ok
    assert check.problems() == {"e1": "its SGLang checksum differs from that of e0, e2 (the engines of one push "
                                      "serve one model in one layout)"}
    assert check.describe().startswith("e1 its SGLang checksum differs from that of e0, e2")


@pytest.mark.unit
def test_a_tie_names_every_engine_in_the_disagreement() -> None:
    check = check_checksums("xxh3", SENT, served(e0=X, e1=Y), None)
    assert check.matched == () and set(check.differ) == {"e0", "e1"}
    assert "differs from that of e1" in check.why["e0"] and "differs from that of e0" in check.why["e1"]
    four = check_checksums("xxh3", SENT, served(e0=X, e1=X, e2=Y, e3=Y), None)
    assert set(four.differ) == {"e0", "e1", "e2", "e3"} and "e2, e3" in four.why["e0"]


@pytest.mark.unit
def test_one_engine_whose_checksum_stayed_although_tensors_changed_never_got_the_update() -> None:
    baseline = Baseline(4, "xxh3", SENT, {"e0": X})
    check = check_checksums("xxh3", CHANGED, served(e0=X), baseline)
    assert check.differ == {"e0": ["b", "c"]} and check.matched == ()
    assert check.problems()["e0"] == ("serves the same weights as after version 4: its SGLang checksum did not "
                                      "change although 2 pushed tensor(s) did, e.g. b, c")
    assert check_checksums("xxh3", CHANGED, served(e0=Y), baseline) == FingerprintCheck("xxh3", matched=("e0",))


@pytest.mark.unit
def test_a_stale_engine_is_left_out_of_the_consensus_so_the_updated_one_is_not_blamed() -> None:
    baseline = Baseline(4, "xxh3", SENT, {"e0": X, "e1": X})
    check = check_checksums("xxh3", CHANGED, served(e0=Y, e1=X), baseline)
    assert check.matched == ("e0",) and list(check.differ) == ["e1"] and "after version 4" in check.why["e1"]


@pytest.mark.unit
def test_when_no_tensor_changed_an_unchanged_checksum_is_fine() -> None:
    baseline = Baseline(4, "xxh3", SENT, {"e0": X})
    assert check_checksums("xxh3", dict(SENT), served(e0=X), baseline) == FingerprintCheck("xxh3", matched=("e0",))
    moved = check_checksums("xxh3", dict(SENT), served(e0=Y), baseline)  # moved although nothing did: no verdict
    assert moved.ok and "changed since version 4 although no pushed tensor did" in moved.unchecked["e0"]


@pytest.mark.unit
def test_a_lone_engine_on_the_first_push_is_unchecked_with_the_reason() -> None:
    check = check_checksums("xxh3", SENT, served(e0=X), None)
    assert check.ok and check.matched == ()
    assert check.unchecked == {"e0": "SGLang checksums its own fused, sharded layout: checked against other engines "
                                     "and its previous version only; first push, one engine"}
    joined = check_checksums("xxh3", CHANGED, served(e1=X), Baseline(4, "xxh3", SENT, {"e0": Y}))
    assert "no checksum of its own from version 4" in joined.unchecked["e1"]
    other_algorithm = check_checksums("wsum", CHANGED, served(e0=X), Baseline(4, "xxh3", SENT, {"e0": X}))
    assert other_algorithm.ok and "first push" in other_algorithm.unchecked["e0"]


@pytest.mark.unit
def test_an_engine_without_the_endpoint_is_unchecked_and_the_others_still_compare() -> None:
    check = check_checksums("xxh3", SENT, served(e0=X, e1=None, e2=X), None)
    assert check.matched == ("e0", "e2") and check.unchecked == {"e1": "its server has no /weights_checker"}
    alone = check_checksums("xxh3", SENT, served(e0=X, e1=None), None)
    assert alone.ok and set(alone.unchecked) == {"e0", "e1"}


def with_frozen(checksum: str, frozen: list[str], *, since: int = 4, tensors: int = 10) -> ServedChecksum:
    return ServedChecksum(checksum, tensors=tensors, since=since, frozen=tuple(frozen), frozen_count=len(frozen))


EXPERTS = [f"model.layers.0.mlp.experts.{e}.{projection}.weight" for e in range(2)
           for projection in ("gate_proj", "up_proj", "down_proj")]
MOE_SENT = {name: index for index, name in enumerate(["model.norm.weight", *EXPERTS])}
MOE_MOVED = {name: value + 100 for name, value in MOE_SENT.items()}
FUSED_EXPERTS = ["model.layers.0.mlp.experts.w13_weight", "model.layers.0.mlp.experts.w2_weight"]


@pytest.mark.unit
def test_a_served_tensor_left_as_it_was_while_every_pushed_tensor_it_is_made_of_changed_fails_the_engine() -> None:
    """The MoE case: the server skipped the names it did not know, the other weights moved its checksum, and its
    peers (as blind) agree with it. Only its per-tensor checksums tell."""
    baseline = Baseline(4, "xxh3", MOE_SENT, {"e0": X, "e1": X})
    stuck = {"e0": with_frozen(Y, FUSED_EXPERTS), "e1": with_frozen(Y, FUSED_EXPERTS)}
    check = check_checksums("xxh3", MOE_MOVED, stuck, baseline, sent_in_16_bits=True)
    assert set(check.differ) == {"e0", "e1"} and check.matched == () and not check.ok
    assert check.why["e0"] == ("2 tensor(s) its server serves did not change since version 4 although every pushed "
                               "tensor they are made of did, e.g. model.layers.0.mlp.experts.w13_weight, "
                               "model.layers.0.mlp.experts.w2_weight: its server passed over what should have loaded "
                               "them (SGLang skips a tensor name it does not know without a word)")


@pytest.mark.unit
def test_a_frozen_served_tensor_says_nothing_unless_all_its_pushed_tensors_changed_in_16_bits_since_its_baseline(
        ) -> None:
    """A served tensor whose pushed tensors stayed (in part) may stay; a float32 push may round to nothing on a
    bfloat16 server; a report against another version than the baseline (a push in between was not committed)
    compares other things; and a served tensor no pushed tensor is named like is no evidence."""
    baseline = Baseline(4, "xxh3", MOE_SENT, {"e0": X})
    frozen = {"e0": with_frozen(Y, FUSED_EXPERTS)}
    one_expert_stayed = {**MOE_MOVED, EXPERTS[0]: MOE_SENT[EXPERTS[0]]}
    assert check_checksums("xxh3", one_expert_stayed, frozen, baseline, sent_in_16_bits=True).matched == ("e0",)
    assert check_checksums("xxh3", MOE_MOVED, frozen, baseline, sent_in_16_bits=False).matched == ("e0",)
    stale_report = {"e0": with_frozen(Y, FUSED_EXPERTS, since=5)}
    assert check_checksums("xxh3", MOE_MOVED, stale_report, baseline, sent_in_16_bits=True).matched == ("e0",)
    internal = {"e0": with_frozen(Y, ["model.vision_tower.scale"])}
    assert check_checksums("xxh3", MOE_MOVED, internal, baseline, sent_in_16_bits=True).matched == ("e0",)


@pytest.mark.unit
def test_a_served_tensor_is_made_of_the_pushed_tensors_under_its_module_or_its_parent() -> None:
    sent = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
            "model.layers.0.mlp.experts.0.gate_proj.weight", "model.layers.1.self_attn.q_proj.weight",
            "model.norm.weight", "lm_head.weight"]
    assert feeders("model.layers.0.self_attn.qkv_proj.weight", sent) == sent[:2]
    assert feeders("model.layers.0.mlp.experts.w13_weight", sent) == [sent[2]]
    assert feeders("model.norm.weight", sent) == ["model.norm.weight"]
    assert feeders("lm_head.weight", sent) == ["lm_head.weight"]
    assert feeders("model.layers.0.mlp.gate.weight", sent) == [sent[2]]  # the router: under the layer's mlp
    assert feeders("model.layers.7.mlp.experts.w2_weight", sent) == []


@pytest.mark.unit
def test_a_loader_reports_the_tensors_its_server_left_unchanged_since_its_previous_load() -> None:
    history = ServedHistory()
    first = history.report(X, {"w": "1", "v": "2"}, version=1, server_starts=0)
    assert first == ServedChecksum(X, tensors=2)  # nothing to compare with yet
    second = history.report(Y, {"w": "1", "v": "3"}, version=2, server_starts=0)
    assert second == ServedChecksum(Y, tensors=2, since=1, frozen=("w",), frozen_count=1)
    restarted = history.report(Z, {"w": "1", "v": "4"}, version=3, server_starts=1)
    assert restarted == ServedChecksum(Z, tensors=2)  # a new server serves its launch weights: a new history
    many = {f"t{index:03d}": "same" for index in range(100)}
    history.report(X, many, version=4, server_starts=1)
    capped = history.report(X, many, version=5, server_starts=1)
    assert capped.frozen_count == 100 and capped.frozen == tuple(sorted(many))[:FROZEN_NAMES]


@pytest.mark.unit
def test_a_sharded_tensor_is_frozen_only_when_no_rank_s_shard_changed() -> None:
    """With tensor parallelism each rank checksums its own shard; a step may move only the rows one rank holds."""
    history = ServedHistory()
    history.report(X, {"w@rank0": "1", "w@rank1": "2", "v@rank0": "3", "v@rank1": "4"}, version=1, server_starts=0)
    assert history.report(X, {"w@rank0": "1", "w@rank1": "2", "v@rank0": "3", "v@rank1": "4"}, version=2,
                          server_starts=0).frozen == ("v", "w")
    report = history.report(Y, {"w@rank0": "1", "w@rank1": "9", "v@rank0": "3", "v@rank1": "4"}, version=3,
                            server_starts=0)
    assert report == ServedChecksum(Y, tensors=2, since=2, frozen=("v",), frozen_count=1)
    own = {"model.layers.0.mlp.experts.expert_mask_gpu": "1", "model.rotary_emb.cos_sin_cache": "2"}
    history.report(X, own, version=4, server_starts=0)
    assert history.report(X, own, version=5, server_starts=0).frozen == ()  # SGLang's own, not loaded


@pytest.mark.unit
def test_a_checksum_report_travels_as_json_and_an_unreadable_one_is_named() -> None:
    for report in (ServedChecksum(X), ServedChecksum(None, "checksum failed: HTTP 400"),
                   with_frozen(X, ["model.layers.0.mlp.experts.w13_weight"])):
        assert ServedChecksum.decode(report.encode()) == report
    with pytest.raises(ValueError, match="served checksum: unreadable"):
        ServedChecksum.decode(b'{"checksum": 3, "why": ""}')


# ------------------------------------------------------------------------------------ the answer and the loader


def sglang_answer(*per_gpu: str) -> dict[str, Any]:
    """A `/weights_checker` body as SGLang builds it (`tokenizer_control_mixin.check_weights`)."""
    digest = hashlib.sha256()
    for checksum in per_gpu:
        digest.update(checksum.encode())
    return {"success": True, "message": "Success.", "per_engine_checksum": digest.hexdigest(),
            "ranks": [{"checksums": {}, "per_gpu_checksum": checksum} for checksum in per_gpu]}


@pytest.mark.unit
def test_a_checksum_answer_is_read_only_when_it_adds_up() -> None:
    answer = sglang_answer(X, Y)
    assert protocol.parse_weights_checksum(answer, where="s") == protocol.WeightsChecksum(
        answer["per_engine_checksum"], (X, Y))
    with pytest.raises(protocol.ProtocolError, match="s: per_engine_checksum is not the sha256 of its 2 ranks"):
        protocol.parse_weights_checksum({**answer, "ranks": answer["ranks"][::-1]}, where="s")
    with pytest.raises(protocol.ProtocolError, match="per_engine_checksum None is not a sha256"):
        protocol.parse_weights_checksum({"success": True, "message": "?"}, where="s")
    with pytest.raises(protocol.ProtocolError, match="'ranks' must be a non-empty list"):
        protocol.parse_weights_checksum({**answer, "ranks": []}, where="s")
    answer["ranks"][0]["checksums"] = {"model.norm.weight": "00ff"}
    answer["ranks"][1]["checksums"] = {"model.norm.weight": "0f0f"}
    assert protocol.parse_weights_checksum(answer, where="s").tensors == {
        "model.norm.weight@rank0": "00ff", "model.norm.weight@rank1": "0f0f"}  # each rank holds its own shard
    one_rank = sglang_answer(X)
    one_rank["ranks"][0]["checksums"] = {"model.norm.weight": "00ff"}
    assert protocol.parse_weights_checksum(one_rank, where="s").tensors == {"model.norm.weight": "00ff"}


class Keys:
    """The store keys a loader writes, in a dict."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def set(self, key: str, value: bytes) -> None:
        self.values[key] = value


class CheckingServer:
    """What the loader's report calls on its engine."""

    def __init__(self, answer: protocol.WeightsChecksum | Exception | None) -> None:
        self.answer = answer
        self.restarts = 0

    async def weight_checksum(self, *, timeout: float | None = None) -> protocol.WeightsChecksum | None:
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


@pytest.mark.unit
@pytest.mark.parametrize(("answer", "expected"), [
    (protocol.WeightsChecksum(X, (Y,)), ServedChecksum(X)),
    (None, ServedChecksum(None, "its server has no /weights_checker")),
    (SglangError("http://s/weights_checker: HTTP 400: Unsupported", 400),
     ServedChecksum(None, "checksum failed: http://s/weights_checker: HTTP 400: Unsupported")),
], ids=["checksum", "no-endpoint", "refused"])
async def test_the_loader_reports_its_servers_checksum_or_why_none_and_never_fails_for_it(
        answer: Any, expected: ServedChecksum) -> None:
    loader = SglangWeightLoader(CheckingServer(answer), "rollout-0-0")  # type: ignore[arg-type]
    keys = Keys()
    await loader._report_checksum(keys, 1, 5.0)  # type: ignore[arg-type]
    assert ServedChecksum.decode(keys.values["checksum/rollout-0-0"]) == expected


@pytest.fixture
async def server_without_checker() -> AsyncIterator[str]:
    """An HTTP server with no `/weights_checker` route: what a server without the endpoint answers (404)."""
    runner = web.AppRunner(web.Application())
    await runner.setup()
    port = free_port("127.0.0.1")
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


@pytest.mark.integration
async def test_a_server_without_the_route_cannot_be_checked_which_is_no_error(server_without_checker: str) -> None:
    client = SglangEngine(server_without_checker)
    try:
        assert await client.weight_checksum() is None
    finally:
        await client.close()


# ------------------------------------------------------------------------------------------- real servers

ENGINES = ("rollout-0-0", "rollout-0-1")


def start_server(model: Path, logs: Path, **extra: str) -> ServerProcess:
    spec = ServerSpec(model_path=str(model), module="tools.standins.sglang_server",
                      extra={"torch-threads": "1", "weight-group-timeout": "30", **extra})
    process = ServerProcess(spec, startup_timeout=180, log_dir=logs)
    process.start()
    return process


@pytest.fixture(scope="module")
def servers(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ServerProcess]]:
    """A server, and one that acknowledges every weight update after its first without loading it."""
    logs = tmp_path_factory.mktemp("sglang-logs")
    started = [start_server(tiny_model_path, logs)]
    try:
        started.append(start_server(tiny_model_path, logs, **{"drop-weight-updates-after": "1"}))
        yield started
    finally:
        for process in started:
            process.stop()


def perturbed_model(path: Path, seed: int) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return model


def pushed(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(name, tensor.detach().clone()) for name, tensor in model.state_dict().items()]


def checksum_as_sglang_computes_it(model: torch.nn.Module) -> str:
    """SGLang's `/weights_checker` checksum of `model` on a CPU, one rank, written out from its source
    (`weight_checker.py: _compute_checksum`, `mm_utils.py: tensor_hash`, `tokenizer_control_mixin.py`)."""
    state = dict(model.named_parameters())
    state.update(model.named_buffers())
    tensor_checksums = {}
    for name, tensor in state.items():
        if "inv_freq" in name or "cos_sin_cache" in name:  # non-persistent buffers SGLang recomputes
            continue
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        tensor_checksums[name] = f"{int.from_bytes(hashlib.sha256(raw).digest()[:8], 'big'):016x}"
    per_gpu = hashlib.sha256()
    for name in sorted(tensor_checksums):
        per_gpu.update(name.encode() + tensor_checksums[name].encode())
    return hashlib.sha256(per_gpu.hexdigest().encode()).hexdigest()


async def push(sender: SglangStoreSender, loaders: list[SglangWeightLoader], named: list, version: int, *,
               fresh: bool, fingerprint: bool = True) -> TransferReport | WeightsDiffer:
    """One version to every loader's server; the report, or the WeightsDiffer the send raised. The loaders must
    all have loaded it."""
    spec = sender.open_group(["learner", *(loader.engine_name for loader in loaders)]) if fresh else sender.spec
    assert spec is not None
    receiving = [asyncio.create_task(loader.apply(spec.to_dict(), version, 30.0)) for loader in loaders]
    try:
        if fresh:
            await asyncio.to_thread(sender.wait_for_receivers)
        try:
            outcome: TransferReport | WeightsDiffer = await asyncio.to_thread(
                sender.send, named, version, fingerprint=fingerprint)
        except WeightsDiffer as differ:
            outcome = differ
    finally:
        await asyncio.gather(*receiving, return_exceptions=True)
    for task in receiving:
        if task.exception() is not None:
            raise task.exception()  # type: ignore[misc]
    return outcome


@pytest.mark.integration
async def test_the_compatible_servers_checksum_is_sglangs_over_the_weights_it_serves(
        servers: list[ServerProcess], tiny_model_path: Path) -> None:
    client = SglangEngine(servers[0].url)
    sender = SglangWeightSender(host="127.0.0.1", backend="gloo", timeout_s=30)
    loader = SglangWeightLoader(client, ENGINES[0])
    try:
        seen = []
        for version, seed in ((1, 11), (2, 12)):
            model = perturbed_model(tiny_model_path, seed)
            await push(sender, [loader], pushed(model), version, fresh=version == 1, fingerprint=False)
            answer = await client.weight_checksum()
            assert answer is not None and answer.engine == checksum_as_sglang_computes_it(model)
            seen.append(answer.engine)
        assert seen[0] != seen[1]
        with pytest.raises(SglangError, match=r"HTTP 400.*Unsupported action='snapshot'") as refused:
            await client._call(protocol.WEIGHTS_CHECKER, action="snapshot")  # SGLang's others: not served here
        assert refused.value.status == 400
    finally:
        sender.close()
        await client.close()


@pytest.mark.integration
async def test_a_checked_push_is_matched_and_a_server_that_dropped_the_next_update_fails_it_by_name(
        servers: list[ServerProcess], tiny_model_path: Path) -> None:
    clients = [SglangEngine(process.url) for process in servers]
    loaders = [SglangWeightLoader(client, name) for client, name in zip(clients, ENGINES, strict=True)]
    sender = SglangWeightSender(host="127.0.0.1", backend="gloo", timeout_s=30)
    try:
        first = await push(sender, loaders, pushed(perturbed_model(tiny_model_path, 21)), 1, fresh=True)
        assert isinstance(first, TransferReport) and first.fingerprints == FingerprintCheck("xxh3", matched=ENGINES)
        assert sender.committed_version == 1

        # The second server acknowledges version 2 and claims it, but serves version 1's weights.
        second = await push(sender, loaders, pushed(perturbed_model(tiny_model_path, 22)), 2, fresh=False)
        assert isinstance(second, WeightsDiffer) and sender.committed_version == 1
        assert second.check.matched == (ENGINES[0],) and list(second.check.differ) == [ENGINES[1]]
        assert second.failed[ENGINES[1]].startswith("serves the same weights as after version 1: its SGLang checksum "
                                                    "did not change although")
        assert await clients[1].server_weight_version() == 2  # what the server claims, and why it needs checking
    finally:
        sender.close()
        for client in clients:
            await client.close()


@pytest.mark.integration
async def test_pushes_by_reference_to_one_colocated_server_are_checked_against_its_previous_version(
        servers: list[ServerProcess], tiny_model_path: Path) -> None:
    """The colocated mechanism (`tensor_weights.py`) checks the same way: one engine has nothing to compare with on
    the sender's first push, and from then on its checksum must move with the pushed tensors."""
    client = SglangEngine(servers[0].url)
    sender = SglangTensorSender(host="127.0.0.1", bucket_bytes=64 * 1024, timeout_s=30)
    loader = SglangTensorLoader(client, ENGINES[0])
    second = pushed(perturbed_model(tiny_model_path, 32))
    try:
        first = await push(sender, [loader], pushed(perturbed_model(tiny_model_path, 31)), 1, fresh=True)
        assert isinstance(first, TransferReport) and first.fingerprints is not None and first.fingerprints.ok
        assert "first push, one engine" in first.fingerprints.unchecked[ENGINES[0]]
        for version in (2, 3):  # new tensors, then the same ones again
            report = await push(sender, [loader], second, version, fresh=False)
            assert isinstance(report, TransferReport)
            assert report.fingerprints == FingerprintCheck("xxh3", matched=(ENGINES[0],))
        assert sender.committed_version == 3
    finally:
        sender.close()
        await client.close()
