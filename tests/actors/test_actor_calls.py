"""Calling a custom actor's `@method`s by name, as a plugin reaches a judge: real actors on real sockets in one
process. A call goes to a live member of the role, spread over all of them; waits for one to join within its
deadline; survives the member it went to leaving; and fails with an ActorCallError naming the member and what went
wrong otherwise."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from actors.plugins import Actor, ActorCallError, call_actor, method
from tests.support.inprocess import actor_system


class Doubler(Actor):
    async def on_start(self) -> None:
        self.release = asyncio.Event()  # what `held_double` waits for
        self.holding = 0  # calls of `held_double` waiting for it

    @method
    async def double(self, value: int) -> dict:
        return {"value": 2 * value, "by": self.actor_id}

    @method
    async def held_double(self, value: int) -> dict:
        self.holding += 1
        await self.release.wait()
        return {"value": 2 * value, "by": self.actor_id}

    @method
    async def refuse(self) -> None:
        raise ValueError("not today")


class Relay(Actor):
    """Code running in an actor, as a reward function runs in its reward worker: it reaches the doublers through
    `call_actor`, knowing nothing but their role."""

    @method
    async def quadruple(self, value: int) -> int:
        twice = await call_actor("doubler", "double", timeout=5, value=value)
        return (await call_actor("doubler", "double", timeout=5, value=twice["value"]))["value"]


class Caller(Actor):
    """An actor with no handlers of its own, whose links the test uses."""


def _settings() -> dict[str, object]:
    return {"use_tensorboard": False, "plots": False}


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_a_method_is_called_by_name_and_calls_take_turns_over_every_member(tmp_path: Path) -> None:
    roles = {"controller": "controller", "doubler": Doubler, "caller": Caller}
    async with actor_system(tmp_path, _settings(), roles) as system:
        await system.start("doubler", Doubler, "doubler-0-1")
        doublers = system["caller-0-0"].calls("doubler")
        await system.wait_for(lambda: doublers.peers == ["doubler-0-0", "doubler-0-1"], 10, "both doublers")
        one_by_one = [await doublers.call("double", {"value": index}, timeout=5) for index in range(4)]
        together = await asyncio.gather(*(doublers.call("double", {"value": index}, timeout=5) for index in range(6)))
    assert [reply["value"] for reply in one_by_one] == [0, 2, 4, 6]
    assert sorted(reply["by"] for reply in one_by_one) == ["doubler-0-0"] * 2 + ["doubler-0-1"] * 2
    assert sorted(reply["by"] for reply in together) == ["doubler-0-0"] * 3 + ["doubler-0-1"] * 3


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_a_method_that_raises_or_does_not_exist_fails_the_call_naming_the_member(tmp_path: Path) -> None:
    roles = {"controller": "controller", "doubler": Doubler, "caller": Caller}
    async with actor_system(tmp_path, _settings(), roles) as system:
        doublers = system["caller-0-0"].calls("doubler")
        with pytest.raises(ActorCallError, match=r"^doubler-0-0: refuse failed: ValueError: not today$"):
            await doublers.call("refuse", {}, timeout=5)
        with pytest.raises(ActorCallError, match=r"^doubler-0-0: tripple failed: doubler-0-0 has no method "
                                                 r"'tripple' \(its methods: double, held_double, refuse\)$"):
            await doublers.call("tripple", {"value": 1}, timeout=5)
        with pytest.raises(ActorCallError, match=r"double failed: TypeError: .*unexpected keyword argument 'x'"):
            await doublers.call("double", {"x": 1}, timeout=5)
        assert await doublers.call("double", {"value": 1}, timeout=5) == {"value": 2, "by": "doubler-0-0"}


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_a_call_waits_for_a_member_to_join_within_its_deadline_and_names_the_role_past_it(
        tmp_path: Path) -> None:
    async with actor_system(tmp_path, _settings(), {"controller": "controller", "caller": Caller}) as system:
        doublers = system["caller-0-0"].calls("doubler")
        with pytest.raises(ActorCallError, match=r"^no live 'doubler' actor to call double within 0.3 s \(is one "
                                                 r"started, with --custom-actor doubler=MODULE:CLASS"):
            await doublers.call("double", {"value": 1}, timeout=0.3)
        waiting = asyncio.create_task(doublers.call("double", {"value": 5}, timeout=20))
        await system.start("doubler", Doubler, "doubler-0-0")  # as a judge that is (re)starting
        assert await waiting == {"value": 10, "by": "doubler-0-0"}


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_a_call_whose_member_leaves_before_answering_goes_to_another(tmp_path: Path) -> None:
    roles = {"controller": "controller", "doubler": Doubler, "caller": Caller}
    async with actor_system(tmp_path, _settings(), roles) as system:
        doublers = system["caller-0-0"].calls("doubler")
        await system.wait_for(lambda: doublers.peers == ["doubler-0-0"], 10, "the first doubler")
        held = asyncio.create_task(doublers.call("held_double", {"value": 3}, timeout=20))
        await system.wait_for(lambda: system["doubler-0-0"].holding == 1, 10, "the call to reach doubler-0-0")
        second = await system.start("doubler", Doubler, "doubler-0-1")
        second.release.set()
        system["doubler-0-0"].request_stop("test: a judge going away")
        assert await held == {"value": 6, "by": "doubler-0-1"}


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_call_actor_reaches_a_role_from_code_running_in_an_actor_and_refuses_code_outside_one(
        tmp_path: Path) -> None:
    roles = {"controller": "controller", "doubler": Doubler, "relay": Relay, "caller": Caller}
    async with actor_system(tmp_path, _settings(), roles) as system:
        assert await system["caller-0-0"].calls("relay").call("quadruple", {"value": 3}, timeout=10) == 12
        with pytest.raises(ActorCallError, match="call_actor works in the actors a launcher starts"):
            await call_actor("doubler", "double", timeout=1, value=1)  # the test's own task: in no actor
