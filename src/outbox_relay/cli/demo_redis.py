"""The demo's Redis: the configured one, or a ``redis-server`` started for the demo."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import redis

from outbox_relay.shared.errors import UnavailableError
from outbox_relay.shared.redaction import redact_url
from outbox_relay.shared.redis_conn import connect_redis, translate_redis_errors


@dataclass(frozen=True)
class OwnRedis:
    """A redis-server the demo started, and its working directory (empty: it saves nothing)."""

    proc: subprocess.Popen[bytes]
    workdir: str

    def stop(self) -> None:
        """Stop it and remove its directory, so demos leave nothing behind in the temp dir."""
        self.proc.terminate()
        self.proc.wait(timeout=10)
        shutil.rmtree(self.workdir, ignore_errors=True)


def reuse_or_start(url: str, *, detach: bool) -> tuple[str, OwnRedis | None]:
    """The Redis at ``url``, or one started for the demo when none answers there. A server
    that answers but refuses us (credentials, no such database, not Redis) is an error: a
    Redis of our own would hide the mistake in the URL. ``detach``: ours is in its own session,
    so that a Ctrl-C in the terminal later does not stop the server ``--keep-redis`` keeps."""
    try:
        with translate_redis_errors():
            connect_redis(url, timeout_s=2).ping()
        return url, None
    except UnavailableError:
        pass
    binary = shutil.which("redis-server")
    if binary is None:
        raise UnavailableError(
            f"no Redis at {redact_url(url)} and no redis-server binary to start one. "
            "Start one with `docker compose up -d redis` (compose.yaml) or install the "
            "system package (apt-get install redis-server), or set OUTBOX_REDIS_URL."
        )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="outbox-demo-redis-")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", workdir],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=detach,
    )
    own = f"redis://127.0.0.1:{port}/0"
    client = connect_redis(own, timeout_s=1)
    for _ in range(100):
        try:
            client.ping()
            print(f"started redis-server on port {port} for this demo", file=sys.stderr)
            return own, OwnRedis(proc, workdir)
        except redis.RedisError:
            time.sleep(0.05)
    proc.kill()
    proc.wait()
    shutil.rmtree(workdir, ignore_errors=True)
    raise UnavailableError("could not start a redis-server for the demo")
