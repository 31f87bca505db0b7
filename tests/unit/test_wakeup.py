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
    w = listening()
    w.notify(0)
    clock[0] += wakeup.FULL_ROUND_S / 2
    assert w.targets() == {0}
    w.notify(0)
    clock[0] += wakeup.FULL_ROUND_S / 2
    assert w.targets() is None  # rows elsewhere waiting for their retry time get their turn
