"""Which partitions a relay round visits (relay/wakeup.py): the notified ones, or all."""

from __future__ import annotations

import pytest

from outbox_relay.relay import wakeup
from outbox_relay.relay.wakeup import Wakeup


def listening() -> Wakeup:
    w = Wakeup(5, 200)
    w.listening = True
    assert w.targets() is None  # the first round visits everything
    return w


def test_a_round_visits_the_partitions_notifications_named_since_the_last() -> None:
    w = listening()
    w.notify(2)
    w.notify(3)
    w.notify(2)
    assert w.targets() == {2, 3}
    assert w.targets() == set()  # nothing named since


def test_anything_but_a_partition_means_every_partition() -> None:
    w = listening()
    w.notify(1)
    w.notify(None)  # a payload that is not a partition, a reconnect, a stop
    assert w.targets() is None
    w.notify(1)
    w.visit_everything()  # a failed round
    assert w.targets() is None


def test_a_poll_timeout_visits_every_partition() -> None:
    w = Wakeup(1, 1)
    w.listening = True
    w.targets()
    w.wait()  # nothing notified: times out after max_s (1 ms)
    assert w.targets() is None


def test_without_a_listener_every_round_visits_every_partition() -> None:
    w = Wakeup(5, 200)
    w.notify(1)
    assert w.targets() is None


def test_partitions_never_named_are_visited_at_least_every_full_round_interval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = [1000.0]
    monkeypatch.setattr(wakeup.time, "monotonic", lambda: clock[0])
    w = Wakeup(5_000, 10_000)  # a poll interval longer than FULL_ROUND_S
    w.listening = True
    assert w.targets() is None
    w.notify(0)
    clock[0] += wakeup.FULL_ROUND_S / 2
    assert w.targets() == {0}
    w.notify(0)
    clock[0] += wakeup.FULL_ROUND_S / 2
    assert w.targets() is None  # rows elsewhere waiting for their retry time get their turn


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """``time.monotonic`` of relay/wakeup.py, moved by hand."""
    now = [1000.0]
    monkeypatch.setattr(wakeup.time, "monotonic", lambda: now[0])
    return now


def notified_wait(w: Wakeup, partition: int) -> None:
    """A wait a notification cuts short (returns at once: the event is already set)."""
    w.notify(partition)
    w.wait()


def test_notifications_do_not_hold_off_the_poll_of_the_other_partitions(
    clock: list[float],
) -> None:
    w = listening()  # a full round at 1000.000 s that found nothing
    notified_wait(w, 0)  # the interval doubles: 5 -> 10 ms
    assert w.interval == pytest.approx(0.010)
    clock[0] += 0.004
    assert w.targets() == {0}
    w.worked({0})  # rows a notification named do not shorten the poll interval
    notified_wait(w, 0)
    clock[0] += 0.0061  # 10 ms after the last full round
    assert w.targets() is None  # rows written without NOTIFY are taken within the interval


def test_the_poll_interval_doubles_on_empty_full_rounds_up_to_max(clock: list[float]) -> None:
    w = listening()
    seen = []
    for _ in range(8):
        notified_wait(w, 1)
        seen.append(round(w.interval * 1000))
        clock[0] += w.interval + 1e-6
        assert w.targets() is None  # the poll is due (the notified partition comes along)
    assert seen == [10, 20, 40, 80, 160, 200, 200, 200]  # at idle: one poll per poll_max_ms


def test_a_poll_that_found_rows_polls_again_after_poll_min(clock: list[float]) -> None:
    w = listening()
    for _ in range(5):  # back off to 160 ms
        notified_wait(w, 1)
        clock[0] += w.interval + 1e-6
        w.targets()
    assert w.interval == pytest.approx(0.160)
    clock[0] += w.interval + 1e-6
    assert w.targets() is None  # a poll no notification named ...
    w.worked({1})  # ... found rows: they come without notifications
    assert w.interval == pytest.approx(0.005)
    notified_wait(w, 2)
    clock[0] += 0.0051
    assert w.targets() is None


def test_a_wait_times_out_when_the_poll_is_due() -> None:
    w = Wakeup(1, 1)
    w.listening = True
    w.targets()
    w.worked({0})
    w.wait()  # nothing notified: times out 1 ms after the round started
    assert not w.event.is_set()
    assert w.targets() is None


def full_round(w: Wakeup, clock: list[float], named: set[int]) -> None:
    """The next round, made a full one (its poll is due), with ``named`` notified first."""
    for partition in named:
        w.notify(partition)
    clock[0] += w.interval + 1e-6
    assert w.targets() is None


def test_a_busy_notified_trickle_backs_the_poll_off(clock: list[float]) -> None:
    """Full rounds that find rows only where notifications named them (before the round, or
    while it ran) double the interval, though the relay never waits (it stays busy): the
    notifications bring those rows, and a poll every ``poll_min_ms`` made every other round
    take every partition."""
    w = listening()
    w.worked(set())  # the first round: rows nowhere
    assert w.interval == pytest.approx(0.010)
    full_round(w, clock, {0, 1})
    w.worked({0, 1})
    assert w.interval == pytest.approx(0.020)
    full_round(w, clock, {2})
    w.notify(3)  # committed during the round: its NOTIFY lands after the take found it
    w.worked({2, 3})
    assert w.interval == pytest.approx(0.040)
    w.targets()
    w.worked({1})  # not a full round: the interval stays
    assert w.interval == pytest.approx(0.040)


def test_a_full_round_finding_rows_no_notification_named_polls_again_soon(
    clock: list[float],
) -> None:
    """Rows written without ``NOTIFY`` (``notify=False`` producers) keep the poll at
    ``poll_min_ms``, as before, whatever else was notified."""
    w = listening()
    for _ in range(3):
        full_round(w, clock, {0})
        w.worked({0})
    assert w.interval == pytest.approx(0.040)
    full_round(w, clock, {0})
    w.worked({0, 2})
    assert w.interval == pytest.approx(0.005)


def test_without_a_listener_a_round_that_found_rows_keeps_the_short_interval() -> None:
    w = Wakeup(5, 200)  # every round is a poll: rows found keep it at poll_min_ms
    assert w.targets() is None
    w.interval = 0.1
    w.worked(set())
    assert w.interval == pytest.approx(0.005)
