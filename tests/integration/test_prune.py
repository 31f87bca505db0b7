"""Retention on both databases and the real Redis: what is pruned, what never is, in bounded
batches, by several pruners at once, in the daemons and with ``outbox prune``."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import Engine, func, insert, select, update

from outbox_relay.cli import prune as retention
from outbox_relay.cli.settings import ConsumeSettings, PruneSettings
from outbox_relay.consumer import Handlers
from outbox_relay.consumer.daemon import Consumer
from outbox_relay.consumer.prune import InboxPruner, entry_key, partition_of
from outbox_relay.relay.daemon import Relay
from outbox_relay.relay.prune import prune_delivered
from outbox_relay.runs.prune import prune_terminal_runs
from outbox_relay.runs.schema import runs
from outbox_relay.shared import keys
from outbox_relay.shared.db import is_postgres, now_ms
from outbox_relay.shared.periodic import shutdown
from outbox_relay.shared.schema import inbox, inbox_heads, outbox, stream_trims
from tests.conftest import REDIS_URL
from tests.helpers import (
    GROUP,
    OUTBOX,
    STREAM,
    consumer_settings,
    event,
    key_of,
    relay_settings,
    xadd_event,
)
from tests.helpers import partition_of as partition_for

pytestmark = pytest.mark.integration

DAY_MS = 86_400_000


# -- helpers -----------------------------------------------------------------------------------

EVERYTHING_TRIMMED = "9999999999999-0"


def consume_settings(key_prefix: str, **overrides: Any) -> ConsumeSettings:
    """``outbox consume``'s settings for tests: the consumer's, with the runs retention rule."""
    return ConsumeSettings(**consumer_settings(key_prefix).model_dump() | overrides)


def set_floor(engine: Engine, partition: int, floor: str, stream: str = STREAM) -> None:
    """The trim floor of ``(stream, partition)``: everything below it was trimmed."""
    with engine.begin() as conn:
        conn.execute(stream_trims.delete().where(stream_trims.c.stream == stream,
                                                 stream_trims.c.partition == partition))
        conn.execute(insert(stream_trims).values(stream=stream, partition=partition,
                                                 floor_entry_id=floor, trimmed=1,
                                                 updated_at_ms=now_ms()))


@pytest.fixture(autouse=True)
def _streams_trimmed(request: pytest.FixtureRequest) -> None:
    """Most tests here are about age, letters and batches: their streams count as trimmed
    above every entry, so the trim-floor condition holds (tests of that condition set their
    own floors with :func:`set_floor`)."""
    if "engine" in request.fixturenames:
        engine = request.getfixturevalue("engine")
        for p in range(16):
            set_floor(engine, p, EVERYTHING_TRIMMED)


def add_outbox(engine: Engine, n: int, *, delivered_days_ago: float | None,
               start: int = 0) -> None:
    """``n`` outbox rows, delivered that many days ago (None: undelivered, created 30 days
    ago, so only its delivery state can keep it)."""
    now = now_ms()
    rows = [{
        "event_id": f"ev-{start + i}-{delivered_days_ago}", "stream": STREAM, "partition": 0,
        "type": "t", "source": "tests", "payload": "{}", "headers": "{}",
        "created_at_ms": now - 30 * DAY_MS, "available_at_ms": now - 30 * DAY_MS,
        "entry_id": None if delivered_days_ago is None else f"{now}-{start + i}",
        "delivered_at_ms": None if delivered_days_ago is None
        else now - int(delivered_days_ago * DAY_MS),
    } for i in range(n)]
    with engine.begin() as conn:
        conn.execute(insert(outbox), rows)


def count(engine: Engine, table: Any, *where: Any) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(table).where(*where))
                   .scalar_one())


def add_receipt(engine: Engine, event_id: str, *, days_ago: float, stream_key: str,
                entry_id: str, outcome: str = "applied", group: str = GROUP) -> None:
    with engine.begin() as conn:
        conn.execute(insert(inbox).values(
            group_name=group, event_id=event_id, stream_key=stream_key, entry_id=entry_id,
            outcome=outcome, created_at_ms=now_ms() - int(days_ago * DAY_MS)))


def receipt_ids(engine: Engine) -> set[str]:
    with engine.connect() as conn:
        return set(conn.execute(select(inbox.c.event_id)).scalars())


def age_receipts(engine: Engine, days: float) -> None:
    with engine.begin() as conn:
        conn.execute(update(inbox).values(created_at_ms=now_ms() - int(days * DAY_MS)))


def consume_all(consumer: Consumer, client: redis.Redis, prefix: str) -> None:
    """Run the consumer until its group has nothing pending or new.

    The fixture's trim floors are lifted meanwhile and set again after: streams are trimmed
    after their entries were consumed, and an entry read below its floor is ``resurrected``
    (acknowledged, never applied: see consumer/ordering.py)."""
    with consumer.engine.begin() as conn:
        floors = [dict(r._mapping) for r in conn.execute(select(stream_trims))]
        conn.execute(stream_trims.delete())
    try:
        _drain(consumer, client, prefix)
    finally:
        if floors:
            with consumer.engine.begin() as conn:
                conn.execute(insert(stream_trims), floors)


def _drain(consumer: Consumer, client: redis.Redis, prefix: str) -> None:
    deadline = time.monotonic() + 20
    while True:
        consumer.run_once(block_ms=1)
        busy = 0
        for p in range(consumer.settings.partitions):
            key = keys.stream_key(prefix, STREAM, p)
            if client.exists(key):
                info = {g["name"]: g for g in client.xinfo_groups(key)}
                group = info.get(GROUP.encode())
                busy += int(group["pending"]) + int(group.get("lag") or 0) if group else 1
        if busy == 0:
            return
        assert time.monotonic() < deadline, "the consumer did not drain its streams"


def add_run(engine: Engine, run_id: str, status: str, *, days_ago: float) -> None:
    at = now_ms() - int(days_ago * DAY_MS)
    with engine.begin() as conn:
        conn.execute(insert(runs).values(
            id=run_id, revision=1, status=status, record=json.dumps({"revision": 1}),
            attempts=0, created_at_ms=at, updated_at_ms=at))


# -- outbox rows -------------------------------------------------------------------------------


def test_outbox_prunes_old_delivered_rows_never_undelivered_ones(engine: Engine) -> None:
    add_outbox(engine, 3, delivered_days_ago=None)
    add_outbox(engine, 4, delivered_days_ago=10)
    add_outbox(engine, 5, delivered_days_ago=1)
    result = prune_delivered(engine, 7 * 86400, batch=1000)
    assert (result.rows, result.more) == (4, False)
    assert count(engine, outbox, outbox.c.delivered_at_ms.is_(None)) == 3
    assert count(engine, outbox, outbox.c.delivered_at_ms.is_not(None)) == 5
    # Retention "off" prunes nothing; a retention shorter than every age prunes the rest,
    # and still not one undelivered row (they are 30 days old).
    assert prune_delivered(engine, 0, batch=1000).rows == 0
    assert prune_delivered(engine, 3600, batch=1000).rows == 5
    assert count(engine, outbox) == 3


def test_outbox_batches_are_bounded(engine: Engine) -> None:
    add_outbox(engine, 25, delivered_days_ago=10)
    one = prune_delivered(engine, 86400, batch=10, max_batches=1)
    assert (one.rows, one.more) == (10, True)
    two = prune_delivered(engine, 86400, batch=10, max_batches=2)
    assert (two.rows, two.more) == (15, False)
    assert count(engine, outbox) == 0


# -- receipts and heads ------------------------------------------------------------------------


def test_dead_receipt_is_kept_while_its_letter_exists(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    handlers = Handlers()
    handlers.register("known", lambda conn, ev: None)
    consumer = Consumer(consumer_settings(key_prefix), engine, redis_client, handlers)
    dead = event("agg-dead", 1, type="nobody.handles")
    fine = event("agg-fine", 1, type="known")
    xadd_event(redis_client, key_prefix, dead)
    xadd_event(redis_client, key_prefix, fine)
    consume_all(consumer, redis_client, key_prefix)
    with engine.connect() as conn:
        outcomes = dict(conn.execute(select(inbox.c.event_id, inbox.c.outcome)).all())
    assert outcomes == {dead.id: "dead", fine.id: "applied"}
    age_receipts(engine, 30)

    pruner = InboxPruner(engine, redis_client, 14 * 86400, batch=100)
    first = pruner.prune()
    assert (first.receipts, first.kept_letter) == (1, 1)
    assert receipt_ids(engine) == {dead.id}  # its letter is still in the dead-letter stream

    dlq = keys.dead_letter_key(key_prefix, STREAM, partition_for("agg-dead"))
    (letter_id, _fields), = redis_client.xrange(dlq)
    redis_client.xdel(dlq, letter_id)
    second = pruner.prune()
    assert (second.receipts, second.kept_letter) == (1, 0)
    assert receipt_ids(engine) == set()


def test_lost_receipt_is_kept_by_a_letter_that_knows_only_its_entry(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    # A letter of an entry that vanished unknown carries no event id, only where it was.
    key = keys.stream_key(key_prefix, STREAM, 1)
    add_receipt(engine, f"lost:{key}/5-0", days_ago=30, stream_key=key, entry_id="5-0",
                outcome="lost")
    add_receipt(engine, f"lost:{key}/6-0", days_ago=30, stream_key=key, entry_id="6-0",
                outcome="lost")
    redis_client.xadd(keys.dead_letter_key(key_prefix, STREAM, 1), {
        "dlq.reason": "lost", "dlq.stream": key, "dlq.entry_id": "5-0", "dlq.group": GROUP})
    # Another group's letter of the same entry protects nothing of ours.
    redis_client.xadd(keys.dead_letter_key(key_prefix, STREAM, 1), {
        "dlq.reason": "lost", "dlq.stream": key, "dlq.entry_id": "6-0", "dlq.group": "other"})
    result = InboxPruner(engine, redis_client, 86400, batch=100).prune()
    assert (result.receipts, result.kept_letter) == (1, 1)
    assert receipt_ids(engine) == {f"lost:{key}/5-0"}


def test_receipt_at_or_above_the_trim_floor_is_kept(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    trimmed = keys.stream_key(key_prefix, STREAM, 0)
    untrimmed = keys.stream_key(key_prefix, STREAM, 1)
    set_floor(engine, 0, "100-10")
    # Ids compare as numbers: "9-0" and "100-5" are below "100-10" (not as text).
    for entry_id in ("9-0", "100-5", "100-10", "100-11", "101-0"):
        add_receipt(engine, f"t-{entry_id}", days_ago=30, stream_key=trimmed, entry_id=entry_id)
    add_receipt(engine, "u-1", days_ago=30, stream_key=untrimmed, entry_id="999-0")
    add_receipt(engine, "young", days_ago=1, stream_key=trimmed, entry_id="1-0")
    result = InboxPruner(engine, redis_client, 14 * 86400, batch=2).prune()
    assert (result.receipts, result.kept_floor) == (3, 3)
    assert receipt_ids(engine) == {"t-100-10", "t-100-11", "t-101-0", "young"}


def test_kept_receipts_never_stall_the_scan(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    key = keys.stream_key(key_prefix, STREAM, 0)
    set_floor(engine, 0, "1-0")
    for i in range(6):  # the oldest: kept (above the floor)
        add_receipt(engine, f"kept-{i}", days_ago=40, stream_key=key, entry_id=f"5-{i}")
    other = keys.stream_key(key_prefix, STREAM, 2)
    for i in range(4):
        add_receipt(engine, f"gone-{i}", days_ago=30, stream_key=other, entry_id=f"5-{i}")
    pruner = InboxPruner(engine, redis_client, 14 * 86400, batch=3)
    passes = [pruner.prune(max_batches=1) for _ in range(4)]
    # Each pass goes on where the last one stopped; only one that deleted asks for more soon.
    assert [(p.receipts, p.kept_floor, p.more) for p in passes] == [
        (0, 3, False), (0, 3, False), (3, 0, True), (1, 0, False)]
    assert receipt_ids(engine) == {f"kept-{i}" for i in range(6)}
    assert pruner.prune(max_batches=1).kept_floor == 3  # the scan starts over


def test_heads_move_with_the_head_and_are_pruned_by_age(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    handlers = Handlers()
    handlers.register("thing.happened", lambda conn, ev: None)
    consumer = Consumer(consumer_settings(key_prefix), engine, redis_client, handlers)
    before = now_ms()
    xadd_event(redis_client, key_prefix, event("quiet", 1))
    xadd_event(redis_client, key_prefix, event("busy", 1))
    consume_all(consumer, redis_client, key_prefix)

    def updated() -> dict[str, int]:
        with engine.connect() as conn:
            return dict(conn.execute(select(inbox_heads.c.aggregate_id,
                                            inbox_heads.c.updated_at_ms)).all())

    assert all(at >= before for at in updated().values())  # the upsert sets it
    with engine.begin() as conn:
        conn.execute(update(inbox_heads).values(updated_at_ms=now_ms() - 30 * DAY_MS))
    xadd_event(redis_client, key_prefix, event("busy", 2))  # raises busy's head: moves again
    consume_all(consumer, redis_client, key_prefix)
    assert updated()["busy"] >= before

    result = InboxPruner(engine, redis_client, 14 * 86400, batch=100).prune()
    assert result.heads == 1
    assert set(updated()) == {"busy"}


# -- runs --------------------------------------------------------------------------------------


@pytest.mark.usefixtures("runs_tables")
def test_runs_pruned_only_when_asked_and_only_terminal(engine: Engine) -> None:
    add_run(engine, "old-done", "completed", days_ago=30)
    add_run(engine, "old-failed", "failed", days_ago=30)
    add_run(engine, "old-queued", "queued", days_ago=30)
    add_run(engine, "old-waiting", "needs_input", days_ago=30)
    add_run(engine, "old-drafting", "drafting", days_ago=30)
    add_run(engine, "new-done", "completed", days_ago=1)
    assert prune_terminal_runs(engine, 0, batch=10) == (0, False)  # off by default
    assert count(engine, runs) == 6
    assert prune_terminal_runs(engine, 7 * 86400, batch=1, max_batches=1) == (1, True)
    assert prune_terminal_runs(engine, 7 * 86400, batch=1) == (1, False)
    with engine.connect() as conn:
        left = set(conn.execute(select(runs.c.id)).scalars())
    assert left == {"old-queued", "old-waiting", "old-drafting", "new-done"}


# -- dry run -----------------------------------------------------------------------------------


def _seed_everything(engine: Engine, prefix: str) -> None:
    add_outbox(engine, 3, delivered_days_ago=30)
    add_outbox(engine, 2, delivered_days_ago=None)
    key = keys.stream_key(prefix, STREAM, 0)
    add_receipt(engine, "r-old", days_ago=30, stream_key=key, entry_id="1-0")
    add_receipt(engine, "r-new", days_ago=1, stream_key=key, entry_id="2-0")
    with engine.begin() as conn:
        conn.execute(insert(inbox_heads).values(
            group_name=GROUP, aggregate_type="a", aggregate_id="x", revision=1,
            updated_at_ms=now_ms() - 30 * DAY_MS))
    add_run(engine, "done", "completed", days_ago=30)


def _sizes(engine: Engine) -> list[int]:
    return [count(engine, t) for t in (outbox, inbox, inbox_heads, runs)]


@pytest.mark.usefixtures("runs_tables")
def test_dry_run_counts_and_deletes_nothing(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    _seed_everything(engine, key_prefix)
    before = _sizes(engine)
    settings = PruneSettings(redis_url=REDIS_URL, key_prefix=key_prefix, retention_runs="7d")
    report = retention.prune_all(engine, settings, dry_run=True)
    assert report["pruned"] == {"outbox_events": 3, "outbox_inbox": 1,
                                "outbox_inbox_heads": 1, "outbox_consumer_retries": 0,
                                "outbox_runs": 1}
    assert _sizes(engine) == before
    done = retention.prune_all(engine, settings, dry_run=False)
    assert done["pruned"] == report["pruned"]
    assert _sizes(engine) == [2, 1, 0, 0]


@pytest.mark.usefixtures("runs_tables")
def test_cli_prune_dry_run_json(
    database_url: str, engine: Engine, redis_client: redis.Redis, key_prefix: str,
    tmp_path: Path,
) -> None:
    _seed_everything(engine, key_prefix)
    before = _sizes(engine)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env |= {"OUTBOX_DATABASE_URL": database_url, "OUTBOX_REDIS_URL": REDIS_URL,
            "OUTBOX_KEY_PREFIX": key_prefix}
    proc = subprocess.run([str(OUTBOX), "prune", "--dry-run", "--json"], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["dry_run"] is True
    assert report["pruned"] == {"outbox_events": 3, "outbox_inbox": 1,
                                "outbox_inbox_heads": 1, "outbox_consumer_retries": 0,
                                "outbox_runs": 1}
    assert _sizes(engine) == before

    # No database file is ever created, and the problem is one clean line.
    missing = tmp_path / "nowhere" / "outbox.db"
    env["OUTBOX_DATABASE_URL"] = f"sqlite:///{missing}"
    proc = subprocess.run([str(OUTBOX), "prune", "--dry-run"], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 1
    assert proc.stderr.startswith("error schema_not_ready: ") and "Traceback" not in proc.stderr
    assert not missing.exists() and not missing.parent.exists()


def test_runs_retention_is_off_where_there_are_no_runs_tables(
    engine: Engine, redis_client: redis.Redis, key_prefix: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """An application without runs that sets retention_runs: no runs rule, a warning, and the
    other rules still run (the query on a missing table would fail every pass)."""
    add_outbox(engine, 2, delivered_days_ago=30)
    settings = PruneSettings(redis_url=REDIS_URL, key_prefix=key_prefix, retention_runs="7d")
    with caplog.at_level("WARNING"):
        report = retention.prune_all(engine, settings, dry_run=False)
    assert report["pruned"]["outbox_runs"] is None and report["pruned"]["outbox_events"] == 2
    assert "runs tables were never set up" in caplog.text
    consumer = Consumer(consume_settings(key_prefix, retention_runs="1d", retention_inbox="off"),
                        engine, redis_client, Handlers())
    retention.register_consumer(consumer, consumer.settings)
    assert "retention" not in [t.name for t in consumer.periodic]


# -- several pruners (PostgreSQL: SKIP LOCKED) -------------------------------------------------


def test_pruners_skip_rows_another_one_holds(engine: Engine) -> None:
    if not is_postgres(engine):
        pytest.skip("row locks: PostgreSQL only (SQLite serializes whole transactions)")
    add_outbox(engine, 10, delivered_days_ago=20)
    add_outbox(engine, 10, delivered_days_ago=10, start=100)
    holder = engine.connect()
    try:
        tx = holder.begin()
        held = set(holder.execute(
            select(outbox.c.seq).where(outbox.c.delivered_at_ms.is_not(None))
            .order_by(outbox.c.delivered_at_ms).limit(10).with_for_update()).scalars())
        results: list[int] = []
        worker = threading.Thread(target=lambda: results.append(
            prune_delivered(engine, 86400, batch=10, max_batches=1).rows))
        worker.start()
        worker.join(timeout=60)
        assert not worker.is_alive(), "the pruner waited for rows another pruner holds"
        assert results == [10]
        with engine.connect() as conn:
            assert set(conn.execute(select(outbox.c.seq)).scalars()) == held
        tx.rollback()
    finally:
        holder.close()


def test_concurrent_pruners_delete_each_row_once(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    if not is_postgres(engine):
        pytest.skip("concurrent pruners: PostgreSQL (SQLite serializes them)")
    add_outbox(engine, 2000, delivered_days_ago=10)
    key = keys.stream_key(key_prefix, STREAM, 0)
    with engine.begin() as conn:
        conn.execute(insert(inbox), [{
            "group_name": GROUP, "event_id": f"r{i}", "stream_key": key, "entry_id": f"{i}-0",
            "outcome": "applied", "created_at_ms": now_ms() - 30 * DAY_MS} for i in range(2000)])
    barrier = threading.Barrier(3)
    rows: list[int] = []
    receipts: list[int] = []

    def prune() -> None:
        barrier.wait()
        rows.append(prune_delivered(engine, 86400, batch=50).rows)
        receipts.append(InboxPruner(engine, redis_client, 86400, batch=50).prune().receipts)

    threads = [threading.Thread(target=prune) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(rows) == len(receipts) == 3
    assert sum(rows) == 2000 and sum(receipts) == 2000
    assert count(engine, outbox) == 0 and count(engine, inbox) == 0


# -- in the daemons ----------------------------------------------------------------------------


def test_relay_retention_task_prunes_in_bounded_passes(
    engine: Engine, redis_client: redis.Redis, key_prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    add_outbox(engine, 12, delivered_days_ago=10)
    add_outbox(engine, 1, delivered_days_ago=None)
    settings = relay_settings(key_prefix, prune_batch=2, retention_delivered="7d",
                              prune_interval_s=3600)
    relay = Relay(settings, engine, redis_client)
    retention.register_relay(relay, settings)
    (task,) = [t for t in relay.periodic if t.name == "retention"]
    caplog.set_level(logging.INFO, logger="outbox.retention")
    assert task.maybe_run()
    stats = relay.prune_stats
    assert stats is not None
    assert stats.outbox_rows == retention.PASS_BATCHES * 2  # bounded: not all 12
    assert task.next_at <= time.monotonic() + retention.CATCH_UP_S  # more left: soon again
    assert "pruned 10 delivered outbox rows" in caplog.text
    assert task.maybe_run(task.next_at)
    assert stats.outbox_rows == 12 and stats.passes == 2
    assert task.next_at > time.monotonic() + 3000  # nothing left: the full interval
    assert count(engine, outbox) == 1


def test_retention_off_registers_nothing(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    settings = relay_settings(key_prefix, retention_delivered="off")
    relay = Relay(settings, engine, redis_client)
    retention.register_relay(relay, settings)
    assert "retention" not in [t.name for t in relay.periodic] and relay.prune_stats is None


@pytest.mark.usefixtures("runs_tables")
def test_consumer_retention_task_prunes_receipts_heads_and_runs(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    key = key_of(key_prefix, "a")
    for i in range(3):
        add_receipt(engine, f"r{i}", days_ago=30, stream_key=key, entry_id=f"{i}-1")
    add_receipt(engine, "fresh", days_ago=0, stream_key=key, entry_id="9-1")
    with engine.begin() as conn:
        conn.execute(insert(inbox_heads).values(
            group_name=GROUP, aggregate_type="a", aggregate_id="x", revision=1,
            updated_at_ms=now_ms() - 30 * DAY_MS))
    add_run(engine, "done", "failed", days_ago=30)
    add_run(engine, "running", "drafting", days_ago=30)
    settings = consume_settings(key_prefix, retention_runs="1d")
    consumer = Consumer(settings, engine, redis_client, Handlers())
    retention.register_consumer(consumer, settings)
    consumer.run_once(block_ms=1)  # the loop runs its due housekeeping
    (task,) = [t for t in consumer.periodic if t.name == "retention"]
    # On PostgreSQL on a thread of its own, so its deletes never hold up consuming.
    assert task.background == (engine.dialect.name == "postgresql")
    shutdown(consumer.periodic)  # wait for that run (the daemon does so when it stops)
    stats = consumer.prune_stats
    assert stats is not None
    assert (stats.passes, stats.receipts, stats.heads, stats.runs) == (1, 3, 1, 1)
    assert receipt_ids(engine) == {"fresh"}
    with engine.connect() as conn:
        assert list(conn.execute(select(runs.c.id)).scalars()) == ["running"]


# -- small parsers -----------------------------------------------------------------------------


def test_entry_ids_and_partitions_parse_like_redis() -> None:
    assert entry_key("1700000000000-3") == (1700000000000, 3)
    assert entry_key("5") == (5, 0)
    assert entry_key("9-0") < entry_key("10-0")  # type: ignore[operator]
    assert entry_key("") is None and entry_key("x-1") is None and entry_key("1-") is None
    assert partition_of("outbox:{runs:3}") == ("runs", 3)
    assert partition_of("p:q:{a.b:12}") == ("a.b", 12)
    assert partition_of("outbox:{runs}") is None and partition_of("plain") is None


def test_pruning_survives_a_long_dead_letter_stream(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    # More letters than one XRANGE page: the receipt's letter is on the second page.
    key = keys.stream_key(key_prefix, STREAM, 0)
    dlq = keys.dead_letter_key(key_prefix, STREAM, 0)
    pipe = redis_client.pipeline(transaction=False)
    for i in range(700):
        pipe.xadd(dlq, {"id": f"other-{i}", "dlq.group": GROUP})
    pipe.xadd(dlq, {"id": "mine", "dlq.group": GROUP})
    pipe.execute()
    add_receipt(engine, "mine", days_ago=30, stream_key=key, entry_id="1-0", outcome="dead")
    add_receipt(engine, "gone", days_ago=30, stream_key=key, entry_id="2-0", outcome="dead")
    result = InboxPruner(engine, redis_client, 86400, batch=10).prune()
    assert (result.receipts, result.kept_letter) == (1, 1)
    assert receipt_ids(engine) == {"mine"}


# -- what is still needed stays ----------------------------------------------------------------


def test_rows_above_the_trim_floor_stay_while_trimming_is_on(engine: Engine) -> None:
    """A delivered row above its stream's floor may be the only copy left to refill the stream
    for a group that has not read it yet: pruned only once trimmed (or by age, trimming off)."""
    now = now_ms()
    set_floor(engine, 0, f"{now}-0")
    add_outbox(engine, 2, delivered_days_ago=10)  # entry ids "<now>-<i>": at the floor's ms
    set_floor(engine, 1, "0-0")  # known, never trimmed
    with engine.begin() as conn:
        conn.execute(update(outbox).where(outbox.c.event_id.like("ev-1-%"))
                     .values(partition=1))
    assert prune_delivered(engine, 86400, batch=100).rows == 0
    set_floor(engine, 0, EVERYTHING_TRIMMED)  # trimmed past them
    assert prune_delivered(engine, 86400, batch=100).rows == 1
    assert prune_delivered(engine, 86400, batch=100, below_trim_floor=False).rows == 1


def test_receipts_of_untrimmed_streams_and_undelivered_rows_stay(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    stream_key = keys.stream_key(key_prefix, STREAM, 3)
    with engine.begin() as conn:
        conn.execute(stream_trims.delete().where(stream_trims.c.partition == 3))
    add_receipt(engine, "no-floor", days_ago=30, stream_key=stream_key, entry_id="5-1")
    kept = InboxPruner(engine, redis_client, 86400, batch=10).prune()
    assert (kept.receipts, kept.kept_floor) == (0, 1)  # trimming on: no floor, no pruning
    aged = InboxPruner(engine, redis_client, 86400, batch=10, below_trim_floor=False).prune()
    assert aged.receipts == 1  # trimming off: age decides

    # The relay appended it and died before marking: it may append it again, same id.
    add_outbox(engine, 1, delivered_days_ago=None, start=7)
    add_receipt(engine, "ev-7-None", days_ago=30, stream_key=keys.stream_key(
        key_prefix, STREAM, 0), entry_id="5-2")
    for below in (True, False):
        result = InboxPruner(engine, redis_client, 86400, batch=10,
                             below_trim_floor=below).prune()
        assert (result.receipts, result.kept_undelivered) == (0, 1)
    assert receipt_ids(engine) == {"ev-7-None"}
