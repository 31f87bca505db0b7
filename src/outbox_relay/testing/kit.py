"""The test kit: the real relay and a real consumer in-process, driven until nothing is left.

Why: a handler's contract is "applied once, in order, or dead-lettered with a reason", and the
code that keeps it (the relay's append, the consumer's claim, receipts, order checks, retries,
dead letters) is ours, not the handler's. A test of a handler should run through all of it,
without daemons, threads to wait for or sleeps. :class:`Outbox` does: the test enqueues in its
own transaction, calls :meth:`Outbox.drain`, and asserts on what the handlers wrote,
:meth:`Outbox.receipts` and :meth:`Outbox.dead_letters`.

It runs :meth:`relay.daemon.Relay.run_once` and :meth:`consumer.daemon.Consumer.drain_pending`
/ :meth:`~consumer.daemon.Consumer.run_once` (with partition ownership, as ``outbox consume``
runs), nothing re-implemented. By default on a temporary SQLite file and an in-process
fakeredis (its Lua, the ``lupa`` package of the ``testing`` extra, runs the relay's and the
consumer's scripts); given URLs, on a real PostgreSQL (in a schema of its own, dropped on
close) and a real Redis (under a key prefix of its own, deleted on close).
"""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypedDict

import redis
from sqlalchemy import Connection, Engine, make_url
from sqlalchemy.orm import Session

from outbox_relay.consumer.daemon import Consumer
from outbox_relay.consumer.handlers import Handlers
from outbox_relay.producer.enqueue import Producer
from outbox_relay.relay.daemon import Relay
from outbox_relay.shared import keys
from outbox_relay.shared.db import make_engine, now_ms, upgrade
from outbox_relay.shared.errors import ConfigError, OutboxError
from outbox_relay.shared.redis_conn import connect_redis
from outbox_relay.shared.settings import CommonSettings, ConsumerSettings, RelaySettings
from outbox_relay.testing import state
from outbox_relay.testing.state import Backlog, DeadLetter, Receipt

NODE = "outbox-testing"  # the relay's node id and the consumer's name: one of each per kit
MAX_STEPS = 10_000  # relay rounds or consumer reads within one drain round (a backstop)


class NotSettledError(OutboxError):
    """:meth:`Outbox.drain` could not bring the outbox and the group to rest."""

    code = "not_settled"


@dataclass(frozen=True)
class DrainReport:
    """What one :meth:`Outbox.drain` did."""

    rounds: int
    delivered: int  # outbox rows the relay appended to their streams
    applied: int  # events whose handlers' writes committed with their receipts
    dead: int  # events dead-lettered (rejected, out_of_order, unknown_type …)
    failures: int  # handler failures given a later attempt
    advanced_ms: int  # how far the kit moved the clock (retries, delayed events)


class Options(TypedDict, total=False):
    """What ``outbox_options`` may set: :class:`Outbox` keywords besides the URLs."""

    group: str
    streams: Sequence[str] | None
    partitions: int | None
    consumer_options: Mapping[str, Any] | None


class Outbox:
    """One relay and one consumer of ``group`` on a database and a Redis of their own.

    ``handlers``: the registry under test. ``streams``: the logical streams the group reads
    (None: every stream the outbox holds a row for when :meth:`drain` runs). ``partitions``
    must equal the producer's (``Producer.partitions``; None: ``OUTBOX_PARTITIONS``, default
    4, as the daemons read it).
    ``database_url`` / ``redis_url``: None for a temporary SQLite file / fakeredis.
    ``consumer_options``: further ``ConsumerSettings`` fields (``retry_first_delay_s``,
    ``max_deliveries``, ``signing_key`` …); the other fields come from the environment, as for
    ``outbox consume``.

    What holds when :meth:`drain` returns: every event committed before it (and every event
    its handlers enqueued) was appended to its stream once and, on the streams the group
    reads, is ``applied``, ``superseded`` or ``dead`` with a receipt (and a dead letter for
    each dead one), in the order the consumer guarantees; a rolled-back enqueue left nothing.
    Otherwise :meth:`drain` raises. Use it as a context manager (or call :meth:`close`): it
    drops what it created. A ``database_url`` other than PostgreSQL (a SQLite file) should
    name a fresh database: the kit's relay repairs streams from what the outbox says was
    delivered, and a new kit has new (empty) streams.
    """

    def __init__(
        self,
        handlers: Handlers,
        *,
        group: str = "tests",
        streams: Sequence[str] | None = None,
        partitions: int | None = None,
        database_url: str | None = None,
        redis_url: str | None = None,
        consumer_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.handlers = handlers
        self.group = group
        self.partitions = CommonSettings().partitions if partitions is None else partitions
        self.key_prefix = f"kit{uuid.uuid4().hex[:12]}"
        self._streams = list(streams) if streams is not None else None
        self._consumer_options = dict(consumer_options or {})
        self._cleanup: list[Callable[[], None]] = []
        self._closed = False
        try:
            self.engine: Engine = self._open_database(database_url)
            upgrade(self.engine)
            self.client: redis.Redis = self._open_redis(redis_url)
            self.producer = Producer(source="tests", partitions=self.partitions,
                                     key_prefix=self.key_prefix)
            self.relay = Relay(RelaySettings(key_prefix=self.key_prefix,
                                             partitions=self.partitions, node_id=NODE),
                               self.engine, self.client)
            self._consumer: Consumer | None = None
            self._retired: tuple[int, ...] = (0,) * 8
        except BaseException:
            self.close()
            raise

    # -- the test's side ------------------------------------------------------------------

    def enqueue(self, conn: Connection | Session | None = None, /, **event: Any) -> str:
        """Enqueue one event (keywords of ``Producer.build``) in ``conn``'s transaction, or in
        a transaction of its own without one; returns the event id. Events the code under test
        enqueues with its own ``Producer`` work as well, if its ``partitions`` match."""
        if conn is not None:
            return self.producer.enqueue(conn, **event)
        with self.engine.begin() as own:
            return self.producer.enqueue(own, **event)

    def drain(self, *, max_rounds: int = 1_000, fast_forward: bool = True) -> DrainReport:
        """Relay and consume until nothing is left to deliver or apply; return what it did.

        A round: the relay runs until it reports no backlog, then the consumer's pending pass
        (retries, entries held behind a failing one) and its reads of new entries until none
        is unread. It stops when the outbox has no undelivered row and the group no pending
        or unread entry and no retry outstanding. Events handlers enqueue are delivered and
        applied in the same drain.

        When a round changed nothing and something waits on the clock (a retry's next
        attempt, a delayed event), ``fast_forward`` moves the clock to the earliest of them
        (:func:`testing.state.advance`), so a handler that fails once is retried and applied
        without waiting, and one that keeps failing reaches its retry horizon and is
        dead-lettered (``retry_horizon``). Deterministic: nothing sleeps or polls the clock
        (the same events, handlers and outcomes give the same receipts and letters).

        Raises :class:`NotSettledError` when a round changed nothing and nothing waits on the
        clock (a stream no consumer of the group reads is fine; an append Redis refuses is
        not), or after ``max_rounds`` rounds; the message lists what is left.
        """
        start = self._counters()
        advanced = 0
        last = None
        for rounds in range(1, max_rounds + 1):
            self._relay_round()
            consumer = self._consumer_for_streams()
            if consumer is not None:
                self._consume_round(consumer)
            left = self.backlog()
            if left.settled:
                return self._report(rounds, start, advanced)
            counters = (*self._counters(), left.undelivered, len(left.retrying))
            if counters != last:
                last = counters
                continue
            due = _next_due(left)
            if not fast_forward or due is None:
                why = "nothing waits on the clock" if due is None else "fast_forward is off"
                raise NotSettledError(f"drain() round {rounds} changed nothing and {why}; "
                                      f"left: {left.describe()}")
            state.advance(self.engine, self.group, due)
            advanced += due
        raise NotSettledError(f"drain() did not settle within {max_rounds} rounds; left: "
                              f"{self.backlog().describe()}")

    def receipts(self) -> list[Receipt]:
        """The group's inbox receipts (applied, superseded, dead), in claim order."""
        return state.receipts(self.engine, self.group)

    def dead_letters(self) -> list[DeadLetter]:
        """The group's dead letters (what ``outbox dlq list`` shows), oldest first in each
        partition's dead-letter stream."""
        return state.letters(self.client, self.key_prefix, self.group)

    def backlog(self) -> Backlog:
        """What is left right now (:attr:`state.Backlog.settled` after a :meth:`drain`)."""
        stream_keys = self._consumer.keys if self._consumer is not None else []
        return state.backlog(self.engine, self.client, self.group, stream_keys)

    def stream_key(self, stream: str, partition: int) -> str:
        """The Redis key of one partition stream (for a test that inspects it)."""
        return keys.stream_key(self.key_prefix, stream, partition)

    # -- driving the daemons --------------------------------------------------------------

    def _relay_round(self) -> None:
        for _ in range(MAX_STEPS):
            if not self.relay.run_once():
                return

    def _consume_round(self, consumer: Consumer) -> None:
        consumer.drain_pending()
        for _ in range(MAX_STEPS):
            if not state.unread(self.client, self.group, consumer.keys):
                return
            if not consumer.run_once(block_ms=1):  # BLOCK 1 ms: there are entries to read
                return

    def _consumer_for_streams(self) -> Consumer | None:
        """The consumer, built anew (same name, same group) when the streams it must read
        grew: its pending entries stay its own, and its first pass re-reads them. None while
        there is no stream to read (an empty outbox and no ``streams``)."""
        names = self._streams if self._streams is not None else state.outbox_streams(
            self.engine)
        if not names:
            return None
        if self._consumer is not None and self._consumer.settings.stream_names() == names:
            return self._consumer
        options = {"group": self.group, "consumer": NODE, "streams": ",".join(names),
                   "partitions": self.partitions, "key_prefix": self.key_prefix,
                   "block_ms": 1, **self._consumer_options}
        if self._consumer is not None:
            self._retired = self._counters()[2:]
        self._consumer = Consumer(ConsumerSettings(**options), self.engine, self.client,
                                  self.handlers, ownership=True)
        return self._consumer

    def _counters(self) -> tuple[int, ...]:
        """Relay and consumer counters since the kit started (a consumer built anew for more
        streams adds to its predecessors'): delivered, already present, then applied,
        duplicates, superseded, dead, invalid, lost, failed, resurrected."""
        r = self.relay.stats
        counted = (r.delivered, r.already_present)
        if self._consumer is None:
            return counted + self._retired
        c = self._consumer.stats
        now = (c.applied, c.duplicates, c.superseded, c.dead, c.invalid, c.lost, c.failed,
               c.resurrected)
        return counted + tuple(a + b for a, b in zip(self._retired, now, strict=True))

    def _report(self, rounds: int, start: tuple[int, ...], advanced: int) -> DrainReport:
        end = self._counters()
        delta = [b - a for a, b in zip(start, end, strict=True)]
        return DrainReport(rounds=rounds, delivered=delta[0], applied=delta[2], dead=delta[5],
                           failures=delta[8], advanced_ms=advanced)

    # -- resources ------------------------------------------------------------------------

    def _open_database(self, url: str | None) -> Engine:
        if url is None:
            folder = tempfile.mkdtemp(prefix="outbox-testing-")
            self._cleanup.append(lambda: shutil.rmtree(folder, ignore_errors=True))
            url = f"sqlite:///{folder}/outbox.db"
        elif make_url(url).get_backend_name() == "postgresql":
            url = self._own_schema(url)
        engine = make_engine(url)
        self._cleanup.append(engine.dispose)
        return engine

    def _own_schema(self, url: str) -> str:
        """A schema of this kit's own on PostgreSQL (dropped on close), so that tests can run
        side by side on one database; the URL's connections use it as their search path."""
        schema = self.key_prefix
        state.create_schema(url, schema)
        self._cleanup.append(lambda: state.drop_schema(url, schema))
        return make_url(url).update_query_dict(
            {"options": f"-csearch_path={schema}"}).render_as_string(hide_password=False)

    def _open_redis(self, url: str | None) -> redis.Redis:
        if url is not None:
            client = connect_redis(url)
            prefix = self.key_prefix

            def forget() -> None:
                state.forget_keys(client, prefix)
                client.close()

            self._cleanup.append(forget)
            return client
        # fakeredis runs Lua, the relay's append script, only with lupa installed
        if not all(importlib.util.find_spec(name) for name in ("fakeredis", "lupa")):
            raise ConfigError("the test kit's default Redis is fakeredis with Lua: install "
                              "outbox-relay[testing] (fakeredis[lua]), or give redis_url "
                              "(OUTBOX_TEST_REDIS_URL)")
        import fakeredis

        fake: redis.Redis = fakeredis.FakeRedis(server=fakeredis.FakeServer())
        self._cleanup.append(fake.close)
        return fake

    def close(self) -> None:
        """Stop the relay (it gives its leases back), then drop the schema, keys and files
        this kit created. Safe to call twice."""
        relay: Relay | None = getattr(self, "relay", None)
        if relay is not None and not self._closed:
            relay.stop()
            relay.run(until_idle=True)  # with stop set: only its shutdown (leases, threads)
        self._closed = True
        cleanup, self._cleanup = self._cleanup, []
        for step in reversed(cleanup):
            step()

    def __enter__(self) -> Outbox:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _next_due(left: Backlog) -> int | None:
    """Milliseconds until the earliest thing that waits on the clock, or None."""
    times = [r.next_attempt_at_ms for r in left.retrying]
    if left.undelivered and left.next_available_ms is not None:
        times.append(left.next_available_ms)
    now = now_ms()
    future = [t for t in times if t > now]
    return min(future) - now + 1 if future else None
