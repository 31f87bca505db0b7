"""The refused-stream state machine (relay/refusals.py): one WARNING per change of state,
exponential waits with jitter, streams independent."""

from __future__ import annotations

import logging

import pytest

from outbox_relay.relay.refusals import StreamBackoff


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_one_warning_per_change_of_state(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    b = StreamBackoff(first_s=1.0, max_s=4.0, jitter=0.0, clock=clock)
    with caplog.at_level(logging.WARNING):
        b.outcome(("runs", 0), None)  # accepted while accepted: nothing to say
        assert warnings(caplog) == []
        for _ in range(5):
            b.outcome(("runs", 0), "redis_oom")
        assert len(warnings(caplog)) == 1 and "redis_oom" in warnings(caplog)[0]
        b.outcome(("runs", 0), "redis_acl")  # another reason: a new state
        assert len(warnings(caplog)) == 2 and "redis_acl" in warnings(caplog)[1]
        b.outcome(("runs", 0), None)
        assert len(warnings(caplog)) == 3 and "again" in warnings(caplog)[2]
    assert b.refused == {}


def test_waits_double_up_to_the_cap_and_streams_are_independent() -> None:
    clock = Clock()
    b = StreamBackoff(first_s=1.0, max_s=4.0, jitter=0.0, clock=clock)
    delays = []
    for _ in range(5):
        b.outcome(("runs", 1), "redis_oom")
        delays.append(b.refused[("runs", 1)].delay_s)
    assert delays == [1.0, 2.0, 4.0, 4.0, 4.0]
    assert b.waiting() == {1: frozenset({"runs"})}
    clock.now += 4.0
    assert b.waiting() == {}  # due: taken again
    b.outcome(("other", 1), "redis_acl")
    assert b.waiting() == {1: frozenset({"other"})}
    b.forget_partition(1)
    assert b.refused == {}


def test_jitter_spreads_the_wait() -> None:
    clock = Clock()
    waits = []
    for r in (0.0, 0.5, 1.0):
        b = StreamBackoff(first_s=10.0, max_s=60.0, jitter=0.2, clock=clock, rand=lambda r=r: r)
        b.outcome(("runs", 0), "redis_oom")
        waits.append(b.refused[("runs", 0)].next_at)
    assert waits == pytest.approx([8.0, 10.0, 12.0])
