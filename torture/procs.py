"""The processes the torture drives: daemon children, and a Redis server of its own.

Each incarnation of a child writes its own log file, so the harness can tell, after a death,
whether a fault point fired (the ``outbox-fault: <point>`` line) and which one.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import redis

FAULT_LINE = re.compile(rb"outbox-fault: ([a-z_.]+) pid=")
REPAIR_LINE = re.compile(rb"repair: (refill|rebuild) \S+ \(\w+\): (\d+) entries")
RESURRECTED_LINE = re.compile(rb"(\d+) entries below their streams' trim floor were delivered")
# consumer/ordering.py's WARNING for a failed handler call: "handler for T failed on ID: Error; …"
HANDLER_FAILED_LINE = re.compile(rb"handler for \S+ failed on \S+: (\w+); ")


def free_port() -> int:
    """A loopback TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Child:
    """One long-lived role (``relay-0``, ``consumer-1``, ``producer``) and its incarnations."""

    name: str
    kind: str
    argv: list[str]
    env: dict[str, str]
    log_dir: Path
    proc: subprocess.Popen[bytes] | None = None
    incarnation: int = 0
    armed: str = ""
    logs: list[Path] = field(default_factory=list)
    seed: int = 0

    def start(self, faults_spec: str = "", extra_env: dict[str, str] | None = None) -> None:
        """Start the next incarnation, armed with ``faults_spec`` (``OUTBOX_FAULTS``)."""
        self.incarnation += 1
        env = {**self.env, **(extra_env or {})}
        env["TORTURE_INCARNATION"] = str(self.incarnation)
        if faults_spec:
            env["OUTBOX_FAULTS"] = faults_spec
            stamp = f"{self.seed}:{self.name}:{self.incarnation}"
            env["OUTBOX_FAULTS_SEED"] = str(zlib.crc32(stamp.encode()))
        self.armed = faults_spec
        log = self.log_dir / f"{self.name}.{self.incarnation:05d}.log"
        self.logs.append(log)
        with log.open("wb") as out:
            self.proc = subprocess.Popen(self.argv, env=env, stdout=out, stderr=out)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def fault_fired(self) -> str | None:
        """The fault point the current incarnation died at, if its log says so."""
        if not self.logs:
            return None
        found = FAULT_LINE.search(self.logs[-1].read_bytes())
        return found.group(1).decode() if found else None

    def gave_up_unavailable(self) -> bool:
        """Whether the current incarnation exited 1 saying ``error unavailable``: a daemon
        that cannot reach Redis or the database while it starts (its run loop retries
        instead) gives up and leaves the restart to its supervisor, here the harness."""
        if not self.logs or self.returncode() != 1:
            return False
        lines = self.logs[-1].read_bytes().strip().splitlines()
        return bool(lines) and lines[-1].startswith(b"error unavailable:")

    def kill(self) -> None:
        """SIGKILL the current incarnation and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def pause(self) -> None:
        """SIGSTOP the current incarnation (:meth:`resume` wakes it)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT the current incarnation (harmless if it was not stopped)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM (and SIGCONT, should it be paused), wait, SIGKILL if it does not go; its
        exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.send_signal(signal.SIGCONT)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def count_in_logs(self, needle: bytes) -> int:
        """Occurrences of ``needle`` in every incarnation's log."""
        return sum(log.read_bytes().count(needle) for log in self.logs if log.exists())

    def repaired_entries(self) -> int:
        """Entries this role's relays appended back (from every incarnation's log)."""
        return self._logged_total(REPAIR_LINE, 2)

    def resurrected_entries(self) -> int:
        """Trimmed entries Redis brought back that this role's consumers acknowledged without
        applying (``resurrected``, from every incarnation's log)."""
        return self._logged_total(RESURRECTED_LINE, 1)

    def handler_failures(self, error: str) -> int:
        """Handler calls this role's consumers logged as failed with the exception ``error``
        (its class name), from every incarnation's log."""
        return sum(1 for log in self.logs if log.exists()
                   for m in HANDLER_FAILED_LINE.finditer(log.read_bytes())
                   if m.group(1) == error.encode())

    def _logged_total(self, line: re.Pattern[bytes], group: int) -> int:
        return sum(int(m.group(group)) for log in self.logs if log.exists()
                   for m in line.finditer(log.read_bytes()))


class RedisServer:
    """A redis-server of the harness's own on a fixed loopback port.

    ``start(persistent=True)`` runs with ``appendonly yes``/``appendfsync always`` in its data
    directory; ``wipe=True`` starts from an empty directory without persistence (total data
    loss) and switches AOF on once it is up, so the next SIGKILL loses nothing again.
    """

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None
        self.generation = 0

    @property
    def data_dir(self) -> Path:
        return self.workdir / f"data-{self.generation}"

    def start(self, *, wipe: bool = False) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed")
        if wipe or self.generation == 0:
            self.generation += 1
        self.data_dir.mkdir(parents=True, exist_ok=True)
        appendonly = "no" if wipe else "yes"
        log = self.workdir / f"redis-{self.generation}.log"
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.data_dir),
             "--appendonly", appendonly, "--appendfsync", "always", "--save", "",
             "--logfile", str(log), "--protected-mode", "yes"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        self._wait_ready()
        if wipe:
            client = self.client()
            client.config_set("appendonly", "yes")
            self._wait_aof(client)

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=5, socket_connect_timeout=2)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + 30
        client = self.client()
        while True:
            try:
                if client.ping():
                    info = client.info("persistence")
                    if not info.get("loading"):
                        return
            except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server did not come up")
            time.sleep(0.02)

    def _wait_aof(self, client: redis.Redis) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            info = client.info("persistence")
            if info.get("aof_enabled") and not info.get("aof_rewrite_in_progress") and not (
                info.get("aof_rewrite_scheduled")
            ):
                return
            time.sleep(0.02)
        raise RuntimeError("redis-server did not switch AOF on")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def pause(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


def outbox_argv(*args: str) -> list[str]:
    """``python -m cli.main …`` with this interpreter."""
    return [sys.executable, "-m", "outbox_relay", *args]


def base_env() -> dict[str, str]:
    """This environment without any ``OUTBOX_`` variable of the caller."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "TORTURE_"))}
