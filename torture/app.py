"""Handlers of the torture consumer group: each applied event leaves one side-effect row.

The ``torture_effects`` table deliberately has **no** unique constraint on the event: if the
inbox ever let an event through twice, two rows would show it. The row is written through the
claim transaction's connection, so it commits together with the inbox receipt or not at all.
Its ``seq`` (an autoincrement key) is the apply order: on SQLite writers are serialized, and on
PostgreSQL two claims touching one aggregate hold the same advisory lock, so within one group
and aggregate a later apply always gets a higher ``seq``. :mod:`torture.check` reads the order
of every aggregate back from it.

Types (see :mod:`torture.load`): ``item.changed`` and ``item.noted`` (the same change's two
events, sharing a revision) are ``strict``; ``item.touched`` and every other type (run events,
the plain ``torture.event``) are ``latest``. Strict and latest events never share an
aggregate (``item`` vs ``touch``), so the check judges each aggregate by one rule.

With ``TORTURE_FAIL_PERCENT=N`` (the harness sets 2; unset, nothing fails) about N % of events,
chosen by a hash of the id, fail their first handler call in a process, then succeed on retry:
a transient failure that must hold back the aggregate's later revisions.

A downstream outage: while the file named by ``TORTURE_OUTAGE_FILE`` exists (the harness
creates it for a window mid-run), every handler call raises :class:`DownstreamDown`. The
consumers' retry policy must wait it out: afterwards everything is applied, in order, and
nothing is dead-lettered (design.md flow 3, invariant 9).

One chained hop (publishing from a handler; with ``TORTURE_CHAIN=1``, which the harness sets):
applying a *source* event (:func:`chains`: about :data:`CHAIN_PERCENT` % of the
``item.changed`` events, by a hash of the id) also enqueues, on the claim's connection, its
chained event :func:`chained_id` (``item.relayed``, same aggregate and revision) on stream
:data:`CHAIN_STREAM`, which the second group :data:`CHAIN_GROUP` applies (strict). The chained
event commits with the source's receipt, or neither.

Loaded with ``outbox consume --app torture.app:handlers``.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable

from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    Engine,
    Integer,
    MetaData,
    String,
    Table,
)
from sqlalchemy.ext.asyncio import AsyncConnection

from outbox_relay.consumer import Handlers
from outbox_relay.producer import Producer
from outbox_relay.shared.db import now_ms
from outbox_relay.shared.envelope import Event
from outbox_relay.shared.settings import ConsumerSettings

CHAIN_TYPE = "item.relayed"
STRICT_TYPES = frozenset({"item.changed", "item.noted", CHAIN_TYPE})
LATEST_TYPES = frozenset({"item.touched"})  # and "*": every type not named here
CHAIN_SOURCE_TYPE = "item.changed"
CHAIN_PERCENT = 25
CHAIN_STREAM = "chained"
CHAIN_GROUP = "chain"
CHAIN_PREFIX = "relayed:"

metadata = MetaData()

effects = Table(
    "torture_effects",
    metadata,
    # The apply order; BIGSERIAL on PostgreSQL, the rowid on SQLite.
    Column("seq", BigInteger().with_variant(Integer, "sqlite"), primary_key=True,
           autoincrement=True),
    Column("event_id", String(512), nullable=False),  # no unique constraint, on purpose
    Column("group_name", String(64), nullable=False),
    Column("event_type", String(256), nullable=False),
    Column("aggregate_type", String(128)),
    Column("aggregate_id", String(256)),
    Column("revision", BigInteger),
    Column("pid", Integer, nullable=False),
    Column("created_at_ms", BigInteger, nullable=False),
)

# The producers' compare-and-set rows: an aggregate's next revision is ``revision + 1``.
aggregates = Table(
    "torture_aggregates",
    metadata,
    Column("id", String(256), primary_key=True),
    Column("revision", BigInteger, nullable=False),
)


def create_tables(engine: Engine) -> None:
    """Create ``torture_effects`` and ``torture_aggregates`` (idempotent)."""
    metadata.create_all(engine)


def is_strict(event_type: str) -> bool:
    """Whether the torture group applies ``event_type`` in ``strict`` order."""
    return event_type in STRICT_TYPES


def fails_first(event_id: str, percent: int) -> bool:
    """Whether ``event_id`` is one of the ~``percent`` % whose first call in a process raises."""
    return zlib.crc32(event_id.encode()) % 100 < percent


def chains(event_type: str, event_id: str) -> bool:
    """Whether applying this event enqueues a chained event (a source of the hop)."""
    return (event_type == CHAIN_SOURCE_TYPE
            and zlib.crc32(f"chain:{event_id}".encode()) % 100 < CHAIN_PERCENT)


def chained_id(source_id: str) -> str:
    """The deterministic id of the event chained from ``source_id``."""
    return CHAIN_PREFIX + source_id


def source_of(chained: str) -> str | None:
    """The source event id of a chained event id (None: not a chained id)."""
    return chained[len(CHAIN_PREFIX):] if chained.startswith(CHAIN_PREFIX) else None


class TransientError(RuntimeError):
    """The injected handler failure: the entry stays pending and is retried."""


class DownstreamDown(RuntimeError):
    """The torture's downstream is down (the outage file exists): retried until it is back."""


def handlers(settings: ConsumerSettings) -> Handlers:
    """Every event type: record one effect row in the claim transaction (strict for the item
    changes and the chained type, latest for the rest), failing every call while the outage
    file exists and the first call of ``TORTURE_FAIL_PERCENT`` % of events; a source of the
    hop also enqueues its chained event."""
    group = settings.group
    percent = int(os.environ.get("TORTURE_FAIL_PERCENT", "0"))
    outage = os.environ.get("TORTURE_OUTAGE_FILE", "")
    chain = os.environ.get("TORTURE_CHAIN") == "1"  # the harness sets it; the soak does not
    producer = Producer(source="torture-chain", partitions=settings.partitions,
                        key_prefix=settings.key_prefix)
    failed: set[str] = set()

    def record(conn: Connection, event: Event) -> None:
        if outage and os.path.exists(outage):
            raise DownstreamDown(f"downstream down while applying {event.id}")
        if event.id not in failed and fails_first(event.id, percent):
            failed.add(event.id)
            raise TransientError(f"injected transient failure of {event.id}")
        if chain and chains(event.type, event.id):
            producer.enqueue(conn, type=CHAIN_TYPE, stream=CHAIN_STREAM,
                             aggregate_type=event.aggregatetype, aggregate_id=event.aggregateid,
                             revision=event.revision, data={"source": event.id},
                             event_id=chained_id(event.id))
        conn.execute(
            effects.insert().values(
                event_id=event.id, group_name=group, event_type=event.type,
                aggregate_type=event.aggregatetype, aggregate_id=event.aggregateid,
                revision=event.revision, pid=os.getpid(), created_at_ms=now_ms(),
            )
        )

    registry = Handlers()
    if os.environ.get("TORTURE_HANDLER_STYLE") == "async-batch":
        _register_async_batch(registry, record)
        return registry
    for event_type in sorted(STRICT_TYPES):
        registry.register(event_type, record, ordering="strict")
    for event_type in sorted(LATEST_TYPES):
        registry.register(event_type, record, ordering="latest")
    registry.register("*", record, ordering="latest")
    return registry


def _register_async_batch(registry: Handlers,
                          record: Callable[[Connection, Event], None]) -> None:
    """The same work through the other handler kinds (``TORTURE_HANDLER_STYLE=async-batch``):
    the strict types by an async *batch* handler, the others by async handlers, each calling
    ``record`` on the claim's connection, so the claim runs on an async engine and strict
    events go through batch calls and their one-event fallback."""

    async def one(conn: AsyncConnection, event: Event) -> None:
        await conn.run_sync(record, event)

    async def batch(conn: AsyncConnection, events: list[Event]) -> None:
        for event in events:
            await conn.run_sync(record, event)

    for event_type in sorted(STRICT_TYPES):
        registry.register_batch(event_type, batch, ordering="strict")
    for event_type in sorted(LATEST_TYPES):
        registry.register(event_type, one, ordering="latest")
    registry.register("*", one, ordering="latest")
