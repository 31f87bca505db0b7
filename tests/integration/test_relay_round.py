"""A relay round over several partitions: one take and one settle transaction for all of them,
and a partition fenced out in either leaves the others delivered and itself intact; the
settle also takes the rows committed while the round appended, for the next round."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from sqlalchemy import Engine, event, select

from outbox_relay.producer import Producer
from outbox_relay.relay import append, outgoing, store, wakeup
from outbox_relay.relay.daemon import Relay
from outbox_relay.relay.leases import acquire_leases
from outbox_relay.shared import keys, psycopg_driver
from outbox_relay.shared.db import is_postgres
from outbox_relay.shared.errors import LeaseLostError, UnavailableError
from outbox_relay.shared.schema import relay_leases
from tests.helpers import (
    PARTITIONS,
    STREAM,
    assert_all_marked,
    assert_each_once,
    enqueue_events,
    expire_lease,
    lease_owners,
    outbox_rows,
    partition_of,
    relay_settings,
    undelivered,
    wait_until,
)

pytestmark = pytest.mark.integration

TTL = 10_000


def fenced_transactions(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> list[list[str]]:
    """Record, per committed transaction, the statements it ran (through SQLAlchemy, and the
    pipelined settle's, sent on psycopg's connection itself: ``store._send``); the returned
    list fills as transactions commit."""
    done: list[list[str]] = []
    current: list[str] = []
    relay_thread = threading.get_ident()  # the background housekeeping's are left out

    def on_execute(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if threading.get_ident() == relay_thread:
            current.append(" ".join(statement.split()))

    send = store._send

    def sent(raw: Any, statement: Any, params: dict[str, Any]) -> Any:
        on_execute(None, None, statement.sql)
        return send(raw, statement, params)

    monkeypatch.setattr(store, "_send", sent)

    def on_commit(_conn: Any) -> None:
        if threading.get_ident() == relay_thread:
            done.append(current.copy())
            current.clear()

    def on_rollback(_conn: Any) -> None:
        if threading.get_ident() == relay_thread:
            current.clear()

    event.listen(engine, "before_cursor_execute", on_execute)
    event.listen(engine, "commit", on_commit)
    event.listen(engine, "rollback", on_rollback)
    return done


def is_fence(statement: str) -> bool:
    """The fence alone, or (PostgreSQL's settle) the fence and the mark in one statement."""
    fused = statement.startswith("WITH fence AS (UPDATE outbox_relay_leases")
    alone = statement.startswith("UPDATE outbox_relay_leases") and "RETURNING" in statement
    return fused or alone


def relay_holding_everything(engine: Engine, client: redis.Redis, prefix: str) -> Relay:
    relay = Relay(relay_settings(prefix, node_id="a", lease_ttl_ms=TTL), engine, client)
    relay._refresh_leases()  # hold every partition before the round
    assert sorted(relay.leases) == list(range(PARTITIONS))
    return relay


def test_a_round_takes_and_settles_all_its_partitions_in_one_transaction_each(
    engine: Engine, redis_client: redis.Redis, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = enqueue_events(engine, 24, aggregates=8)  # a few rows in every partition
    assert {r.partition for r in outbox_rows(engine)} == set(range(PARTITIONS))
    relay = relay_holding_everything(engine, redis_client, key_prefix)
    transactions = fenced_transactions(engine, monkeypatch)

    busy = relay.run_once()

    fenced = [t for t in transactions if any(is_fence(s) for s in t)]
    assert len(fenced) == 2  # the take and the settle, each fencing every partition once
    assert [sum(is_fence(s) for s in t) for t in fenced] == [PARTITIONS, PARTITIONS]
    assert not busy and relay.stats.delivered == 24
    assert_each_once(redis_client, key_prefix, ids)
    assert_all_marked(engine, redis_client, key_prefix)


def test_a_partition_fenced_out_before_the_take_leaves_the_rest_of_the_round_delivered(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    ids = enqueue_events(engine, 24, aggregates=8)
    relay = relay_holding_everything(engine, redis_client, key_prefix)
    expire_lease(engine, 2)  # relay "a" stalled; "b" took partition 2 over
    assert list(acquire_leases(engine, "b", PARTITIONS, TTL)) == [2]

    relay.run_once()

    assert relay.stats.lease_losses == 1 and 2 not in relay.leases
    left = [r for r in outbox_rows(engine) if r.delivered_at_ms is None]
    assert left and {r.partition for r in left} == {2}
    assert all(r.entry_id is None for r in left)  # "a" took nothing there
    Relay(relay_settings(key_prefix, node_id="b"), engine, redis_client).run(until_idle=True)
    assert_each_once(redis_client, key_prefix, ids)
    assert_all_marked(engine, redis_client, key_prefix)


def test_a_partition_fenced_out_after_its_append_is_left_to_its_new_owner_by_id(
    engine: Engine, redis_client: redis.Redis, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = enqueue_events(engine, 24, aggregates=8)
    relay = relay_holding_everything(engine, redis_client, key_prefix)
    real = append.append_many

    def steal_partition_1_after_its_append(*args: Any, **kwargs: Any) -> Any:
        outcomes = real(*args, **kwargs)
        if any(rows[0].partition == 1 for rows, _epoch in args[2]):
            expire_lease(engine, 1)  # appended under "a"'s epoch; "b" takes over now
            assert list(acquire_leases(engine, "b", PARTITIONS, TTL)) == [1]
        return outcomes

    monkeypatch.setattr(append, "append_many", steal_partition_1_after_its_append)
    relay.run_once()
    monkeypatch.setattr(append, "append_many", real)

    assert relay.stats.lease_losses == 1 and 1 not in relay.leases
    left = [r for r in outbox_rows(engine) if r.delivered_at_ms is None]
    assert left and {r.partition for r in left} == {1}  # "a" could not mark them
    assert relay.stats.delivered == 24 - len(left)
    with pytest.raises(LeaseLostError):  # and "a" cannot take them again
        store.take_batch(engine, 1, "a", 1, 100, TTL)
    stats = Relay(relay_settings(key_prefix, node_id="b"), engine, redis_client).run(
        until_idle=True)
    assert stats.already_present == len(left)  # retried under the ids "a" appended them with
    assert undelivered(engine) == 0
    assert_each_once(redis_client, key_prefix, ids)
    assert_all_marked(engine, redis_client, key_prefix)


def during_the_first_append(
    monkeypatch: pytest.MonkeyPatch, commit: Callable[[], list[str]]
) -> list[str]:
    """Make the next append run ``commit`` first (after the round's take, before its
    settle); the returned list fills with the event ids it committed. Later appends are
    left alone."""
    real = append.append_many
    ids: list[str] = []

    def commit_then_append(*args: Any, **kwargs: Any) -> Any:
        if not ids:
            ids.extend(commit())
        return real(*args, **kwargs)

    monkeypatch.setattr(append, "append_many", commit_then_append)
    return ids


def committing_during_the_first_append(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, count: int
) -> list[str]:
    """:func:`during_the_first_append` committing ``count`` events over 8 aggregates."""
    return during_the_first_append(
        monkeypatch, lambda: enqueue_events(engine, count, aggregates=8, first=1000))



def recorded_ids(engine: Engine) -> dict[tuple[int, int], str]:
    """``(partition, seq)`` → the entry id a batch recorded on the partition's lease row
    (taken, not settled) gives it; a batch's seq range also spans other partitions' seqs."""
    with engine.connect() as conn:
        rows = conn.execute(select(relay_leases.c.partition, relay_leases.c.inflight)).all()
    return {(p, seq): f"{b.ms}-{seq}" for p, text in rows for b in outgoing.load_batches(text)
            for seq in range(b.first_seq, b.last_seq + 1)}


def pending_seqs(engine: Engine) -> set[tuple[int, int]]:
    return {(r.partition, r.seq) for r in outbox_rows(engine) if r.delivered_at_ms is None}


def a_round_taking_for_the_next(
    engine: Engine, client: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> tuple[Relay, list[str], list[str]]:
    """A relay holding every partition runs one round of 24 events, during whose append 16
    more commit; its settle takes those (recorded on the lease rows, not yet appended).
    Returns the relay, every event id, and the 16 later ones'."""
    ids = enqueue_events(engine, 24, aggregates=8)
    later = committing_during_the_first_append(engine, monkeypatch, 16)
    relay = relay_holding_everything(engine, client, prefix)
    assert relay.run_once()  # busy: its settle took the rows committed meanwhile
    assert relay.stats.delivered == 24 and len(later) == 16
    assert set(recorded_ids(engine)) >= pending_seqs(engine)
    assert len(pending_seqs(engine)) == 16
    monkeypatch.undo()
    return relay, ids + later, later


def assert_sent_once(engine: Engine, client: redis.Redis, prefix: str, ids: list[str]) -> None:
    assert_each_once(client, prefix, ids)
    assert_all_marked(engine, client, prefix)


def assert_sent_under(engine: Engine, taken: dict[tuple[int, int], str], later: list[str]) -> None:
    """Every event of ``later`` went out under the entry id the settle recorded for it."""
    assert all(r.entry_id == taken[r.partition, r.seq] for r in outbox_rows(engine)
               if r.event_id in later)


def test_rows_committed_while_a_round_appends_are_taken_by_its_settle_for_the_next_round(
    engine: Engine, redis_client: redis.Redis, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    transactions = fenced_transactions(engine, monkeypatch)
    relay, ids, later = a_round_taking_for_the_next(engine, redis_client, key_prefix,
                                                     monkeypatch)
    fenced = [t for t in transactions if any(is_fence(s) for s in t)]
    assert len(fenced) == 2 and any(s.startswith("SELECT") for s in fenced[1])
    taken = recorded_ids(engine)
    transactions = fenced_transactions(engine, monkeypatch)  # the round's patches are undone

    busy = relay.run_once()

    fenced = [t for t in transactions if any(is_fence(s) for s in t)]
    assert len(fenced) == 1  # no take transaction: the settle's only (which finds no more)
    assert not busy and relay.stats.delivered == 40
    assert_sent_under(engine, taken, later)
    assert_sent_once(engine, redis_client, key_prefix, ids)
    assert recorded_ids(engine) == {}


def test_a_batch_a_settle_took_is_retried_by_id_when_its_relay_dies_before_appending_it(
    engine: Engine, redis_client: redis.Redis, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _relay, ids, later = a_round_taking_for_the_next(engine, redis_client, key_prefix,
                                                      monkeypatch)
    taken = recorded_ids(engine)
    for partition in range(PARTITIONS):  # "a" died holding them; "b" takes over
        expire_lease(engine, partition)

    Relay(relay_settings(key_prefix, node_id="b"), engine, redis_client).run(until_idle=True)

    assert_sent_under(engine, taken, later)
    assert_sent_once(engine, redis_client, key_prefix, ids)


def test_a_relay_that_wins_its_leases_back_retries_what_its_settle_took_by_id(
    engine: Engine, redis_client: redis.Redis, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    relay, ids, later = a_round_taking_for_the_next(engine, redis_client, key_prefix,
                                                     monkeypatch)
    taken = recorded_ids(engine)
    old = dict(relay.leases)
    for partition in range(PARTITIONS):  # "a" stalled past its TTL; it leases them again
        expire_lease(engine, partition)
    relay._next_lease_check = 0.0

    rounds = 1
    while relay.run_once():  # the old epoch's batches dropped, then retried from the record
        rounds += 1
        assert rounds < 5

    assert all(relay.leases[p] == old[p] + 1 for p in old)  # under new epochs
    assert undelivered(engine) == 0 and recorded_ids(engine) == {}
    assert_sent_under(engine, taken, later)  # the old epoch's batches, retried by id
    assert_sent_once(engine, redis_client, key_prefix, ids)


def test_a_stopping_relay_sends_what_its_last_settle_took(
    engine: Engine, redis_client: redis.Redis, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    relay, ids, _later = a_round_taking_for_the_next(engine, redis_client, key_prefix,
                                                      monkeypatch)

    relay.stop()  # the loop runs no round, and still sends the batches taken
    relay.run(until_idle=True)

    assert undelivered(engine) == 0 and recorded_ids(engine) == {}
    assert lease_owners(engine) == dict.fromkeys(range(PARTITIONS))  # released
    assert_sent_once(engine, redis_client, key_prefix, ids)


def test_a_round_that_starts_with_housekeeping_takes_its_own_rows_after_it(
    engine: Engine, redis_client: redis.Redis, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = enqueue_events(engine, 24, aggregates=8)
    later = committing_during_the_first_append(engine, monkeypatch, 16)
    relay = relay_holding_everything(engine, redis_client, key_prefix)
    real = append.append_many

    def lease_round_due_after_append(*args: Any, **kwargs: Any) -> Any:
        relay._next_lease_check = 0.0  # the next round starts with a lease round
        return real(*args, **kwargs)

    monkeypatch.setattr(append, "append_many", lease_round_due_after_append)
    transactions = fenced_transactions(engine, monkeypatch)

    assert not relay.run_once()  # nothing taken for the next round: it would wait
    assert relay.stats.delivered == 24 and len(pending_seqs(engine)) == 16
    assert recorded_ids(engine) == {}
    assert not any(s.startswith("SELECT") for s in transactions[-1])
    monkeypatch.undo()
    relay.run(until_idle=True)
    assert_sent_once(engine, redis_client, key_prefix, ids + later)


def test_a_settles_take_reads_on_past_held_back_rows_and_takes_another_aggregates_rows(
    engine: Engine, redis_client: redis.Redis, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two partitions settle together and take their next rows. In one, a delayed row heads
    an aggregate whose 80 later rows are held back behind it, more than the take's first
    read returns (batch 2 + 64 of slack): the take reads on and takes the two rows of another
    aggregate of the partition after them, recorded under the settle's clock, and nothing of
    the held aggregate. On PostgreSQL the settle is pipelined (relay/store.py
    ``_settle_pipelined``): its further read is sent alone, after the first reads."""
    ids = enqueue_events(engine, 24, aggregates=8)
    leases = acquire_leases(engine, "a", PARTITIONS, TTL)
    batches = {p: store.take_batch(engine, p, "a", leases[p], 100, TTL) for p in (0, 1)}
    assert all(batches.values())
    verdicts = {p: append.append(redis_client, key_prefix, rows, leases[p])
                for p, rows in batches.items()}
    held, other = aggregates_in(0, 2)
    producer = Producer(source="tests", partitions=PARTITIONS)
    with engine.begin() as conn:
        producer.enqueue(conn, type="thing.happened", stream=STREAM, data={},
                         aggregate_type="thing", aggregate_id=held, revision=1,
                         delay_ms=3_600_000)
        for revision in range(2, 82):
            producer.enqueue(conn, type="thing.happened", stream=STREAM, data={},
                             aggregate_type="thing", aggregate_id=held, revision=revision)
        later = [producer.enqueue(conn, type="thing.happened", stream=STREAM, data={},
                                  aggregate_type="thing", aggregate_id=other, revision=r)
                 for r in (1, 2)]

    sent = pipelined_sends(engine, monkeypatch)

    lost, taken = store.settle_batches(engine, "a", TTL, [
        store.Settlement(p, leases[p], verdicts[p].delivered, [], []) for p in (0, 1)],
        take=frozenset({0, 1}), batch_size=2)

    # pipelined: 2 fences and marks, 2 first reads, 1 read on, 2 records
    assert len(sent) == (7 if pipelined_on(engine) else 0)
    assert lost == [] and list(taken) == [0]
    assert [r.event_id for r in taken[0]] == later
    assert recorded_ids(engine) == {(0, r.seq): r.entry_id for r in taken[0]}
    marked = {r.event_id for r in outbox_rows(engine) if r.delivered_at_ms is not None}
    assert marked == {r.event_id for rows in batches.values() for r in rows}
    assert marked < set(ids)


def pipelined_sends(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The statements the relay sends in psycopg's pipeline mode (``store._send``); the
    returned list fills as they are sent."""
    sent: list[str] = []
    send = store._send

    def spy(raw: Any, statement: Any, params: dict[str, Any]) -> Any:
        sent.append(statement.sql)
        return send(raw, statement, params)

    monkeypatch.setattr(store, "_send", spy)
    return sent


def pipelined_on(engine: Engine) -> bool:
    """Whether the relay's take and settle run pipelined here (PostgreSQL, libpq ≥ 14)."""
    with engine.connect() as conn:
        return is_postgres(conn) and psycopg_driver.pipelining_connection(conn) is not None


def aggregates_in(partition: int, count: int) -> list[str]:
    """``count`` aggregate ids the producer maps to ``partition``."""
    found = (f"held-{i}" for i in range(10_000))
    return [a for a in found if partition_of(a) == partition][:count]


def enqueue_in(engine: Engine, partition: int, count: int, aggregate: int = 0) -> list[str]:
    """``count`` events of one aggregate the producer maps to ``partition``."""
    producer = Producer(source="tests", partitions=PARTITIONS)
    aggregate_id = aggregates_in(partition, aggregate + 1)[aggregate]
    with engine.begin() as conn:
        return [producer.enqueue(conn, type="thing.happened", stream=STREAM, data={},
                                 aggregate_type="thing", aggregate_id=aggregate_id,
                                 revision=r) for r in range(1, count + 1)]


def test_a_rounds_take_tells_idle_partitions_from_lost_ones_and_retries_recorded_batches(
    engine: Engine, redis_client: redis.Redis, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One take over four held partitions: one with new rows (taken and recorded under one
    ``ms``), one whose lease row records a batch no settle finished (its rows come back under
    their recorded ids, nothing new taken), one idle (nothing taken, not lost) and one taken
    over by another relay (lost, nothing of it recorded). On PostgreSQL the take is
    pipelined (relay/store.py ``_take_pipelined``): the idle and the lost partition both
    return no row from the fence, and only the read after it tells them apart."""
    fresh, retried, idle, stolen = 0, 1, 2, 3
    held = acquire_leases(engine, "a", PARTITIONS, TTL)
    first = enqueue_in(engine, retried, 3)
    recorded = store.take_batch(engine, retried, "a", held[retried], 100, TTL)
    assert [r.event_id for r in recorded] == first
    new = enqueue_in(engine, fresh, 4)
    enqueue_in(engine, stolen, 2)
    expire_lease(engine, stolen)
    assert acquire_leases(engine, "b", PARTITIONS, TTL)[stolen] == held[stolen] + 1

    sent = pipelined_sends(engine, monkeypatch)

    taken, lost = store.take_batches(engine, "a", held, 100, TTL)

    # pipelined: 4 fences, 2 lease checks (idle, stolen), 1 read and 1 record (fresh); the
    # retry after the pipeline, through SQLAlchemy
    assert len(sent) == (8 if pipelined_on(engine) else 0)

    assert lost == [stolen] and sorted(taken) == [fresh, retried]
    assert [(r.event_id, r.entry_id, r.retry) for r in taken[retried]] == [
        (r.event_id, r.entry_id, True) for r in recorded]
    assert [r.event_id for r in taken[fresh]] == new
    assert len({r.entry_id.split("-")[0] for r in taken[fresh]}) == 1
    ids = recorded_ids(engine)
    assert {p for p, _seq in ids} == {fresh, retried}
    assert all(ids[fresh, r.seq] == r.entry_id for r in taken[fresh])
    assert idle in held and idle not in taken and idle not in lost


def test_a_round_whose_append_fails_in_one_partition_settles_the_others_and_retries_it(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    """A round appends four partitions' batches in one Redis round trip
    (``in_flight.finish_round``). One partition's stream lost its entries (Redis lost data):
    its append is refused (``stream_behind``, nothing of it written) while the other three
    land. Those three are settled by the round, which then raises; the refused batch stays
    unmarked, shows its error, and goes out after the repair refills the stream, each event
    once."""
    first = enqueue_events(engine, 24, aggregates=8)
    relay = relay_holding_everything(engine, redis_client, key_prefix)
    wait_until(lambda: relay.run_once() is not None and undelivered(engine) == 0,
               what="the first events to go out")
    lossy = 2
    key = keys.stream_key(key_prefix, STREAM, lossy)
    assert relay.repairer.floors.get(key)
    redis_client.delete(key, keys.fence_key(key_prefix, STREAM, lossy))
    later = enqueue_events(engine, 24, aggregates=8, first=100)
    relay.repairer._next_check = float("inf")  # only the refusal may ask for the check

    with pytest.raises(UnavailableError) as refused:
        relay.run_once()

    assert refused.value.code == "stream_behind"
    left = [r for r in outbox_rows(engine) if r.delivered_at_ms is None]
    assert left and {r.partition for r in left} == {lossy}
    assert all(r.last_error == "stream_behind" for r in left)
    assert redis_client.xlen(key) == 0  # nothing appended above the hole
    wait_until(lambda: relay.run_once() is not None and undelivered(engine) == 0,
               what="the refill, then the refused batch")
    assert_sent_once(engine, redis_client, key_prefix, first + later)


def test_a_pipelined_settle_whose_connection_drops_is_unavailable_with_no_driver_text_logged(
    engine: Engine, redis_client: redis.Redis, key_prefix: str,
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """The database connection dies in the middle of a pipelined settle (its backend
    terminated after the first statement was sent): the settle raises ``UnavailableError``,
    nothing is marked, no record at WARNING or above carries the driver's text (psycopg's
    own exit of a pipeline would log it), and the next settle of the same batches, on
    another pooled connection, marks them."""
    if not pipelined_on(engine):
        pytest.skip("the settle is pipelined on PostgreSQL only")
    enqueue_events(engine, 24, aggregates=8)
    held = acquire_leases(engine, "a", PARTITIONS, TTL)
    batches = {p: store.take_batch(engine, p, "a", held[p], 100, TTL) for p in (0, 1)}
    outcomes = [store.Settlement(p, held[p], append.append(
        redis_client, key_prefix, rows, held[p]).delivered, [], []) for p, rows in batches.items()]
    send, killed = store._send, []

    def send_then_kill_the_backend(raw: Any, statement: Any, params: dict[str, Any]) -> Any:
        cursor = send(raw, statement, params)
        if not killed:
            killed.append(raw.info.backend_pid)
            with engine.connect() as other:
                other.exec_driver_sql("SELECT pg_terminate_backend(%(pid)s)",
                                      {"pid": killed[0]})
        return cursor

    monkeypatch.setattr(store, "_send", send_then_kill_the_backend)
    caplog.set_level(logging.DEBUG)
    with pytest.raises(UnavailableError):
        store.settle_batches(engine, "a", TTL, outcomes)
    monkeypatch.undo()

    assert killed and undelivered(engine) == len(outbox_rows(engine))
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not loud, [(r.name, r.getMessage()) for r in loud]
    lost, _taken = store.settle_batches(engine, "a", TTL, outcomes)
    assert lost == []
    marked = {r.seq for r in outbox_rows(engine) if r.delivered_at_ms is not None}
    assert marked == {r.seq for rows in batches.values() for r in rows}


def test_on_a_cluster_a_call_whose_connection_is_lost_makes_only_its_batch_unknown(
    engine: Engine, redis_client: redis.Redis, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On Redis Cluster a round's append calls go one by one, each to its slot's master
    (``append._run``): the call whose connection is lost is its batch's unknown outcome,
    and the batch whose call was answered stands (it is settled, not retried)."""
    enqueue_events(engine, 24, aggregates=8)
    held = acquire_leases(engine, "a", PARTITIONS, TTL)
    batches = [(store.take_batch(engine, p, "a", held[p], 100, TTL), held[p]) for p in (0, 1)]
    monkeypatch.setattr(append, "is_cluster", lambda _client: True)
    evalsha, lost_key = redis_client.evalsha, keys.stream_key(key_prefix, STREAM, 1)

    def losing_partition_1(*args: Any) -> Any:
        if lost_key in args:
            raise redis.ConnectionError("connection lost")
        return evalsha(*args)

    monkeypatch.setattr(redis_client, "evalsha", losing_partition_1)

    outcomes = append.append_many(redis_client, key_prefix, batches)

    assert isinstance(outcomes[0], append.Verdicts)
    assert len(outcomes[0].delivered) == len(batches[0][0])
    assert isinstance(outcomes[1], UnavailableError)
    assert redis_client.xlen(lost_key) == 0


def a_round_taking_a_notified_partition(
    engine: Engine, client: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> tuple[Relay, list[str], list[str], list[str]]:
    """A listening relay holding every partition runs a round of partition 0 during whose
    append 4 events are committed and notified in partition 1; its settle takes those
    (recorded on the lease row, not appended). Returns the relay, the statements the round
    sent pipelined, and the ids of partition 0's and partition 1's events."""
    relay = relay_holding_everything(engine, client, prefix)
    first = enqueue_in(engine, 0, 2)
    relay.run(until_idle=True)  # the stream is registered: later settles are pipelined
    relay.wakeup.listening = True  # notifications name partitions (a LISTEN connection)
    relay.wakeup.interval = 3600.0  # and no poll makes a round visit every partition
    monkeypatch.setattr(wakeup, "FULL_ROUND_S", 3600.0)
    relay.wakeup.targets()
    first += enqueue_in(engine, 0, 3, aggregate=1)
    relay.wakeup.notify(0)

    def commit_and_notify() -> list[str]:
        ids = enqueue_in(engine, 1, 4)
        relay.wakeup.notify(1)  # what its NOTIFY does, through the listener thread
        return ids

    later = during_the_first_append(monkeypatch, commit_and_notify)
    sent = pipelined_sends(engine, monkeypatch)
    delivered = relay.stats.delivered

    assert relay.run_once()  # busy: what its settle took goes out next

    assert relay.stats.delivered == delivered + 3 and len(later) == 4
    assert set(relay._pretaken) == {1}
    assert {p for p, _seq in recorded_ids(engine)} == {1}
    return relay, sent, first, later


def test_a_settle_also_takes_the_partitions_notified_during_its_round(
    engine: Engine, redis_client: redis.Redis, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """:func:`a_round_taking_a_notified_partition`: on PostgreSQL the settle's take of
    partition 1 is pipelined, its fence sent in partition order among the settle's fenced
    marks; the next round appends partition 1's rows with no take transaction of its own,
    under the ids recorded then, once each."""
    relay, sent, first, later = a_round_taking_a_notified_partition(
        engine, redis_client, key_prefix, monkeypatch)
    if pipelined_on(engine):
        settle = [x.split()[0] for x in sent[next(i for i, x in enumerate(sent)
                                                  if x.startswith("WITH fence")):]]
        # 0's fenced mark, then 1's fence (partition order); both first reads; both records
        assert settle == ["WITH", "UPDATE", "SELECT", "SELECT", "UPDATE", "UPDATE"]
    taken = recorded_ids(engine)
    transactions = fenced_transactions(engine, monkeypatch)
    delivered = relay.stats.delivered

    relay.run_once()

    fenced = [t for t in transactions if any(is_fence(s) for s in t)]
    assert len(fenced) == 1  # the settle: no take transaction
    assert relay.stats.delivered == delivered + 4
    assert_sent_under(engine, taken, later)
    assert_sent_once(engine, redis_client, key_prefix, first + later)


def test_what_a_settle_took_of_a_notified_partition_survives_its_relay_pausing_past_its_lease(
    engine: Engine, redis_client: redis.Redis, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The relay that took partition 1's rows in its settle stalls past its lease (as a
    SIGSTOP would); another relay takes the partition over and sends the recorded batch under
    its recorded ids. Woken, the first relay still believes it holds the partition and tries
    to append what it took: nothing is sent twice, and it finds out it lost the lease."""
    relay, _sent, first, later = a_round_taking_a_notified_partition(
        engine, redis_client, key_prefix, monkeypatch)
    taken = recorded_ids(engine)
    expire_lease(engine, 1)
    Relay(relay_settings(key_prefix, node_id="b"), engine, redis_client).run(until_idle=True)
    assert_sent_under(engine, taken, later)
    assert_sent_once(engine, redis_client, key_prefix, first + later)

    relay.run_once()  # woken: no lease check is due, its round starts from what it took

    assert_sent_once(engine, redis_client, key_prefix, first + later)
    assert 1 not in relay.leases and not relay._pretaken


def test_a_settle_takes_nothing_of_a_partition_notified_but_idle_lost_or_retrying(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    """``also`` in a settle (pipelined on PostgreSQL, one statement at a time on SQLite): a
    partition with a recorded batch to retry is left to its own take (its record
    unchanged), one taken over by another relay is neither taken nor reported lost (its next
    take finds out), an idle one takes nothing; the settle of the others commits."""
    settled, retrying, stolen, idle = 0, 1, 2, 3
    held = acquire_leases(engine, "a", PARTITIONS, TTL)
    enqueue_in(engine, settled, 2)
    batch = store.take_batch(engine, settled, "a", held[settled], 100, TTL)
    verdict = append.append(redis_client, key_prefix, batch, held[settled])
    enqueue_in(engine, retrying, 2)
    recorded = store.take_batch(engine, retrying, "a", held[retrying], 100, TTL)
    enqueue_in(engine, stolen, 2)
    expire_lease(engine, stolen)
    assert acquire_leases(engine, "b", PARTITIONS, TTL)[stolen] == held[stolen] + 1
    before = recorded_ids(engine)

    lost, taken = store.settle_batches(
        engine, "a", TTL, [store.Settlement(settled, held[settled], verdict.delivered, [], [])],
        take=frozenset({settled}), batch_size=100,
        also={p: held[p] for p in (retrying, stolen, idle)})

    assert lost == [] and taken == {}
    assert recorded_ids(engine) == {k: v for k, v in before.items() if k[0] == retrying}
    assert {(r.partition, r.seq) for r in recorded} <= set(recorded_ids(engine))
    marked = {r.event_id for r in outbox_rows(engine) if r.delivered_at_ms is not None}
    assert marked == {r.event_id for r in batch}


def test_rows_no_notification_named_keep_the_poll_short_though_a_settle_took_them(
    engine: Engine, redis_client: redis.Redis, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Producers without ``NOTIFY`` and a listening relay: rows committed while a round
    appends are taken by its settle (partition 0 settled whole), and the next round, a full
    one, has only those. They were announced by nothing, so the poll stays at
    ``poll_min_ms`` (relay/wakeup.py ``worked``): counted as an empty poll, the interval
    doubled and the other partitions' rows waited up to ``poll_max_ms`` (p99 at 1,000 ev/s
    with ``notify=False`` producers went from 20 to 39 ms)."""
    relay = relay_holding_everything(engine, redis_client, key_prefix)
    relay.wakeup.listening = True  # its first round is a full one, with nothing named
    first = enqueue_in(engine, 0, 2)
    later = during_the_first_append(monkeypatch, lambda: enqueue_in(engine, 0, 3, aggregate=1))
    assert relay.run_once() and set(relay._pretaken) == {0} and later
    relay.wakeup.worked(relay._found_in)
    relay.wakeup.interval = 0.4  # as if polls had backed off

    relay.wakeup.visit_everything()  # the next round is a full one too
    relay.run_once()

    assert relay._found_in == {0}
    relay.wakeup.worked(relay._found_in)
    assert relay.wakeup.interval == pytest.approx(relay.wakeup.min_s)
    assert_sent_once(engine, redis_client, key_prefix, first + later)


def test_a_pipelined_settle_whose_record_fails_commits_nothing(
    engine: Engine, redis_client: redis.Redis, key_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A record that fails in the pipeline (after every fenced mark was answered) fails the
    whole settle: it raises, and none of its marks is committed."""
    if not pipelined_on(engine):
        pytest.skip("the settle is pipelined on PostgreSQL only")
    enqueue_events(engine, 24, aggregates=8)
    held = acquire_leases(engine, "a", PARTITIONS, TTL)
    taken, _lost = store.take_batches(engine, "a", held, 100, TTL)
    outcomes = [store.Settlement(p, held[p], append.append(
        redis_client, key_prefix, rows, held[p]).delivered, [], []) for p, rows in taken.items()]
    enqueue_events(engine, 8, aggregates=8, first=24)  # rows for the settle's take to record
    record = outgoing.record_statement

    def failing(dialect: Any) -> Any:  # the record cannot run: 'boom' is no number
        good = record(dialect)
        sql = good.sql.replace("inflight=%(b_inflight)s", "inflight=%(b_inflight)s, "
                               "epoch = CAST('boom' AS BIGINT)", 1)
        assert sql != good.sql
        return SimpleNamespace(sql=sql, defaults=good.defaults)

    monkeypatch.setattr(outgoing, "record_statement", failing)
    with pytest.raises(UnavailableError):  # the driver's text left out (translate_errors)
        store.settle_batches(engine, "a", TTL, outcomes, take=frozenset(held), batch_size=100)
    monkeypatch.undo()
    assert undelivered(engine) == 32  # none of the fenced marks was committed
