"""``outbox dlq list | show | replay | purge``: inspect, replay and give up dead letters.

``list`` and ``show`` only read Redis. ``replay`` also opens the database and loads the group's
handlers (``--app``, as ``outbox consume`` does) because it runs each letter through the normal
claim transaction of ``--group`` and applies it whatever the aggregate's applied revision (an
operator decided; see :mod:`consumer.dead_letters`, also for why it does not re-add the entry to
the stream). Exit status: 0 when every letter asked for was replayed, 1 when some
stay in the dead-letter stream (each is printed with the reason it stayed). ``replay --all``
with no group given (``--group`` / ``OUTBOX_GROUP``) does not guess: it lists the groups that
have letters. ``purge`` deletes letters for good (``--older-than``, ``--group``, ``--stream``,
``--dry-run``); with no filter at all it refuses (exit 2) unless ``--all`` says every letter of
every group is meant (``OUTBOX_GROUP`` in the environment is not a filter: a flag is).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

from outbox_relay.cli import apps, options
from outbox_relay.consumer import dead_letters
from outbox_relay.shared import db
from outbox_relay.shared.db import now_ms
from outbox_relay.shared.errors import ConfigError
from outbox_relay.shared.redis_conn import connect_redis
from outbox_relay.shared.settings import CommonSettings, ConsumerSettings, parse_duration

LeafFactory = Callable[..., argparse.ArgumentParser]


def add_commands(dlq_parser: argparse.ArgumentParser, leaf: LeafFactory) -> None:
    """Attach ``list``, ``show`` and ``replay`` below ``outbox dlq`` (``leaf`` is main's)."""
    sub = dlq_parser.add_subparsers(dest="dlq_command", required=True, metavar="DLQ_COMMAND")
    ls = leaf(sub, "list", "list dead letters, oldest first", CommonSettings, cmd_list)
    _filters(ls)
    ls.add_argument("--count", type=int, default=50, help="at most this many (default 50)")
    ls.add_argument("--json", action="store_true", help="print JSON (with the fields)")
    sh = leaf(sub, "show", "show one dead letter with its original fields", CommonSettings,
              cmd_show)
    sh.add_argument("letter_id", metavar="ID", help="stream:partition:entry-id, as listed")
    sh.add_argument("--json", action="store_true", help="print JSON")
    sh.add_argument("--full", action="store_true",
                    help=f"print long fields whole (else cut at {SHOW_LIMIT} characters)")
    rp = leaf(sub, "replay", "apply dead letters through the group's claim path",
              ConsumerSettings, cmd_replay)
    which = rp.add_mutually_exclusive_group(required=True)
    which.add_argument("letter_id", metavar="ID", nargs="?", help="the letter to replay")
    which.add_argument("--all", action="store_true", help="replay every letter of --group")
    _filters(rp)
    rp.add_argument("--app", default=None,
                    help="the group's handlers, as module:attribute [env OUTBOX_APP; required]")
    rp.add_argument("--json", action="store_true", help="print JSON")
    pg = leaf(sub, "purge", "delete dead letters for good (their events are never applied)",
              CommonSettings, cmd_purge)
    _filters(pg)
    pg.add_argument("--group", default=None, help="only this group's letters")
    pg.add_argument("--older-than", default="0", metavar="DURATION",
                    help="only letters written longer ago than this (90s, 15m, 7d; default: all)")
    pg.add_argument("--dry-run", action="store_true", help="count, delete nothing")
    pg.add_argument("--all", action="store_true",
                    help="with no filter: delete every letter of every group (else refused)")


def _filters(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stream", default=None, help="only this logical stream")
    parser.add_argument("--partition", type=int, default=None,
                        help="only this partition (needs --stream)")


def cmd_list(args: argparse.Namespace) -> int:
    """Print dead letters as a table or JSON."""
    settings = options.load_settings(CommonSettings, args)
    _check_filters(args)
    if args.count < 1:
        raise ConfigError("--count must be at least 1")
    client = connect_redis(settings.redis_url)
    letters = dead_letters.list_letters(
        client, settings.key_prefix, stream=args.stream, partition=args.partition,
        count=args.count,
    )
    if args.json:
        print(json.dumps([letter.to_json() for letter in letters], indent=2))
        return 0
    print(f"{'id':<36} {'reason':<16} {'group':<12} {'deliv':>5}  original entry")
    for letter in letters:
        view = letter.to_json()
        print(f"{view['id']:<36} {view['reason']:<16} {view['group']:<12} "
              f"{view['deliveries']:>5}  {view['stream_key']} {view['entry_id']}")
    if not letters:
        print("(no dead letters)")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    """Print one letter: its record and every original field."""
    settings = options.load_settings(CommonSettings, args)
    letter = dead_letters.show(connect_redis(settings.redis_url), settings.key_prefix,
                               args.letter_id)
    view = letter.to_json()
    if args.json:
        print(json.dumps(view, indent=2))
        return 0
    fields = view.pop("fields")
    for name, value in view.items():
        print(f"{name:<16} {_cut(str(value), args.full)}")
    print("fields:")
    for name, value in fields.items():
        print(f"  {name:<16} {_cut(value, args.full)}")
    return 0


SHOW_LIMIT = 2000


def _cut(value: str, full: bool) -> str:
    """Long values (a 1 MiB payload) cut for the terminal, saying how much is left out."""
    if full or len(value) <= SHOW_LIMIT:
        return value
    return f"{value[:SHOW_LIMIT]}… ({len(value) - SHOW_LIMIT} more characters; --full shows all)"


def cmd_purge(args: argparse.Namespace) -> int:
    """Delete letters (older than ``--older-than``, of ``--group``); print how many."""
    settings = options.load_settings(CommonSettings, args)
    _check_filters(args)
    try:
        older = parse_duration(args.older_than)
    except ValueError as err:
        raise ConfigError(f"--older-than: {err}") from None
    unfiltered = args.group is None and args.stream is None and older == 0
    if unfiltered and not args.all and not args.dry_run:
        raise ConfigError("purge with no filter would delete every dead letter of every group "
                          "for good: name --group, --stream or --older-than, or give --all "
                          "(--dry-run counts them)")
    removed = dead_letters.purge(
        connect_redis(settings.redis_url), settings.key_prefix, older_than_ms=int(older * 1000),
        now_ms=now_ms(), group=args.group, stream=args.stream, partition=args.partition,
        dry_run=args.dry_run,
    )
    print(f"{removed} dead letter(s) {'would be ' if args.dry_run else ''}deleted")
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    """Replay one letter or all of the group's; 0 if every one left the dead-letter stream."""
    settings = options.load_settings(ConsumerSettings, args)
    _check_filters(args)
    if args.all and getattr(args, "group", None) is None and "OUTBOX_GROUP" not in os.environ:
        # Not the default group's letters by guesswork: say which groups have some.
        client = connect_redis(settings.redis_url)
        counts = dead_letters.letters_by_group(client, settings.key_prefix, stream=args.stream,
                                               partition=args.partition)
        listed = ", ".join(f"{g or '(no group)'}: {n}" for g, n in sorted(counts.items()))
        raise ConfigError("replay --all needs --group (or OUTBOX_GROUP): letters by group: "
                          + (listed or "none"))
    engine = db.existing_engine(settings.database_url)
    db.check_schema(engine)
    handlers = apps.load_handlers(apps.app_spec(args.app), settings)
    client = connect_redis(settings.redis_url)
    common: dict[str, Any] = {"group": settings.group, "max_data_bytes": settings.max_data_bytes}
    if args.all:
        results = dead_letters.replay_all(
            client, engine, settings.key_prefix, handlers,
            stream=args.stream, partition=args.partition, **common,
        )
    else:
        letter = dead_letters.show(client, settings.key_prefix, args.letter_id)
        results = [dead_letters.replay(client, engine, letter, handlers, **common)]
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in results], indent=2))
    else:
        for r in results:
            state = "replayed" if r.removed else "stays"
            print(f"{r.letter_id:<36} {r.outcome:<10} {state:<8} {r.detail}".rstrip())
        print(f"{sum(r.removed for r in results)} replayed, "
              f"{sum(not r.removed for r in results)} stay in the dead-letter streams")
    return 0 if all(r.removed for r in results) else 1


def _check_filters(args: argparse.Namespace) -> None:
    if args.partition is not None and args.stream is None:
        raise ConfigError("--partition needs --stream")
