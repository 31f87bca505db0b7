"""What a dead outcome's letter says: its reason, a message, and the fields that explain it.

Every letter carries the entry's original fields plus the ``dlq.*`` fields of
:func:`consumer.streams.dead_letter`; some reasons add their evidence:

- ``out_of_order``: ``dlq.revision`` (the event's) and ``dlq.head`` (the applied revision it
  arrived behind);
- ``conflicting_duplicate``: ``dlq.receipt_fingerprint`` (the event the inbox applied under
  this id) and ``dlq.fingerprint`` (the one delivered now), :func:`shared.envelope.fingerprint`;
- ``rejected`` and ``retry_horizon``: ``dlq.attempts`` (the handler's failures), and the
  message names the error (a ``PermanentError``'s own text).
"""

from __future__ import annotations

from outbox_relay.consumer import inbox
from outbox_relay.consumer.streams import Entry


def of(entry: Entry, o: inbox.Outcome) -> tuple[Entry, str, str]:
    """``(entry with its evidence fields, reason, message)`` of a dead outcome."""
    reason = o.error or inbox.DEAD
    extra: dict[bytes, bytes] = {}
    message = f"dead-lettered: {reason}"
    if reason == inbox.OUT_OF_ORDER:
        rev, head = o.delivery.event.revision, o.head
        extra = {b"dlq.revision": str(rev).encode(),
                 b"dlq.head": str(head if head is not None else "").encode()}
        message = f"revision {rev} arrived after revision {head} was applied"
    elif reason == inbox.CONFLICTING_DUPLICATE and o.detail:
        applied, delivered = o.detail.split(" ", 1)
        extra = {b"dlq.receipt_fingerprint": applied.encode(),
                 b"dlq.fingerprint": delivered.encode()}
        message = ("the event id was applied with other content (fingerprint "
                   f"{applied[:12]}…); this delivery ({delivered[:12]}…) was not applied")
    elif reason in (inbox.REJECTED, inbox.RETRY_HORIZON):
        extra = {b"dlq.attempts": str(o.attempts).encode()}
        what = "the handler refused it" if reason == inbox.REJECTED else (
            "its first failure is older than the retry horizon")
        message = f"{what} after {o.attempts} attempt(s): {o.detail or o.error}"
    if not extra:
        return entry, reason, message
    fields = {**(entry.fields or {}), **extra}
    return Entry(entry.key, entry.entry_id, fields, entry.deliveries), reason, message
