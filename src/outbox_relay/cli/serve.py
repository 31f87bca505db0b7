"""``outbox serve``: the HTTP API of the run store (FastAPI on uvicorn), and with ``--console``
(``OUTBOX_CONSOLE``) the operator console under ``/console`` (:mod:`cli.console`).

Startup order: read settings → check who may call (tokens: refused beyond loopback without
them, before anything is opened) → open the database and check its schema → recover (one sweep:
runs whose execution lease expired get their ``run.resume``) → listen. The schema check comes
first so recovery never writes to a database this code does not understand; recovery comes
before listening so that a run orphaned by a crash is already on its way again when clients can
see it, instead of being reported as running while nobody executes it.
"""

from __future__ import annotations

import argparse
import logging
import signal
from types import FrameType

from outbox_relay.cli.startup import until_available
from outbox_relay.runs import auth
from outbox_relay.runs import schema as runs_schema
from outbox_relay.runs.settings import ServeSettings
from outbox_relay.runs.store import store_for
from outbox_relay.runs.sweeper import sweep
from outbox_relay.shared import db
from outbox_relay.shared.errors import ConfigError
from outbox_relay.shared.redaction import redact_url

log = logging.getLogger("outbox.serve")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No flags beyond the settings ones (``--host``, ``--port``, ``--max-body-bytes`` …)."""


def main(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT."""
    try:  # here, not at import time: every other command would pay for it
        import uvicorn

        from outbox_relay.runs import server
        from outbox_relay.runs.http import create_app
    except ImportError:
        raise ConfigError("outbox serve needs the http extra: "
                          "pip install 'outbox-relay[http]'") from None
    from outbox_relay.cli import options

    settings = options.load_settings(ServeSettings, args)
    tokens = auth.api_tokens(settings)
    engine = db.make_engine(settings.database_url, create=False)  # only `db upgrade` creates
    patience = settings.startup_timeout_s
    until_available(lambda: runs_schema.check_schema(engine), "schema check", patience)
    store = store_for(settings, source="outbox-api")
    recovered = until_available(
        lambda: sweep(engine, store, max_attempts=settings.run_max_attempts,
                      limit=settings.sweep_batch),
        "recovery sweep", patience,
    )
    log.info("recovered %d run(s), failed %d", recovered.resumed, recovered.failed)
    limit = auth.CreateLimit(settings.api_create_rate, settings.api_create_burst)
    console_router = None
    if settings.console:  # its action log is a core table: the core schema must be current
        from outbox_relay.cli import console
        from outbox_relay.console import api as console_api

        until_available(lambda: db.check_schema(engine), "schema check (console)", patience)
        console_router = console.load(settings, engine, can_mutate=tokens is not None)
    app = create_app(engine, store, max_body_bytes=settings.max_body_bytes, tokens=tokens,
                     create_limit=limit,
                     open_paths=console_api.PAGE_PATHS if console_router else ())
    if console_router is not None:
        app.include_router(console_router)
    scheme = "https" if settings.api_ssl_certfile else "http"
    who = (f"{len(tokens)} API token(s)" if tokens is not None
           else "no authentication (loopback, no tokens)")
    log.info("serving runs of %s on %s://%s:%d with %s", redact_url(settings.database_url),
             scheme, settings.host, settings.port, who)
    if console_router is not None:
        log.info("operator console on %s://%s:%d/console/ (%s)", scheme, settings.host,
                 settings.port, "replay and purge with a token" if tokens is not None
                 else "read-only: no API tokens")
    config = server.config(app, settings)
    # uvicorn catches SIGTERM/SIGINT while serving (graceful shutdown), then restores the
    # previous handlers and re-raises the signal: with these no-op handlers, the re-raise ends
    # in a clean exit 0, like the other daemons.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _shutdown_done)
    from outbox_relay.cli import observe

    with observe.serve(settings, engine):  # --metrics-port: /metrics, /healthz, /readyz
        uvicorn.Server(config).run()
    return 0


def _shutdown_done(_signum: int, _frame: FrameType | None) -> None:
    """The server already shut down gracefully; nothing is left to do."""
