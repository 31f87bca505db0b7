"""The one lease algorithm (shared/leases.py), on both databases and both lease tables.

Relay partitions and consumer partition streams share it, so every property is checked on both
tables: the fair share among live nodes, the epoch bump of a take, a renewal that lost a race
not believed held, scopes that do not see each other's nodes, releases, one-off takes, and two
hosts whose clocks are an hour apart sharing the keys by the database's clock.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
from sqlalchemy import Engine, select, update

from outbox_relay.consumer.ownership import CONSUMER_LEASES
from outbox_relay.relay.leases import RELAY_LEASES
from outbox_relay.shared import leases
from outbox_relay.shared.leases import Key, LeaseTable

pytestmark = pytest.mark.integration

TTL_MS = 60_000
KEYS_OF = {"relay": [(p,) for p in range(4)],
           "consumer": [("orders", p) for p in range(2)] + [("billing", p) for p in range(2)]}


@pytest.fixture(params=["relay", "consumer"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def table_of(kind: str) -> LeaseTable:
    return RELAY_LEASES if kind == "relay" else CONSUMER_LEASES


def scope_of(kind: str) -> dict[str, Any]:
    return {} if kind == "relay" else {"group_name": f"g-{uuid.uuid4().hex[:8]}"}


def owners(engine: Engine, table: LeaseTable, scope: dict[str, Any]) -> dict[Key, str | None]:
    """Each key's owner as the lease table says."""
    t = table.leases
    with engine.connect() as conn:
        rows = conn.execute(select(t).where(*table.in_scope(t, scope))).all()
    return {table.key_of(r): r.owner for r in rows}


def expire(engine: Engine, table: LeaseTable, scope: dict[str, Any], node: str) -> None:
    """``node`` stops (a crash): its leases and heartbeat are past their expiry."""
    with engine.begin() as conn:
        conn.execute(update(table.leases).where(*table.in_scope(table.leases, scope),
                                                table.leases.c.owner == node)
                     .values(expires_at_ms=1))
        conn.execute(update(table.nodes).where(*table.in_scope(table.nodes, scope),
                                               table.nodes.c[table.node_column] == node)
                     .values(expires_at_ms=1))


def test_two_nodes_split_the_keys_and_a_take_bumps_the_epoch(engine: Engine, kind: str) -> None:
    table, scope, keys = table_of(kind), scope_of(kind), KEYS_OF[kind]
    a = leases.acquire(engine, table, scope, "a", keys, TTL_MS)
    assert set(a) == set(keys) and set(a.values()) == {1}  # alone: all, each taken once
    leases.acquire(engine, table, scope, "b", keys, TTL_MS)  # b's heartbeat: 2 live nodes
    a = leases.acquire(engine, table, scope, "a", keys, TTL_MS)  # a gives up its extra half
    b = leases.acquire(engine, table, scope, "b", keys, TTL_MS)
    assert len(a) == len(b) == 2 and not set(a) & set(b)
    assert set(b.values()) == {2}  # taken from a: the fence moved
    assert owners(engine, table, scope) == {**dict.fromkeys(a, "a"), **dict.fromkeys(b, "b")}

    expire(engine, table, scope, "b")  # b crashes
    a = leases.acquire(engine, table, scope, "a", keys, TTL_MS)
    assert set(a) == set(keys)
    assert {a[k] for k in b} == {3}  # b's keys come back to a under a new epoch


def test_a_renewal_that_lost_the_race_is_not_believed_held(engine: Engine, kind: str) -> None:
    """a read its rows, then b took one of its keys (a's lease had expired) before a's renewal
    ran: the renewal changes no row, so a must not count the key as its own."""
    table, scope, keys = table_of(kind), scope_of(kind), KEYS_OF[kind]
    leases.acquire(engine, table, scope, "a", keys, TTL_MS)
    with engine.begin() as conn:
        now = leases.db_now(conn)
        stale = leases.lease_rows(conn, table, scope, keys)  # a sees its own, live leases
    expire(engine, table, scope, "a")
    b = leases.acquire(engine, table, scope, "b", keys, TTL_MS)
    assert set(b) == set(keys)
    with engine.begin() as conn:
        held = leases.rebalance(conn, table, scope, "a", stale, len(keys), TTL_MS, now)
    assert held == {}
    assert set(owners(engine, table, scope).values()) == {"b"}


def test_a_live_lease_is_never_taken_and_a_one_off_take_bumps_a_free_one(
    engine: Engine, kind: str
) -> None:
    table, scope, keys = table_of(kind), scope_of(kind), KEYS_OF[kind]
    a = leases.acquire(engine, table, scope, "a", keys[:1], TTL_MS)
    assert leases.take_free(engine, table, scope, "tool", keys[0], TTL_MS) is None
    assert leases.take_free(engine, table, scope, "tool", keys[1], TTL_MS) == 1  # no row yet
    leases.release(engine, table, scope, "a", a)
    assert leases.take_free(engine, table, scope, "tool", keys[0], TTL_MS) == a[keys[0]] + 1
    assert owners(engine, table, scope)[keys[0]] == "tool"


def test_a_release_frees_the_keys_and_the_node_no_longer_counts(engine: Engine, kind: str) -> None:
    table, scope, keys = table_of(kind), scope_of(kind), KEYS_OF[kind]
    leases.acquire(engine, table, scope, "b", keys, TTL_MS)
    a = leases.acquire(engine, table, scope, "a", keys, TTL_MS)
    b = leases.acquire(engine, table, scope, "b", keys, TTL_MS)  # b at its share of 2
    leases.release(engine, table, scope, "b", b)
    assert set(owners(engine, table, scope).values()) <= {"a", None}
    a = leases.acquire(engine, table, scope, "a", keys, TTL_MS)  # alone again: everything
    assert set(a) == set(keys)


def test_groups_do_not_count_each_others_nodes(engine: Engine) -> None:
    keys = KEYS_OF["consumer"]
    one, two = scope_of("consumer"), scope_of("consumer")
    leases.acquire(engine, CONSUMER_LEASES, one, "a", keys, TTL_MS)
    leases.acquire(engine, CONSUMER_LEASES, two, "b", keys, TTL_MS)
    a = leases.acquire(engine, CONSUMER_LEASES, one, "a", keys, TTL_MS)
    b = leases.acquire(engine, CONSUMER_LEASES, two, "b", keys, TTL_MS)
    assert set(a) == set(b) == set(keys)  # each alone in its group


def test_hosts_an_hour_apart_share_the_keys_by_the_database_clock(
    engine: Engine, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Host a runs an hour behind, host b an hour ahead (every Python clock they could read).
    By a host clock, b would see a's leases and heartbeat as long expired and take everything,
    and a would see b's as valid for an hour after b stopped; by the database's they share."""
    table, scope, keys = table_of(kind), scope_of(kind), KEYS_OF[kind]
    real_time, real_ns = time.time, time.time_ns

    def on_host(skew_s: float) -> None:
        monkeypatch.setattr(time, "time", lambda: real_time() + skew_s)
        monkeypatch.setattr(time, "time_ns", lambda: real_ns() + int(skew_s * 1e9))

    for _ in range(3):  # a few rounds: a share that flapped would show
        on_host(-3600)
        a = leases.acquire(engine, table, scope, "a", keys, TTL_MS)
        on_host(+3600)
        b = leases.acquire(engine, table, scope, "b", keys, TTL_MS)
    on_host(-3600)
    a = leases.acquire(engine, table, scope, "a", keys, TTL_MS)
    assert len(a) == len(b) == len(keys) // 2 and not set(a) & set(b)
    assert set(a.values()) == {1} and set(b.values()) == {2}  # one handover, no flapping


def test_a_lease_its_owner_let_expire_comes_back_to_it_under_a_new_epoch(
    engine: Engine, kind: str
) -> None:
    """A node paused past its TTL (nobody took its keys meanwhile) wins them back at its next
    round, but as a new lease: epoch + 1, so the caller treats the keys as newly owned (takes
    over their pending entries first) and a write fenced at the old epoch is refused."""
    table, scope, keys = table_of(kind), scope_of(kind), KEYS_OF[kind]
    before = leases.acquire(engine, table, scope, "a", keys, TTL_MS)
    assert leases.acquire(engine, table, scope, "a", keys, TTL_MS) == before  # renewed
    expire(engine, table, scope, "a")
    after = leases.acquire(engine, table, scope, "a", keys, TTL_MS)
    assert after == {k: e + 1 for k, e in before.items()}
