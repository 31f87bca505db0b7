"""The torture's producer process: runs, plain events, and concurrent writers of shared aggregates.

Two loads run side by side, together at ``TORTURE_RATE`` events per second:

- The main thread (a ``1 - TORTURE_AGGREGATE_SHARE`` share): transactions of 1-8 items, each
  a run (``RunStore.create``: the run row and its ``run.created`` event) or a plain event
  (``torture.event`` on stream ``events``, no aggregate). Ids carry the incarnation
  (``TORTURE_INCARNATION``) so a restarted producer never reuses one.
- ``TORTURE_WRITERS`` threads (default 3) writing the SAME aggregates concurrently. Each
  transaction takes the aggregate's next revision from its row in ``torture_aggregates`` by
  compare-and-set (``UPDATE … SET revision = revision + 1 WHERE id = ? AND revision = ?``; no row
  changed is a conflict, retried in a new transaction), enqueues the event(s) of that revision
  in the same transaction, and holds the transaction open for a random 0-``TORTURE_HOLD_MS`` ms
  before commit. On PostgreSQL that makes ``seq`` order differ from commit order, the relay's
  hardest case. A transaction is either an ``item`` change (``item.changed``, plus in a quarter
  of them ``item.noted`` at the same revision: both must apply) or a ``touch`` (``item.touched``,
  a latest-ordered type). Aggregates are drawn with a hot set, so writers collide often.
  Event ids are the deterministic ``{aggregate}:{type}:{revision}``: a revision is committed
  with its events or not at all, so an id is never reused.

The harness SIGKILLs this process at random and arms ``producer.before_commit``; what counts
afterwards is only what the database committed.

Run by the harness as ``python -m torture.load`` with the ``OUTBOX_*`` environment.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time
from types import FrameType

from sqlalchemy import Engine, select, update
from sqlalchemy.exc import DBAPIError, IntegrityError

from outbox_relay.producer import Producer
from outbox_relay.runs.store import RunStore
from outbox_relay.shared import db
from outbox_relay.shared.errors import UnavailableError
from outbox_relay.shared.settings import CommonSettings
from torture.app import aggregates

EVENTS_STREAM = "events"
ITEMS = 40  # item aggregates; the first HOT of them take half of the writes
TOUCHES = 10  # touch aggregates (latest-ordered events)
HOT = 5
NOTED_SHARE = 0.25
TOUCH_SHARE = 0.25


class Conflict(Exception):
    """The compare-and-set found another revision: retry in a new transaction."""


def main() -> int:
    settings = CommonSettings.model_validate({})
    rate = float(os.environ.get("TORTURE_RATE", "100"))
    runs_share = float(os.environ.get("TORTURE_RUNS_SHARE", "0.3"))
    aggregate_share = float(os.environ.get("TORTURE_AGGREGATE_SHARE", "0.5"))
    writers = int(os.environ.get("TORTURE_WRITERS", "3"))
    hold_s = float(os.environ.get("TORTURE_HOLD_MS", "50")) / 1000
    tag = f"i{os.environ.get('TORTURE_INCARNATION', '0')}"
    engine = db.make_engine(settings.database_url, pool_size=writers + 2)
    producer = Producer(source="torture", partitions=settings.partitions,
                        key_prefix=settings.key_prefix)
    stopping = threading.Event()

    def stop(_signum: int, _frame: FrameType | None) -> None:
        stopping.set()

    signal.signal(signal.SIGTERM, stop)
    threads = [
        threading.Thread(
            target=write_aggregates, name=f"writer-{i}", daemon=True,
            args=(engine, producer, random.Random(f"{settings.key_prefix}:{tag}:w{i}"),
                  rate * aggregate_share / max(writers, 1), hold_s, stopping),
        )
        for i in range(writers)
    ]
    for thread in threads:
        thread.start()
    write_runs_and_events(engine, producer, random.Random(f"{settings.key_prefix}:{tag}"), tag,
                          rate * (1 - aggregate_share), runs_share, stopping)
    for thread in threads:
        thread.join(timeout=5)
    return 0


def write_runs_and_events(
    engine: Engine, producer: Producer, rng: random.Random, tag: str, rate: float,
    runs_share: float, stopping: threading.Event,
) -> None:
    """The main thread's load: runs and plain events, ``rate`` items per second."""
    store = RunStore(producer)
    n = 0
    started = time.monotonic()
    while not stopping.is_set():
        size = rng.randint(1, 8)
        first, n = n, n + size  # ids are never reused, even when the commit's outcome is unknown
        try:
            with engine.begin() as conn:
                for i in range(size):
                    item = f"{tag}-{first + i:07d}"
                    if rng.random() < runs_share:
                        store.create(conn, f"run-{item}", {"request": {"n": first + i}})
                    else:
                        producer.enqueue(conn, type="torture.event", stream=EVENTS_STREAM,
                                         data={"n": first + i}, event_id=f"evt-{item}")
        except (UnavailableError, DBAPIError):
            time.sleep(0.2)
            continue
        _pace(n, rate, started, stopping)


def write_aggregates(
    engine: Engine, producer: Producer, rng: random.Random, rate: float, hold_s: float,
    stopping: threading.Event,
) -> None:
    """One writer thread: compare-and-set transactions on shared aggregates, ``rate`` events
    per second, each held open 0-``hold_s`` before commit."""
    n = 0
    started = time.monotonic()
    while not stopping.is_set():
        touch = rng.random() < TOUCH_SHARE
        pool = TOUCHES if touch else ITEMS
        k = rng.randrange(min(HOT, pool)) if rng.random() < 0.5 else rng.randrange(pool)
        aggregate = f"touch-{k}" if touch else f"item-{k}"
        types = (["item.touched"] if touch
                 else ["item.changed", "item.noted"] if rng.random() < NOTED_SHARE
                 else ["item.changed"])
        try:
            commit_revision(engine, producer, aggregate, types, rng.uniform(0, hold_s))
        except (Conflict, IntegrityError):
            continue  # another writer took this revision: read the row again
        except (UnavailableError, DBAPIError):
            time.sleep(0.2)
            continue
        n += len(types)
        _pace(n, rate, started, stopping)


def commit_revision(
    engine: Engine, producer: Producer, aggregate: str, types: list[str], hold_s: float
) -> int:
    """In one transaction: take ``aggregate``'s next revision by compare-and-set (its first is
    1, inserted), enqueue one event per type at that revision, wait ``hold_s``, commit.
    Raises :class:`Conflict` (or ``IntegrityError`` for a racing first insert) when another
    transaction got there first; nothing is then committed."""
    kind, _, _ = aggregate.partition("-")
    with engine.begin() as conn:
        current = conn.execute(
            select(aggregates.c.revision).where(aggregates.c.id == aggregate)
        ).scalar_one_or_none()
        if current is None:
            conn.execute(aggregates.insert().values(id=aggregate, revision=1))
            revision = 1
        else:
            changed = conn.execute(
                update(aggregates)
                .where(aggregates.c.id == aggregate, aggregates.c.revision == current)
                .values(revision=aggregates.c.revision + 1)
            ).rowcount
            if changed != 1:
                raise Conflict(aggregate)
            revision = int(current) + 1
        for event_type in types:
            producer.enqueue(conn, type=event_type, stream=EVENTS_STREAM,
                             aggregate_type=kind, aggregate_id=aggregate, revision=revision,
                             data={"revision": revision})
        time.sleep(hold_s)
    return revision


def _pace(done: int, rate: float, started: float, stopping: threading.Event) -> None:
    """Wait until ``done`` items are not ahead of ``rate`` per second (or until stopping)."""
    if rate <= 0:
        stopping.wait(1.0)
        return
    ahead = done / rate - (time.monotonic() - started)
    if ahead > 0:
        stopping.wait(ahead)


if __name__ == "__main__":
    sys.exit(main())
