"""The torture's producer process: a steady load of runs and plain events, in transactions.

Each transaction writes 1-8 items, each either a run (``RunStore.create``: the run row and its
``run.created`` event) or a plain event (``Producer.enqueue``, stream ``events``), then commits.
Ids carry the incarnation (``TORTURE_INCARNATION``) so a restarted producer never reuses one.
The harness SIGKILLs this process at random and arms ``producer.before_commit``; what counts
afterwards is only what the database committed.

Run by the harness as ``python -m torture.load`` with the ``OUTBOX_*`` environment.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import time
from types import FrameType

from sqlalchemy.exc import DBAPIError

from producer import Producer
from producer.runs import RunStore
from shared import db
from shared.errors import UnavailableError
from shared.settings import CommonSettings

EVENTS_STREAM = "events"


def main() -> int:
    settings = CommonSettings.model_validate({})
    rate = float(os.environ.get("TORTURE_RATE", "100"))
    runs_share = float(os.environ.get("TORTURE_RUNS_SHARE", "0.3"))
    tag = f"i{os.environ.get('TORTURE_INCARNATION', '0')}"
    engine = db.make_engine(settings.database_url)
    producer = Producer(source="torture", partitions=settings.partitions,
                        key_prefix=settings.key_prefix)
    store = RunStore(producer)
    stopping = False

    def stop(_signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    rng = random.Random(f"{settings.key_prefix}:{tag}")
    n = 0
    started = time.monotonic()
    while not stopping:
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
        ahead = n / rate - (time.monotonic() - started)
        if ahead > 0:
            time.sleep(ahead)
    return 0


if __name__ == "__main__":
    sys.exit(main())
