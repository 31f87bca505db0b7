"""The relay's housekeeping off its thread: the periodic repair check (a read-only screen) and
the stream trim run on threads of their own while the relay appends (relay/repair.py,
relay/trim.py, "off the relay thread"). What must hold: neither holds a round; the screen
never takes a stream in step for one behind while appends land between its reads; what it
finds is repaired by the relay's next round; and a trim never removes a batch taken while it
ran, so a relay dying after such a batch's XADD leaves it to be retried by id, once.

Real Redis (our own keys only) and both databases.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import redis
from sqlalchemy import Engine

from outbox_relay.relay import append, repair, repair_store, store, stream_book, trim
from outbox_relay.relay.daemon import Relay
from outbox_relay.shared import keys
from outbox_relay.shared.db import now_ms
from outbox_relay.shared.errors import UnavailableError
from outbox_relay.shared.settings import RelaySettings
from tests.conftest import REDIS_URL
from tests.helpers import enqueue_numbered, let_die, undelivered

pytestmark = pytest.mark.integration

STREAM = "chores"
TTL = 10_000

_enqueue = partial(enqueue_numbered, source="chores-test", partitions=1, stream=STREAM,
                   id_format="evt-{n:05d}")


def _settings(engine: Engine, prefix: str, node: str = "chores") -> RelaySettings:
    return RelaySettings(
        database_url=engine.url.render_as_string(hide_password=False), redis_url=REDIS_URL,
        key_prefix=prefix, partitions=1, node_id=node, stream_keep=0, stream_keep_s=0,
        batch_size=1000)


def _key(prefix: str) -> str:
    return keys.stream_key(prefix, STREAM, 0)


def _ids(client: redis.Redis, key: str) -> list[str]:
    return [i.decode() for i, _ in client.xrange(key)]


def _read_ack(client: redis.Redis, key: str, group: str) -> int:
    reply = client.xreadgroup(group, "c1", {key: ">"}, count=10_000)
    ids = [i for i, _ in reply[0][1]] if reply else []
    if ids:
        client.xack(key, group, *ids)
    return len(ids)


def _task(relay: Relay, name: str) -> Any:
    (task,) = [t for t in relay.periodic if t.name == name]
    return task


def _wrap(monkeypatch: pytest.MonkeyPatch, module: Any, name: str,
          before: Callable[[], None] = lambda: None, after: Callable[[], None] = lambda: None,
          ) -> None:
    """Make ``module.name`` call ``before()`` first and ``after()`` once it has answered
    (the moments between two reads)."""
    original = getattr(module, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        before()
        answer = original(*args, **kwargs)
        after()
        return answer

    monkeypatch.setattr(module, name, wrapped)


@pytest.mark.parametrize("task", ["repair check", "stream trim"])
def test_a_slow_repair_check_or_trim_does_not_hold_the_relays_rounds(
    engine: Engine, redis_client: redis.Redis, key_prefix: str, task: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _enqueue(engine, key_prefix, 0, 10)
    relay = Relay(_settings(engine, key_prefix), engine, redis_client)
    relay.run_once()  # leases, the first full check on this thread, the first delivery
    assert undelivered(engine) == 0
    entered, release = threading.Event(), threading.Event()

    def stall() -> None:  # the task's first read waits until the test lets it go
        entered.set()
        release.wait(10)

    first_read = ((repair_store, "delivered_counts") if task == "repair check"
                  else (stream_book, "known_groups"))
    _wrap(monkeypatch, *first_read, before=stall)
    _task(relay, task).next_at = 0.0  # due now
    try:
        relay.run_once()  # starts the task on its thread
        assert entered.wait(10), f"the {task} did not start"
        _enqueue(engine, key_prefix, 10, 5)
        relay.wakeup.visit_everything()
        relay.run_once()  # with the task still stalled in its read
        assert not release.is_set() and undelivered(engine) == 0
        assert len(_ids(redis_client, _key(key_prefix))) == 15
    finally:
        release.set()
        relay.stop()
        relay.run(until_idle=True)  # stops at once; waits for the task, gives the leases back


def test_the_screen_takes_a_stream_in_step_for_in_step_while_appends_land_between_its_reads(
    engine: Engine, redis_client: redis.Redis, key_prefix: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A relay round (take, XADD, mark delivered) runs right before the screen reads the
    stream and again right before it reads the lease row: read the other way round, the
    stream would look behind the outbox and its top above the ids assigned."""
    _enqueue(engine, key_prefix, 0, 20)
    relay = Relay(_settings(engine, key_prefix), engine, redis_client)
    relay.run_once()
    batches = iter(range(20, 1000, 20))

    def a_round() -> None:
        _enqueue(engine, key_prefix, next(batches), 20)
        relay.wakeup.visit_everything()
        relay.run_once()

    _wrap(monkeypatch, repair.streams, "stream_state", a_round)
    _wrap(monkeypatch, repair_store, "last_assigned", a_round)
    asked: list[bool] = []
    relay.repairer.on_wanted = lambda: asked.append(True)
    checks = relay.repairer.stats.checks
    for _ in range(3):
        assert relay.repairer.screen(dict(relay.leases)) is False
    assert not asked and not relay.repairer.due(1e18)
    assert relay.repairer.stats.checks == checks + 3
    # The appends raised the floor to the newest entry; the screens write no floor.
    assert relay.repairer.floors[_key(key_prefix)] == _ids(redis_client, _key(key_prefix))[-1]
    relay.stop()


def test_the_screen_asks_for_a_foreign_top_ahead_of_the_clock_only(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    """A foreign entry above the relay's ids but behind the clock halts nothing (the next ids
    pass it; the full check leaves it too): asking for the full check would run it every
    interval. One ahead of the clock halts the partition: the full check moves it."""
    _enqueue(engine, key_prefix, 0, 5)
    relay = Relay(_settings(engine, key_prefix), engine, redis_client)
    relay.run_once()
    key = _key(key_prefix)
    last_ms = int(_ids(redis_client, key)[-1].split("-")[0])
    redis_client.xadd(key, {"x": "behind the clock"}, id=f"{last_ms}-999999")
    assert relay.repairer.screen(dict(relay.leases)) is False
    ahead = now_ms() + 600_000
    redis_client.xadd(key, {"x": "ahead of the clock"}, id=f"{ahead}-0")
    assert relay.repairer.screen(dict(relay.leases)) is True
    relay.run_once()  # the full check moves it to the dead-letter stream
    assert _ids(redis_client, key)[-1] == f"{last_ms}-999999"
    assert relay.repairer.stats.foreign_entries == 1
    relay.stop()


def test_a_full_check_that_fails_is_asked_for_again(
    engine: Engine, redis_client: redis.Redis, key_prefix: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    _enqueue(engine, key_prefix, 0, 5)
    relay = Relay(_settings(engine, key_prefix), engine, redis_client)
    relay.run_once()
    repairer = relay.repairer
    repairer.check_soon(("elsewhere", 0))
    failures = iter([UnavailableError("the database is unavailable")])

    def counts(*_args: Any) -> Any:
        for err in failures:
            raise err
        return {}

    monkeypatch.setattr(repair_store, "delivered_counts", counts)
    with pytest.raises(UnavailableError):
        repairer.maybe_run(dict(relay.leases))
    assert repairer.due(0.0) and repairer._asked == {("elsewhere", 0)}
    checks = repairer.stats.checks
    repairer.maybe_run(dict(relay.leases))
    assert repairer.stats.checks == checks + 1 and not repairer.due(1e18)
    assert repairer._asked == set()
    relay.stop()


def test_what_the_screen_finds_the_relays_next_round_repairs(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    _enqueue(engine, key_prefix, 0, 30)
    relay = Relay(_settings(engine, key_prefix), engine, redis_client)
    relay.run_once()
    key = _key(key_prefix)
    before = _ids(redis_client, key)
    assert relay.repairer.screen(dict(relay.leases)) is False
    redis_client.delete(key)  # Redis lost the stream
    woken: list[bool] = []
    relay.repairer.on_wanted = lambda: woken.append(True)
    assert relay.repairer.screen(dict(relay.leases)) is True
    assert woken and relay.repairer.due(0.0)
    relay.run_once()  # the full check on the relay thread: a rebuild under the same ids
    assert _ids(redis_client, key) == before
    assert relay.repairer.stats.behind == 1 and not relay.repairer.due(0.0)
    relay.stop()


def test_a_batch_taken_while_a_trim_runs_is_kept_for_its_retry_by_id(
    engine: Engine, redis_client: redis.Redis, key_prefix: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After the trim read the lease rows (nothing unsettled) and before its script runs, the
    relay takes a batch and appends it, the group reads and acknowledges it, and the relay
    dies before marking it. The trim must keep that batch for its retry by id: trimmed, the
    next owner would find a gap and append those events again, and the group would read them
    twice. The database's clock steps back a minute after the trim read it, so the batch's
    ids are older than the trim's keep-for cutoff (``stream_keep_s`` 0: the clock it read):
    only the stream's newest entry, read before the lease rows, keeps it."""
    _enqueue(engine, key_prefix, 0, 20)
    key = _key(key_prefix)
    redis_client.xgroup_create(key, "g", id="0", mkstream=True)
    relay = Relay(_settings(engine, key_prefix, "doomed"), engine, redis_client)
    relay.run_once()  # delivers the first 20
    assert _read_ack(redis_client, key, "g") == 20
    _enqueue(engine, key_prefix, 20, 10)
    epoch = relay.leases[0]
    taken: list[int] = []

    def a_take_and_append() -> None:
        rows = store.take_batch(engine, 0, "doomed", epoch, 100, TTL)
        taken.append(len(append.append(redis_client, key_prefix, rows, epoch).delivered))
        assert _read_ack(redis_client, key, "g") == 10

    _wrap(monkeypatch, stream_book, "unsettled_ms", after=a_take_and_append)
    stepped = trim.database_now(engine) + 60_000
    monkeypatch.setattr(trim, "database_now", lambda _engine: stepped)
    removed = relay.trimmer.run({0: epoch}, {(STREAM, 0)})
    monkeypatch.undo()
    assert taken == [10] and removed == 20  # what was acknowledged before the trim began
    let_die(engine, "doomed")  # no settle: the batch stays recorded on the lease row
    _enqueue(engine, key_prefix, 30, 5)
    Relay(_settings(engine, key_prefix, "next"), engine, redis_client).run(until_idle=True)
    assert undelivered(engine) == 0
    reply = redis_client.xreadgroup("g", "c1", {key: ">"}, count=100)
    read = [f[b"id"].decode() for _, f in reply[0][1]] if reply else []
    assert read == [f"evt-{n:05d}" for n in range(30, 35)]  # nothing read twice
