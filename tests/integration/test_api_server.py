"""``outbox serve``'s server limits, on a real process and raw sockets (issue 28, finding 5).

Connections that send part of a request head (or nothing, or one byte at a time) are closed
within ``api_read_timeout_s``; while they are held, requests beyond ``api_limit_concurrency``
get 503 at once instead of queueing; an idle kept-alive connection is closed after
``api_keep_alive_s``; a head over ``api_max_head_bytes`` is refused. The server keeps serving
throughout. Every wait is on the condition (a socket reading EOF), with a deadline.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import shutil
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from outbox_relay.runs import schema as runs_schema
from outbox_relay.shared import db
from tests.helpers import free_port, make_certificates

pytestmark = pytest.mark.integration

READ_TIMEOUT_S = 1.0
TOKEN = "tester-0123456789abcdef"
PARTIAL = b"GET /runs/x HTTP/1.1\r\nHost: a\r\nX-Slow: "


@dataclass
class Server:
    port: int
    log: Path

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=5)

    def get(self, path: str) -> httpx.Response:
        return httpx.get(f"http://127.0.0.1:{self.port}{path}", timeout=10,
                         headers={"authorization": f"Bearer {TOKEN}"})


@contextlib.contextmanager
def serving(tmp_path: Path, **settings: str) -> Iterator[Server]:
    """``outbox serve`` on a fresh SQLite file with ``settings`` (``OUTBOX_<NAME>``)."""
    url = f"sqlite:///{tmp_path}/serve.db"
    engine = db.make_engine(url)
    runs_schema.upgrade(engine)
    engine.dispose()
    port = free_port()
    log = tmp_path / "serve.log"
    env = {**os.environ, "OUTBOX_DATABASE_URL": url, "OUTBOX_API_TOKENS": f"tester:{TOKEN}",
           **{f"OUTBOX_{name.upper()}": value for name, value in settings.items()}}
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "outbox_relay", "serve", "--port",
                                 str(port)], env=env, stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "server did not start"
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.05)
        yield Server(port, log)
    finally:
        proc.terminate()
        assert proc.wait(timeout=15) == 0
    assert "Traceback" not in log.read_text() and TOKEN not in log.read_text()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    with serving(tmp_path, api_read_timeout_s=str(READ_TIMEOUT_S), api_keep_alive_s="1",
                 api_limit_concurrency="20", api_max_head_bytes="2048") as started:
        yield started


def wait_closed(socks: list[socket.socket], deadline_s: float,
                trickle: frozenset[socket.socket] = frozenset()) -> float:
    """Seconds until every socket in ``socks`` read EOF (or a reset); those in ``trickle`` send
    one more byte of their head every 0.1 s meanwhile. Fails at the deadline."""
    start = time.monotonic()
    selector = selectors.DefaultSelector()
    for sock in socks:
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)
    open_ = set(socks)
    try:
        while open_:
            assert time.monotonic() - start < deadline_s, f"{len(open_)} still open"
            for key, _ in selector.select(timeout=0.1):
                ready = key.fileobj
                assert isinstance(ready, socket.socket)
                try:
                    data = ready.recv(65536)
                except (ConnectionResetError, BrokenPipeError):
                    data = b""
                if not data:
                    selector.unregister(ready)
                    open_.discard(ready)
            for sock in trickle & open_:
                with contextlib.suppress(ConnectionResetError, BrokenPipeError):
                    sock.send(b"x")  # once closed, the next select reads the EOF
        return time.monotonic() - start
    finally:
        selector.close()


def test_partial_heads_are_closed_within_the_read_timeout(server: Server) -> None:
    silent = [server.connect() for _ in range(5)]  # connect and send nothing
    partial = [server.connect() for _ in range(40)]  # a request line and half a header
    for sock in partial:
        sock.sendall(PARTIAL)
    trickling = [server.connect() for _ in range(5)]  # slowloris: one byte every 0.1 s
    for sock in trickling:
        sock.sendall(PARTIAL)
    # Held: far more connections than the cap, so a whole request is refused at once (503),
    # not queued behind them.
    assert server.get("/runs/x").status_code == 503
    held = silent + partial + trickling
    took = wait_closed(held, READ_TIMEOUT_S + 10, frozenset(trickling))
    assert took >= READ_TIMEOUT_S * 0.5  # closed by the timeout, not refused at connect
    for sock in held:
        sock.close()
    assert server.get("/runs/x").status_code == 404  # serving again once they are gone


def test_idle_keep_alive_and_oversized_heads_are_closed(server: Server) -> None:
    kept = server.connect()
    kept.sendall(b"GET /healthz HTTP/1.1\r\nHost: a\r\n\r\n")
    assert kept.recv(65536).startswith(b"HTTP/1.1 200")
    wait_closed([kept], 1 + 10)  # idle after its response: closed after api_keep_alive_s
    second = server.connect()  # a whole request, then half of the next one
    second.sendall(b"GET /healthz HTTP/1.1\r\nHost: a\r\n\r\n")
    assert second.recv(65536).startswith(b"HTTP/1.1 200")
    second.sendall(PARTIAL)  # its first byte ends the keep-alive wait; the read timeout holds
    wait_closed([second], READ_TIMEOUT_S + 10)
    second.close()
    big = server.connect()
    big.sendall(b"GET /healthz HTTP/1.1\r\nHost: a\r\nX-Big: " + b"a" * 4096)  # no end yet
    big.setblocking(True)
    assert big.recv(65536).startswith(b"HTTP/1.1 400")
    wait_closed([big], 10)
    for sock in (kept, big):
        sock.close()


def test_tls_with_client_certificates(tmp_path: Path) -> None:
    """``api_ssl_*``: TLS by uvicorn; with ``api_ssl_ca_certs`` a client certificate is
    required (mutual TLS), and the bearer token still is."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl CLI to make certificates")
    certs = make_certificates(tmp_path)
    with serving(tmp_path, api_ssl_certfile=str(certs["server.pem"]),
                 api_ssl_keyfile=str(certs["server.key"]),
                 api_ssl_ca_certs=str(certs["ca.pem"]), log_level="DEBUG") as server:
        url = f"https://127.0.0.1:{server.port}/runs/x"
        trusted = ssl.create_default_context(cafile=str(certs["ca.pem"]))
        with (httpx.Client(verify=trusted, timeout=10) as anonymous,
              pytest.raises(httpx.TransportError)):  # no client certificate: no handshake
            anonymous.get(url, headers={"authorization": f"Bearer {TOKEN}"})
        trusted.load_cert_chain(str(certs["client.pem"]), str(certs["client.key"]))
        with httpx.Client(verify=trusted, timeout=10) as client:
            assert client.get(url).status_code == 401
            assert client.get(url, headers={"authorization": f"Bearer {TOKEN}"}).status_code == 404
        with pytest.raises(httpx.TransportError):  # plain HTTP on the TLS port
            httpx.get(f"http://127.0.0.1:{server.port}/healthz", timeout=5).raise_for_status()
