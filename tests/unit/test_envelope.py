"""The envelope: flat CloudEvents fields out, the same event back, every bad entry named."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from outbox_relay.shared.envelope import REQUIRED_FIELDS, Event
from outbox_relay.shared.errors import InvalidEventError

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)
# Attribute text: any Unicode except NUL (PostgreSQL text cannot hold it; from_fields refuses it).
chars = st.characters(codec="utf-8", exclude_characters="\x00")
short_text = st.text(chars, min_size=1, max_size=40)
events = st.builds(
    Event,
    id=st.text(chars, min_size=1, max_size=512),
    source=st.text(chars, min_size=1, max_size=256),
    type=st.text(chars, min_size=1, max_size=256),
    time=st.datetimes(timezones=st.just(UTC)),
    subject=st.none() | short_text,
    data=json_values,
    aggregatetype=st.none() | short_text,
    aggregateid=st.none() | short_text,
    revision=st.none() | st.integers(min_value=0, max_value=2**63 - 1),
    traceparent=st.none() | short_text,
)


def valid_fields(**changes: str | None) -> dict[str, str]:
    """The fields of a valid entry, with some replaced (``None`` removes a field)."""
    fields = {
        "specversion": "1.0",
        "id": "run-1:run.created:1",
        "source": "tests",
        "type": "run.created",
        "time": "2024-05-01T12:00:00.123456Z",
        "datacontenttype": "application/json",
        "data": '{"a":1}',
        "subject": "run-1",
        "aggregatetype": "run",
        "aggregateid": "run-1",
        "revision": "1",
    }
    for name, value in changes.items():
        if value is None:
            fields.pop(name, None)
        else:
            fields[name] = value
    return fields


@given(events)
def test_round_trip_through_text_fields(event: Event) -> None:
    fields = event.to_fields()
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in fields.items())
    assert Event.from_fields(fields) == event


@given(events)
def test_round_trip_through_redis_bytes(event: Event) -> None:
    raw = {k.encode(): v.encode() for k, v in event.to_fields().items()}
    assert Event.from_fields(raw) == event


def test_fields_are_cloudevents_attributes() -> None:
    event = Event(
        id="a:t:3", source="svc", type="t", time=datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC),
        subject="a", data={"x": [1, "é"]}, aggregatetype="run", aggregateid="a", revision=3,
        traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    )
    assert event.to_fields() == {
        "specversion": "1.0",
        "id": "a:t:3",
        "source": "svc",
        "type": "t",
        "time": "2024-01-02T03:04:05Z",
        "datacontenttype": "application/json",
        "data": '{"x":[1,"é"]}',
        "subject": "a",
        "aggregatetype": "run",
        "aggregateid": "a",
        "revision": "3",
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    }


def test_absent_optional_attributes_are_left_out() -> None:
    fields = Event(id="e", source="s", type="t", time=datetime.now(UTC)).to_fields()
    assert set(fields) == {*REQUIRED_FIELDS, "datacontenttype", "data"}
    assert fields["data"] == "null"


def test_time_is_written_in_utc() -> None:
    local = datetime(2024, 1, 1, 12, 0, tzinfo=timezone(timedelta(hours=2)))
    fields = Event(id="e", source="s", type="t", time=local).to_fields()
    assert fields["time"] == "2024-01-01T10:00:00Z"


def test_unknown_extension_fields_are_ignored() -> None:
    event = Event.from_fields(valid_fields(comexampleext="x"))
    assert event.id == "run-1:run.created:1"
    assert event.data == {"a": 1}
    assert event.revision == 1


def test_naive_time_is_read_as_utc() -> None:
    event = Event.from_fields(valid_fields(time="2024-05-01T12:00:00"))
    assert event.time == datetime(2024, 5, 1, 12, tzinfo=UTC)


def test_non_json_content_type_keeps_data_as_text() -> None:
    event = Event.from_fields(valid_fields(datacontenttype="text/plain", data="not json"))
    assert event.data == "not json"


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        pytest.param({}, "empty_entry", id="empty"),
        *[
            pytest.param(valid_fields(**{name: None}), "missing_field", id=f"no-{name}")
            for name in REQUIRED_FIELDS
        ],
        pytest.param(valid_fields(id=""), "missing_field", id="empty-id"),
        pytest.param(valid_fields(specversion="0.3"), "bad_specversion", id="specversion"),
        pytest.param(valid_fields(data="{not json"), "bad_json", id="bad-json"),
        pytest.param(valid_fields(data='"' + "x" * 200 + '"'), "data_too_large", id="too-large"),
        pytest.param({b"specversion": b"1.0", b"id": b"\xff\xfe"}, "bad_encoding", id="value"),
        pytest.param({b"\xff": b"x", b"id": b"e"}, "bad_encoding", id="key"),
        pytest.param(valid_fields(source="a\x00b"), "bad_encoding", id="nul"),
        pytest.param(valid_fields(revision=str(2**63)), "bad_revision", id="revision-overflow"),
        pytest.param(valid_fields(revision="-1"), "bad_revision", id="negative-revision"),
        pytest.param(valid_fields(revision="one"), "bad_revision", id="word-revision"),
        pytest.param(valid_fields(revision="\uff13"), "bad_revision", id="fullwidth-revision"),
        pytest.param(valid_fields(revision=""), "bad_revision", id="empty-revision"),
        pytest.param(valid_fields(time="yesterday"), "bad_field", id="bad-time"),
        pytest.param(valid_fields(id="x" * 513), "bad_field", id="long-id"),
        pytest.param(valid_fields(source="s" * 257), "bad_field", id="long-source"),
    ],
)
def test_from_fields_names_every_reason(raw: dict[Any, Any], code: str) -> None:
    with pytest.raises(InvalidEventError) as info:
        Event.from_fields(raw, max_data_bytes=100)
    assert info.value.code == code
    assert str(info.value).startswith(f"{code}: ")


def test_data_limit_counts_utf8_bytes() -> None:
    text = json.dumps("é" * 50, ensure_ascii=False)  # 52 characters, 102 bytes
    with pytest.raises(InvalidEventError) as info:
        Event.from_fields(valid_fields(data=text), max_data_bytes=101)
    assert info.value.code == "data_too_large"
    assert Event.from_fields(valid_fields(data=text), max_data_bytes=102).data == "é" * 50


def test_event_is_frozen() -> None:
    event = Event.from_fields(valid_fields())
    with pytest.raises(ValueError):
        event.id = "other"


@pytest.mark.parametrize("data", ['{"x":1e999}', '{"x":NaN}', "[Infinity]", "-Infinity"])
def test_non_finite_numbers_in_data_are_refused(data: str) -> None:
    from outbox_relay.shared.errors import InvalidEventError

    fields = {"specversion": "1.0", "id": "e1", "source": "s", "type": "t",
              "time": "2026-01-01T00:00:00Z", "data": data}
    with pytest.raises(InvalidEventError) as caught:
        Event.from_fields(fields)
    assert caught.value.code == "non_finite_number"
