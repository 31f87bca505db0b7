"""Fuzzing the entry parser: ``Event.from_fields`` returns an Event or raises
``InvalidEventError`` with a code from a fixed set, whatever a foreign producer wrote.

A parsed event must also be storable by the consumer on both databases (revision fits BIGINT,
aggregate attributes fit their columns, no NUL characters), or it would poison a claim batch.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from outbox_relay.producer import Producer
from outbox_relay.shared.envelope import MAX_REVISION, Event
from outbox_relay.shared.errors import InvalidEventError

CODES = {
    "missing_field", "bad_specversion", "bad_json", "data_too_large", "bad_encoding",
    "bad_revision", "empty_entry", "bad_field", "non_finite_number",
}
MAX_DATA = 4096
FUZZ = settings(max_examples=400, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

BASE = {
    b"specversion": b"1.0", b"id": b"agg-1:thing.done:3", b"source": b"svc",
    b"type": b"thing.done", b"time": b"2024-05-01T12:00:00Z",
    b"datacontenttype": b"application/json", b"data": b'{"k":[1,2]}',
    b"aggregatetype": b"thing", b"aggregateid": b"agg-1", b"revision": b"3",
}


def parse(fields: dict[Any, Any]) -> Event | None:
    """The property under test; returns None for a rejected entry."""
    try:
        event = Event.from_fields(fields, max_data_bytes=MAX_DATA)
    except InvalidEventError as err:
        assert err.code in CODES, err.code
        assert err.message and "Traceback" not in err.message
        return None
    assert_storable(event)
    return event


def assert_storable(event: Event) -> None:
    """What the inbox columns and PostgreSQL text need of an accepted event."""
    assert 0 < len(event.id) <= 512 and 0 < len(event.type) <= 256
    assert event.revision is None or 0 <= event.revision <= MAX_REVISION
    assert event.aggregatetype is None or len(event.aggregatetype) <= 128
    assert event.aggregateid is None or len(event.aggregateid) <= 256
    for text in (event.id, event.type, event.source, event.aggregatetype, event.aggregateid):
        assert text is None or "\x00" not in text


nasty_bytes = st.one_of(
    st.binary(max_size=40),
    st.text(max_size=40).map(lambda t: t.encode("utf-8")),
    st.sampled_from([b"", b"\x00", b"\xff\xfe", b"\xed\xa0\x80", b"1.0\x00", b"null", b"-1",
                     b"9" * 19, b"9" * 5000, b"NaN", b"[]", b"{}", b"\"", b"0x10", b"\xc3\x28"]),
)
huge = st.integers(MAX_DATA - 2, MAX_DATA + 64).map(lambda n: b'"' + b"x" * n + b'"')
deep = st.sampled_from([50, 1_500, 2_040, 100_000]).map(lambda n: b"[" * n + b"]" * n)
revision = st.one_of(
    st.integers(-5, 2**64).map(lambda n: str(n).encode()),
    st.sampled_from([b"", b" 1", b"1.0", b"\xd9\xa3", b"\xc2\xb2", b"0" * 30 + b"7"]),
)
values = st.one_of(nasty_bytes, huge, deep, revision,
                   st.sampled_from([b"1.0", b"0.3", b"1.0 ", b"2024-02-30T00:00:00Z",
                                    b"a" * 300, b"b" * 600, b"text/plain"]))


@FUZZ
@given(st.dictionaries(st.binary(max_size=16), st.binary(max_size=64), max_size=12))
def test_arbitrary_bytes_maps_never_crash(fields: dict[bytes, bytes]) -> None:
    parse(fields)


@FUZZ
@given(
    drop=st.sets(st.sampled_from(sorted(BASE))),
    changes=st.dictionaries(st.sampled_from([*sorted(BASE), b"subject", b"traceparent",
                                             b"extra", b"dlq.reason", b"\xff"]),
                            values, max_size=4),
)
def test_mutated_valid_entries_never_crash(drop: set[bytes], changes: dict[bytes, bytes]) -> None:
    fields = {k: v for k, v in BASE.items() if k not in drop}
    fields.update(changes)
    parse(fields)


@FUZZ
@given(st.dictionaries(st.text(max_size=12), st.text(max_size=40), max_size=12))
def test_text_maps_never_crash(fields: dict[str, str]) -> None:
    parse(fields)


@FUZZ
@given(
    event_id=st.text(st.characters(blacklist_characters="\x00", blacklist_categories=["Cs"]),
                     min_size=1, max_size=512),
    data=st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=20),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                    max_size=4),
        max_leaves=12,
    ),
    rev=st.none() | st.integers(0, MAX_REVISION),
    ms=st.integers(0, 4_102_444_800_000),
)
def test_valid_events_round_trip(event_id: str, data: Any, rev: int | None, ms: int) -> None:
    event = Event(id=event_id, source="svc", type="t.x", data=data, revision=rev,
                  aggregatetype="agg" if rev is not None else None,
                  aggregateid="a-1" if rev is not None else None,
                  time=datetime.fromtimestamp(ms / 1000, tz=UTC))
    wire = {k.encode(): v.encode() for k, v in event.to_fields().items()}
    assert Event.from_fields(wire, max_data_bytes=10**7) == event


@pytest.mark.parametrize(
    ("change", "code"),
    [
        ({}, None),
        ({b"id": None}, "missing_field"),
        ({b"time": b""}, "missing_field"),
        ({b"specversion": b"0.3"}, "bad_specversion"),
        ({b"data": b"{not json"}, "bad_json"),
        ({b"data": b"[" * 2000 + b"]" * 2000}, "bad_json"),  # 4000 bytes, 2000 deep
        ({b"data": b'"' + b"x" * MAX_DATA + b'"'}, "data_too_large"),
        ({b"source": b"\xff\xfe"}, "bad_encoding"),
        ({b"\xff": b"x"}, "bad_encoding"),
        ({b"id": b"a\x00b"}, "bad_encoding"),
        ({b"revision": b"-1"}, "bad_revision"),
        ({b"revision": b"1.5"}, "bad_revision"),
        ({b"revision": str(MAX_REVISION + 1).encode()}, "bad_revision"),
        ({b"revision": b"9" * 5000}, "bad_revision"),
        ({b"revision": str(MAX_REVISION).encode()}, None),
        ({b"aggregateid": b"x" * 257}, "bad_field"),
        ({b"aggregatetype": b"x" * 129}, "bad_field"),
        ({b"id": b"i" * 513}, "bad_field"),
        ({b"time": b"yesterday"}, "bad_field"),
        ({b"type": b"never.registered"}, None),  # unknown types are the consumer's call
    ],
)
def test_each_rule_has_its_code(change: dict[bytes, bytes | None], code: str | None) -> None:
    fields = {**BASE, **change}
    fields = {k: v for k, v in fields.items() if v is not None}
    if code is None:
        assert parse(fields) is not None
        return
    with pytest.raises(InvalidEventError) as caught:
        Event.from_fields(fields, max_data_bytes=MAX_DATA)
    assert caught.value.code == code


def test_empty_entry() -> None:
    with pytest.raises(InvalidEventError) as caught:
        Event.from_fields({})
    assert caught.value.code == "empty_entry"


# --- the producer side: what enqueue accepts, the consumer must accept ----------------------

PRODUCER_CODES = CODES | {"bad_type", "bad_stream"}


def _nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


PRODUCER = Producer(source="fuzz", partitions=4, max_data_bytes=MAX_DATA)
json_data = st.recursive(
    st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=3),
    max_leaves=10,
) | st.sampled_from([b"bytes", {1, 2}, "x" * (MAX_DATA + 1), "\ud800",
                     _nested(5000)])
names = st.text(max_size=20) | st.sampled_from(["run.created", "a" * 257, "runs", "x\x00y"])
maybe_text = st.none() | st.text(max_size=300) | st.sampled_from(["a" * 129, "b" * 257, "\x00"])


def built_fields(**event: Any) -> dict[bytes, bytes] | None:
    """What the relay would put in the stream for an event the producer accepts."""
    try:
        event_id, _stmt = PRODUCER.build(postgres=False, **event)
    except InvalidEventError as err:
        assert err.code in PRODUCER_CODES, err.code
        return None
    row = PRODUCER._row(**{"event_id": None, "traceparent": None, "delay_ms": 0,
                           "aggregate_type": None, "aggregate_id": None, "revision": None,
                           "data": None, **event})
    fields = {"specversion": "1.0", "id": event_id, "source": row["source"], "type": row["type"],
              "time": "2024-01-01T00:00:00Z", "data": row["payload"]}
    for name, key in (("aggregatetype", "aggregate_type"), ("aggregateid", "aggregate_id"),
                      ("revision", "revision")):
        if row[key] is not None:
            fields[name] = str(row[key])
    return {k.encode(): v.encode("utf-8", "surrogatepass") for k, v in fields.items()}


@FUZZ
@given(type=names, stream=names, data=json_data, aggregate_type=maybe_text,
       aggregate_id=maybe_text, revision=st.none() | st.integers(-3, 2**64),
       event_id=st.none() | st.text(max_size=600))
@example(type="t", stream="s", data=None, aggregate_type="a" * 129, aggregate_id=None,
         revision=None, event_id=None)
def test_producer_accepts_only_what_consumers_accept(**event: Any) -> None:
    fields = built_fields(**event)
    if fields is not None:
        assert parse(fields) is not None, "the producer enqueued an event consumers reject"


def test_producer_refuses_data_nested_too_deep_for_json() -> None:
    # A separate test: hypothesis cannot pretty-print an example this deep.
    with pytest.raises(InvalidEventError) as caught:
        PRODUCER.build(postgres=False, type="t", stream="s", data=_nested(5000))
    assert caught.value.code == "bad_json"


def test_producer_rejects_with_clear_codes_and_limits() -> None:
    base: dict[str, Any] = {"type": "run.created", "stream": "runs", "data": {"n": 1}}
    cases: list[tuple[dict[str, Any], str]] = [
        ({"type": "bad type!"}, "bad_type"),
        ({"stream": "has:colon"}, "bad_stream"),
        ({"revision": -1}, "bad_revision"),
        ({"data": {1, 2}}, "bad_json"),
        ({"data": float("nan")}, "bad_json"),
        ({"data": "x" * MAX_DATA}, "data_too_large"),
        ({"traceparent": "nope"}, "bad_field"),
        ({"delay_ms": -5}, "bad_field"),
        ({"event_id": "i" * 513}, "bad_field"),
        ({"event_id": ""}, "bad_field"),
    ]
    for change, code in cases:
        with pytest.raises(InvalidEventError) as caught:
            PRODUCER.build(postgres=False, **{**base, **change})
        assert caught.value.code == code, change
        assert caught.value.message
    event_id, _ = PRODUCER.build(postgres=False, **base, aggregate_id="r1", revision=2)
    assert event_id == "r1:run.created:2"
