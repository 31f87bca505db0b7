"""Broker data-loss repair against the real Redis and both databases.

Loss is simulated on our own keys only (the shared Redis is never flushed): deleting a stream
is a total loss, re-creating it with a prefix of its entries is a rollback to a lagging copy.
"""

from __future__ import annotations

import pytest
import redis
from sqlalchemy import Engine, select

from outbox_relay.relay import repair, repair_store
from outbox_relay.relay.daemon import Relay
from outbox_relay.relay.leases import take_free_lease
from outbox_relay.runs.schema import runs
from outbox_relay.shared import keys
from outbox_relay.shared.schema import outbox
from tests.helpers import (
    REPAIR_PARTITIONS,
    delivered_entries,
    repair_enqueue,
    repair_settings,
    stream_contents,
)

pytestmark = pytest.mark.integration

PARTITIONS = REPAIR_PARTITIONS


def _relay(engine: Engine, client: redis.Redis, prefix: str) -> Relay:
    relay = Relay(repair_settings(engine, prefix), engine, client)
    relay.run(until_idle=True)
    return relay


def _assert_in_step(engine: Engine, client: redis.Redis, prefix: str) -> None:
    for p in range(PARTITIONS):
        assert stream_contents(client, prefix, p) == delivered_entries(engine, p)


def test_total_loss_is_refilled_with_original_ids(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    repair_enqueue(engine, key_prefix, 0, 30)
    _relay(engine, redis_client, key_prefix)
    before = [stream_contents(redis_client, key_prefix, p) for p in range(PARTITIONS)]
    assert sum(map(len, before)) == 30
    for p in range(PARTITIONS):
        redis_client.delete(keys.stream_key(key_prefix, "things", p))

    relay = _relay(engine, redis_client, key_prefix)

    assert [stream_contents(redis_client, key_prefix, p) for p in range(PARTITIONS)] == before
    assert relay.repairer.stats.repaired_entries == 30
    assert relay.repairer.stats.rebuilds == 0
    again = repair.Repairer(repair_settings(engine, key_prefix), engine, redis_client,
                            "repair-test")
    assert again.run(_take_leases(engine)) == 0


def _take_leases(engine: Engine) -> dict[int, int]:
    leases = {p: take_free_lease(engine, p, "repair-test", 10_000)
              for p in range(PARTITIONS)}
    assert None not in leases.values()
    return {p: e for p, e in leases.items() if e is not None}


def test_rollback_to_a_prefix_refills_the_tail_and_keeps_groups(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    repair_enqueue(engine, key_prefix, 0, 40)
    _relay(engine, redis_client, key_prefix)
    key = keys.stream_key(key_prefix, "things", 0)
    entries = redis_client.xrange(key)
    kept = entries[: len(entries) // 2]
    redis_client.delete(key)
    for entry_id, fields in kept:
        redis_client.xadd(key, fields, id=entry_id)
    redis_client.xgroup_create(key, "g", id="0")

    relay = _relay(engine, redis_client, key_prefix)

    _assert_in_step(engine, redis_client, key_prefix)
    assert relay.repairer.stats.refills == 1
    assert relay.repairer.stats.repaired_entries == len(entries) - len(kept)
    assert [g["name"] for g in redis_client.xinfo_groups(key)] == [b"g"]


def test_loss_followed_by_newer_appends_is_rebuilt_without_duplicates(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    repair_enqueue(engine, key_prefix, 0, 30)
    _relay(engine, redis_client, key_prefix)
    for p in range(PARTITIONS):
        redis_client.delete(keys.stream_key(key_prefix, "things", p))
    repair_enqueue(engine, key_prefix, 30, 10)
    relay = Relay(repair_settings(engine, key_prefix), engine, redis_client)
    # A writer that never checked the stream (no floors: an older relay, another tool) appends
    # above the hole; today's relay refuses that (test_relay_order: BEHIND) and repairs first.
    relay.repairer.maybe_run = lambda leases: 0  # type: ignore[method-assign]
    relay.run(until_idle=True)
    assert sum(len(stream_contents(redis_client, key_prefix, p)) for p in range(PARTITIONS)) == 10

    leases = _take_leases(engine)
    fixer = repair.Repairer(repair_settings(engine, key_prefix), engine, redis_client,
                            "repair-test")
    assert fixer.run(leases) == 30  # the lost entries; the 10 newer ones stay where they are

    _assert_in_step(engine, redis_client, key_prefix)
    assert fixer.stats.rebuilds >= 1
    assert fixer.run(leases) == 0


def test_refill_refuses_ids_at_or_below_the_top(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    repair_enqueue(engine, key_prefix, 0, 5)
    _relay(engine, redis_client, key_prefix)
    p = next(p for p in range(PARTITIONS) if delivered_entries(engine, p))
    rows = repair_store.delivered_rows(engine, "things", p)
    key = keys.stream_key(key_prefix, "things", p)
    finding = repair.compare(engine, redis_client, key_prefix, "things", p, len(rows))
    epoch = _take_leases(engine)[p]
    assert repair.refill(redis_client, finding, epoch, rows) == 0  # all there: the first is refused
    assert len(redis_client.xrange(key)) == len(rows)


def test_reconcile_repairs_a_lost_stream_and_resumes_a_stuck_run(
    runs_tables: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    engine = runs_tables
    from sqlalchemy import update

    from outbox_relay.cli import reconcile
    from outbox_relay.runs.store import store_for

    settings = repair_settings(engine, key_prefix)
    run_store = store_for(settings)
    with engine.begin() as conn:
        run_store.create(conn, "run-stuck", {"request": {}})
    repair_enqueue(engine, key_prefix, 0, 10)
    _relay(engine, redis_client, key_prefix)
    for p in range(PARTITIONS):
        redis_client.delete(keys.stream_key(key_prefix, "things", p))

    dry = reconcile.check_streams(engine, redis_client, settings, dry_run=True)
    assert {s["behind"] for s in dry if "things" in s["key"]} == {"stream_missing"}
    done = reconcile.check_streams(engine, redis_client, settings, dry_run=False)
    assert sum(s["repaired_entries"] for s in done) == 10
    _assert_in_step(engine, redis_client, key_prefix)

    with engine.begin() as conn:  # make the run look abandoned long ago
        conn.execute(update(runs).values(updated_at_ms=0))
    found = reconcile.check_runs(engine, settings, dry_run=False, stuck_after_ms=1000, limit=10)
    assert [(r["id"], r["action"]) for r in found] == [("run-stuck", "resumed")]
    with engine.connect() as conn:
        resume = conn.execute(
            select(outbox.c.event_id).where(outbox.c.type == "run.resume")
        ).scalars().all()
    assert resume == ["run-stuck:run.resume:2"]
    assert reconcile.check_runs(engine, settings, dry_run=True, stuck_after_ms=1000,
                                limit=10) == []
