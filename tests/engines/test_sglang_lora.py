"""A LoRA run's adapter into an SGLang(-compatible) server: broadcast to the rollout worker over gloo, written as
a PEFT folder, loaded by the server by name, and named by every request after it; in a run of several policies,
each policy's adapter, named by the requests of that policy.

Real processes: the compatible server runs in its own process with SGLang's LoRA flags; the learner-side sender
and the worker-side loader are the built-in `sglang_lora` transport. Expected outputs come from a torch engine
that merged the same adapter: the scale is 2 (alpha 8, rank 4), a power of two, so the server's merge (B scaled
first) and the reference's (the product scaled) give the same floats and greedy tokens match exactly.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import structlog
import structlog.testing
import torch
from torch import Tensor
from transformers import AutoModelForCausalLM

from actors.rollout.lanes import adapter_room, retire_adapter
from engines.inference.base import GenerateRequest, SamplingParams
from engines.inference.torch_engine import TorchEngine
from engines.sglang import protocol
from engines.sglang.adapter_endpoints import AdapterServing
from engines.sglang.adapter_sync import SglangAdapterLoader, write_adapter_folder
from engines.sglang.client import SglangEngine
from engines.sglang.launch import ServerProcess, ServerSpec
from engines.training.lora import LoraSettings, adapter_tensors, wrap
from engines.weights.base import WeightTransferError
from engines.weights.transport import SGLANG_LORA, SenderOptions, resolve_transport
from tests.support.waiting import until
from tools.standins.sglang_server.adapters import AdapterError, AdapterRoutes
from tools.standins.sglang_server.args import parse_args

pytestmark = pytest.mark.integration
RANK, ALPHA = 4, 8.0
PROMPT = [7, 21, 33, 4, 18]
GREEDY = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
ENGINE = "rollout-0-0"
TARGETS = ("q_proj", "v_proj", "down_proj")


def lora_server(model: Path, logs: Path, **flags: str | list[str]) -> ServerProcess:
    extra: dict[str, str | list[str]] = {"torch-threads": "1", "weight-group-timeout": "20", **flags}
    return ServerProcess(ServerSpec(model_path=str(model), module="tools.standins.sglang_server", extra=extra),
                         startup_timeout=120, log_dir=logs)


@pytest.fixture(scope="module")
def server(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = lora_server(tiny_model_path, tmp_path_factory.mktemp("sglang-logs"), **{
        "enable-lora": "true", "max-lora-rank": str(RANK), "lora-target-modules": list(TARGETS)})
    process.start()
    yield process
    process.stop()


def random_adapter(model_path: Path, seed: int, rank: int = RANK) -> list[tuple[str, Tensor]]:
    """The wire tensors of a trained-looking adapter on TARGETS (B non-zero, so it changes the outputs)."""
    model = wrap(AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32),
                 LoraSettings(rank=rank, alpha=ALPHA, target_modules=TARGETS))
    generator = torch.Generator().manual_seed(seed)
    return [(name, torch.randn(tensor.shape, generator=generator) * 0.3) for name, tensor in adapter_tensors(model)]


async def reference_greedy(model_path: Path, adapter: list[tuple[str, Tensor]] | None, tokens: int) -> list[int]:
    engine = TorchEngine.from_pretrained(model_path, lora_scaling=ALPHA / RANK)
    try:
        if adapter is not None:
            await engine.update_weights(adapter, 1)
        params = SamplingParams(temperature=0, max_new_tokens=tokens, ignore_eos=True)
        (output,) = await engine.generate(GenerateRequest("reference", PROMPT, params))
        return list(output.output_ids)
    finally:
        await engine.close()


async def raw_generate(url: str, adapter: str) -> tuple[int, str]:
    """A `/generate` naming `adapter`, sent past the client (which only names the adapter it loaded last)."""
    body = protocol.generate_json(GenerateRequest("raw", PROMPT, GREEDY), adapter=adapter)
    async with aiohttp.ClientSession() as session, session.post(f"{url}/generate", json=body) as reply:
        return reply.status, await reply.text()


class Learner:
    """The learner's end of the `sglang_lora` transport, and the worker's loader beside it, in this process; with
    `policy`, that policy's learner, whose pushes name its adapter (a run of several policies)."""

    def __init__(self, client: SglangEngine, policy: str | None = None) -> None:
        transport = resolve_transport(SGLANG_LORA)
        self.policy = policy
        self.sender = transport.make_sender(SenderOptions(host="127.0.0.1", backend="nccl", timeout_s=20.0))
        self.loader = transport.make_loader(client, ENGINE, structlog.get_logger())
        assert isinstance(self.loader, SglangAdapterLoader)
        name = "learner" if policy is None else f"learner@{policy}"
        self.group = self.sender.open_group([name, ENGINE]).to_dict()
        self.joined = False

    async def push(self, named: list[tuple[str, Tensor]], version: int) -> None:
        named_adapter = {} if self.policy is None else {"adapter": self.policy}
        receiving = asyncio.create_task(self.loader.apply(self.group, version, 20.0, **named_adapter))
        try:
            if not self.joined:
                await asyncio.to_thread(self.sender.wait_for_receivers)
                self.joined = True
            await asyncio.to_thread(self.sender.send, named, version)
        finally:
            await asyncio.gather(receiving, return_exceptions=True)
        if receiving.exception() is not None:
            raise receiving.exception()

    async def retired(self) -> None:
        """Until the loader's background unloads of old adapters are done."""
        await asyncio.wait_for(asyncio.gather(*self.loader._unloads), 30)

    def close(self) -> None:
        self.loader.close()
        self.sender.close()


async def release(client: SglangEngine, *learners: Learner) -> None:
    """Close a test's learners and client and leave the module's server holding none of their adapters: the
    server holds at most `--max-loras-per-batch` adapters, and every test on it loads some."""
    for learner in learners:
        await asyncio.gather(learner.retired(), return_exceptions=True)
        learner.close()
    names = {client.adapter_name(policy) for policy in (None, *POLICIES)} - {None}
    async with aiohttp.ClientSession() as session:
        for name in names:
            async with session.post(f"{client.url}/unload_lora_adapter", json={"lora_name": name}) as reply:
                assert reply.status == 200, await reply.text()
    await client.close()


def test_the_folder_a_worker_writes_loads_in_peft_as_the_learners_adapter(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    """SGLang reads PEFT's folder format; PEFT itself loading ours, to the same outputs, is the check we can run."""
    from peft import PeftModel

    settings = LoraSettings(rank=RANK, alpha=ALPHA, target_modules=TARGETS)
    trained = wrap(AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32), settings)
    with torch.no_grad():
        for _, tensor in adapter_tensors(trained):
            tensor.normal_(0, 0.3)
    folder = tmp_path / "adapter"
    write_adapter_folder(dict(adapter_tensors(trained)), ALPHA, folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (RANK, ALPHA, sorted(TARGETS))

    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32),
                                       str(folder))
    tokens = torch.tensor([PROMPT])
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=tokens).logits, trained(input_ids=tokens).logits)


def test_a_folder_of_tensors_that_are_no_adapter_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not LoRA adapter tensors"):
        write_adapter_folder({"model.layers.0.mlp.down_proj.weight": torch.zeros(2, 2),
                              "model.layers.0.mlp.down_proj.lora_A.weight": torch.zeros(1, 2)}, ALPHA, tmp_path / "x")
    assert not (tmp_path / "x").exists()


async def test_adapter_versions_reach_the_server_by_name_and_tag_the_tokens_they_produce(
    server: ServerProcess, tiny_model_path: Path
) -> None:
    client = SglangEngine(server.url, adapters=AdapterServing(ALPHA))
    learner = Learner(client)
    first, second = random_adapter(tiny_model_path, seed=1), random_adapter(tiny_model_path, seed=2)
    try:
        (base,) = await client.generate(GenerateRequest("base", PROMPT, GREEDY))
        assert base.output_ids == await reference_greedy(tiny_model_path, None, GREEDY.max_new_tokens)
        assert base.versions == [0] * GREEDY.max_new_tokens

        await learner.push(first, 1)
        first_name = client.adapter
        assert learner.sender.committed_version == 1 and first_name is not None and first_name.startswith(
            "slipstream-v1-"
        )
        (after,) = await client.generate(GenerateRequest("after", PROMPT, GREEDY))
        expected = await reference_greedy(tiny_model_path, first, GREEDY.max_new_tokens)
        assert after.output_ids == expected != base.output_ids
        assert after.versions == [1] * GREEDY.max_new_tokens

        await learner.push(second, 2)
        (later,) = await client.generate(GenerateRequest("later", PROMPT, GREEDY))
        assert later.output_ids == await reference_greedy(tiny_model_path, second, GREEDY.max_new_tokens)
        assert later.versions == [2] * GREEDY.max_new_tokens
        # The first version is retired: unloaded from the server, its folder gone; the second's stays.
        await learner.retired()
        status, text = await raw_generate(server.url, first_name)
        assert status == 400 and "not loaded" in text
        assert sorted(folder.name for folder in learner.loader.root.iterdir()) == [client.adapter]
        assert (learner.loader.root / client.adapter / "adapter_model.safetensors").exists()

        await learner.push(second, 2)  # the same version again (a retried push) loads under a name of its own
        assert client.adapter.startswith("slipstream-v2-") and learner.sender.committed_version == 2
    finally:
        await release(client, learner)


async def test_a_request_in_flight_keeps_its_adapter_while_the_next_one_loads(
    server: ServerProcess, tiny_model_path: Path
) -> None:
    """No pause, no abort: the long request runs to its end with version 1 while version 2 loads, then retires."""
    client = SglangEngine(server.url, adapters=AdapterServing(ALPHA))
    learner = Learner(client)
    first = random_adapter(tiny_model_path, seed=3)
    long = GenerateRequest("long", PROMPT, SamplingParams(temperature=0, max_new_tokens=480, ignore_eos=True))
    try:
        await learner.push(first, 1)
        version_1 = client.adapter
        running = asyncio.create_task(client.generate(long))
        await until(lambda: client._adapter_users[version_1] == 1, "the long request to name version 1's adapter")
        await learner.push(random_adapter(tiny_model_path, seed=4), 2)
        assert not running.done(), "the push waited for the request of the adapter it replaces"
        assert client.adapter is not None and client.adapter.startswith("slipstream-v2-")
        (output,) = await asyncio.wait_for(running, 60)
        await learner.retired()
    finally:
        await release(client, learner)
    assert output.finish_reason == "length" and client.resumed_requests == 0
    assert output.versions == [1] * 480
    assert output.output_ids == await reference_greedy(tiny_model_path, first, 480)


async def test_an_adapter_the_server_refuses_is_not_committed_and_requests_keep_the_last_one(
    server: ServerProcess, tiny_model_path: Path
) -> None:
    client = SglangEngine(server.url, adapters=AdapterServing(ALPHA))
    learner = Learner(client)
    try:
        await learner.push(random_adapter(tiny_model_path, seed=5), 1)
        loaded = client.adapter
        too_wide = random_adapter(tiny_model_path, seed=6, rank=2 * RANK)  # over the server's --max-lora-rank
        with pytest.raises(WeightTransferError, match=rf"{ENGINE}.*rank {2 * RANK} is incompatible"):
            await learner.push(too_wide, 2)
        assert learner.sender.committed_version == 1 and client.adapter == loaded
        assert sorted(folder.name for folder in learner.loader.root.iterdir()) == [loaded]  # the refused one's gone
        (output,) = await client.generate(GenerateRequest("still", PROMPT, GREEDY))
        assert output.versions == [1] * GREEDY.max_new_tokens
    finally:
        await release(client, learner)


async def test_a_server_without_lora_says_how_to_enable_it(tiny_model_path: Path, tmp_path: Path) -> None:
    process = lora_server(tiny_model_path, tmp_path)
    process.start()
    client = SglangEngine(process.url, adapters=AdapterServing(ALPHA))
    learner = Learner(client)
    try:
        with pytest.raises(WeightTransferError, match=r"LoRA is not enabled\. Please set `--enable-lora`"):
            await learner.push(random_adapter(tiny_model_path, seed=7), 1)
        assert learner.sender.committed_version is None and client.adapter is None
    finally:
        await release(client, learner)
        process.stop()


# ---- a run of several policies: one adapter per policy on one server

POLICIES = ("p", "q")


def policy_request(request_id: str, policy: str, tokens: int) -> GenerateRequest:
    return GenerateRequest(request_id, PROMPT, SamplingParams(temperature=0, max_new_tokens=tokens, ignore_eos=True),
                           adapter=policy)


async def until_running(url: str, count: int) -> None:
    """Until the server reports `count` requests running (SGLang's gauge), 30 s at most."""
    async with aiohttp.ClientSession() as session:
        for _ in range(3000):
            async with session.get(f"{url}/metrics") as reply:
                gauge = next(line for line in (await reply.text()).splitlines()
                             if line.startswith("sglang:num_running_reqs"))
            if float(gauge.rsplit(" ", 1)[1]) >= count:
                return
            await asyncio.sleep(0.01)
    raise AssertionError(f"{url} never ran {count} requests at once")


async def test_each_policys_requests_run_with_its_own_adapter_in_one_batch_tagged_with_its_version(
    server: ServerProcess, tiny_model_path: Path
) -> None:
    """P and Q decode side by side on one server, each token for token what its adapter alone decodes; a policy
    before its first push decodes the base model at its version 0."""
    client = SglangEngine(server.url, adapters=AdapterServing(ALPHA, policies=POLICIES))
    learners = {policy: Learner(client, policy) for policy in POLICIES}
    adapters = {"p": random_adapter(tiny_model_path, seed=11), "q": random_adapter(tiny_model_path, seed=12)}
    try:
        (fresh,) = await client.generate(policy_request("fresh", "q", 12))
        assert fresh.output_ids == await reference_greedy(tiny_model_path, None, 12)
        assert fresh.versions == [0] * 12 and client.adapter_version("q") == 0

        await learners["p"].push(adapters["p"], 1)
        await learners["q"].push(adapters["q"], 2)
        names = {policy: client.adapter_name(policy) for policy in POLICIES}
        assert names["p"].startswith("slipstream-p-v1-") and names["q"].startswith("slipstream-q-v2-")
        assert client.adapter is None and client.version == 0  # no adapter of a run of one; the base untouched

        long = asyncio.create_task(client.generate(policy_request("long-p", "p", 300)))
        await until_running(server.url, 1)
        short = asyncio.create_task(client.generate(policy_request("short-q", "q", 40)))
        await until_running(server.url, 2)  # both in the server's batch at once
        (of_p,), (of_q,) = await asyncio.wait_for(asyncio.gather(long, short), 60)
    finally:
        await release(client, *learners.values())
    assert of_p.output_ids == await reference_greedy(tiny_model_path, adapters["p"], 300)
    assert of_q.output_ids == await reference_greedy(tiny_model_path, adapters["q"], 40)
    assert (of_p.versions, of_q.versions) == ([1] * 300, [2] * 40)


async def test_a_load_of_one_policys_next_version_leaves_the_others_running_request_alone(
    server: ServerProcess, tiny_model_path: Path
) -> None:
    """Q's request runs across P's push of version 2 (it is still running when aborted after it) and decodes what
    Q's adapter alone decodes; P's requests switch to version 2, and P's version 1 is retired without waiting."""
    client = SglangEngine(server.url, adapters=AdapterServing(ALPHA, policies=POLICIES))
    learners = {policy: Learner(client, policy) for policy in POLICIES}
    of_q = random_adapter(tiny_model_path, seed=13)
    p_next = random_adapter(tiny_model_path, seed=15)
    try:
        await learners["p"].push(random_adapter(tiny_model_path, seed=14), 1)
        await learners["q"].push(of_q, 1)
        first_p, q_name = client.adapter_name("p"), client.adapter_name("q")
        running = asyncio.create_task(client.generate(policy_request("long-q", "q", 500)))
        await until_running(server.url, 1)
        await learners["p"].push(p_next, 2)
        await learners["p"].retired()  # P's version 1 unloaded while Q's request still runs
        (after,) = await client.generate(policy_request("after-p", "p", 12))
        assert not running.done(), "Q's request ended before P's load and request did: nothing was tested"
        await client.abort("long-q")
        (output,) = await asyncio.wait_for(running, 60)
        status, text = await raw_generate(server.url, first_p)
    finally:
        await release(client, *learners.values())
    assert client.adapter_name("q") == q_name and client.adapter_name("p").startswith("slipstream-p-v2-")
    assert after.output_ids == await reference_greedy(tiny_model_path, p_next, 12) and after.versions == [2] * 12
    assert status == 400 and "not loaded" in text
    assert output.finish_reason == "abort" and client.resumed_requests == 0 and output.output_ids
    assert output.output_ids == (await reference_greedy(tiny_model_path, of_q, 500))[: len(output.output_ids)]
    assert output.versions == [1] * len(output.output_ids)


async def test_a_request_naming_a_policy_the_engine_serves_no_adapter_for_is_refused_naming_it() -> None:
    policies = SglangEngine("http://127.0.0.1:9", adapters=AdapterServing(ALPHA, policies=POLICIES))
    plain = SglangEngine("http://127.0.0.1:9")
    try:
        with pytest.raises(ValueError, match=r"request 'r': adapter 'judge' is not one .* serves \(its policies: "
                                             r"\['p', 'q'\]\)"):
            await policies.generate(policy_request("r", "judge", 4))
        with pytest.raises(ValueError, match=r"adapter 'p': .* serves no adapters \(the run trains none: --lora-rank"):
            await plain.generate(policy_request("r", "p", 4))
    finally:
        await policies.close()
        await plain.close()


async def test_the_compatible_server_refuses_a_load_past_the_adapters_it_holds(tiny_model_path: Path,
                                                                             tmp_path: Path) -> None:
    engine = TorchEngine.from_pretrained(tiny_model_path, lora_scaling=1.0, max_adapters=1)
    args = parse_args(["--model-path", str(tiny_model_path), "--enable-lora", "--max-lora-rank", str(RANK),
                       "--lora-target-modules", *TARGETS, "--max-loras-per-batch", "1"])
    registry = AdapterRoutes.for_server(engine, args).registry
    assert registry is not None
    for seed in (1, 2):
        write_adapter_folder(dict(random_adapter(tiny_model_path, seed)), ALPHA, tmp_path / f"a{seed}")
    try:
        await registry.load("a1", str(tmp_path / "a1"))
        with pytest.raises(AdapterError, match=r"holds at most --max-loras-per-batch 1 adapters at once"):
            await registry.load("a2", str(tmp_path / "a2"))
        await registry.unload("a1")
        await registry.load("a2", str(tmp_path / "a2"))  # room again once the first is gone
        assert registry.loaded == {"a2": str(tmp_path / "a2")}
    finally:
        await engine.close()


def test_the_compatible_server_refuses_lora_with_deterministic_inference(tiny_model_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--model-path", str(tiny_model_path), "--enable-lora", "--max-lora-rank", str(RANK),
                    "--lora-target-modules", *TARGETS, "--enable-deterministic-inference"])
    assert "--enable-lora with --enable-deterministic-inference" in capsys.readouterr().err


# ---- a policy that joins the running job, leaves it, and joins again (docs/multi-policy.md)


async def listed_adapters(url: str) -> set[str]:
    """The adapters the server lists: `/v1/models` holds the base model's card, then one per loaded adapter."""
    async with aiohttp.ClientSession() as session, session.get(f"{url}/v1/models") as reply:
        cards = (await reply.json())["data"]
    return {card["id"] for card in cards if card.get("parent") is not None}


async def test_a_policy_served_at_run_time_runs_on_the_base_model_until_its_first_load(
    server: ServerProcess, tiny_model_path: Path
) -> None:
    """Q joins an engine built for P alone: its requests decode the base model at Q's version 0 until its learner's
    first push, then Q's adapter at the pushed version."""
    client = SglangEngine(server.url, adapters=AdapterServing(ALPHA, policies=("p",)))
    learner = Learner(client, "q")
    adapter = random_adapter(tiny_model_path, seed=21)
    try:
        with pytest.raises(ValueError, match=r"adapter 'q' is not one .* serves \(its policies: \['p'\]\)"):
            await client.generate(policy_request("early", "q", 4))
        client.serve_adapter("q")
        client.serve_adapter("q")  # heard again in the next roster: nothing changes
        assert client.adapters is not None and client.adapters.policies == ("p", "q")
        (fresh,) = await client.generate(policy_request("fresh", "q", 12))
        await learner.push(adapter, 3)
        (trained,) = await client.generate(policy_request("trained", "q", 12))
    finally:
        await release(client, learner)
    assert fresh.output_ids == await reference_greedy(tiny_model_path, None, 12) and fresh.versions == [0] * 12
    assert trained.output_ids == await reference_greedy(tiny_model_path, adapter, 12)
    assert trained.versions == [3] * 12


async def test_a_worker_says_its_servers_adapter_room_from_its_max_loras_per_batch(server: ServerProcess) -> None:
    """What the controller checks a join against (actors/controller/policy_table.py): the server's
    --max-loras-per-batch (8 here) holds 3 policies' adapters, each with the one it replaces mid-push, beside the base
    model."""
    client = SglangEngine(server.url, adapters=AdapterServing(ALPHA, policies=POLICIES))
    plain = SglangEngine(server.url)  # a run that trains no adapter: nothing to say
    try:
        assert await adapter_room(client) == {
            "adapter_room": 3, "adapter_room_why": f"SGLang server {server.url} (--max-loras-per-batch 8)"}
        assert await adapter_room(plain) == {}
    finally:
        await client.close()
        await plain.close()


async def test_a_policy_that_leaves_is_refused_at_once_and_unloaded_once_its_requests_are_done(
    server: ServerProcess, tiny_model_path: Path
) -> None:
    """Q leaves while a request of Q and one of P run: Q's next request is refused naming Q; Q's adapter stays on
    the server while Q's request runs (a wait that runs out says so and unloads nothing), and leaves it once that
    request is done; P's adapter stays and P's request decodes what P's adapter alone decodes."""
    client = SglangEngine(server.url, adapters=AdapterServing(ALPHA, policies=POLICIES))
    learners = {policy: Learner(client, policy) for policy in POLICIES}
    adapters = {"p": random_adapter(tiny_model_path, seed=22), "q": random_adapter(tiny_model_path, seed=23)}
    try:
        await learners["p"].push(adapters["p"], 1)
        await learners["q"].push(adapters["q"], 2)
        names = {policy: client.adapter_name(policy) for policy in POLICIES}
        assert set(names.values()) <= await listed_adapters(server.url)
        of_q = asyncio.create_task(client.generate(policy_request("long-q", "q", 500)))
        of_p = asyncio.create_task(client.generate(policy_request("long-p", "p", 300)))
        await until_running(server.url, 2)

        with pytest.raises(TimeoutError, match=rf"adapter {names['q']!r} still serves 1 requests after 0.2s"):
            await client.stop_serving("q", timeout=0.2)
        with pytest.raises(ValueError, match=r"request 'late-q': policy 'q' left the run: .* serves its adapter no "):
            await client.generate(policy_request("late-q", "q", 4))
        assert names["q"] in await listed_adapters(server.url)
        stopping = asyncio.create_task(client.stop_serving("q", timeout=60))
        assert not of_q.done(), "Q's request ended before the checks of its wait did: nothing was tested"
        await client.abort("long-q")
        await asyncio.wait_for(stopping, 60)
        listed = await listed_adapters(server.url)
        (output_q,), (output_p,) = await asyncio.wait_for(asyncio.gather(of_q, of_p), 60)
        (after,) = await client.generate(policy_request("after-p", "p", 12))
    finally:
        await release(client, *learners.values())
    assert names["q"] not in listed and names["p"] in listed
    assert client.adapter_name("q") is None and client.adapter_name("p") == names["p"]
    assert output_q.finish_reason == "abort" and output_q.versions == [2] * len(output_q.output_ids)
    assert output_q.output_ids == (await reference_greedy(tiny_model_path, adapters["q"], 500))[
        : len(output_q.output_ids)]
    p_alone = await reference_greedy(tiny_model_path, adapters["p"], 300)
    assert output_p.output_ids == p_alone and output_p.versions == [1] * 300
    assert after.output_ids == p_alone[:12] and after.versions == [1] * 12


async def test_a_policy_that_left_joins_again_on_the_base_model_and_loads_its_next_push(
    server: ServerProcess, tiny_model_path: Path
) -> None:
    client = SglangEngine(server.url, adapters=AdapterServing(ALPHA, policies=POLICIES))
    learner = Learner(client, "q")
    first, resumed = random_adapter(tiny_model_path, seed=24), random_adapter(tiny_model_path, seed=25)
    try:
        await learner.push(first, 2)
        await client.stop_serving("q", timeout=10)
        client.serve_adapter("q")
        (back,) = await client.generate(policy_request("back", "q", 12))
        await learner.push(resumed, 3)  # its learner resumed from its checkpoint pushes its next version
        (trained,) = await client.generate(policy_request("trained", "q", 12))
        listed = await listed_adapters(server.url)
    finally:
        await release(client, learner)
    assert back.output_ids == await reference_greedy(tiny_model_path, None, 12) and back.versions == [0] * 12
    assert trained.output_ids == await reference_greedy(tiny_model_path, resumed, 12) and trained.versions == [3] * 12
    assert client.adapter_name("q") in listed and not any(name.startswith("slipstream-q-v2-") for name in listed)


async def test_a_policy_back_before_its_adapter_left_is_served_that_adapter_again(
    server: ServerProcess, tiny_model_path: Path
) -> None:
    """The rollout worker cancels the retirement of a policy that joins again while its adapter waits for a request
    (actors/rollout/lanes.py): the adapter stays, and the policy's requests run with it at its version."""
    client = SglangEngine(server.url, adapters=AdapterServing(ALPHA, policies=POLICIES))
    learner = Learner(client, "q")
    adapter = random_adapter(tiny_model_path, seed=26)
    try:
        await learner.push(adapter, 4)
        name = client.adapter_name("q")
        running = asyncio.create_task(client.generate(policy_request("long-q", "q", 500)))
        await until_running(server.url, 1)
        retiring = asyncio.create_task(retire_adapter(client, "q", timeout=60, log=structlog.get_logger()))
        await until(lambda: "q" not in client.adapters.policies, "q's requests to be refused")
        retiring.cancel()
        client.serve_adapter("q")
        (back,) = await client.generate(policy_request("back", "q", 12))
        await client.abort("long-q")
        await asyncio.wait_for(running, 60)
        listed = await listed_adapters(server.url)
    finally:
        await release(client, learner)
    assert retiring.cancelled() and client.adapter_name("q") == name and name in listed
    assert back.output_ids == await reference_greedy(tiny_model_path, adapter, 12) and back.versions == [4] * 12


async def test_an_adapter_the_server_no_longer_has_leaves_the_worker_running_with_a_warning(
    server: ServerProcess, tiny_model_path: Path
) -> None:
    """The server lost the adapter of a policy that left (it restarted, an operator unloaded it): the retirement
    says so in the log and returns, as a wait that ran out does; the worker goes on."""
    client = SglangEngine(server.url, adapters=AdapterServing(ALPHA, policies=POLICIES))
    learner = Learner(client, "q")
    try:
        await learner.push(random_adapter(tiny_model_path, seed=27), 1)
        name = client.adapter_name("q")
        async with aiohttp.ClientSession() as session, session.post(f"{server.url}/unload_lora_adapter",
                                                                     json={"lora_name": name}) as reply:
            assert reply.status == 200, await reply.text()
        with structlog.testing.capture_logs() as logs:
            await retire_adapter(client, "q", timeout=10, log=structlog.get_logger())
    finally:
        await release(client, learner)
    (warning,) = [entry for entry in logs if entry["log_level"] == "warning"]
    assert warning["event"] == "adapter of a policy that left not unloaded" and warning["policy"] == "q"
    assert f"LoRA with name {name} does not exist" in warning["error"]
