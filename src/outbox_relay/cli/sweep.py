"""``outbox sweep``: one recovery pass over runs whose execution lease expired.

Each such run gets a ``run.resume`` event through the outbox (attempts + 1) or, past
``--run-max-attempts``, fails with ``attempts_exhausted``. Safe to run beside consumer daemons
(which sweep periodically themselves): every change is a compare-and-set.
"""

from __future__ import annotations

import argparse
import json

from outbox_relay.runs import schema
from outbox_relay.runs.settings import RunSettings
from outbox_relay.runs.store import store_for
from outbox_relay.runs.sweeper import sweep
from outbox_relay.shared import db


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--json`` besides the settings flags."""
    parser.add_argument("--json", action="store_true", help="print the counts as JSON")


def main(args: argparse.Namespace) -> int:
    """One pass; prints how many runs were resumed and failed."""
    from outbox_relay.cli import options

    settings = options.load_settings(RunSettings, args)
    engine = db.existing_engine(settings.database_url)
    schema.check_schema(engine)
    stats = sweep(engine, store_for(settings, source="outbox-sweep"),
                  max_attempts=settings.run_max_attempts, limit=settings.sweep_batch)
    counts = {"resumed": stats.resumed, "failed": stats.failed, "raced": stats.raced}
    if args.json:
        print(json.dumps(counts))
    else:
        print(f"resumed {stats.resumed}, failed {stats.failed}, raced {stats.raced}")
    return 0
