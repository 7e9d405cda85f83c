"""`tools/hostile/judge.py`: frames a full peer table folded into "(other)" are still every frame accounted for,
and a frame truly uncounted still fails the attack that sent it."""

from __future__ import annotations

import pytest

from tools.hostile.judge import Counters, judge
from tools.hostile.plan import Attack
from tools.hostile.run import Endpoint

INBOX = Endpoint("buffer", "inbox", "tcp://127.0.0.1:1")


def _judged(no_hello_row: float, other_over_credit: float) -> tuple[Attack, Attack]:
    """A no-hello attack and a random-identity flood on one inbox, 250 frames each; the no-hello row counted
    `no_hello_row` over-credit drops, "(other)" `other_over_credit` more, and 128 frames went through first."""
    after = {
        "buffer/dropped_by.inbox.hostile-nohello.over_credit": no_hello_row,
        "buffer/dropped.unhandled.Heartbeat": 128.0,
        "buffer/dropped_by.inbox.(other).bad_msgpack": 31.0,
        "buffer/dropped_by.inbox.(other).over_credit": other_over_credit,
        "buffer/dropped_by.inbox.zz-random.bad_schema": 219.0,
    }
    no_hello = Attack(INBOX, "no_hello", label="hostile-nohello", sent=250)
    flood = Attack(INBOX, "idents", label="(random ids)", sent=250)
    judge([no_hello, flood], Counters({}, after), actor_ids=["buffer", "learner"])
    return no_hello, flood


@pytest.mark.unit
def test_every_frame_counted_under_its_own_row_passes_without_a_note() -> None:
    no_hello, flood = _judged(no_hello_row=122, other_over_credit=0)
    assert no_hello.ok and flood.ok
    assert "(other)" not in no_hello.counted and "folded" not in flood.counted


@pytest.mark.unit
def test_a_row_folded_into_other_is_settled_against_the_floods_surplus() -> None:
    """The failure CI saw: one no-hello drop counted before its row was folded, read by the flood's count."""
    no_hello, flood = _judged(no_hello_row=121, other_over_credit=1)
    assert no_hello.ok and flood.ok
    assert "1 more in (other)" in no_hello.counted
    assert "1 of them other attacks'" in flood.counted


@pytest.mark.unit
def test_a_frame_nobody_counted_still_fails() -> None:
    no_hello, flood = _judged(no_hello_row=120, other_over_credit=1)  # 2 short, 1 surplus: one frame lost
    assert not no_hello.ok and not flood.ok
