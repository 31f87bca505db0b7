"""The torture's empty restart destroys something only repair can bring back (torture/brokers.py
``SingleRedis``): it counts, while Redis refuses every write, the stream entries the outbox had
marked delivered, and does nothing (Redis left writable) when there are none. And its
``refuse_appends`` fault counts as met only when an outbox row's refused attempts grew while
Redis refused writes (a row of a backlog as well as of the burst), never on a refusal recorded
before it.

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

    def oom_attempts(self) -> dict[int, int] | None:
        raise AssertionError("not a refuse_appends test")


class RefusalProbe(MarkedProbe):
    """A ledger stand-in for ``refuse_appends``: the rows refused for memory, as a relay would
    leave them, after each question (the last answer repeats)."""

    def __init__(self, answers: list[dict[int, int] | None]) -> None:
        super().__init__(set())
        self.answers = answers
        self.bursts = 0

    def burst(self, keys: list[str]) -> list[str]:
        self.bursts += 1
        return ["burst1-0"]

    def oom_attempts(self) -> dict[int, int] | None:
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


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


@pytest.mark.parametrize(("answers", "met"), [
    # a backlog row ahead of the burst (seq 7) refused while the fault lasts: met
    ([{}, {7: 1}], True),
    # a row refused by an earlier fault, retried and refused again: met
    ([{7: 2}, {7: 3}], True),
    # only the earlier fault's refusal, unchanged: not met
    ([{7: 2}], False),
    # nothing refused: not met
    ([{}], False),
    # the outbox unreadable now and then during the fault: asked again, met once it answers
    ([{}, None, {7: 1}], True),
])
def test_a_refusal_is_met_only_when_refused_attempts_grow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, answers: list[dict[int, int]], met: bool
) -> None:
    monkeypatch.setattr("torture.brokers.REFUSAL_WAIT_S", 0.3)
    probe = RefusalProbe(answers)
    broker = SingleRedis(tmp_path, KEYS, probe, stall_s=(0.01, 0.02))
    try:
        assert broker.inflict("redis.refuse_appends", random.Random(1), _noop) is True
        assert probe.bursts == 1
        assert bool(broker.refused) is met
        assert broker.unmet == (0 if met else 1)
        broker.client().set("writable", "1")  # the limit is lifted either way
    finally:
        broker.stop()


def test_no_refusal_fault_without_the_rows_refused_before(tmp_path: Path) -> None:
    """When the outbox cannot be read first, nothing is done (Redis never limited): an
    earlier fault's refusal could not be told from one of this fault."""
    probe = RefusalProbe([None])
    broker = SingleRedis(tmp_path, KEYS, probe, stall_s=(0.01, 0.02))
    try:
        assert broker.inflict("redis.refuse_appends", random.Random(1), _noop) is False
        assert probe.bursts == 0
        assert broker.refused == [] and broker.unmet == 0
        assert broker.client().config_get("maxmemory")["maxmemory"] == "0"
    finally:
        broker.stop()
