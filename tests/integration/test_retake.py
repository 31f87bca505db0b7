"""A consumer that gets a partition stream back (issue 21), on the real Redis and both databases.

The read rule (consumer/read_states.py): no ``XREADGROUP >`` on a stream while any pending
entry of it in the group, this consumer's own included, from an earlier epoch, has not been
processed in the current epoch. Each test drives real :class:`Consumer` objects with ownership
step by step: leases live for a minute, so nothing expires on its own; a lease, a heartbeat or
a pause expires when the test writes its row's expiry into the database, and a renewal falls
due when the test moves the consumer's renewal clock back (:func:`elapse`). The moment of the
renewal inside a pending pass is the consumer's ``after_batch`` hook, which runs between the
pass's pages.

Each scenario applied revision 2 of an aggregate before its own older pending revision 1 (then
dead-lettered ``out_of_order``) before the fix.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import redis
from sqlalchemy import Connection, Engine, select, update

from outbox_relay.consumer import Handlers, streams
from outbox_relay.consumer.daemon import Consumer
from outbox_relay.consumer.read_states import DRAINING, READABLE
from outbox_relay.shared import keys
from outbox_relay.shared.envelope import Event
from outbox_relay.shared.schema import consumer_leases, consumer_nodes
from tests.helpers import (
    GROUP,
    PARTITIONS,
    STREAM,
    consumer_settings,
    dead_letters,
    effects,
    event,
    partition_of,
    pending_total,
    receipts,
    record_effect,
    xadd_event,
)

pytestmark = pytest.mark.integration

TTL_MS = 60_000  # nothing expires unless the test says so


class App:
    """A strict ``thing.happened`` handler recording each application; the ids in ``failing``
    fail (a transient error) for as long as they are there."""

    def __init__(self) -> None:
        self.failing: set[str] = set()
        self.handlers = Handlers()
        self.handlers.register("thing.happened", self.handle)

    def handle(self, conn: Connection, ev: Event) -> None:
        if ev.id in self.failing:
            raise RuntimeError("failing on purpose")
        record_effect(conn, ev)


class Hook:
    """``after_batch``: runs ``action`` once, after the next batch once armed."""

    def __init__(self) -> None:
        self.action: Callable[[], None] | None = None

    def __call__(self) -> None:
        action, self.action = self.action, None
        if action is not None:
            action()


def consumer(engine: Engine, client: redis.Redis, prefix: str, name: str, app: App,
             hook: Hook | None = None, **overrides: Any) -> Consumer:
    settings = consumer_settings(prefix, consumer=name, lease_ttl_ms=TTL_MS,
                                 claim_interval_ms=60_000, max_deliveries=100, **overrides)
    return Consumer(settings, engine, client, app.handlers, after_batch=hook, ownership=True)


def elapse(c: Consumer, ms: float) -> None:
    """As if ``ms`` passed on ``c``'s clock since its last renewal: a third of the ttl makes
    the next renewal due, half of it makes its leases unreadable until then."""
    c.leases._renewed_at -= ms / 1000


def pending_check_due(c: Consumer) -> None:
    """The periodic pending check (every ``claim_interval_ms``) is due at the next step."""
    c._next_pending_check = 0.0


def key(prefix: str, partition: int) -> str:
    return keys.stream_key(prefix, STREAM, partition)


def aggregate_on(partition: int, n: int = 0) -> str:
    return [f"agg-{i}" for i in range(1_000) if partition_of(f"agg-{i}") == partition][n]


def applied(engine: Engine) -> list[str]:
    with engine.connect() as conn:
        return list(conn.execute(select(effects.c.event_id).order_by(effects.c.n)).scalars())


def set_node(engine: Engine, name: str, expires_at_ms: int) -> None:
    """Write (or expire, with 0) a consumer's heartbeat row, as a live or dead node would."""
    with engine.begin() as conn:
        found = conn.execute(update(consumer_nodes).where(
            consumer_nodes.c.group_name == GROUP, consumer_nodes.c.consumer == name)
            .values(expires_at_ms=expires_at_ms)).rowcount
        if not found:
            conn.execute(consumer_nodes.insert().values(
                group_name=GROUP, consumer=name, expires_at_ms=expires_at_ms))


def expire_leases(engine: Engine, owner: str, partitions: list[int] | None = None) -> None:
    """Expire ``owner``'s leases (all, or those of ``partitions``) as a pause would."""
    with engine.begin() as conn:
        stmt = update(consumer_leases).where(consumer_leases.c.group_name == GROUP,
                                             consumer_leases.c.owner == owner)
        if partitions is not None:
            stmt = stmt.where(consumer_leases.c.partition.in_(partitions))
        conn.execute(stmt.values(expires_at_ms=0))


def epochs(engine: Engine) -> dict[int, tuple[str | None, int]]:
    with engine.connect() as conn:
        rows = conn.execute(select(consumer_leases).where(consumer_leases.c.group_name == GROUP))
        return {r.partition: (r.owner, r.epoch) for r in rows}


def settle(c: Consumer, steps: int = 6) -> None:
    for _ in range(steps):
        c.run_once()


def assert_in_order(engine: Engine, client: redis.Redis, prefix: str, *ids: str) -> None:
    """``ids`` applied in this order, each once; no ``out_of_order`` receipt nor letter."""
    order = applied(engine)
    assert [i for i in order if i in ids] == list(ids), order
    got = receipts(engine)
    assert all(got[i] == ("applied", None) for i in ids), got
    assert [dead_letters(client, prefix, p) for p in range(PARTITIONS)] == [[]] * PARTITIONS


def test_a_stream_given_up_and_got_back_reads_its_own_older_pending_entries_first(
    effects_engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    """The issue's timeline: A's revision 1 of X fails and stays pending to A; a rebalance
    makes A give X's stream up; nobody takes it; A gets it back under a new epoch, at the
    renewal inside a pending pass over the streams it kept. Revision 2 of X must wait."""
    app, hook = App(), Hook()
    a = consumer(effects_engine, redis_client, key_prefix, "a", app, hook)
    a.run_once()
    assert len(a.leases.held) == PARTITIONS
    x, z = aggregate_on(3), aggregate_on(0)
    x1, x2, z1 = event(x, 1), event(x, 2), event(z, 1)
    app.failing = {x1.id, z1.id}
    xadd_event(redis_client, key_prefix, x1)
    xadd_event(redis_client, key_prefix, z1)
    a.run_once()
    assert pending_total(redis_client, key_prefix) == 2  # both failed, pending to a

    set_node(effects_engine, "ghost", 10**15)  # a live node: a's fair share drops to 2
    elapse(a, TTL_MS / 3)
    a.run_once()
    assert sorted(a.leases.held) == [key(key_prefix, 0), key(key_prefix, 1)]
    assert epochs(effects_engine)[3][0] is None  # given up, still pending to a
    xadd_event(redis_client, key_prefix, x2)
    app.failing = {z1.id}  # x1 would apply now; z1 keeps a's pending pass going

    def ghost_leaves() -> None:  # between the pass's pages: the renewal gives 2 and 3 back
        set_node(effects_engine, "ghost", 0)
        elapse(a, TTL_MS / 3)

    hook.action = ghost_leaves
    pending_check_due(a)
    a.run_once()  # pass over streams 0 and 1 (z1), renewal inside it, then the read
    assert hook.action is None  # the renewal happened inside the pass
    assert len(a.leases.held) == PARTITIONS
    assert x2.id not in applied(effects_engine)
    assert a.reads.state(key(key_prefix, 3), a.leases.held) == DRAINING

    app.failing = set()
    settle(a)
    assert_in_order(effects_engine, redis_client, key_prefix, x1.id, x2.id)
    assert a.stats.out_of_order == 0
    assert pending_total(redis_client, key_prefix) == 0


def test_a_renewal_inside_a_pending_pass_that_gives_a_stream_back_restarts_its_pass(
    effects_engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    """A pass of one entry per page over a stream with three pending entries of a's own (read
    before a restart); after the first page the stream's lease has expired and the renewal
    gives it back to a under a new epoch. The two entries the pass has not reached must be
    processed, in the new epoch, before revision 2 of X is read."""
    app, hook = App(), Hook()
    streams.ensure_groups(redis_client, [key(key_prefix, p) for p in range(PARTITIONS)], GROUP)
    y, x = aggregate_on(3, 0), aggregate_on(3, 1)
    y1, y2, x1, x2 = event(y, 1), event(y, 2), event(x, 1), event(x, 2)
    for ev in (y1, y2, x1):
        xadd_event(redis_client, key_prefix, ev)
    assert len(redis_client.xreadgroup(GROUP, "a", {key(key_prefix, 3): ">"})[0][1]) == 3
    xadd_event(redis_client, key_prefix, x2)  # new, behind a's three pending entries

    a = consumer(effects_engine, redis_client, key_prefix, "a", app, hook, batch_size=1)

    def lease_expires() -> None:
        expire_leases(effects_engine, "a", [3])
        elapse(a, TTL_MS / 3)

    hook.action = lease_expires
    a.run_once()  # acquire, pass (page 1: y1; renewal: stream 3 at a new epoch), read
    assert hook.action is None
    assert epochs(effects_engine)[3] == ("a", 2)
    assert x2.id not in applied(effects_engine)
    assert a.reads.state(key(key_prefix, 3), a.leases.held) == DRAINING
    assert a.reads.state(key(key_prefix, 0), a.leases.held) == READABLE

    settle(a)
    assert_in_order(effects_engine, redis_client, key_prefix, y1.id, y2.id)
    assert_in_order(effects_engine, redis_client, key_prefix, x1.id, x2.id)
    assert pending_total(redis_client, key_prefix) == 0


@pytest.mark.parametrize("retaken_by", ["itself", "another"])
def test_a_paused_owner_wakes_to_find_its_stream_retaken(
    effects_engine: Engine, redis_client: redis.Redis, key_prefix: str, retaken_by: str
) -> None:
    """a is paused inside a pending pass for longer than its lease: its heartbeat and leases
    expire. Either nobody takes them (a takes them back itself), or b takes them all and is
    paused too before it touched the pending entries, and its leases expire in turn. a wakes:
    its renewal (inside the pass) takes every stream under a new epoch; its own pending
    entries it had not reached must come before revision 2 of X."""
    app, hook = App(), Hook()
    streams.ensure_groups(redis_client, [key(key_prefix, p) for p in range(PARTITIONS)], GROUP)
    y, x = aggregate_on(2, 0), aggregate_on(2, 1)
    y1, y2, x1, x2 = event(y, 1), event(y, 2), event(x, 1), event(x, 2)
    for ev in (y1, y2, x1):
        xadd_event(redis_client, key_prefix, ev)
    assert len(redis_client.xreadgroup(GROUP, "a", {key(key_prefix, 2): ">"})[0][1]) == 3
    xadd_event(redis_client, key_prefix, x2)
    a = consumer(effects_engine, redis_client, key_prefix, "a", app, hook, batch_size=1)
    b = consumer(effects_engine, redis_client, key_prefix, "b", App())

    def paused() -> None:
        expire_leases(effects_engine, "a")
        set_node(effects_engine, "a", 0)
        if retaken_by == "another":
            b.leases.renew()  # b's heartbeat and takeover: every stream, a new epoch each
            assert len(b.leases.held) == PARTITIONS
            expire_leases(effects_engine, "b")  # b paused before its pending pass
            set_node(effects_engine, "b", 0)
        elapse(a, TTL_MS)  # a's own clock says so too: nothing readable until it renews

    hook.action = paused
    a.run_once()  # acquire (epoch 1), pass page 1 (y1), the pause, the renewal, the read
    assert hook.action is None
    assert epochs(effects_engine)[2] == ("a", 3 if retaken_by == "another" else 2)
    assert x2.id not in applied(effects_engine)
    assert a.reads.readable(a.leases.readable(), a.leases.held) == []

    settle(a)
    assert_in_order(effects_engine, redis_client, key_prefix, y1.id, y2.id)
    assert_in_order(effects_engine, redis_client, key_prefix, x1.id, x2.id)
    assert pending_total(redis_client, key_prefix) == 0
    assert a.stats.lease_losses == 0
