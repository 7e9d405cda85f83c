import asyncio
import math
import threading

import pytest

from policies.rewards import RewardInput, build_reward, runs_inline, score, score_group
from policies.rewards.selection import boxed_only
from policies.rewards.types import RewardOutcome


def _inputs(*responses: str) -> list[RewardInput]:
    return [RewardInput(prompt="p", response=r, label="x") for r in responses]


def length_reward(inp: RewardInput) -> float:
    if inp.response == "boom":
        raise RuntimeError("judge crashed")
    if inp.response == "nan":
        return math.nan
    if inp.response == "inf":
        return math.inf
    if inp.response == "text":
        return "high"  # type: ignore[return-value]
    return float(len(inp.response))


@pytest.mark.unit
async def test_raising_and_non_finite_rewards_become_error_outcomes_with_reasons() -> None:
    outcomes = await score(length_reward, _inputs("ok", "boom", "nan", "inf", "text"))
    assert outcomes[0] == RewardOutcome.ok(2.0)
    assert [o.status for o in outcomes[1:]] == ["error"] * 4
    assert outcomes[1].reason == "raised RuntimeError: judge crashed"
    assert "non-finite reward nan" in outcomes[2].reason and "non-finite reward inf" in outcomes[3].reason
    assert "returned str" in outcomes[4].reason
    assert all(o.reward is None for o in outcomes[1:])


@pytest.mark.unit
async def test_async_reward_functions_run_concurrently() -> None:
    """Each call waits until all ten have started: run one after another, the first would wait alone until its
    deadline and fail (no guess at how fast the machine is)."""
    started = 0
    everyone_in = asyncio.Event()

    async def waits_for_the_others(inp: RewardInput) -> float:
        nonlocal started
        started += 1
        if started == 10:
            everyone_in.set()
        await asyncio.wait_for(everyone_in.wait(), timeout=30)
        return 1.0

    outcomes = await score(waits_for_the_others, _inputs(*["a"] * 10))
    assert [o.reward for o in outcomes] == [1.0] * 10


@pytest.mark.unit
async def test_slow_reward_times_out_into_an_error_outcome() -> None:
    async def hangs(inp: RewardInput) -> float:
        await asyncio.sleep(30)
        return 1.0

    (outcome,) = await score(hangs, _inputs("a"), timeout_s=0.1)
    assert outcome.status == "error" and outcome.reason == "timed out after 0.1s"


@pytest.mark.unit
async def test_sync_reward_runs_off_the_event_loop() -> None:
    """The sync function blocks until a coroutine on the event loop releases it: on the loop's own thread it would
    block that coroutine too, and return 0 at its deadline."""
    released = threading.Event()

    def blocking(inp: RewardInput) -> float:
        return 1.0 if released.wait(timeout=30) else 0.0

    async def release() -> None:
        released.set()

    task = asyncio.create_task(release())
    (outcome,) = await score(blocking, _inputs("a"))
    await task
    assert outcome.reward == 1.0


@pytest.mark.unit
async def test_a_reward_marked_inline_runs_on_the_loop_and_its_failures_are_still_outcomes() -> None:
    threads: set[int] = set()

    @runs_inline
    def checked(inp: RewardInput) -> float:
        threads.add(threading.get_ident())
        return length_reward(inp)

    outcomes = await score(checked, _inputs("ok", "boom", "nan", "text"), timeout_s=5)
    assert threads == {threading.get_ident()}  # no thread hop, no timer
    assert outcomes[0] == RewardOutcome.ok(2.0)
    assert outcomes[1].reason == "raised RuntimeError: judge crashed" and "length_reward" in outcomes[1].trace
    assert "non-finite reward nan" in outcomes[2].reason and "returned str" in outcomes[3].reason
    # the built-in text rewards only read the text, so they are marked; an unmarked sync function keeps its thread
    assert all(getattr(build_reward(name).fn, "slipstream_runs_inline", False)
               for name in ("exact_match", "f1", "multiple_choice"))
    threads.clear()
    await score(lambda inp: threads.add(threading.get_ident()) or 1.0, _inputs("a"))
    assert threading.get_ident() not in threads


@pytest.mark.unit
async def test_dict_result_keeps_extra_fields() -> None:
    (outcome,) = await score(lambda inp: {"reward": True, "format_ok": False}, _inputs("a"))
    assert outcome == RewardOutcome.ok(1.0, {"format_ok": False})
    (missing,) = await score(lambda inp: {"score": 1.0}, _inputs("a"))
    assert missing.status == "error" and "without 'reward'" in missing.reason


@pytest.mark.unit
async def test_graded_steps_are_kept_apart_from_the_extras_and_checked() -> None:
    graded = {"reward": 0.5, "correct": False, "step_rewards": [[4, 1], (9, True), [9, 0.0]]}
    (outcome,) = await score(lambda inp: graded, _inputs("a"))
    assert outcome == RewardOutcome.ok(0.5, {"correct": False}, ((4, 1.0), (9, 1.0), (9, 0.0)))
    bad = [("3 steps", "expected a list of [end, reward] pairs"), ([[4, 1, 2]], "step 0 is [4, 1, 2], expected [end"),
           ([[0, 1]], "step 0 ends at 0, expected a character offset >= 1"), ([[2.5, 1]], "ends at 2.5"),
           ([[3, math.nan]], "step 0 has reward nan"), ([[5, 1], [3, 0]], "step 1 ends at 3, before step 0 (5)")]
    for steps, reason in bad:
        (refused,) = await score(lambda inp, steps=steps: {"reward": 1.0, "step_rewards": steps}, _inputs("a"))
        assert refused.status == "error" and reason in refused.reason, (steps, refused.reason)


@pytest.mark.unit
async def test_group_reward_scores_the_whole_group_in_one_call() -> None:
    calls = []

    def rank_by_length(group: list[RewardInput]) -> list[float]:
        calls.append(len(group))
        longest = max(len(i.response) for i in group)
        return [float(len(i.response) == longest) for i in group]

    outcomes = await score_group(rank_by_length, _inputs("a", "abc", "ab"))
    assert calls == [3] and [o.reward for o in outcomes] == [0.0, 1.0, 0.0]


@pytest.mark.unit
async def test_group_reward_failures_mark_every_sample_but_a_nan_only_its_own() -> None:
    wrong_length = await score_group(lambda group: [1.0], _inputs("a", "b"))
    assert [o.reason for o in wrong_length] == ["group reward returned 1 rewards for 2 samples"] * 2
    one_nan = await score_group(lambda group: [1.0, math.nan], _inputs("a", "b"))
    assert [o.status for o in one_nan] == ["ok", "error"]

    def broken(group: list[RewardInput]) -> list[float]:
        raise ValueError("judge offline")

    assert {o.reason for o in await score_group(broken, _inputs("a", "b"))} == {"raised ValueError: judge offline"}


@pytest.mark.unit
def test_build_reward_prefers_custom_path_and_requires_a_url_for_remote() -> None:
    spec = build_reward("math", custom_rm_path="test_policy_reward_runner:length_reward")
    assert spec.fn is length_reward and not spec.is_group
    assert build_reward("exact_match").name == "exact_match"
    with pytest.raises(ValueError, match="needs rm_url"):
        build_reward("remote_rm")
    with pytest.raises(ValueError, match="unknown reward function 'maths'"):
        build_reward("maths")


@pytest.mark.unit
async def test_a_boxed_rm_type_scores_the_last_boxed_answer_with_the_type_it_prefixes() -> None:
    """slime's `boxed_<type>`: `<type>` reads only what the last box holds (nothing without one), sync or async and
    inline as `<type>` is; DAPO's verdict is read by slime's `--reward-key score` as by our default key."""
    spec = build_reward("boxed_exact_match")
    assert spec.name == "boxed_exact_match" and getattr(spec.fn, "slipstream_runs_inline", False)
    boxed = [RewardInput(prompt="p", response=response, label="Paris")
             for response in ("it is \\boxed{paris}", "it is paris", "\\boxed{Rome} or \\boxed{Paris}")]
    assert [o.reward for o in await score(spec.fn, boxed)] == [1.0, 0.0, 1.0]
    assert [o.reward for o in await score(build_reward("exact_match").fn, boxed)] == [1.0, 0.0, 1.0]
    assert [o.reward for o in await score(build_reward("f1").fn, boxed[1:2])] == [0.5]  # "it", "paris"
    assert [o.reward for o in await score(build_reward("boxed_f1").fn, boxed[1:2])] == [0.0]

    async def seen(inp: RewardInput) -> float:
        return float(len(inp.response))

    assert [o.reward for o in await score(boxed_only(seen), _inputs("a \\boxed{xyz}", "none"))] == [3.0, 0.0]
    dapo = [RewardInput(prompt="p", response="\\boxed{Answer: 42}", label="42")]
    (by_box,) = await score(build_reward("boxed_dapo").fn, dapo, key="score")
    assert by_box == RewardOutcome.ok(1.0, {"reward": 1.0, "acc": True, "pred": "42"})
    (unboxed,) = await score(build_reward("dapo").fn, [RewardInput(prompt="p", response="42", label="42")])
    assert unboxed == RewardOutcome.ok(-1.0, {"score": -1.0, "acc": False, "pred": "[INVALID]"})
    with pytest.raises(ValueError, match="unknown reward function 'maths'"):
        build_reward("boxed_maths")
