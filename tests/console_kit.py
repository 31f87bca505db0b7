"""Dead letters for the console's tests, made by the real consumer, and the handlers that
replay them (``outbox serve --console-apps g1=tests.console_kit:handlers`` imports this).

``late.type`` has no handler in the consumer that dead-letters it (``unknown_type``), and one
here: the "fixed" handlers a replay uses, which record an effect row per application.
"""

from __future__ import annotations

import time

import redis
from sqlalchemy import Engine

from outbox_relay.consumer import Handlers, dead_letters
from outbox_relay.consumer.daemon import Consumer
from outbox_relay.shared import keys
from tests.helpers import (
    GROUP,
    STREAM,
    consumer_settings,
    create_effects,
    event,
    pending_total,
    record_effect,
    xadd_event,
)

LATE = "late.type"

handlers = Handlers()
handlers.register(LATE, record_effect)
handlers.register("thing.happened", record_effect)


def make_letters(engine: Engine, client: redis.Redis, prefix: str,
                 aggregates: tuple[str, ...] = ("a1", "a2", "a3")) -> list[str]:
    """One ``unknown_type`` letter per aggregate (event ids returned) and one
    ``missing_field`` letter (an entry without the envelope), dead-lettered by group g1."""
    create_effects(engine)
    ids = []
    for aggregate in aggregates:
        ev = event(aggregate, 1, type=LATE)
        xadd_event(client, prefix, ev)
        ids.append(ev.id)
    client.xadd(keys.stream_key(prefix, STREAM, 0), {b"id": b"broken"})
    only_known = Handlers()
    only_known.register("thing.happened", record_effect)
    consumer = Consumer(consumer_settings(prefix, max_deliveries=1), engine, client, only_known)
    deadline = time.monotonic() + 20
    while (len(dead_letters.list_letters(client, prefix)) < len(aggregates) + 1
           or pending_total(client, prefix, GROUP)):
        assert time.monotonic() < deadline, "the consumer did not dead-letter the entries"
        consumer.run_once(block_ms=1)
    return ids
