"""A read batch sorted before the claim: letters for what can never apply, deliveries for the rest.

Entries that do not parse, and with a signing key unsigned or forged ones, get a letter and
are acknowledged without a receipt (:func:`split`); entries that vanished from the stream
while pending get a ``lost`` receipt, then a letter (:func:`record_lost`). Everything else
becomes a :class:`consumer.inbox.Delivery` for the claim (consumer/daemon.py, step 1 and 2).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from sqlalchemy import Connection, Engine

from outbox_relay.consumer import inbox, lost, validate
from outbox_relay.consumer.counters import ConsumerStats
from outbox_relay.consumer.handlers import Handlers
from outbox_relay.consumer.streams import Entry
from outbox_relay.shared.errors import InvalidEventError
from outbox_relay.shared.settings import ConsumerSettings
from outbox_relay.shared.signing import Signer

# The consumer daemon's logger, which these records always had: operators filter on it.
log = logging.getLogger("outbox_relay.consumer.daemon")

Letter = tuple[Entry, str, str]  # an entry, its reason code, the reason in words


def split(
    entries: list[Entry], settings: ConsumerSettings, signer: Signer | None, handlers: Handlers,
    stats: ConsumerStats,
) -> tuple[list[Entry], list[Letter], list[inbox.Delivery]]:
    """Split a batch: (to ack now, their letters, deliveries to claim).

    Unparsable entries, and with a signing key unsigned or forged ones
    (:mod:`consumer.validate`), get a letter and are acknowledged, without a receipt; an
    unknown type or too many deliveries (when ``max_deliveries`` is set) marks the
    delivery dead (the claim still decides: a delivery of a blocked aggregate waits
    whatever its counter says).
    """
    s = settings
    to_ack: list[Entry] = []
    letters: list[Letter] = []
    batch: list[inbox.Delivery] = []
    for entry in entries:
        if entry.fields is None:  # vanished while pending: see record_lost
            continue
        try:
            event = validate.parse(entry.fields, s.max_data_bytes, signer)
        except InvalidEventError as err:
            letters.append((entry, err.code, err.message))
            to_ack.append(entry)
            stats.invalid += 1
            continue
        reason = None
        if handlers.get(event.type) is None:
            reason = "unknown_type"
        elif s.max_deliveries and entry.deliveries > s.max_deliveries:
            reason = "max_deliveries"
        batch.append(inbox.Delivery(entry.key, entry.entry_id, event, entry.deliveries, reason))
    return to_ack, letters, batch


def record_lost(
    engine: Engine, settings: ConsumerSettings, vanished: list[Entry], letters: list[Letter],
    fence: Callable[[list[str]], Callable[[Connection], None] | None], stats: ConsumerStats,
) -> list[Entry]:
    """Entries that vanished from the stream while pending (an operator's blind trim):
    a ``lost`` receipt committed first (consumer/lost.py), then a letter (added to
    ``letters``) carrying what the outbox still knows; returns the entries to ack.
    ``fence``: the consumer's ownership fence for the keys (its ``_fence_check``)."""
    if not vanished:
        return []
    check = fence(sorted({e.key for e in vanished}))
    decided = lost.record(engine, settings.key_prefix, settings.group, vanished, check)
    for d in decided:
        if d.letter:
            stats.lost += 1
            letters.append((d.entry, lost.LOST, "the entry vanished from the stream while "
                            "pending (trimmed or deleted before this group handled it)"))
            log.warning("entry %s of %s vanished while pending; receipt lost, "
                        "dead-lettered", d.entry.entry_id, d.entry.key,
                        extra={"event_id": d.event_id, "stream_key": d.entry.key,
                               "group": settings.group})
    return [d.entry for d in decided]
