"""The observation port of a real daemon (``outbox relay`` as a subprocess, SQLite and the real
Redis) against the attack of issue 28, finding 3: it listens on loopback unless told, 200
half-sent ``GET /metrics`` do not grow its threads beyond the pool and are closed after the
request timeout, and connection resets print no traceback to its stderr."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from outbox_relay.shared import db
from outbox_relay.shared.metrics_server import MAX_CONNECTIONS, REQUEST_TIMEOUT_S
from tests.conftest import REDIS_URL
from tests.helpers import OUTBOX, free_port, wait_until

pytestmark = pytest.mark.integration

HALF_SENT = b"GET /metrics HTTP/1.1\r\nHost: x\r\n"


def threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads line")


def listening_addresses(pid: int, port: int) -> set[str]:
    """The local addresses (hex, as in /proc/net/tcp) on which ``pid``'s namespace listens on
    ``port``."""
    found = set()
    for name in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:
                found.add(address)
    return found


def answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
            sock.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
            return sock.recv(64).startswith(b"HTTP/1.0 200")
    except OSError:
        return False


@pytest.fixture
def daemon(tmp_path: Path, key_prefix: str,
           redis_client: redis.Redis) -> Iterator[tuple[subprocess.Popen[bytes], int, Path]]:
    url = f"sqlite:///{tmp_path}/outbox.db"
    engine = db.make_engine(url)
    db.upgrade(engine)
    engine.dispose()
    port = free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env = {**base, "OUTBOX_DATABASE_URL": url, "OUTBOX_REDIS_URL": REDIS_URL,
           "OUTBOX_KEY_PREFIX": key_prefix, "OUTBOX_METRICS_PORT": str(port)}
    stderr = tmp_path / "relay.stderr"
    with stderr.open("wb") as err:
        proc = subprocess.Popen([str(OUTBOX), "relay"], env=env, stdout=subprocess.DEVNULL,
                                stderr=err)
    try:
        wait_until(lambda: answers(port), timeout=30, what="the relay's metrics port")
        yield proc, port, stderr
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_the_daemon_listens_on_loopback_by_default(
    daemon: tuple[subprocess.Popen[bytes], int, Path],
) -> None:
    proc, port, _ = daemon
    assert listening_addresses(proc.pid, port) == {"0100007F"}  # 127.0.0.1, nothing else


@pytest.mark.slow  # waits out the read timeouts
def test_half_sent_requests_and_resets_cost_neither_threads_nor_tracebacks(
    daemon: tuple[subprocess.Popen[bytes], int, Path],
) -> None:
    proc, port, stderr = daemon
    before = threads(proc.pid)
    socks: list[socket.socket] = []
    try:
        started = time.monotonic()
        most = before
        for _ in range(200):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            socks.append(sock)
            sock.sendall(HALF_SENT)
            most = max(most, threads(proc.pid))
        # The pool's threads are made as needed (a /healthz probe may already have made one).
        assert max(most, threads(proc.pid)) <= before + MAX_CONNECTIONS
        # Every connection is closed by the daemon: at once when the pool is full, else at
        # the request timeout.
        deadline = started + REQUEST_TIMEOUT_S + 20
        for sock in socks:
            sock.settimeout(max(deadline - time.monotonic(), 0.01))
            try:
                while sock.recv(65536):
                    pass
            except ConnectionError:
                pass
        assert time.monotonic() - started >= REQUEST_TIMEOUT_S * 0.9  # held, then cut off
    finally:
        for sock in socks:
            sock.close()
    for payload in (HALF_SENT, b"GET /metrics HTTP/1.0\r\n\r\n"):
        for _ in range(10):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            sock.sendall(payload)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()  # a reset
    wait_until(lambda: answers(port), timeout=20, what="the port to answer again")
    assert threads(proc.pid) <= before + MAX_CONNECTIONS
    assert proc.poll() is None
    assert "Traceback" not in stderr.read_text()
