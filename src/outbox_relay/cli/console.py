"""``outbox serve --console``: the operator console wired onto the serve app.

The console (:mod:`console`) needs what only the CLI may assemble: the Redis and database of
``outbox serve``, the handlers of each group it may replay (``OUTBOX_CONSOLE_APPS``, loaded as
``outbox consume --app`` loads them, so a replay runs the code that group's consumers run), and
the ``outbox status`` report (:mod:`cli.status`) for owners, groups and lag.
"""

from __future__ import annotations

from fastapi import APIRouter
from sqlalchemy import Engine

from outbox_relay.cli import apps, status
from outbox_relay.console import api
from outbox_relay.console.letter_actions import Letters
from outbox_relay.consumer import Handlers
from outbox_relay.runs.settings import ServeSettings
from outbox_relay.shared import keys
from outbox_relay.shared.errors import ConfigError
from outbox_relay.shared.redis_conn import connect_redis
from outbox_relay.shared.settings import ConsumerSettings


def parse_apps(text: str) -> dict[str, str]:
    """``{group: "module:attribute"}`` from ``"billing=shop.billing:handlers,…"``."""
    found: dict[str, str] = {}
    for position, raw in enumerate(text.split(","), start=1):
        entry = raw.strip()
        if not entry:
            continue
        group, equals, spec = (part.strip() for part in entry.partition("="))
        if not equals or ":" not in spec:
            raise ConfigError(f"console_apps, entry {position}: expected "
                              f"group=module:attribute, not {entry!r}")
        keys.check_name("group", group)
        if group in found:
            raise ConfigError(f"console_apps names group {group!r} twice")
        found[group] = spec
    return found


def load(settings: ServeSettings, engine: Engine, *, can_mutate: bool) -> APIRouter:
    """The console's router: handlers loaded, Redis connected (lazily, as every command)."""
    handlers: dict[str, Handlers] = {}
    max_data_bytes = _consumer_settings(settings, None).max_data_bytes
    for group, spec in parse_apps(settings.console_apps).items():
        handlers[group] = apps.load_handlers(spec, _consumer_settings(settings, group))
    client = connect_redis(settings.redis_url)
    letters = Letters(client, engine, settings.key_prefix, handlers, max_data_bytes)
    return api.router(letters, lambda: status.collect(engine, client, settings.key_prefix),
                      can_mutate=can_mutate)


def _consumer_settings(settings: ServeSettings, group: str | None) -> ConsumerSettings:
    """What a group's handler factory is given: the environment's consumer settings with
    ``outbox serve``'s database, Redis, prefix and partitions (and the group)."""
    base = ConsumerSettings(database_url=settings.database_url, redis_url=settings.redis_url,
                            key_prefix=settings.key_prefix, partitions=settings.partitions)
    return base if group is None else base.model_copy(update={"group": group})
