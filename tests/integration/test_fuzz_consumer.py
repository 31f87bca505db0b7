"""The consumer against malformed entries written straight into the real stream.

For every entry the consumer reads, exactly what the envelope parser says must happen: an
invalid entry ends in its partition's dead-letter stream with the parser's reason code and the
original fields; a valid one has an inbox receipt (plus a letter when it is dead). The consumer
never raises, and at the end nothing is pending: nothing was acknowledged without a record.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Connection, Engine, select

from outbox_relay.consumer import Handlers
from outbox_relay.consumer.daemon import Consumer
from outbox_relay.shared import keys
from outbox_relay.shared.envelope import Event, fingerprint
from outbox_relay.shared.errors import InvalidEventError
from outbox_relay.shared.schema import inbox
from outbox_relay.shared.settings import ConsumerSettings

pytestmark = pytest.mark.integration

GROUP = "fuzz"
MAX_DATA = 2048
STREAM = "fuzz"
Fields = dict[bytes, bytes]
FIGURES: Counter[str] = Counter()  # printed with -s: what the fuzzing covered


class Boom(RuntimeError):
    """The failing handler's error: the entry stays pending until max_deliveries."""


def _ok(conn: Connection, event: Event) -> None:
    """Accept: the receipt is the effect."""


def _boom(conn: Connection, event: Event) -> None:
    raise Boom("always fails")


def fuzz_consumer(engine: Engine, client: redis.Redis, prefix: str) -> Consumer:
    handlers = Handlers()
    handlers.register("fuzz.ok", _ok)
    handlers.register("fuzz.boom", _boom)
    s = ConsumerSettings(
        key_prefix=prefix, streams=STREAM, partitions=1, group=GROUP, consumer="fuzzer",
        block_ms=1, max_data_bytes=MAX_DATA, max_deliveries=2, claim_idle_ms=100,
        claim_interval_ms=100, redis_timeout_s=5.0,
    )
    return Consumer(s, engine, client, handlers)


def drain(consumer: Consumer, client: redis.Redis, key: str, last_id: bytes) -> None:
    """Run the consumer until it has read up to ``last_id`` and nothing is pending."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        consumer.run_once(block_ms=1)  # any exception fails the test: the consumer died
        info = {g["name"]: g for g in client.xinfo_groups(key)}[GROUP.encode()]
        delivered = _id(info["last-delivered-id"]) >= _id(last_id)
        if delivered and info["pending"] == 0:
            return
    raise AssertionError("the consumer did not settle every entry within 30 s")


def check_records(
    engine: Engine, client: redis.Redis, prefix: str, written: list[tuple[bytes, Fields]]
) -> Counter[str]:
    """The oracle: what the parser says about each entry must be on record.

    An event id written again (a mutated entry's id is drawn from a few values, so two
    examples can share one) is settled by its first entry's receipt: with the same fingerprint
    it is a duplicate, with another one it must be dead-lettered ``conflicting_duplicate`` —
    exactly then, the only case in which its letter's reason is not the type's."""
    seen: Counter[str] = Counter()
    first: dict[str, str] = {}  # event id -> fingerprint of its first valid entry
    letters = {
        fields[b"dlq.entry_id"]: fields
        for _id_, fields in client.xrange(keys.dead_letter_key(prefix, STREAM, 0))
    }
    with engine.connect() as conn:
        receipts = dict(conn.execute(
            select(inbox.c.event_id, inbox.c.outcome).where(inbox.c.group_name == GROUP)
        ).all())
    for entry_id, fields in written:
        try:
            event = Event.from_fields(fields, max_data_bytes=MAX_DATA)
        except InvalidEventError as err:
            letter = letters.get(entry_id)
            assert letter is not None, f"invalid entry {entry_id!r} has no dead letter"
            assert letter[b"dlq.reason"] == err.code.encode()
            assert {k: v for k, v in letter.items() if not k.startswith(b"dlq.")} == fields
            seen[f"dead_{err.code}"] += 1
            continue
        outcome = receipts.get(event.id)
        assert outcome is not None, f"valid entry {entry_id!r} has no inbox receipt"
        if event.id in first:
            if first[event.id] != fingerprint(event):
                letter = letters.get(entry_id)
                assert letter is not None, f"conflicting entry {entry_id!r} has no dead letter"
                assert letter[b"dlq.reason"] == b"conflicting_duplicate"
                seen["dead_conflicting_duplicate"] += 1
            else:
                seen["duplicate"] += 1
            continue
        first[event.id] = fingerprint(event)
        if event.type not in ("fuzz.ok", "fuzz.boom") and outcome == "dead":
            assert letters[entry_id][b"dlq.reason"] == b"unknown_type"
        if event.type == "fuzz.boom" and outcome == "dead":
            assert letters[entry_id][b"dlq.reason"] == b"max_deliveries"
        seen[f"receipt_{outcome}"] += 1
    return seen


def _id(raw: bytes | str) -> tuple[int, int]:
    text = raw.decode() if isinstance(raw, bytes) else raw
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


# --- what a foreign or broken producer may write ------------------------------------------

def _valid(kind: str, rev: int | None = None) -> dict[bytes, bytes]:
    fields = {
        b"specversion": b"1.0", b"id": f"{uuid.uuid4()}".encode(), b"source": b"fuzz",
        b"type": kind.encode(), b"time": b"2024-05-01T12:00:00Z", b"data": b'{"n":1}',
    }
    if rev is not None:
        fields |= {b"aggregatetype": b"thing", b"aggregateid": b"agg-1",
                   b"revision": str(rev).encode()}
    return fields


field_names = st.sampled_from([b"specversion", b"id", b"source", b"type", b"time", b"data",
                               b"datacontenttype", b"revision", b"aggregateid",
                               b"aggregatetype", b"", b"\xff\x00", b"x"])
field_values = st.one_of(
    st.binary(max_size=48),
    st.sampled_from([b"", b"1.0", b"0.3", b"\x00", b"\xc3\x28", b"-1", b"9" * 25, b"{",
                     b"[" * 3000, b'"' + b"x" * MAX_DATA + b'"', b"a" * 300,
                     b"2024-05-01T12:00:00Z", b"fuzz.ok", b"application/json"]),
)
mutated = st.builds(
    lambda base, changes: {**base, **changes},
    st.sampled_from(["fuzz.ok", "fuzz.unknown"]).map(_valid),
    st.dictionaries(field_names, field_values, max_size=3),
)
targeted = st.builds(  # one precise breakage of an otherwise valid entry
    lambda kind, change: _valid(kind, 1) | dict([change]),
    st.sampled_from(["fuzz.ok", "fuzz.unknown"]),
    st.sampled_from([
        (b"data", b"{"), (b"data", b"[" * 3000), (b"data", b'"' + b"x" * MAX_DATA + b'"'),
        (b"revision", b"-1"), (b"revision", b"9" * 25), (b"revision", b"1e3"),
        (b"aggregateid", b"a" * 300), (b"aggregatetype", b"\x00"), (b"time", b"noon"),
        (b"specversion", b"2.0"), (b"id", b""), (b"type", b""), (b"source", b"\xff"),
    ]) | st.tuples(field_names, field_values),
)
arbitrary = st.dictionaries(
    st.binary(max_size=12).filter(lambda k: not k.startswith(b"dlq.")), st.binary(max_size=40),
    min_size=1, max_size=8,
)
valid = st.one_of(
    st.sampled_from(["fuzz.ok", "fuzz.ok", "fuzz.unknown", "fuzz.boom"]).map(_valid),
    st.integers(0, 5).map(lambda r: _valid("fuzz.ok", r)),  # some are stale
)
entries = st.lists(st.one_of(arbitrary, mutated, targeted, valid), min_size=1, max_size=4)


@pytest.fixture
def consumer(engine: Engine, redis_client: redis.Redis, key_prefix: str) -> Consumer:
    return fuzz_consumer(engine, redis_client, key_prefix)


@pytest.mark.slow
def test_malformed_entries_are_recorded_never_dropped(
    consumer: Consumer, engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    key = keys.stream_key(key_prefix, STREAM, 0)
    written: list[tuple[bytes, dict[bytes, bytes]]] = []

    @settings(max_examples=30, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(entries)
    def one_example(batch: list[dict[bytes, bytes]]) -> None:
        ids = [redis_client.xadd(key, fields) for fields in batch]  # type: ignore[arg-type]
        written.extend(zip(ids, batch, strict=True))
        drain(consumer, redis_client, key, ids[-1])
        check_records(consumer.engine, redis_client, key_prefix, written)

    one_example()
    assert redis_client.xpending(key, GROUP)["pending"] == 0
    FIGURES.update(check_records(engine, redis_client, key_prefix, written))
    FIGURES["entries"] += len(written)
    FIGURES["examples"] += 30
    print(f"\nfuzz figures so far: {dict(FIGURES)}; consumer stats {consumer.stats}")


def test_an_id_written_again_with_other_content_is_on_record_as_conflicting(
    consumer: Consumer, redis_client: redis.Redis, key_prefix: str
) -> None:
    """What the fuzzer can draw (two entries sharing an id), pinned: the oracle accepts the
    second entry's ``conflicting_duplicate`` letter because its fingerprint differs, and a
    third with the first's content is a plain duplicate."""
    key = keys.stream_key(key_prefix, STREAM, 0)
    unknown = _valid("fuzz.unknown")
    other = unknown | {b"type": b"fuzz.other"}
    written = [(redis_client.xadd(key, f), f)  # type: ignore[arg-type]
               for f in (unknown, other, unknown)]
    drain(consumer, redis_client, key, written[-1][0])
    seen = check_records(consumer.engine, redis_client, key_prefix, written)
    assert seen == {"receipt_dead": 1, "dead_conflicting_duplicate": 1, "duplicate": 1}


CASES: list[tuple[str, dict[bytes, bytes], str]] = [
    ("missing fields", {b"id": b"x", b"type": b"fuzz.ok"}, "missing_field"),
    ("empty field name only", {b"": b""}, "missing_field"),
    ("wrong specversion", _valid("fuzz.ok") | {b"specversion": b"0.3"}, "bad_specversion"),
    ("non-JSON data", _valid("fuzz.ok") | {b"data": b"{nope"}, "bad_json"),
    ("deeply nested data", _valid("fuzz.ok") | {b"data": b"[" * 1000 + b"]" * 1000}, "bad_json"),
    ("huge data", _valid("fuzz.ok") | {b"data": b'"' + b"x" * 4000 + b'"'}, "data_too_large"),
    ("binary bytes", _valid("fuzz.ok") | {b"source": b"\xff\xfe\x00"}, "bad_encoding"),
    ("NUL in the id", _valid("fuzz.ok") | {b"id": b"a\x00b"}, "bad_encoding"),
    ("negative revision", _valid("fuzz.ok", 1) | {b"revision": b"-3"}, "bad_revision"),
    ("revision beyond BIGINT", _valid("fuzz.ok", 1) | {b"revision": b"9" * 20}, "bad_revision"),
    ("aggregate id too long", _valid("fuzz.ok", 1) | {b"aggregateid": b"a" * 300}, "bad_field"),
    ("bad time", _valid("fuzz.ok") | {b"time": b"yesterday"}, "bad_field"),
    ("unknown type", _valid("fuzz.unknown"), "unknown_type"),
    ("handler always fails", _valid("fuzz.boom"), "max_deliveries"),
]


def test_each_kind_of_bad_entry_gets_its_reason(
    consumer: Consumer, engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    key = keys.stream_key(key_prefix, STREAM, 0)
    ok = _valid("fuzz.ok")
    ids = [redis_client.xadd(key, f) for _name, f, _code in CASES]  # type: ignore[arg-type]
    ok_id = redis_client.xadd(key, ok)  # type: ignore[arg-type]
    drain(consumer, redis_client, key, ok_id)
    dead: dict[bytes, dict[bytes, Any]] = {
        f[b"dlq.entry_id"]: f for _i, f in redis_client.xrange(keys.dead_letter_key(
            key_prefix, STREAM, 0))
    }
    for entry_id, (name, fields, code) in zip(ids, CASES, strict=True):
        letter = dead.get(entry_id)
        assert letter is not None, name
        assert letter[b"dlq.reason"].decode() == code, name
        assert letter[b"dlq.group"] == GROUP.encode()
        assert {k: v for k, v in letter.items() if not k.startswith(b"dlq.")} == fields, name
    assert ok_id not in dead
    with engine.connect() as conn:
        outcome = conn.execute(select(inbox.c.outcome).where(
            inbox.c.event_id == ok[b"id"].decode())).scalar_one()
    assert outcome == "applied"
    assert redis_client.xpending(key, GROUP)["pending"] == 0
