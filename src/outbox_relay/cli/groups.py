"""``outbox groups forget GROUP [--stream S]``: stop holding trims for a group deleted on purpose.

The relay records every consumer group its trims see on a partition stream and does not trim a
stream while one of them is missing (Redis lost it; its consumers have not recreated it yet:
relay/trim.py). A group an operator destroyed on purpose would hold the stream until
``OUTBOX_GROUP_FORGET_S`` (1 day) has passed; this command forgets it at once.
"""

from __future__ import annotations

import argparse

from outbox_relay.cli import options
from outbox_relay.relay import stream_book
from outbox_relay.shared import db
from outbox_relay.shared.settings import CommonSettings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("group", help="the consumer group to forget")
    parser.add_argument("--stream", default=None,
                        help="only on this logical stream (default: on every stream)")


def main(args: argparse.Namespace) -> int:
    settings = options.load_settings(CommonSettings, args)
    engine = db.existing_engine(settings.database_url)
    db.check_schema(engine)
    removed = stream_book.forget_groups(engine, args.group, args.stream)
    where = f"stream {args.stream}" if args.stream else "every stream"
    print(f"forgot group {args.group} on {removed} partition stream(s) of {where}")
    return 0
