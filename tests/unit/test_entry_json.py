"""The relay's direct JSON writing of the append script's argument (``relay.append.entry_json``)
is byte for byte what ``json.dumps`` made of the fields of ``shared.envelope.encode_fields``
(through ``relay.append.to_fields``): so the stream entries are the same, whatever the row."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from outbox_relay.relay.append import batch_json, entry_json, to_fields
from outbox_relay.relay.outgoing import OutboxRow
from outbox_relay.shared.signing import Signer
from tests.helpers import TRACEPARENT
from tests.helpers import outbox_row as _row

CHECK = settings(max_examples=300, deadline=None, database=None,
                 suppress_health_check=[HealthCheck.too_slow])

# Text with what JSON escapes (quotes, backslashes, control characters), non-ASCII (accents,
# CJK, emoji, U+2028) and lone surrogates, which ``ensure_ascii=False`` passes through as is.
text = st.text(st.characters(codec=None, min_codepoint=0, max_codepoint=0x10FFFF), max_size=40)
tricky = st.sampled_from(['"', "\\", "\n\t\x00\x1f\x7f", "é", "日本", "😀", "\u2028", "\ud800", ""])
strings = st.one_of(text, tricky)
# Times: around now, whole seconds and whole milliseconds, the epoch, the edge of the direct
# path (2**32 s) and beyond it, and times before 1970.
millis = st.one_of(
    st.integers(1_600_000_000_000, 1_900_000_000_000),
    st.integers(0, 2**32 * 1000 + 10_000),
    st.integers(-(2**36), 2**38).map(lambda s: s * 1000),
    st.integers(-62_000_000_000_000, 253_402_300_799_999),
    st.sampled_from([0, 1, 999, 1000, 2**32 * 1000 - 1, 2**32 * 1000, 2**33 * 1000 - 1, -1]),
)
revisions = st.one_of(st.none(), st.integers(0, 2**63 - 1), st.sampled_from([0, 1]))


@st.composite
def headers(draw: st.DrawFn) -> str:
    """A row's headers JSON: none, ``{}``, or trace context (each key present or not, empty
    tracestate, other keys, non-ASCII values, compact or spaced JSON)."""
    kind = draw(st.sampled_from(["empty", "braces", "trace"]))
    if kind == "empty":
        return ""
    if kind == "braces":
        return "{}"
    found: dict[str, Any] = {}
    if draw(st.booleans()):
        found["traceparent"] = draw(st.one_of(st.just(TRACEPARENT), strings))
    if draw(st.booleans()):
        found["tracestate"] = draw(st.one_of(st.just("k=v,vendor=é"), st.just(""), strings))
    if draw(st.booleans()):
        found["baggage"] = draw(strings)
    spaced = draw(st.booleans())
    return json.dumps(found, ensure_ascii=draw(st.booleans()),
                      separators=(", ", ": ") if spaced else (",", ":"))


@st.composite
def rows(draw: st.DrawFn) -> OutboxRow:
    seq = draw(st.integers(1, 2**62))
    return OutboxRow(
        seq=seq, event_id=draw(strings), stream=draw(strings), partition=0,
        aggregate_type=draw(st.one_of(st.none(), strings)),
        aggregate_id=draw(st.one_of(st.none(), strings)),
        revision=draw(revisions), type=draw(strings), source=draw(strings),
        payload=draw(st.one_of(strings, st.just('{"n":1,"note":"é \\" \\\\ \\n"}'),
                               st.builds(lambda v: json.dumps(v, ensure_ascii=False),
                                         st.dictionaries(strings, strings, max_size=3)))),
        headers=draw(headers()), created_at_ms=draw(millis),
        entry_id=draw(st.one_of(st.just(f"{draw(millis)}-{seq}"), strings)),
    )


def reference(batch: list[OutboxRow]) -> str:
    """The argument as it was written before: the fields dict, flattened, one ``json.dumps``."""
    return json.dumps([[r.entry_id, [x for kv in to_fields(r).items() for x in kv]]
                       for r in batch], ensure_ascii=False, separators=(",", ":"))


def _valid_dates(row: OutboxRow) -> bool:
    """Whether ``datetime`` can represent the row's time (else both writers must raise)."""
    try:
        to_fields(row)
    except (ValueError, OverflowError, OSError):
        return False
    return True


@CHECK
@given(st.lists(rows(), min_size=1, max_size=5))
@example([_row()])
@example([_row(aggregate_type=None, aggregate_id=None, revision=None, headers="{}")])
@example([_row(headers=json.dumps({"traceparent": TRACEPARENT}))])
@example([_row(headers=json.dumps({"tracestate": "k=v"}))])  # tracestate alone: dropped
@example([_row(headers=json.dumps({"traceparent": TRACEPARENT, "tracestate": ""}))])
@example([_row(revision=0, created_at_ms=1_764_000_000_000)])  # falsy values kept; .000 left out
@example([_row(created_at_ms=0), _row(created_at_ms=2**32 * 1000), _row(created_at_ms=-1)])
@example([_row(payload="{\"a\":\"\\u00e9\\n\"}", aggregate_id="\u2028\ud800\x00")])
def test_direct_json_is_json_dumps_of_encode_fields(batch: list[OutboxRow]) -> None:
    if not all(_valid_dates(r) for r in batch):
        for r in batch:
            if not _valid_dates(r):
                try:
                    entry_json(r)
                except (ValueError, OverflowError, OSError):
                    continue
                raise AssertionError(f"{r.created_at_ms} encoded, to_fields raised")
        return
    assert batch_json(batch) == reference(batch)
    for r in batch:
        assert json.loads(entry_json(r)) == [r.entry_id,
                                             [x for kv in to_fields(r).items() for x in kv]]


@CHECK
@given(st.one_of(st.builds(float, st.integers(0, 2**40)), st.booleans(), st.just(3.0)))
def test_values_of_other_types_take_the_reference_path(odd: Any) -> None:
    """A value that is not what the columns hold (a float time or revision, a bool) is still
    written exactly as ``json.dumps`` of ``encode_fields`` writes it."""
    for row in (_row(revision=odd), _row(created_at_ms=odd)):
        if _valid_dates(row):
            assert batch_json([row]) == reference([row])


@pytest.mark.parametrize("signed", [False, True], ids=["plain", "signed"])
def test_a_check_only_row_carries_the_flag_the_script_stops_at(signed: bool) -> None:
    """A retried row that must not overtake (relay/outgoing.py ``_overtakers``) reaches the
    script as ``[id, fields, 1]``; every other row as ``[id, fields]``, unchanged."""
    signer = Signer.from_setting("0123456789abcdef0123456789abcdef") if signed else None
    rows = [_row(), _row()._replace(entry_id="2-2", check_only=True), _row()]
    parsed = json.loads(batch_json(rows, signer))
    assert [len(e) for e in parsed] == [2, 3, 2]
    assert parsed[1][2] == 1
    plain = json.loads(batch_json([rows[1]._replace(check_only=False)], signer))
    assert parsed[1][:2] == plain[0]
