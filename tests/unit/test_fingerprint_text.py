"""The fingerprint's canonical JSON, written by a C encoder built once
(``shared/envelope.py``, ``_canonical_json``), is the text ``json.JSONEncoder.encode`` with the
same options writes: a receipt's fingerprint must not change with how it is computed (a
redelivered event would otherwise be a ``conflicting_duplicate`` of its own receipt)."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from outbox_relay.shared import envelope
from outbox_relay.shared.envelope import Event, fingerprint

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=500, deadline=None, database=None)
@given(json_values, st.text(max_size=8), st.none() | st.integers(0, 2**63 - 1))
def test_the_canonical_text_is_the_encoders(data: Any, name: str, revision: int | None) -> None:
    body = [name, "svc", None, "agg-1", revision, "application/json", data]
    assert envelope._canonical_json(body) == envelope._CANONICAL.encode(body)


def test_a_known_fingerprint_is_unchanged() -> None:
    """Pinned: the hex SHA-256 of the canonical text, keys sorted, non-ASCII as is."""
    event = Event(id="e-1", source="svc", type="thing.done", time=datetime(2024, 1, 1, tzinfo=UTC),
                  aggregatetype="thing", aggregateid="agg-1", revision=3,
                  data={"b": [1, 2.5, None], "a": "é"})
    text = '["thing.done","svc","thing","agg-1",3,"application/json",{"a":"é","b":[1,2.5,null]}]'
    assert envelope._canonical_json(
        [event.type, event.source, event.aggregatetype, event.aggregateid, event.revision,
         event.datacontenttype, event.data]) == text
    assert fingerprint(event) == hashlib.sha256(text.encode("utf-8")).hexdigest()


def test_a_cycle_is_refused_as_the_encoder_refuses_it() -> None:
    cyclic: list[Any] = []
    cyclic.append(cyclic)
    with pytest.raises(ValueError, match="Circular reference"):
        envelope._canonical_json(["t", cyclic])
