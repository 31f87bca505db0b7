"""Trimming tied to acknowledgements, the trim floor, and entries that vanish while pending.

Real Redis (our own keys only) and both databases. A "Redis loss" deletes our stream key.
"""

from __future__ import annotations

import os
import subprocess
from functools import partial

import pytest
import redis
from sqlalchemy import Engine, func, select

from outbox_relay.cli import status
from outbox_relay.consumer import dead_letters, group_status, streams
from outbox_relay.consumer.daemon import Consumer
from outbox_relay.consumer.handlers import Handlers
from outbox_relay.consumer.prune import InboxPruner
from outbox_relay.relay import entry_ids, stream_book
from outbox_relay.relay.daemon import Relay
from outbox_relay.shared import keys
from outbox_relay.shared.db import now_ms
from outbox_relay.shared.redis_conn import connect_redis
from outbox_relay.shared.schema import consumer_retries, inbox, outbox, stream_groups
from outbox_relay.shared.settings import ConsumerSettings, RelaySettings
from tests.conftest import REDIS_URL
from tests.helpers import OUTBOX, enqueue_numbered

pytestmark = pytest.mark.integration

STREAM = "things"


def _settings(engine: Engine, prefix: str, **extra: object) -> RelaySettings:
    values: dict[str, object] = {
        "database_url": engine.url.render_as_string(hide_password=False),
        "redis_url": REDIS_URL, "key_prefix": prefix, "partitions": 1, "node_id": "trim-test",
        "stream_keep": 0, "stream_keep_s": 0, "batch_size": 1000,
    }
    values.update(extra)
    return RelaySettings(**values)  # type: ignore[arg-type]


# thing.done events evt-00000 … on one partition (tests.helpers.enqueue_numbered)
_enqueue = partial(enqueue_numbered, source="trim-test", partitions=1, stream=STREAM,
                   id_format="evt-{n:05d}")


def _relay(engine: Engine, client: redis.Redis, prefix: str, **extra: object) -> Relay:
    relay = Relay(_settings(engine, prefix, **extra), engine, client)
    relay.run(until_idle=True)
    return relay


def _epoch(relay: Relay) -> int:
    """Lease partition 0 again (``run`` gave the leases back when it returned)."""
    relay._next_lease_check = 0.0
    relay._refresh_leases()
    return relay.leases[0]


def _key(prefix: str) -> str:
    return keys.stream_key(prefix, STREAM, 0)


def _read_ack(client: redis.Redis, key: str, group: str, count: int, ack: bool = True) -> int:
    """Read up to ``count`` new entries as ``group``; acknowledge them unless ``ack`` is False."""
    got = 0
    while got < count:
        reply = client.xreadgroup(group, "c1", {key: ">"}, count=min(1000, count - got))
        if not reply:
            break
        ids = [i for i, _ in reply[0][1]]
        if ack:
            client.xack(key, group, *ids)
        got += len(ids)
    return got


def _ids(client: redis.Redis, key: str) -> list[str]:
    return [i.decode() for i, _ in client.xrange(key)]


def test_a_slow_group_keeps_what_it_has_not_acknowledged_and_the_stream_is_bounded_once_it_catches_up(  # noqa: E501
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    total = 12_000
    _enqueue(engine, key_prefix, 0, total)
    key = _key(key_prefix)
    for group in ("fast", "slow"):
        redis_client.xgroup_create(key, group, id="0", mkstream=True)
    relay = _relay(engine, redis_client, key_prefix)
    everything = _ids(redis_client, key)
    assert len(everything) == total
    assert _read_ack(redis_client, key, "fast", total) == total
    assert _read_ack(redis_client, key, "slow", 2_000) == 2_000  # 10,000 entries behind
    assert _read_ack(redis_client, key, "slow", 50, ack=False) == 50  # and 50 pending

    removed = relay.trimmer.trim(STREAM, 0, epoch=_epoch(relay))

    # Only the 2,000 the slow group acknowledged may go: its 50 pending and 9,950 unread stay.
    assert removed == 2_000
    assert _ids(redis_client, key) == everything[2_000:]
    assert stream_book.trim_floor(engine, STREAM, 0) == f"{entry_ids.parse(everything[2_000])[0]}-0"

    redis_client.xack(key, "slow", *everything[2_000:2_050])
    assert _read_ack(redis_client, key, "slow", total) == total - 2_050
    relay.trimmer.trim(STREAM, 0, epoch=_epoch(relay))
    assert redis_client.xlen(key) == 0  # bounded: nothing anyone still needs, keep = 0
    assert relay.trimmer.stats.trimmed_entries == total
    report = status.collect(engine, redis_client, key_prefix)  # `outbox status` shows it
    [shown] = [st for st in report["streams"] if st["key"] == key]
    assert (shown["length"], shown["trimmed"]) == (0, total)
    assert shown["trim_floor"] == stream_book.trim_floor(engine, STREAM, 0)


def test_trim_keeps_the_newest_entries_and_never_trims_a_stream_without_groups(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    _enqueue(engine, key_prefix, 0, 300)
    relay = _relay(engine, redis_client, key_prefix, stream_keep=100)
    key = _key(key_prefix)
    assert relay.trimmer.trim(STREAM, 0, epoch=_epoch(relay)) == 0  # no group: no trim
    assert redis_client.xlen(key) == 300
    redis_client.xgroup_create(key, "g", id="0")
    _read_ack(redis_client, key, "g", 300)
    everything = _ids(redis_client, key)
    relay.trimmer.trim(STREAM, 0, epoch=_epoch(relay))
    # Whole milliseconds only: the newest 100 stay, plus the rest of the oldest kept one's ms.
    kept = _ids(redis_client, key)
    assert everything[-100:] == kept[-100:]
    cut = entry_ids.parse(everything[-100])[0]
    assert kept == [i for i in everything if entry_ids.parse(i)[0] >= cut]


def test_a_declared_group_holds_the_trim_before_its_consumers_ever_started(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    """A group whose consumers have not started yet (a worker that cannot reach its database)
    would otherwise lose what the other groups acknowledged and a trim removed; declared in
    OUTBOX_STREAM_GROUPS, the relay creates it at 0 and it keeps every entry it has not read."""
    _enqueue(engine, key_prefix, 0, 200)
    relay = _relay(engine, redis_client, key_prefix,
                   stream_groups=f"{STREAM}:late, other:x ,{STREAM}:late")
    key = _key(key_prefix)
    redis_client.xgroup_create(key, "early", id="0")
    assert _read_ack(redis_client, key, "early", 200) == 200
    everything = _ids(redis_client, key)

    assert relay.trimmer.trim(STREAM, 0, epoch=_epoch(relay)) == 0
    assert _ids(redis_client, key) == everything
    groups = {g["name"].decode(): g for g in redis_client.xinfo_groups(key)}
    assert set(groups) == {"early", "late"}
    assert groups["late"]["last-delivered-id"].decode() == "0-0"

    # The late group's consumers start (creating the group is a no-op now) and read it all.
    streams.ensure_groups(redis_client, [key], "late")
    assert _read_ack(redis_client, key, "late", 200) == 200
    assert relay.trimmer.trim(STREAM, 0, epoch=_epoch(relay)) == 200
    assert _ids(redis_client, key) == []
    with engine.connect() as conn:  # recorded like any seen group: a Redis loss holds on it
        seen = set(conn.execute(select(stream_groups.c.group_name).where(
            stream_groups.c.stream == STREAM)).scalars())
    assert seen == {"early", "late"}


@pytest.mark.parametrize("value", ["runs", "runs:", ":workers", "runs:wor kers", "a:b:c"])
def test_a_malformed_stream_groups_setting_is_a_clear_error(value: str) -> None:
    with pytest.raises(ValueError, match="stream_groups"):
        RelaySettings(stream_groups=value)


def test_the_periodic_trim_runs_in_the_relay_loop(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    _enqueue(engine, key_prefix, 0, 50)
    key = _key(key_prefix)
    redis_client.xgroup_create(key, "g", id="0", mkstream=True)
    relay = _relay(engine, redis_client, key_prefix)
    _read_ack(redis_client, key, "g", 50)
    _enqueue(engine, key_prefix, 50, 1)
    relay.periodic[0].next_at = 0.0  # due now
    relay.run(until_idle=True)
    assert redis_client.xlen(key) == 1  # the 50 acknowledged ones went; the new one stays
    assert relay.trimmer.stats.trimmed_entries == 50


def test_repair_after_a_redis_loss_refills_only_above_the_trim_floor(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    _enqueue(engine, key_prefix, 0, 60)
    key = _key(key_prefix)
    redis_client.xgroup_create(key, "g", id="0", mkstream=True)
    relay = _relay(engine, redis_client, key_prefix)
    _enqueue(engine, key_prefix, 60, 40)
    relay.run(until_idle=True)  # a second batch: a later millisecond
    everything = _ids(redis_client, key)
    _read_ack(redis_client, key, "g", 60)
    relay.trimmer.trim(STREAM, 0, epoch=_epoch(relay))
    left = _ids(redis_client, key)
    assert left == everything[60:]

    redis_client.delete(key)  # Redis lost the stream
    relay.repairer.check_soon()
    relay.repairer.maybe_run({0: _epoch(relay)})

    assert _ids(redis_client, key) == left  # the 40 unacknowledged ones, not the 60 trimmed
    assert relay.repairer.stats.repaired_entries == 40


def test_after_a_redis_loss_a_known_group_not_yet_back_holds_the_trim(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    # Found by the torture: Redis restarted empty, one group's consumers recreated theirs and
    # read everything; the other group's consumers were down. Trimming by the groups present
    # removed what the missing group had never read.
    _enqueue(engine, key_prefix, 0, 60)
    key = _key(key_prefix)
    for group in ("fast", "slow"):
        redis_client.xgroup_create(key, group, id="0", mkstream=True)
    relay = _relay(engine, redis_client, key_prefix)
    _read_ack(redis_client, key, "fast", 60)
    _read_ack(redis_client, key, "slow", 60)
    relay.trimmer.trim(STREAM, 0, epoch=_epoch(relay))  # both groups become known
    assert redis_client.xlen(key) == 0
    _enqueue(engine, key_prefix, 60, 40)
    relay.run(until_idle=True)
    unread = _ids(redis_client, key)
    assert len(unread) == 40

    redis_client.delete(key)  # Redis lost the stream and both groups
    relay.repairer.check_soon()
    relay.repairer.maybe_run({0: _epoch(relay)})
    assert _ids(redis_client, key) == unread
    redis_client.xgroup_create(key, "fast", id="0")  # only one group's consumers are back
    _read_ack(redis_client, key, "fast", 40)

    assert relay.trimmer.trim(STREAM, 0, epoch=_epoch(relay)) == 0  # held for "slow"
    assert _ids(redis_client, key) == unread
    assert relay.trimmer.stats.trims_held == 1

    redis_client.xgroup_create(key, "slow", id="0")  # back: reads, then the trim goes on
    assert _read_ack(redis_client, key, "slow", 40) == 40
    assert relay.trimmer.trim(STREAM, 0, epoch=_epoch(relay)) == 40


def test_a_group_missing_longer_than_group_forget_s_is_forgotten(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    _enqueue(engine, key_prefix, 0, 30)
    key = _key(key_prefix)
    for group in ("kept", "dropped"):
        redis_client.xgroup_create(key, group, id="0", mkstream=True)
    relay = _relay(engine, redis_client, key_prefix, group_forget_s="1h")
    relay.trimmer.trim(STREAM, 0, epoch=_epoch(relay))
    redis_client.xgroup_destroy(key, "dropped")  # deleted on purpose by an operator
    _read_ack(redis_client, key, "kept", 30)
    assert relay.trimmer.trim(STREAM, 0, epoch=_epoch(relay)) == 0  # held: missing since now
    [known] = stream_book.known_groups(engine, [0]).values()
    assert known["kept"] is None and known["dropped"] is not None

    with engine.begin() as conn:  # an hour and a second later
        conn.execute(stream_groups.update().values(
            missing_since_ms=stream_groups.c.missing_since_ms - 3_601_000))
    assert relay.trimmer.trim(STREAM, 0, epoch=_epoch(relay)) == 0  # forgotten this round
    assert relay.trimmer.stats.groups_forgotten == 1
    assert stream_book.known_groups(engine, [0]) == {(STREAM, 0): {"kept": None}}
    assert relay.trimmer.trim(STREAM, 0, epoch=_epoch(relay)) == 30


def test_status_shows_a_missing_group_and_outbox_groups_forget_releases_the_hold(
    database_url: str, engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    _enqueue(engine, key_prefix, 0, 30)
    key = _key(key_prefix)
    for group in ("kept", "dropped"):
        redis_client.xgroup_create(key, group, id="0", mkstream=True)
    relay = _relay(engine, redis_client, key_prefix)
    relay.trimmer.trim(STREAM, 0, epoch=_epoch(relay))
    redis_client.xgroup_destroy(key, "dropped")
    _read_ack(redis_client, key, "kept", 30)
    assert relay.trimmer.trim(STREAM, 0, epoch=_epoch(relay)) == 0
    report = status.collect(engine, redis_client, key_prefix)
    [shown] = [st for st in report["streams"] if st["key"] == key]
    assert shown["missing_groups"] == ["dropped"]
    assert "trimming held: known group(s) missing: dropped" in status.render(report)

    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env |= {"OUTBOX_DATABASE_URL": database_url, "OUTBOX_KEY_PREFIX": key_prefix}
    proc = subprocess.run([str(OUTBOX), "groups", "forget", "dropped", "--stream", STREAM],
                          env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "forgot group dropped on 1 partition stream(s)" in proc.stdout
    assert relay.trimmer.trim(STREAM, 0, epoch=_epoch(relay)) == 30


def test_a_stream_trimmed_to_nothing_then_lost_takes_new_appends(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    _enqueue(engine, key_prefix, 0, 20)
    key = _key(key_prefix)
    redis_client.xgroup_create(key, "g", id="0", mkstream=True)
    relay = _relay(engine, redis_client, key_prefix)
    newest = _ids(redis_client, key)[-1]
    _read_ack(redis_client, key, "g", 20)
    relay.trimmer.trim(STREAM, 0, epoch=_epoch(relay))
    assert redis_client.xlen(key) == 0
    redis_client.delete(key)  # lost while empty: its top is gone too

    _enqueue(engine, key_prefix, 20, 5)
    relay.repairer.check_soon()
    relay.run(until_idle=True)

    ids = _ids(redis_client, key)
    assert len(ids) == 5 and all(entry_ids.greater(i, newest) for i in ids)
    with engine.connect() as conn:
        undelivered = conn.execute(select(func.count()).select_from(outbox).where(
            outbox.c.delivered_at_ms.is_(None))).scalar_one()
    assert undelivered == 0


def _consumer(engine: Engine, prefix: str, handlers: Handlers) -> Consumer:
    settings = ConsumerSettings(
        database_url=engine.url.render_as_string(hide_password=False), redis_url=REDIS_URL,
        key_prefix=prefix, partitions=1, streams=STREAM, group="g", consumer="c1",
        block_ms=10,
    )
    return Consumer(settings, engine, connect_redis(REDIS_URL), handlers,
                    ownership=True)


def test_entries_trimmed_while_pending_get_a_lost_receipt_and_a_letter_never_a_silent_ack(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    _enqueue(engine, key_prefix, 0, 10)
    key = _key(key_prefix)
    handlers = Handlers()
    handlers.on("thing.done")(lambda conn, event: None)
    consumer = _consumer(engine, key_prefix, handlers)
    consumer.run_once(block_ms=10)  # creates the group
    _relay(engine, redis_client, key_prefix)
    everything = _ids(redis_client, key)
    # Delivered to our consumer but not handled yet (as if it crashed before the claim)...
    assert len(redis_client.xreadgroup("g", "c1", {key: ">"}, count=4)[0][1]) == 4
    # ...then an operator's blind trim removes those 4 (and 2 more nobody read).
    redis_client.xtrim(key, minid=everything[6], approximate=False)

    consumer.recheck_pending()
    consumer.run_once(block_ms=10)

    assert group_status.group_pending(redis_client, [key], "g")[key] == 0
    with engine.connect() as conn:
        receipts = dict(conn.execute(
            select(inbox.c.event_id, inbox.c.outcome).where(inbox.c.group_name == "g")).all())
    assert {i for i, o in receipts.items() if o == "lost"} == {f"evt-{n:05d}" for n in range(4)}
    assert {i for i, o in receipts.items() if o == "applied"} == {
        f"evt-{n:05d}" for n in range(6, 10)}
    letters = redis_client.xrange(keys.dead_letter_key(key_prefix, STREAM, 0))
    assert sorted(f[b"id"].decode() for _, f in letters) == [f"evt-{n:05d}" for n in range(4)]
    assert {f[b"dlq.reason"] for _, f in letters} == {b"lost"}
    assert all(b"data" in f and b"type" in f for _, f in letters)  # what the outbox knows
    assert consumer.stats.lost == 4
    # An operator replays the letters: the events are applied (the lost receipts give way).
    replayed = [dead_letters.replay(redis_client, engine, letter, handlers, group="g")
                for letter in dead_letters.list_letters(redis_client, key_prefix)]
    assert sorted(r.outcome for r in replayed) == ["applied"] * 4
    with engine.connect() as conn:
        outcomes = dict(conn.execute(
            select(inbox.c.event_id, inbox.c.outcome).where(inbox.c.group_name == "g")).all())
    assert outcomes == {f"evt-{n:05d}": "applied" for n in (0, 1, 2, 3, 6, 7, 8, 9)}
    # The 2 trimmed before anyone read them were never delivered to the group: Redis cannot
    # tell anyone about them; the relay's trim never does this (it keeps unread entries).


def test_an_entry_that_vanishes_while_waiting_for_a_retry_takes_its_retry_row_with_it(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    """Invariant 7: a retry row is deleted when its event settles, and also when its entry
    vanishes (lost); one nobody touched for the inbox retention is pruned."""
    _enqueue(engine, key_prefix, 0, 3)
    key = _key(key_prefix)
    handlers = Handlers()

    def failing(conn: object, event: object) -> None:
        raise RuntimeError("the downstream is down")

    handlers.on("thing.done")(failing)
    consumer = _consumer(engine, key_prefix, handlers)
    consumer.run_once(block_ms=10)  # creates the group
    _relay(engine, redis_client, key_prefix)
    consumer.run_once(block_ms=10)  # every call fails: three retry rows
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(consumer_retries)).scalar() == 3
    redis_client.xtrim(key, maxlen=0, approximate=False)  # they vanish while pending

    consumer.recheck_pending()
    consumer.run_once(block_ms=10)
    assert consumer.stats.lost == 3
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(consumer_retries)).scalar() == 0

    # A row left by an older version, or by a group destroyed while it retried: the pruning
    # removes it once nobody wrote it for the inbox retention, and not before.
    with engine.begin() as conn:
        conn.execute(consumer_retries.insert(), [
            {"group_name": "gone", "event_id": name, "stream_key": key, "entry_id": "1-1",
             "attempts": 2, "first_failed_at_ms": at, "next_attempt_at_ms": at,
             "updated_at_ms": at}
            for name, at in (("old", now_ms() - 3_600_000), ("fresh", now_ms()))])
    pruned = InboxPruner(engine, redis_client, 600, batch=10).prune()
    assert pruned.retries == 1
    with engine.connect() as conn:
        assert set(conn.execute(select(consumer_retries.c.event_id)).scalars()) == {"fresh"}


def test_a_vanished_entry_that_was_already_handled_is_just_acknowledged(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    _enqueue(engine, key_prefix, 0, 3)
    key = _key(key_prefix)
    handlers = Handlers()
    handlers.on("thing.done")(lambda conn, event: None)
    consumer = _consumer(engine, key_prefix, handlers)
    consumer.run_once(block_ms=10)
    _relay(engine, redis_client, key_prefix)
    consumer.run_once(block_ms=10)  # applied and acked
    redis_client.xreadgroup("g", "c1", {key: "0"})  # nothing pending: a no-op read
    # Make entry 0 pending again as if the ACK had been lost after the claim committed.
    first = _ids(redis_client, key)[0]
    redis_client.xclaim(key, "g", "c1", 0, [first], force=True, justid=True)
    redis_client.xdel(key, first)

    consumer.recheck_pending()
    consumer.run_once(block_ms=10)

    assert group_status.group_pending(redis_client, [key], "g")[key] == 0
    assert consumer.stats.lost == 0
    assert redis_client.xlen(keys.dead_letter_key(key_prefix, STREAM, 0)) == 0
    with engine.connect() as conn:
        outcomes = conn.execute(select(inbox.c.outcome).where(
            inbox.c.group_name == "g")).scalars().all()
    assert sorted(outcomes) == ["applied"] * 3


def test_a_batch_appended_but_never_marked_is_not_trimmed_before_its_retry(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    """A relay dies after its XADD, before marking; every group reads and acknowledges the
    entries. The next trim must keep them: the retry of the recorded batch (same ids) has to
    find them, or it would call them a gap and append every event a second time."""
    from outbox_relay.relay import append

    _enqueue(engine, key_prefix, 0, 2)
    key = _key(key_prefix)
    redis_client.xgroup_create(key, "g", id="0", mkstream=True)
    relay = _relay(engine, redis_client, key_prefix)
    _enqueue(engine, key_prefix, 2, 3)
    epoch = _epoch(relay)
    rows = relay._take(0, epoch, None)  # recorded on the lease row...
    append.append(redis_client, key_prefix, rows, epoch)  # ...appended, never marked
    appended = {r.event_id: r.entry_id for r in rows}
    assert _read_ack(redis_client, key, "g", 10) == 5

    relay.repairer.maybe_run(relay.leases)
    relay.trimmer.run(relay.leases, relay.repairer.streams)
    assert _ids(redis_client, key) == sorted(appended.values(), key=entry_ids.parse)
    stats = relay.run(until_idle=True)  # the retry: the same ids, already there

    assert (stats.ordering_gaps, stats.already_present) == (0, 3)
    with engine.connect() as conn:
        marked = dict(conn.execute(select(outbox.c.event_id, outbox.c.entry_id).where(
            outbox.c.event_id.in_(list(appended)))).all())
    assert marked == appended
    assert redis_client.xreadgroup("g", "c1", {key: ">"}) == []  # nothing delivered twice


def test_trimmed_entries_redis_brings_back_without_receipts_are_acknowledged_never_applied(
    engine: Engine, redis_client: redis.Redis, key_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A replica promoted without WAIT can still hold entries its old master trimmed, with the
    group's older position; by then retention may have pruned their receipts. Below the trim
    floor they are ``resurrected``: acknowledged, never applied a second time."""
    _enqueue(engine, key_prefix, 0, 10)
    key = _key(key_prefix)
    applied: list[str] = []
    handlers = Handlers()
    handlers.on("thing.done")(lambda conn, event: applied.append(event.id))
    consumer = _consumer(engine, key_prefix, handlers)
    consumer.run_once(block_ms=10)  # creates the group
    relay = _relay(engine, redis_client, key_prefix)
    consumer.run_once(block_ms=10)
    assert len(applied) == 10
    before = redis_client.xrange(key)  # what the replica still holds
    assert relay.trimmer.trim(STREAM, 0, epoch=_epoch(relay)) == 10
    assert entry_ids.greater(stream_book.trim_floor(engine, STREAM, 0), before[-1][0].decode())
    with engine.begin() as conn:  # what retention does to receipts below the floor
        conn.execute(inbox.delete().where(inbox.c.group_name == "g"))
    # The failover: the promoted replica has the trimmed entries and the group's old position.
    redis_client.delete(key)
    for entry_id, fields in before:
        redis_client.xadd(key, fields, id=entry_id)
    redis_client.xgroup_create(key, "g", id="0")
    fresh = {**before[0][1], b"id": b"evt-fresh"}  # a new event, above the floor
    redis_client.xadd(key, fresh)

    consumer.recheck_pending()
    with caplog.at_level("WARNING", logger="outbox_relay.consumer.daemon"):
        consumer.run_once(block_ms=10)

    assert applied[10:] == ["evt-fresh"]
    assert consumer.stats.resurrected == 10
    assert group_status.group_pending(redis_client, [key], "g")[key] == 0
    assert redis_client.xinfo_groups(key)[0]["last-delivered-id"] == redis_client.xinfo_stream(
        key)["last-generated-id"]
    with engine.connect() as conn:  # no receipt for what was not applied
        assert conn.execute(select(inbox.c.event_id).where(
            inbox.c.group_name == "g")).scalars().all() == ["evt-fresh"]
    assert any("10 entries below their streams' trim floor" in r.getMessage()
               for r in caplog.records)


def test_groups_are_known_from_the_first_trim_after_a_delivery_so_a_redis_loss_holds_the_trim(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    # Found by the torture (SQLite, 300 kills): Redis restarted empty 23 s into the run. No
    # trim had run on the stream yet (the relay trimmed only streams its repair check had
    # found, and its first check, at start, found nothing delivered), so no group was known;
    # the first trim after the loss saw only the group whose consumers were back and removed
    # 13 entries the other group had never read.
    key = _key(key_prefix)
    for group in ("fast", "slow"):
        redis_client.xgroup_create(key, group, id="0", mkstream=True)
    relay = Relay(_settings(engine, key_prefix), engine, redis_client)
    _enqueue(engine, key_prefix, 0, 30)
    relay.run_once()  # leases, a repair check that finds nothing delivered yet, the delivery
    assert relay.stats.delivered == 30 and not relay.repairer.streams
    trim = relay.periodic[0]
    assert trim.name == "stream trim"
    trim.run(*trim.inputs())  # the relay's trim task, before any further repair check
    with engine.connect() as conn:
        known = set(conn.execute(select(stream_groups.c.group_name)).scalars())
    assert known == {"fast", "slow"}

    redis_client.delete(key)  # Redis lost the stream and both groups
    relay.repairer.check_soon()
    relay.repairer.maybe_run(relay.leases)
    assert len(_ids(redis_client, key)) == 30
    redis_client.xgroup_create(key, "fast", id="0")  # only one group's consumers are back
    _read_ack(redis_client, key, "fast", 30)
    trim.run(*trim.inputs())
    assert len(_ids(redis_client, key)) == 30  # held for "slow", which has read nothing
