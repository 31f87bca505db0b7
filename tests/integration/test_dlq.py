"""Dead letters on the real Redis and both databases: list, show, and replay through the
normal claim path (idempotent thanks to the inbox; the partition stream is never touched)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import pytest
import redis
from sqlalchemy import Column, Connection, Engine, MetaData, String, Table, func, select

from outbox_relay.consumer import Handlers, dead_letters
from outbox_relay.consumer.daemon import Consumer
from outbox_relay.shared import keys
from outbox_relay.shared.envelope import Event
from outbox_relay.shared.errors import InvalidRequestError, NotFoundError
from outbox_relay.shared.schema import inbox, inbox_heads
from outbox_relay.shared.settings import ConsumerSettings

pytestmark = pytest.mark.integration

GROUP = "g1"
effects_md = MetaData()
effects = Table("test_dlq_effects", effects_md, Column("event_id", String(512)))


def record_effect(conn: Connection, event: Event) -> None:
    """A local side effect, committed with the receipt (so we can count applications)."""
    conn.execute(effects.insert().values(event_id=event.id))


def registry(*types: str, handler: Callable[[Connection, Event], None] = record_effect) -> Handlers:
    h = Handlers()
    for t in types:
        h.register(t, handler)
    return h


def entry(kind: str, *, rev: int | None = None, data: bytes = b'{"n":1}') -> dict[bytes, bytes]:
    fields = {b"specversion": b"1.0", b"id": str(uuid.uuid4()).encode(), b"source": b"t",
              b"type": kind.encode(), b"time": b"2024-05-01T12:00:00Z", b"data": data}
    if rev is not None:
        fields |= {b"aggregatetype": b"a", b"aggregateid": b"agg", b"revision": str(rev).encode()}
    return fields


class World:
    """A prefix, a consumer of group g1 on streams ``s`` (2 partitions), and helpers."""

    def __init__(self, engine: Engine, client: redis.Redis, prefix: str) -> None:
        self.engine, self.client, self.prefix = engine, client, prefix
        effects_md.create_all(engine)

    def consume(self, handlers: Handlers, entries: list[dict[bytes, bytes]],
                partition: int = 0, group: str = GROUP) -> list[bytes]:
        s = ConsumerSettings(key_prefix=self.prefix, streams="s", partitions=2, group=group,
                             consumer="c", block_ms=1, max_deliveries=1, claim_idle_ms=100,
                             claim_interval_ms=100, max_data_bytes=1000)
        consumer = Consumer(s, self.engine, self.client, handlers)
        key = keys.stream_key(self.prefix, "s", partition)
        ids = [self.client.xadd(key, f) for f in entries]  # type: ignore[arg-type]
        consumer.run_once(block_ms=1)
        deadline = time.monotonic() + 20
        while self.pending(group) and time.monotonic() < deadline:
            consumer.run_once(block_ms=1)
        assert self.pending(group) == 0
        return ids

    def pending(self, group: str) -> int:
        return sum(int(self.client.xpending(keys.stream_key(self.prefix, "s", p), group)[
            "pending"]) for p in (0, 1))

    def letters(self) -> list[dead_letters.DeadLetter]:
        return dead_letters.list_letters(self.client, self.prefix)

    def receipts(self, event_id: bytes) -> list[str]:
        with self.engine.connect() as conn:
            return list(conn.execute(select(inbox.c.outcome).where(
                inbox.c.group_name == GROUP, inbox.c.event_id == event_id.decode())).scalars())

    def effects(self, event_id: bytes) -> int:
        with self.engine.connect() as conn:
            return int(conn.execute(select(func.count()).where(
                effects.c.event_id == event_id.decode())).scalar_one())

    def head(self) -> int | None:
        with self.engine.connect() as conn:
            return conn.execute(select(inbox_heads.c.revision).where(
                inbox_heads.c.group_name == GROUP, inbox_heads.c.aggregate_id == "agg")
            ).scalar_one_or_none()

    def stream_length(self) -> int:
        return sum(int(self.client.xlen(keys.stream_key(self.prefix, "s", p))) for p in (0, 1))


@pytest.fixture
def world(engine: Engine, redis_client: redis.Redis, key_prefix: str) -> World:
    return World(engine, redis_client, key_prefix)


def test_list_and_show(world: World) -> None:
    bad = {b"id": b"x"}
    world.consume(registry("ok"), [bad, entry("ok")], partition=0)
    unknown = entry("nobody.handles")
    (unknown_id,) = world.consume(registry("ok"), [unknown], partition=1)
    letters = world.letters()
    assert [(x.stream, x.partition, x.reason) for x in letters] == [
        ("s", 0, "missing_field"), ("s", 1, "unknown_type")]
    assert letters[0].fields == bad and letters[1].fields == unknown
    assert letters[1].meta["entry_id"] == unknown_id.decode()
    assert [x.reason for x in dead_letters.list_letters(
        world.client, world.prefix, stream="s", partition=1)] == ["unknown_type"]
    assert dead_letters.list_letters(world.client, world.prefix, stream="other") == []
    assert len(dead_letters.list_letters(world.client, world.prefix, count=1)) == 1
    shown = dead_letters.show(world.client, world.prefix, letters[1].letter_id)
    assert shown == letters[1]
    bare = dead_letters.show(world.client, world.prefix, letters[0].dead_id)
    assert bare == letters[0]
    view = shown.to_json()
    assert view["reason"] == "unknown_type" and view["group"] == GROUP
    assert view["fields"]["type"] == "nobody.handles"
    with pytest.raises(NotFoundError):
        dead_letters.show(world.client, world.prefix, "s:0:1-1")
    for bad_id in ("nonsense", "s:x:1-1", "a:b:0:1-1", "s:0:12", "", "s:\u00b2:1-1",
                   "s:0:99999999999999999999999-0"):
        with pytest.raises(InvalidRequestError):
            dead_letters.show(world.client, world.prefix, bad_id)


def test_replay_applies_once_and_never_touches_the_stream(world: World) -> None:
    unknown = entry("late.type")
    world.consume(registry("ok"), [unknown])
    assert world.receipts(unknown[b"id"]) == ["dead"]
    (letter,) = world.letters()
    length = world.stream_length()

    now_known = registry("ok", "late.type")
    result = dead_letters.replay(world.client, world.engine, letter, now_known, group=GROUP)
    assert (result.outcome, result.removed) == ("applied", True)
    assert world.receipts(unknown[b"id"]) == ["applied"]
    assert world.effects(unknown[b"id"]) == 1
    assert world.letters() == []
    # the same letter replayed again (say, from a stale listing): a duplicate, no new effect
    again = dead_letters.replay(world.client, world.engine, letter, now_known, group=GROUP)
    assert again.outcome == "duplicate"
    assert world.effects(unknown[b"id"]) == 1
    assert world.receipts(unknown[b"id"]) == ["applied"]
    assert world.stream_length() == length  # replay claims directly, it never re-adds


def test_replay_leaves_what_still_cannot_succeed(world: World) -> None:
    too_big = entry("ok", data=b'"' + b"x" * 2000 + b'"')
    unknown = entry("still.unknown")
    world.consume(registry("ok"), [too_big, unknown])
    by_reason = {x.reason: x for x in world.letters()}
    handlers = registry("ok")
    kept = dead_letters.replay(world.client, world.engine, by_reason["data_too_large"], handlers,
                               group=GROUP, max_data_bytes=1000)
    assert (kept.outcome, kept.detail, kept.removed) == ("invalid", "data_too_large", False)
    skipped = dead_letters.replay(world.client, world.engine, by_reason["unknown_type"],
                                  handlers, group=GROUP)
    assert (skipped.outcome, skipped.removed) == ("skipped", False)
    assert world.receipts(unknown[b"id"]) == ["dead"]  # untouched while no handler exists
    other = dead_letters.replay(world.client, world.engine, by_reason["unknown_type"],
                                registry("still.unknown"), group="someone-else")
    assert other.outcome == "skipped" and "other_group" in other.detail
    assert len(world.letters()) == 2
    # a larger limit lets the big one through
    done = dead_letters.replay(world.client, world.engine, by_reason["data_too_large"],
                               handlers, group=GROUP, max_data_bytes=10_000)
    assert (done.outcome, done.removed) == ("applied", True)
    assert world.effects(too_big[b"id"]) == 1


def test_replay_after_max_deliveries_applies_whatever_the_head(world: World) -> None:
    # Was ..._and_when_stale: the replay ended ``stale`` and deleted the letter (a silent loss).
    def boom(conn: Connection, event: Event) -> None:
        raise RuntimeError("down")

    first, later = entry("job", rev=1), entry("job", rev=2)
    world.consume(registry("job", handler=boom), [first])
    (letter,) = world.letters()
    assert letter.reason == "max_deliveries" and world.receipts(first[b"id"]) == ["dead"]
    still_failing = dead_letters.replay(world.client, world.engine, letter,
                                        registry("job", handler=boom), group=GROUP)
    assert (still_failing.outcome, still_failing.removed) == ("failed", False)
    assert world.receipts(first[b"id"]) == []  # no receipt, but the letter is the record
    assert len(world.letters()) == 1
    world.consume(registry("job"), [later])  # revision 2 is applied meanwhile
    replayed = dead_letters.replay(world.client, world.engine, letter, registry("job"),
                                   group=GROUP)
    assert (replayed.outcome, replayed.removed) == ("applied", True)  # an operator decided
    assert world.receipts(first[b"id"]) == ["applied"] and world.effects(first[b"id"]) == 1
    assert world.head() == 2  # never lowered by a replay
    assert world.letters() == []


def test_replay_all_of_a_group(world: World) -> None:
    unknown = [entry("t.new") for _ in range(5)]
    world.consume(registry("ok"), unknown[:3], partition=0)
    world.consume(registry("ok"), [*unknown[3:], {b"garbage": b"\xff"}], partition=1)
    world.consume(registry("ok"), [], group="g2")  # g2 dead-letters the same 6 entries
    assert len(world.letters()) == 12
    results = dead_letters.replay_all(world.client, world.engine, world.prefix,
                                      registry("ok", "t.new"), group=GROUP, batch=2)
    assert sorted(r.outcome for r in results) == ["applied"] * 5 + ["invalid"]
    assert all(world.effects(f[b"id"]) == 1 for f in unknown)
    left = sorted((x.group, x.reason) for x in world.letters())
    assert left == [(GROUP, "bad_encoding"), ("g2", "bad_encoding")] + [("g2", "unknown_type")] * 5
    assert dead_letters.replay_all(world.client, world.engine, world.prefix,
                                   registry("ok", "t.new"), group=GROUP, stream="s",
                                   partition=0) == []
