"""``outbox``: database migrations, the relay and consumer daemons, status and the demo.

Every daemon starts the same way: read settings once → open the database and check its schema
→ connect to Redis → run. Errors reach the terminal as ``error <code>: <message>`` with exit
status 2 (configuration) or 1 (anything else); driver messages only with ``--log-level DEBUG``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence

import redis

from outbox_relay.cli import apps, options
from outbox_relay.cli import prune as retention
from outbox_relay.cli import status as status_report
from outbox_relay.cli.settings import ConsumeSettings, PruneSettings
from outbox_relay.cli.startup import until_available
from outbox_relay.consumer import hygiene
from outbox_relay.consumer.daemon import Consumer
from outbox_relay.relay.daemon import Relay
from outbox_relay.runs import Runs
from outbox_relay.runs import schema as runs_schema
from outbox_relay.runs.settings import RunSettings, ServeSettings, WorkerSettings
from outbox_relay.shared import db, gc_pace
from outbox_relay.shared.errors import (
    CannotConnectError,
    ConfigError,
    OutboxError,
    UnavailableError,
)
from outbox_relay.shared.redaction import redact_url
from outbox_relay.shared.redis_conn import (
    as_outbox_error,
    connect_redis,
    translate_redis_errors,
    where,
)
from outbox_relay.shared.settings import CommonSettings, RelaySettings

log = logging.getLogger("outbox")


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    """Apply pending migrations (the core's; with ``--runs`` the runs component's too)."""
    settings = options.load_settings(CommonSettings, args)
    engine = db.make_engine(settings.database_url)
    head = db.upgrade(engine)
    where = f"database {redact_url(settings.database_url)}"
    print(f"{where} is at schema {head}")
    if args.runs:
        print(f"{where} has the runs tables at schema {runs_schema.MIGRATIONS.upgrade(engine)}")
    return 0


def cmd_db_check(args: argparse.Namespace) -> int:
    """Exit 0 if the schema is current (with ``--runs``, the runs tables too), else say why."""
    settings = options.load_settings(CommonSettings, args)
    engine = db.existing_engine(settings.database_url)
    db.check_schema(engine)
    print(f"schema is current ({db.code_head()})")
    if args.runs:
        runs_schema.MIGRATIONS.check(engine)
        print(f"runs schema is current ({runs_schema.MIGRATIONS.code_head()})")
    return 0


def _quiet_flag(parser: argparse.ArgumentParser) -> None:
    """``--quiet``: no periodic progress line (``--progress-interval-s off``)."""
    parser.add_argument("--quiet", dest="progress_interval_s", action="store_const",
                        const="off", help="no periodic progress line (same as "
                        "--progress-interval-s off); start, stop and problems are still logged")


def cmd_relay(args: argparse.Namespace) -> int:
    """Run the relay daemon until SIGTERM/SIGINT."""
    settings = options.load_settings(RelaySettings, args)
    engine = db.make_engine(settings.database_url, create=False)  # only `db upgrade` creates
    until_available(lambda: db.check_schema(engine), "schema check", settings.startup_timeout_s)
    client = until_available(  # a Redis Cluster client asks a node for the slot map at once
        lambda: _daemon_redis(settings.redis_url, settings.redis_timeout_s),
        "connecting to Redis", settings.startup_timeout_s)
    relay = Relay(settings, engine, client)
    gc_pace.pace(settings.gc_threshold)
    retention.register_relay(relay, settings)  # periodic task "retention"
    relay.install_signal_handlers()
    from outbox_relay.cli import observe  # here: prometheus_client is not every command's cost

    with observe.relay(relay):  # --metrics-port: /metrics, /healthz, /readyz
        relay.run(until_idle=args.until_idle)
    return 0


def cmd_consume(args: argparse.Namespace) -> int:
    """Run the consumer daemon until SIGTERM/SIGINT."""
    consumer_settings = options.load_settings(ConsumeSettings, args)  # checked before the app
    spec = apps.app_spec(args.app)
    app = apps.resolve(spec)
    settings = consume_settings(consumer_settings, app)
    if settings.redis_timeout_s * 1000 <= settings.block_ms:
        raise ConfigError("redis_timeout_s must be longer than block_ms")
    engine = db.make_engine(settings.database_url, create=False)  # only `db upgrade` creates
    patience = settings.startup_timeout_s
    until_available(lambda: db.check_schema(engine), "schema check", patience)
    handlers = until_available(lambda: apps.handlers_of(spec, app, settings), "start-up",
                               patience)
    client = until_available(
        lambda: _daemon_redis(settings.redis_url, settings.redis_timeout_s),
        "connecting to Redis", patience)
    consumer = Consumer(settings, engine, client, handlers, ownership=True)
    gc_pace.pace(settings.gc_threshold)
    hygiene.install(consumer)  # periodic task "group hygiene"
    retention.register_consumer(consumer, settings)  # periodic task "retention"
    consumer.install_signal_handlers()
    from outbox_relay.cli import observe

    with observe.consumer(consumer):  # --metrics-port: /metrics, /healthz, /readyz
        consumer.run(until_idle=args.until_idle)
    return 0


def consume_settings(
    settings: ConsumeSettings, app: object
) -> ConsumeSettings | WorkerSettings:
    """The settings ``app`` (what ``--app`` names) runs with: a run worker (a :class:`Runs`)
    gets the runs component's :class:`WorkerSettings`, with what ``settings`` were given,
    ``OUTBOX_RUN_*``/``OUTBOX_SWEEP_*`` from the environment and the runs stream unless
    ``--streams`` says otherwise; any other app ``settings``, whose streams are required.
    Either way, no stream is ``invalid_config`` at once, not after the start-up's waits."""
    chosen: ConsumeSettings | WorkerSettings = settings
    if isinstance(app, Runs):
        chosen = options.validated(WorkerSettings, {
            name: getattr(settings, name) for name in settings.model_fields_set})
    chosen.stream_names()
    return chosen


def _daemon_redis(url: str, timeout_s: float) -> redis.Redis:
    """A daemon's Redis client, after one ``PING``: what retrying cannot fix (no such database
    number, a server that is not Redis, a wrong password, an unknown host) ends the start-up
    with its one-line error. A Redis that is down is left to the daemon's loop, which waits it
    out like any later outage."""
    client = connect_redis(url, timeout_s=timeout_s)
    try:
        with translate_redis_errors():
            client.ping()
    except UnavailableError as err:
        log.warning("%s; starting anyway, retrying it", err.message)
    return client


def cmd_status(args: argparse.Namespace) -> int:
    """Print the outbox backlog and every stream's groups."""
    settings = options.load_settings(CommonSettings, args)
    engine = db.existing_engine(settings.database_url)
    db.check_schema(engine)
    report = status_report.collect(engine, connect_redis(settings.redis_url), settings.key_prefix)
    print(json.dumps(report, indent=2) if args.json else status_report.render(report))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Run the end-to-end demo (see ``cli.demo``)."""
    from outbox_relay.cli import demo

    return demo.main(args)


def build_parser() -> argparse.ArgumentParser:
    """The whole command tree; every settings field is a flag."""
    parser = argparse.ArgumentParser(
        prog="outbox",
        description="Transactional outbox → Redis Streams → idempotent consumers.",
    )
    parser.add_argument("--version", action="version", version=f"outbox {_version()}",
                        help="print the installed outbox-relay version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    dbp = sub.add_parser("db", help="database schema commands")
    dbsub = dbp.add_subparsers(dest="db_command", required=True, metavar="DB_COMMAND")
    for name, help_text, func in (("upgrade", "apply pending migrations", cmd_db_upgrade),
                                  ("check", "check that the schema is current", cmd_db_check)):
        _leaf(dbsub, name, help_text, CommonSettings, func).add_argument(
            "--runs", action="store_true",
            help="the durable-runs tables too (only applications that use runs need them)")

    relay = _leaf(sub, "relay", "move committed outbox rows into Redis Streams", RelaySettings,
                  cmd_relay)
    relay.add_argument("--until-idle", action="store_true",
                       help="exit once a round finds nothing to deliver (for scripts and tests)")
    _quiet_flag(relay)
    # Accepted and ignored, as before the runs rule left the core's settings: the relay never
    # pruned runs (consumers and `outbox prune` do), and one flag list may serve both daemons.
    relay.add_argument("--retention-runs", help=argparse.SUPPRESS)

    consume = _leaf(sub, "consume", "read streams with a consumer group and claim events",
                    ConsumeSettings, cmd_consume)
    consume.add_argument("--until-idle", action="store_true",
                         help="exit once the group has nothing pending (retries waiting "
                         "included) or unread on its streams (for scripts and tests)")
    _quiet_flag(consume)
    consume.add_argument("--app", default=None,
                         help="your handlers, as module:attribute [env OUTBOX_APP; required] "
                         f"(the demo's run worker: {apps.DEFAULT_APP}; a run worker, an "
                         "outbox_relay.runs.Runs, reads the stream 'runs' unless --streams "
                         "says otherwise and takes OUTBOX_RUN_* and OUTBOX_SWEEP_* from the "
                         "environment)")

    st = _leaf(sub, "status", "outbox backlog and stream/group state", CommonSettings, cmd_status)
    st.add_argument("--json", action="store_true", help="print JSON instead of a table")

    from outbox_relay.cli import demo

    demo.add_arguments(_leaf(sub, "demo", "run the end-to-end demo", CommonSettings, cmd_demo))

    from outbox_relay.cli import serve, sweep

    serve.add_arguments(_leaf(sub, "serve", "serve the runs HTTP API", ServeSettings, serve.main))
    sweep.add_arguments(_leaf(sub, "sweep", "resume runs whose execution lease expired (one pass)",
                              RunSettings, sweep.main))

    from outbox_relay.cli import dlq

    dlq.add_commands(sub.add_parser("dlq", help="inspect and replay dead letters"), _leaf)

    from outbox_relay.cli import reconcile

    reconcile.add_arguments(_leaf(sub, "reconcile", "repair streams behind the outbox and "
                                  "resume stuck runs", CommonSettings, reconcile.main))

    from outbox_relay.cli import groups

    grp = sub.add_parser("groups", help="consumer groups the relay's trims wait for")
    grpsub = grp.add_subparsers(dest="groups_command", required=True, metavar="GROUPS_COMMAND")
    groups.add_arguments(_leaf(grpsub, "forget", "stop holding trims for a group deleted on "
                               "purpose", CommonSettings, groups.main))

    retention.add_arguments(_leaf(sub, "prune", "delete what retention allows: delivered outbox "
                                  "rows, old receipts and heads, terminal runs (if asked)",
                                  PruneSettings, retention.main))
    return parser


def _version() -> str:
    """The installed distribution's version (``0+unknown`` when run from a bare source tree)."""
    from importlib import metadata

    try:
        return metadata.version("outbox-relay")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def _leaf(
    sub: argparse._SubParsersAction,  # type: ignore[type-arg]
    name: str,
    help_text: str,
    model: type[CommonSettings],
    func: Callable[[argparse.Namespace], int],
) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = sub.add_parser(name, help=help_text, description=help_text)
    options.add_settings_flags(parser, model)
    parser.set_defaults(func=func)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``outbox`` console script."""
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
        return code
    except (ConfigError, CannotConnectError) as err:  # fix the setting; retrying cannot help
        print(f"error {err.code}: {redact_url(err.message)}", file=sys.stderr)
        return 2
    except OutboxError as err:
        print(f"error {err.code}: {redact_url(err.message)}", file=sys.stderr)
        return 1
    except redis.RedisError as err:  # one a command did not wrap: still one line, no traceback
        log.debug("unwrapped redis error", exc_info=True)
        wrapped = as_outbox_error(err) or OutboxError(
            f"{where(err)} refused a command: {redact_url(str(err))[:200]}", code="redis_error")
        print(f"error {wrapped.code}: {redact_url(wrapped.message)}", file=sys.stderr)
        return 2 if isinstance(wrapped, CannotConnectError) else 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `outbox status | head`: the reader left; nothing to report
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
