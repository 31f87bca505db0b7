"""The torture's empty restart destroys something only repair can bring back (torture/brokers.py
``SingleRedis``): it counts, while Redis refuses every write, the stream entries the outbox had
marked delivered, and does nothing (Redis left writable) when there are none.

A private ``redis-server`` on a free port: the test kills and restarts it.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from torture.brokers import SingleRedis

pytestmark = pytest.mark.integration

KEYS = ["p:{s:0}", "p:{s:1}"]


class MarkedProbe:
    """A ledger stand-in: the entry ids it calls marked delivered."""

    def __init__(self, marked: set[str]) -> None:
        self.marked_ids = marked
        self.asked: list[dict[str, list[str]]] = []

    def marked_among(self, entries: dict[str, list[str]]) -> int:
        self.asked.append(entries)
        return sum(i in self.marked_ids for ids in entries.values() for i in ids)

    def burst(self, keys: list[str]) -> list[str]:
        raise AssertionError("a single Redis makes no burst")

    def can_burst(self, keys: list[str]) -> bool:
        raise AssertionError("a single Redis makes no burst")

    def marked(self, event_ids: list[str]) -> int:
        raise AssertionError("a single Redis makes no burst")

    def lacked(self, replica: redis.Redis, keys: list[str]) -> int:
        raise AssertionError("a single Redis has no replica")


@pytest.fixture
def probe() -> MarkedProbe:
    return MarkedProbe(set())


@pytest.fixture
def server(tmp_path: Path, probe: MarkedProbe) -> Iterator[SingleRedis]:
    broker = SingleRedis(tmp_path, KEYS, probe)
    yield broker
    broker.stop()


def _noop() -> None:
    return None


def test_no_marked_entry_in_the_streams_means_no_restart_and_redis_stays_writable(
    server: SingleRedis, probe: MarkedProbe
) -> None:
    client = server.client()
    client.xadd(KEYS[0], {"f": "v"}, id="5-0")  # in the stream, not marked delivered
    assert server.inflict("redis.restart_empty", random.Random(1), _noop) is False
    assert server.destroyed == []
    # Not paused any more: a write answers at once, and nothing was lost.
    client.set("after", "1")
    assert client.xlen(KEYS[0]) == 1
    assert probe.asked == [{KEYS[0]: ["5-0"]}]


def test_marked_entries_are_counted_then_destroyed(
    server: SingleRedis, probe: MarkedProbe
) -> None:
    client = server.client()
    for i in (1, 2, 3):
        client.xadd(KEYS[0], {"f": "v"}, id=f"{i}-0")
    client.xadd(KEYS[1], {"f": "v"}, id="9-0")
    client.xadd("p:other", {"f": "v"}, id="1-0")  # not a partition stream: never counted
    probe.marked_ids.update({"2-0", "3-0", "9-0"})
    assert server.inflict("redis.restart_empty", random.Random(1), _noop) is True
    assert server.destroyed == [3]
    fresh = server.client()
    assert fresh.exists(KEYS[0], KEYS[1], "p:other") == 0
    fresh.set("writable", "1")
