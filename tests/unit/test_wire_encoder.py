"""One wire encoder: the relay's fields of a row equal the model's, field for field, and parse
back to the same event (every optional attribute set, and none)."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from outbox_relay.relay.append import to_fields
from outbox_relay.relay.outgoing import OutboxRow
from outbox_relay.shared.envelope import Event
from tests.helpers import TRACEPARENT, outbox_row


@pytest.mark.parametrize("row", [
    outbox_row(),
    outbox_row(aggregate_type=None, aggregate_id=None, revision=None, headers="{}"),
    outbox_row(headers=json.dumps({"traceparent": TRACEPARENT})),
], ids=["every-attribute", "no-optional", "traceparent-only"])
def test_the_relay_and_the_model_encode_the_same_fields(row: OutboxRow) -> None:
    headers = json.loads(row.headers)
    model = Event(
        id=row.event_id, source=row.source, type=row.type,
        time=datetime.fromtimestamp(row.created_at_ms / 1000, tz=UTC),
        subject=row.aggregate_id, data=json.loads(row.payload),
        aggregatetype=row.aggregate_type, aggregateid=row.aggregate_id, revision=row.revision,
        traceparent=headers.get("traceparent"), tracestate=headers.get("tracestate"),
    )
    fields = to_fields(row)
    assert fields == model.to_fields()
    assert Event.from_fields(fields) == model  # and back
    assert fields["time"] == "2025-11-24T16:00:00.123000Z"
