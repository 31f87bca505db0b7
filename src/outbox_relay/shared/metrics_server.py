"""The observation port of a daemon: ``/metrics``, ``/healthz`` and ``/readyz``.

One small threaded HTTP server (stdlib ``ThreadingHTTPServer`` on a daemon thread) per daemon,
on ``metrics_host:metrics_port`` (port 0: no server). It never touches the daemon's loop:

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

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.openmetrics import exposition as openmetrics

from outbox_relay.shared.errors import OutboxError
from outbox_relay.shared.redaction import redact_url

log = logging.getLogger(__name__)

Check = Callable[[], object]
"""A readiness check: returns when ready, raises (ideally an ``OutboxError``) when not."""

CHECK_TIMEOUT_S = 3.0


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
        self._httpd = ThreadingHTTPServer((host, port), _handler_for(self))
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever,
                                        name="outbox-metrics", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        """The port the server is bound to."""
        return int(self._httpd.server_address[1])

    def stop(self) -> None:
        """Stop serving and close the socket (returns once the serving thread ended)."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)
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


def _handler_for(server: MetricsServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        """Routes GET requests to the server's three endpoints; anything else is 404."""

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            try:
                if path == "/metrics":
                    body, content_type = server.metrics(self.headers.get("Accept", ""))
                    self._send(200, body, content_type)
                elif path == "/healthz":
                    self._json(*server.health())
                elif path == "/readyz":
                    self._json(*server.readiness())
                else:
                    self._json(404, {"error": "not_found"})
            except Exception as err:  # never a traceback (or driver text) in the answer
                log.warning("%s failed: %s", path, type(err).__name__)
                log.debug("metrics endpoint error", exc_info=True)
                self._json(500, {"error": type(err).__name__})

        def _json(self, status: int, body: Mapping[str, object]) -> None:
            self._send(status, json.dumps(body).encode(), "application/json")

        def _send(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            """Probes every few seconds are not worth a log line each."""

    return Handler
