"""The runs API's HTTP server: uvicorn, bounded.

A server that waits forever for a request's head is held open by anyone who opens connections
and sends nothing, or one byte a minute (slowloris). uvicorn bounds the idle time between
requests (``timeout_keep_alive``), the size of a request head (h11's maximum incomplete event)
and the requests at once (``limit_concurrency``: more get 503 at once), but not how long a
client may take to send a request. :class:`BoundedH11Protocol` adds that: a request — head and
body — must arrive within ``api_read_timeout_s`` of the connection opening, or of its first
byte on a kept-alive connection; else the connection is closed. A connection that never sends a
byte is closed after the same time.

Imported by ``outbox serve`` only (it needs uvicorn, the ``[http]`` extra).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from outbox_relay.runs.settings import ServeSettings

log = logging.getLogger("outbox.serve")

_OWED = (h11.IDLE, h11.SEND_BODY)
"""The client's h11 states in which it still owes us (part of) a request."""


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on receiving each request (see the module)."""

    read_timeout_s: float = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._read_deadline: asyncio.TimerHandle | None = None
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state in _OWED:
            if self._read_deadline is None:  # the first byte of a request on a kept connection
                self._arm()
        else:  # the request is in (or the connection is over): its handling is not bounded
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._read_deadline = self.loop.call_later(self.read_timeout_s, self._read_timed_out)

    def _disarm(self) -> None:
        deadline = getattr(self, "_read_deadline", None)
        if deadline is not None:
            deadline.cancel()
            self._read_deadline = None

    def _read_timed_out(self) -> None:
        self._read_deadline = None
        if self.conn.their_state in _OWED and not self.transport.is_closing():
            client = self.client[0] if self.client else "?"
            log.debug("closed a connection from %s: no whole request within %gs", client,
                      self.read_timeout_s)
            self.transport.close()


def config(app: Any, settings: ServeSettings) -> uvicorn.Config:
    """uvicorn's configuration of ``outbox serve``: limits and TLS from ``settings``."""
    protocol = type("BoundedH11Protocol", (BoundedH11Protocol,),
                    {"read_timeout_s": settings.api_read_timeout_s})
    tls: dict[str, Any] = {}
    if settings.api_ssl_certfile:
        tls = {"ssl_certfile": settings.api_ssl_certfile,
               "ssl_keyfile": settings.api_ssl_keyfile or None}
        if settings.api_ssl_ca_certs:  # mutual TLS: a client certificate is required
            tls.update(ssl_ca_certs=settings.api_ssl_ca_certs, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return uvicorn.Config(
        app, host=settings.host, port=settings.port, http=protocol, ws="none",
        timeout_keep_alive=settings.api_keep_alive_s,
        h11_max_incomplete_event_size=settings.api_max_head_bytes,
        limit_concurrency=settings.api_limit_concurrency,
        log_level=settings.log_level.lower(), access_log=False, log_config=None, **tls,
    )
