"""The observation port of a daemon: ``/metrics``, ``/healthz`` and ``/readyz``.

One small HTTP server (stdlib ``HTTPServer`` on a daemon thread) per daemon, on
``metrics_host:metrics_port`` (port 0: no server; the host is ``127.0.0.1`` unless told, e.g.
``0.0.0.0`` in a Kubernetes pod). It never touches the daemon's loop, and no client can make it
grow (design invariant 10, issue 28 finding 3):

- a bounded worker pool (``max_connections`` threads, made as needed): a connection beyond the
  cap is answered ``503`` and closed at once, never queued on a thread of its own;
- a deadline per connection (``request_timeout_s`` from accept to the last header byte, and as
  long again for the answer): a client that sends half a request is closed when it passes;
- one log line per client error (a timeout, a reset, a malformed request), never a traceback.

The endpoints:

- ``/metrics``: the daemon's own ``CollectorRegistry`` (never the global one, so several
  daemons in one process stay apart), OpenMetrics text by default; a scraper that asks for
  the classic text format (``Accept: text/plain``) gets it, as ``prometheus_client`` decides.
- ``/healthz`` (liveness): 200 while the daemon's loop turns. ``heartbeat()`` returns the
  seconds since the loop last started an iteration; older than ``stale_after_s`` is 503, so an
  orchestrator restarts a process whose loop is stuck. No heartbeat: 200 while the port answers.
- ``/readyz`` (readiness): every named check, each a callable that raises when not ready, run
  with a short timeout on a small pool (a hung check answers ``timeout``, it never hangs the
  probe). 200 with ``{"database": "ok", ...}``, else 503 with ``{"redis": "unavailable: …"}``:
  our error code and message, redacted; a foreign exception shows its class name only.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.openmetrics import exposition as openmetrics

from outbox_relay.shared.errors import OutboxError
from outbox_relay.shared.redaction import redact_url

log = logging.getLogger(__name__)

Check = Callable[[], object]
"""A readiness check: returns when ready, raises (ideally an ``OutboxError``) when not."""

CHECK_TIMEOUT_S = 3.0
REQUEST_TIMEOUT_S = 5.0
"""A connection that has not sent its whole request head by then is closed."""
MAX_CONNECTIONS = 16
"""Connections served at once (one pool thread each); more are answered 503 and closed."""
BUSY = (b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        b"Content-Length: 17\r\nConnection: close\r\n\r\n{\"error\": \"busy\"}")


class MetricsServer:
    """``/metrics``, ``/healthz`` and ``/readyz`` on one port; :meth:`stop` closes it.

    ``port=0`` binds an ephemeral port (tests); :func:`serve` is what daemons call, where 0
    means off. :attr:`port` is the bound port.
    """

    def __init__(
        self,
        host: str,
        port: int,
        registry: CollectorRegistry,
        *,
        heartbeat: Callable[[], float] | None = None,
        stale_after_s: float = 30.0,
        checks: Mapping[str, Check] | None = None,
        check_timeout_s: float = CHECK_TIMEOUT_S,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self.registry = registry
        self.heartbeat = heartbeat
        self.stale_after_s = stale_after_s
        self.checks = dict(checks or {})
        self.check_timeout_s = check_timeout_s
        # Bounded: a check stuck in a driver keeps its thread; later probes queue behind it
        # and answer "timeout" instead of piling up threads.
        self._pool = ThreadPoolExecutor(max(2 * len(self.checks), 1),
                                        thread_name_prefix="outbox-readyz")
        self._httpd = _BoundedServer((host, port), _handler_for(self, request_timeout_s),
                                     max_connections)
        self._thread = threading.Thread(target=self._httpd.serve_forever,
                                        name="outbox-metrics", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        """The port the server is bound to."""
        return int(self._httpd.server_address[1])

    @property
    def host(self) -> str:
        """The address the server is bound to."""
        return str(self._httpd.server_address[0])

    @property
    def refused(self) -> int:
        """Connections answered 503 and closed because every worker was busy."""
        return self._httpd.refused

    @property
    def accepted(self) -> int:
        """Connections the pool took (since the start)."""
        return self._httpd.accepted

    @property
    def busy(self) -> int:
        """Connections being served now (at most ``max_connections``)."""
        return self._httpd.active

    def stop(self) -> None:
        """Stop serving and close the socket (returns once the serving thread ended)."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)
        self._httpd.close_all()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def health(self) -> tuple[int, dict[str, object]]:
        """Liveness: ``(status, body)``."""
        if self.heartbeat is None:
            return 200, {"status": "ok"}
        age = self.heartbeat()
        body: dict[str, object] = {"last_loop_age_s": round(age, 3),
                                   "stale_after_s": self.stale_after_s}
        if age > self.stale_after_s:
            return 503, {"status": "stale", **body}
        return 200, {"status": "ok", **body}

    def readiness(self) -> tuple[int, dict[str, str]]:
        """Readiness: ``(status, {check: "ok" | "<code>: <message>"})``, checks in parallel,
        each bounded by ``check_timeout_s`` (measured from the start of the probe)."""
        futures = {name: self._pool.submit(check) for name, check in self.checks.items()}
        deadline = time.monotonic() + self.check_timeout_s
        result: dict[str, str] = {}
        for name, future in futures.items():
            try:
                future.result(timeout=max(deadline - time.monotonic(), 0.0))
                result[name] = "ok"
            except FutureTimeout:
                future.cancel()
                result[name] = f"timeout: no answer within {self.check_timeout_s:g}s"
            except OutboxError as err:
                result[name] = f"{err.code}: {redact_url(err.message)}"
            except Exception as err:  # a foreign error: its class only, never driver text
                log.debug("readiness check %s failed", name, exc_info=True)
                result[name] = f"error: {type(err).__name__}"
        ready = all(v == "ok" for v in result.values())
        return (200 if ready else 503), result

    def metrics(self, accept: str) -> tuple[bytes, str]:
        """The registry's exposition and its content type, chosen from ``Accept``."""
        if "openmetrics-text" in accept or "text/plain" in accept:
            encoder, content_type = choose_encoder(accept)
            return encoder(self.registry), content_type
        body: bytes = openmetrics.generate_latest(self.registry)  # type: ignore[no-untyped-call]
        return body, openmetrics.CONTENT_TYPE_LATEST


def serve(
    host: str,
    port: int,
    registry: CollectorRegistry,
    *,
    heartbeat: Callable[[], float] | None = None,
    stale_after_s: float = 30.0,
    checks: Mapping[str, Check] | None = None,
) -> MetricsServer | None:
    """Start the observation port of a daemon; ``None`` when ``port`` is 0 (off)."""
    if port == 0:
        return None
    server = MetricsServer(host, port, registry, heartbeat=heartbeat,
                           stale_after_s=stale_after_s, checks=checks)
    log.info("metrics, /healthz and /readyz on http://%s:%d", host, server.port)
    return server


class _BoundedServer(HTTPServer):
    """``HTTPServer`` whose connections are served by a bounded pool: at most ``workers`` at
    once; one more is answered 503 and closed, so neither threads nor queued sockets grow
    with the number of clients."""

    request_queue_size = 64  # connections the kernel holds until accepted (stdlib: 5)

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler],
                 workers: int) -> None:
        super().__init__(address, handler)
        self.workers = ThreadPoolExecutor(max(workers, 1),
                                          thread_name_prefix="outbox-metrics-worker")
        self._slots = threading.BoundedSemaphore(max(workers, 1))
        self._lock = threading.Lock()
        self.refused = 0
        self.accepted = 0
        self.active = 0
        self._open: set[socket.socket] = set()

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            with self._lock:
                self.refused += 1
            log.debug("metrics port busy: connection from %s refused", _peer(client_address))
            try:
                request.setblocking(False)
                request.send(BUSY)  # a fresh socket's send buffer takes it whole or not at all
            except OSError:
                pass
            self.shutdown_request(request)
            return
        with self._lock:
            self.accepted += 1
            self.active += 1
            self._open.add(request)
        try:
            self.workers.submit(self._serve, request, client_address)
        except RuntimeError:  # stopping
            self._done(request)

    def _serve(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self._done(request)

    def _done(self, request: Any) -> None:
        self.shutdown_request(request)
        with self._lock:
            self.active -= 1
            self._open.discard(request)
        self._slots.release()

    def close_all(self) -> None:
        """Cut every connection being served, so the pool's threads end now (at exit, the
        interpreter waits for them)."""
        self.workers.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            open_now = list(self._open)
        for request in open_now:
            with contextlib.suppress(OSError):
                request.shutdown(socket.SHUT_RDWR)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """One line, never a traceback (the stdlib prints one to stderr per error): a client
        that resets or drops its connection is routine on a port anyone can reach."""
        err = sys.exc_info()[1]
        if isinstance(err, (ConnectionError, TimeoutError)):
            log.debug("metrics port: %s from %s", type(err).__name__, _peer(client_address))
        else:
            log.info("metrics port: client %s: %s", _peer(client_address),
                     type(err).__name__ if err is not None else "error")


class _DeadlineReader(io.RawIOBase):
    """The request's socket, readable until a deadline: each ``recv`` may wait only for the
    time left, so a client dripping one byte at a time is cut off like a silent one."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock = sock
        self._deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("request head not complete in time")
        self._sock.settimeout(left)
        return self._sock.recv_into(buffer)


def _peer(client_address: Any) -> str:
    try:
        return f"{client_address[0]}:{client_address[1]}"
    except (TypeError, IndexError):
        return "?"


def _handler_for(server: MetricsServer, request_timeout_s: float
                 ) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        """Routes GET requests to the server's three endpoints; anything else is 404."""

        timeout = request_timeout_s

        def setup(self) -> None:
            super().setup()
            self.rfile.close()  # the plain reader: replaced by one that keeps the deadline
            deadline = time.monotonic() + request_timeout_s
            self.rfile = io.BufferedReader(_DeadlineReader(self.connection, deadline))

        def send_response(self, code: int, message: str | None = None) -> None:
            self.connection.settimeout(request_timeout_s)  # the answer gets its own time
            super().send_response(code, message)

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            try:
                status, body, content_type = self._answer(path)
            except Exception as err:  # never a traceback (or driver text) in the answer
                log.warning("%s failed: %s", path, type(err).__name__)
                log.debug("metrics endpoint error", exc_info=True)
                status, body = 500, json.dumps({"error": type(err).__name__}).encode()
                content_type = "application/json"
            self._send(status, body, content_type)  # a client gone meanwhile: handle_error

        def _answer(self, path: str) -> tuple[int, bytes, str]:
            if path == "/metrics":
                return 200, *server.metrics(self.headers.get("Accept", ""))
            if path == "/healthz":
                status, answer = server.health()
            elif path == "/readyz":
                status, checks = server.readiness()
                answer = dict(checks)
            else:
                status, answer = 404, {"error": "not_found"}
            return status, json.dumps(answer).encode(), "application/json"

        def _send(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            """Probes every few seconds are not worth a log line each."""

        def log_error(self, format: str, *args: object) -> None:
            """A client's timeout or malformed request: one line (the client's text cut and
            escaped by the stdlib's ``%r``), at DEBUG for a timeout, INFO otherwise."""
            message = (format % args)[:200]
            level = logging.DEBUG if message.startswith("Request timed out") else logging.INFO
            log.log(level, "metrics port: client %s: %s", _peer(self.client_address), message)

    return Handler
