"""The one home of the helpers the test modules share (test modules never import each other).

Settings factories with short timings, a polling wait (never a bare sleep standing in for a
condition), stream readers, a test table handlers write their effects to, a private
``redis-server`` for tests that must stall or break their own Redis, free ports, receipts,
consumers on test handlers, numbered events, the relay and repair tests' assertions, Redis
ACLs and certificates, the HTTP app in process and the ``outbox`` command as a subprocess.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import redis
from sqlalchemy import (
    Column,
    Connection,
    Engine,
    Integer,
    MetaData,
    Row,
    String,
    Table,
    create_engine,
    func,
    select,
    text,
    update,
)

from outbox_relay.consumer import Handlers
from outbox_relay.consumer.daemon import Consumer
from outbox_relay.producer import Producer
from outbox_relay.relay import entry_ids
from outbox_relay.relay.outgoing import OutboxRow
from outbox_relay.shared import keys
from outbox_relay.shared.envelope import Event
from outbox_relay.shared.schema import inbox, relay_leases, relay_nodes
from outbox_relay.shared.schema import outbox as outbox_table
from outbox_relay.shared.settings import ConsumerSettings, RelaySettings
from tests.conftest import REDIS_URL

if TYPE_CHECKING:
    import httpx
    from fastapi import FastAPI

ROOT = Path(__file__).resolve().parents[1]
OUTBOX = Path(sys.executable).with_name("outbox")  # the console script of this virtualenv

PARTITIONS = 4
STREAM = "runs"
GROUP = "g1"

effects_metadata = MetaData()
effects = Table(
    "test_effects",
    effects_metadata,
    Column("n", Integer, primary_key=True, autoincrement=True),
    Column("event_id", String(512), nullable=False),
    Column("note", String(64)),
)


def wait_until(
    predicate: Callable[[], object], *, timeout: float = 20.0, what: str = "condition"
) -> None:
    """Poll ``predicate`` until it is truthy; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


def relay_settings(key_prefix: str, **overrides: Any) -> RelaySettings:
    """Relay settings for tests: our Redis, our prefix, short polls."""
    values: dict[str, Any] = {
        "redis_url": REDIS_URL,
        "key_prefix": key_prefix,
        "partitions": PARTITIONS,
        "poll_min_ms": 1,
        "poll_max_ms": 20,
        "node_id": "relay-a",
    }
    values.update(overrides)
    return RelaySettings(**values)


def consumer_settings(key_prefix: str, **overrides: Any) -> ConsumerSettings:
    """Consumer settings for tests: short blocks and idle times, few deliveries."""
    values: dict[str, Any] = {
        "redis_url": REDIS_URL,
        "key_prefix": key_prefix,
        "partitions": PARTITIONS,
        "group": GROUP,
        "consumer": "c1",
        "streams": STREAM,
        "block_ms": 10,
        "claim_idle_ms": 100,
        "claim_interval_ms": 100,
        "max_deliveries": 3,
        "retry_first_delay_s": 0,  # a failed entry is due again at the next pending pass
        "retry_max_delay_s": 0,
        "redis_timeout_s": 5.0,
    }
    values.update(overrides)
    return ConsumerSettings(**values)


def event(
    aggregate_id: str,
    revision: int,
    *,
    type: str = "thing.happened",
    data: Any = None,
    **extra: Any,
) -> Event:
    """A valid event of one aggregate, with the producer's deterministic id."""
    return Event(
        id=f"{aggregate_id}:{type}:{revision}",
        source="tests",
        type=type,
        time=datetime.now(UTC),
        subject=aggregate_id,
        data=data,
        aggregatetype="thing",
        aggregateid=aggregate_id,
        revision=revision,
        **extra,
    )


def partition_of(aggregate_id: str) -> int:
    """The partition the producer maps an aggregate to."""
    return keys.partition_for(aggregate_id, PARTITIONS)


def key_of(prefix: str, aggregate_id: str) -> str:
    """The stream key of an aggregate's partition."""
    return keys.stream_key(prefix, STREAM, partition_of(aggregate_id))


def xadd_event(client: redis.Redis, prefix: str, ev: Event) -> str:
    """Append an event by hand (as a relay would, but with a Redis-chosen id)."""
    key = keys.stream_key(prefix, STREAM, partition_of(ev.aggregateid or ev.id))
    entry_id = client.xadd(key, ev.to_fields())  # type: ignore[arg-type]
    return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)


def stream_entries(
    client: redis.Redis, prefix: str, *, stream: str = STREAM
) -> list[tuple[int, str, dict[str, str]]]:
    """Every entry of every partition: ``(partition, entry id, decoded fields)``."""
    out = []
    for p in range(PARTITIONS):
        for entry_id, fields in client.xrange(keys.stream_key(prefix, stream, p)):
            decoded = {k.decode(): v.decode() for k, v in fields.items()}
            out.append((p, entry_id.decode(), decoded))
    return out


def dead_letters(client: redis.Redis, prefix: str, partition: int) -> list[dict[bytes, bytes]]:
    """The raw fields of every entry of a partition's dead-letter stream."""
    key = keys.dead_letter_key(prefix, STREAM, partition)
    return [fields for _id, fields in client.xrange(key)]


def pending_total(client: redis.Redis, prefix: str, group: str = GROUP) -> int:
    """Entries delivered to ``group`` but not acknowledged, over all partitions."""
    total = 0
    for p in range(PARTITIONS):
        key = keys.stream_key(prefix, STREAM, p)
        if client.exists(key) and any(
            g["name"] == group.encode() for g in client.xinfo_groups(key)
        ):
            total += int(client.xpending(key, group)["pending"])
    return total


def create_effects(engine: Engine) -> None:
    """Create the table test handlers write to (outside the reference schema)."""
    effects_metadata.create_all(engine)


def record_effect(conn: Connection, ev: Event, note: str = "applied") -> None:
    """What a test handler does: one row per call, in the claim transaction."""
    conn.execute(effects.insert().values(event_id=ev.id, note=note))


def effect_counts(engine: Engine) -> Counter[str]:
    """How many effect rows each event id has."""
    with engine.connect() as conn:
        return Counter(row[0] for row in conn.execute(select(effects.c.event_id)))


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def private_redis(workdir: Path, *extra: str) -> Iterator[str]:
    """Start our own ``redis-server`` (no persistence, DEBUG allowed); yield its URL.

    For tests that stall or stop Redis: never the shared server. Stopped by its pid.
    """
    binary = shutil.which("redis-server")
    assert binary is not None, "redis-server is not installed"
    port = free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(workdir), "--enable-debug-command", "yes", *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    probe = redis.Redis.from_url(url, socket_timeout=1)
    try:
        def up() -> bool:
            try:
                return bool(probe.ping())
            except redis.ConnectionError:
                return False

        wait_until(up, timeout=10, what="the private redis-server")
        yield url
    finally:
        probe.close()
        proc.terminate()
        proc.wait(timeout=10)


def enqueue_events(
    engine: Engine, count: int, *, aggregates: int = 8, prefix: str = "agg", first: int = 0
) -> list[str]:
    """Commit ``count`` events spread round-robin over ``aggregates`` aggregates (revision
    order within each), in one transaction; return their ids in enqueue order."""
    producer = Producer(source="tests", partitions=PARTITIONS)
    ids = []
    with engine.begin() as conn:
        for i in range(first, first + count):
            ids.append(producer.enqueue(
                conn, type="thing.happened", stream=STREAM, data={"i": i},
                aggregate_type="thing", aggregate_id=f"{prefix}-{i % aggregates}",
                revision=i // aggregates + 1,
            ))
    return ids


def outbox_rows(engine: Engine) -> list[Any]:
    """Every outbox row, in ``seq`` order."""
    with engine.connect() as conn:
        return list(conn.execute(select(outbox_table).order_by(outbox_table.c.seq)))


def undelivered(engine: Engine) -> int:
    """Outbox rows not yet marked delivered."""
    return sum(1 for r in outbox_rows(engine) if r.delivered_at_ms is None)


TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def outbox_row(**overrides: Any) -> OutboxRow:
    """An outbox row as the relay takes it, every optional column set (``overrides`` change
    any of them): what the relay's wire encoders are checked on."""
    values: dict[str, Any] = {
        "seq": 7, "event_id": "o-1:order.placed:3", "stream": "orders", "partition": 0,
        "aggregate_type": "order", "aggregate_id": "o-1", "revision": 3,
        "type": "order.placed", "source": "shop", "payload": '{"total":42,"note":"é"}',
        "headers": json.dumps({"traceparent": TRACEPARENT, "tracestate": "k=v"}),
        "created_at_ms": 1_764_000_000_123, "entry_id": "1764000000123-7",
    }
    values.update(overrides)
    return OutboxRow(**values)


def deliveries(events: list[Event], key: str = "k") -> list[Any]:
    """``events`` as a claim's batch (``inbox.Delivery``), entry ids ``1-0``, ``1-1`` …"""
    from outbox_relay.consumer import inbox

    return [inbox.Delivery(key, f"1-{i}", ev, 1) for i, ev in enumerate(events)]


def receipt_outcomes(engine: Engine) -> dict[str, str]:
    """Every receipt's outcome by event id (any group)."""
    from outbox_relay.shared.schema import inbox as inbox_table

    with engine.connect() as conn:
        rows = conn.execute(select(inbox_table.c.event_id, inbox_table.c.outcome))
        return {event_id: outcome for event_id, outcome in rows}


def receipts(engine: Engine, group: str | None = GROUP) -> dict[str, tuple[str, str | None]]:
    """Every receipt's ``(outcome, reason)`` by event id, of ``group`` (None: any group)."""
    query = select(inbox.c.event_id, inbox.c.outcome, inbox.c.reason)
    if group is not None:
        query = query.where(inbox.c.group_name == group)
    with engine.connect() as conn:
        return {i: (o, r) for i, o, r in conn.execute(query)}


def receipt_rows(engine: Engine) -> dict[str, Row[Any]]:
    """Every receipt row of :data:`GROUP` by event id."""
    with engine.connect() as conn:
        rows = conn.execute(select(inbox).where(inbox.c.group_name == GROUP)).all()
    return {r.event_id: r for r in rows}


def receipt_counts(engine: Engine) -> dict[str, int]:
    """How many receipts of :data:`GROUP` have each outcome."""
    with engine.connect() as conn:
        rows = conn.execute(select(inbox.c.outcome, func.count())
                            .where(inbox.c.group_name == GROUP)
                            .group_by(inbox.c.outcome)).all()
    return {str(outcome): int(n) for outcome, n in rows}


# --- consumers --------------------------------------------------------------------------------

class Recorder:
    """Handlers for ``thing.happened`` that write an effect row, and may fail on purpose."""

    def __init__(self, fails: Callable[[Event, int], bool] = lambda _e, _n: False) -> None:
        self.calls: Counter[str] = Counter()
        self.fails = fails
        self.handlers = Handlers()
        self.handlers.register("thing.happened", self.handle)

    def handle(self, conn: Connection, ev: Event) -> None:
        self.calls[ev.id] += 1
        record_effect(conn, ev)
        if self.fails(ev, self.calls[ev.id]):
            raise RuntimeError("the handler failed on purpose")


class HasHandlers(Protocol):
    """Anything carrying a handler registry: a :class:`Recorder`, a test module's app."""

    @property
    def handlers(self) -> Handlers: ...


def make_consumer(
    engine: Engine, client: redis.Redis, prefix: str, app: HasHandlers, **settings: Any
) -> Consumer:
    """A consumer on :func:`consumer_settings` (``settings`` override them) with ``app``'s
    handlers."""
    return Consumer(consumer_settings(prefix, **settings), engine, client, app.handlers)


# --- numbered events, and the relay's repair ---------------------------------------------------

def enqueue_numbered(
    engine: Engine, prefix: str, first: int, count: int, *, source: str, partitions: int,
    stream: str = "things", id_format: str | None = None, aggregates: int | None = None,
) -> None:
    """Commit ``thing.done`` events ``n`` = ``first`` … ``first + count - 1`` (data ``{"n": n}``)
    in one transaction. ``id_format`` (``"evt-{n:04d}"``) names each event, else the producer
    does; ``aggregates`` spreads them over aggregates ``a{n % aggregates}``, else none."""
    producer = Producer(source=source, partitions=partitions, key_prefix=prefix)
    with engine.begin() as conn:
        for n in range(first, first + count):
            options: dict[str, Any] = {}
            if id_format is not None:
                options["event_id"] = id_format.format(n=n)
            if aggregates is not None:
                options["aggregate_id"] = f"a{n % aggregates}"
            producer.enqueue(conn, type="thing.done", stream=stream, data={"n": n}, **options)


REPAIR_PARTITIONS = 2


def repair_settings(engine: Engine, prefix: str) -> RelaySettings:
    """The repair tests' relay: :data:`REPAIR_PARTITIONS` partitions, node ``repair-test``."""
    return RelaySettings(
        database_url=engine.url.render_as_string(hide_password=False),
        redis_url=REDIS_URL,
        key_prefix=prefix,
        partitions=REPAIR_PARTITIONS,
        node_id="repair-test",
    )


def repair_enqueue(engine: Engine, prefix: str, first: int, count: int) -> None:
    """The repair tests' events ``evt-0000`` …, on stream ``things``."""
    enqueue_numbered(engine, prefix, first, count, source="repair-test",
                     partitions=REPAIR_PARTITIONS, id_format="evt-{n:04d}")


def delivered_entries(engine: Engine, partition: int) -> list[tuple[str, str]]:
    """``(entry id, event id)`` of the delivered rows of stream ``things`` in ``partition``,
    in entry id order: what its stream should hold."""
    with engine.connect() as conn:
        rows = conn.execute(
            select(outbox_table.c.entry_id, outbox_table.c.event_id).where(
                outbox_table.c.stream == "things", outbox_table.c.partition == partition,
                outbox_table.c.delivered_at_ms.is_not(None),
            )
        ).all()
    return sorted(((e, i) for e, i in rows), key=lambda t: entry_ids.parse(t[0]))


def stream_contents(client: redis.Redis, prefix: str, partition: int) -> list[tuple[str, str]]:
    """``(entry id, event id)`` of every entry of stream ``things`` in ``partition``."""
    key = keys.stream_key(prefix, "things", partition)
    return [(i.decode(), f[b"id"].decode()) for i, f in client.xrange(key)]


# --- the relay ---------------------------------------------------------------------------------

TTL = 10_000  # the relay tests' lease TTL (ms)


def assert_each_once(client: redis.Redis, prefix: str, event_ids: list[str]) -> None:
    """Every id exactly once in the streams, nothing else there."""
    seen = Counter(fields["id"] for _p, _id, fields in stream_entries(client, prefix))
    assert seen == Counter(event_ids)


def assert_all_marked(engine: Engine, client: redis.Redis, prefix: str) -> None:
    """Each row is delivered, and its stored entry id is where Redis holds its event."""
    by_id = {fields["id"]: (p, entry_id) for p, entry_id, fields in stream_entries(client, prefix)}
    for row in outbox_rows(engine):
        assert row.delivered_at_ms is not None, row.event_id
        assert by_id[row.event_id] == (row.partition, row.entry_id)


def lease_owners(engine: Engine) -> dict[int, str | None]:
    with engine.connect() as conn:
        return dict(conn.execute(select(relay_leases.c.partition, relay_leases.c.owner)).all())


def expire_lease(engine: Engine, partition: int) -> None:
    """What the clock does to the lease of a relay that stalls past its TTL."""
    with engine.begin() as conn:
        conn.execute(
            update(relay_leases).where(relay_leases.c.partition == partition)
            .values(expires_at_ms=0)
        )


class LostReply:
    """A Redis client whose next ``n`` append calls (``EVALSHA``, or pipelines) really run,
    then report a timeout: the outcome a relay sees when the reply is lost."""

    def __init__(self, real: redis.Redis, n: int = 1) -> None:
        self.real, self.remaining = real, n

    def evalsha(self, *args: Any) -> Any:
        answer = self.real.evalsha(*args)
        if self.remaining > 0:
            self.remaining -= 1
            raise redis.TimeoutError("Timeout reading from socket")
        return answer

    def pipeline(self, transaction: bool = True) -> Any:
        pipe = self.real.pipeline(transaction=transaction)
        if self.remaining > 0:
            self.remaining -= 1
            execute = pipe.execute

            def execute_then_time_out(raise_on_error: bool = True) -> Any:
                execute(raise_on_error=raise_on_error)
                raise redis.TimeoutError("Timeout reading from socket")

            pipe.execute = execute_then_time_out  # type: ignore[method-assign]
        return pipe

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


# --- Redis ACLs (docs/security.md) and TLS -----------------------------------------------------

SECURITY_DOC = ROOT / "docs" / "security.md"


def documented_acl() -> dict[str, str]:
    """``{role: rules}`` from the ``user outbox-<role> …`` lines of docs/security.md."""
    found = re.findall(r"^user outbox-(\w+) (.+)$", SECURITY_DOC.read_text(), flags=re.MULTILINE)
    return dict(found)


def rule_words(rules: str) -> list[str]:
    """The ACL words of ``rules``; a selector ``(~k:* +cmd ...)`` is one word."""
    return re.findall(r"\([^)]*\)|\S+", rules)


def make_certificates(folder: Path) -> dict[str, Path]:
    """A throwaway CA, a server certificate for 127.0.0.1 and a client certificate."""
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
        "-subj", "/CN=outbox-test-ca")
    (folder / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        run("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr",
            "-subj", f"/CN=outbox-test-{name}")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", "san.cnf")
    return {n: folder / n for n in ("ca.pem", "server.pem", "server.key", "client.pem",
                                    "client.key")}


# --- the HTTP app in process, and the CLI as a subprocess --------------------------------------

def assert_error(response: httpx.Response, status: int, code: str) -> None:
    """``response`` is the API's error shape with ``status`` and ``code``, no traceback."""
    assert response.status_code == status
    body = response.json()
    assert body == {"error": {"code": code, "message": body["error"]["message"]}}
    assert "Traceback" not in response.text


def call(app: FastAPI, method: str, url: str, **kwargs: Any) -> httpx.Response:
    """One request through the ASGI app (the chunks of a generator body arrive one by one)."""
    import httpx

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, url, **kwargs)

    return asyncio.run(go())


def outbox(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """Run ``outbox …`` with a clean ``OUTBOX_*`` environment plus ``env``."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    return subprocess.run(
        [str(OUTBOX), *args], env={**base, **(env or {})}, cwd=cwd, capture_output=True,
        text=True, timeout=timeout, check=False,
    )


def let_die(engine: Engine, node_id: str) -> None:
    """What the clock does to a dead relay: its heartbeat and all its leases run out."""
    with engine.begin() as conn:
        conn.execute(update(relay_nodes).where(relay_nodes.c.node_id == node_id)
                     .values(expires_at_ms=0))
        conn.execute(update(relay_leases).where(relay_leases.c.owner == node_id)
                     .values(expires_at_ms=0))


SHIFTED = ("TEMPLATE template0 LOCALE_PROVIDER icu ICU_LOCALE 'en-u-ka-shifted' "
           "LOCALE 'C.UTF-8'")
"""``CREATE DATABASE`` options for a default collation that ignores punctuation first, as
glibc's ``en_US.UTF-8`` does (ICU's rule; PostgreSQL 15 can make it a database's default)."""


@contextmanager
def private_database(
    admin_url: str, kind: str, *, options: str = "", settings: dict[str, str] | None = None,
    needs_icu: bool = False,
) -> Iterator[str]:
    """A PostgreSQL database of its own on the test server (``CREATE DATABASE <name>
    <options>``, then ``ALTER DATABASE … SET`` each of ``settings``), its URL; dropped
    afterwards, also when its setup failed. Skips the test when ``needs_icu`` and the server
    cannot make an ICU collation a database's default (before 15, or built without ICU)."""
    import pytest

    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    name = f"t_{kind}_{os.urandom(6).hex()}"
    try:
        with admin.connect() as conn:
            if needs_icu and (
                int(conn.execute(text("SHOW server_version_num")).scalar_one()) < 150000
                or not conn.execute(text(
                    "SELECT count(*) FROM pg_collation WHERE collprovider = 'i'")).scalar_one()):
                pytest.skip("an ICU default collation needs PostgreSQL 15 built with ICU")
            conn.execute(text(f"CREATE DATABASE {name} {options}"))
        try:
            with admin.connect() as conn:
                for setting, value in (settings or {}).items():
                    conn.execute(text(f"ALTER DATABASE {name} SET {setting} = '{value}'"))
            yield admin.url.set(database=name).render_as_string(hide_password=False)
        finally:
            with admin.connect() as conn:
                conn.execute(text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
    finally:
        admin.dispose()
