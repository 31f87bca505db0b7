"""Redis ACL users and TLS through the URL, and credentials kept out of every output.

A Redis of our own (free loopback port, ``--dir`` under tmp, stopped by pid) with the default
user off, an admin user for the test itself, and the ACL users of ``docs/security.md`` loaded
*from that file*, so the documented rules are exactly the rules tested. The relay, a consumer,
``outbox status`` and the dead-letter tools then run end to end through them, over plain TCP and
over TLS (a throwaway CA and server certificate made with the ``openssl`` CLI).
"""

from __future__ import annotations

import gc
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from sqlalchemy import Connection, Engine, create_engine, func, select, text

from outbox_relay.cli import main as cli_main
from outbox_relay.cli import status
from outbox_relay.consumer import Handlers, dead_letters, hygiene
from outbox_relay.consumer.daemon import Consumer
from outbox_relay.producer import Producer
from outbox_relay.relay.daemon import Relay
from outbox_relay.runs import schema as runs_schema
from outbox_relay.shared import db, keys
from outbox_relay.shared.envelope import Event
from outbox_relay.shared.errors import CannotConnectError, UnavailableError
from outbox_relay.shared.redis_conn import connect_redis, translate_redis_errors
from outbox_relay.shared.schema import inbox
from outbox_relay.shared.settings import ConsumerSettings, RelaySettings
from tests.conftest import PG_ADMIN_URL, pg_schema_url
from tests.helpers import ROOT, documented_acl, free_port, make_certificates, rule_words
from torture.redis_sets import conf_quoted

DEMO_APP = "outbox_relay.cli.demo_app:handlers"

pytestmark = pytest.mark.integration

SECRET = "Zq7-S3cr3t-w0rd"  # part of every password below; must never be printed
ADMIN_PW = f"admin-{SECRET}"
# Commands of the test's own admin connection and of connection set-up, not of the roles.
NOT_A_ROLE = {"info", "config|resetstat", "acl|log", "acl|setuser", "auth", "hello",
              "client|setinfo"}


def allowed_commands(rules: str) -> set[str]:
    words = " ".join(w.strip("()") for w in rule_words(rules)).split()
    return {r[1:] for r in words if r.startswith("+") and not r.startswith("+@")}


@dataclass
class PrivateRedis:
    """Our own redis-server; ``tls_port`` is None when the binary has no TLS support."""

    proc: subprocess.Popen[bytes]
    port: int
    tls_port: int | None
    certs: dict[str, Path]
    tls_skip_reason: str = ""

    def admin(self) -> redis.Redis:
        return redis.Redis(port=self.port, username="admin", password=ADMIN_PW)

    def url(self, role: str, *, tls: bool = False, query: str = "", pw: str | None = None) -> str:
        password = pw if pw is not None else f"{role}-{SECRET}"
        if tls:
            assert self.tls_port is not None
            return f"rediss://outbox-{role}:{password}@127.0.0.1:{self.tls_port}/0{query}"
        return f"redis://outbox-{role}:{password}@127.0.0.1:{self.port}/0{query}"

    def load_roles(self, prefix: str) -> dict[str, set[str]]:
        """``ACL SETUSER`` each documented role, its key pattern narrowed to ``prefix``."""
        admin, roles = self.admin(), {}
        for role, rules in documented_acl().items():
            rules = rules.replace("~outbox:*", f"~{prefix}:*").replace("&outbox:*", f"&{prefix}:*")
            rules = re.sub(r">\S+", f">{role}-{SECRET}", rules)
            admin.execute_command("ACL", "SETUSER", f"outbox-{role}", "reset",
                                  *rule_words(rules))
            roles[role] = allowed_commands(rules)
        admin.execute_command("ACL", "SETUSER", "outbox-demo", "reset", "on",
                              f">demo-{SECRET}", "~*", "&*", "+@all")
        admin.execute_command("ACL", "LOG", "RESET")
        return roles

    def commands_used(self) -> dict[str, tuple[int, int]]:
        """``{command: (calls, rejected_calls)}`` since the last ``CONFIG RESETSTAT``."""
        stats = self.admin().info("commandstats")
        return {
            name.removeprefix("cmdstat_"): (int(v["calls"]), int(v.get("rejected_calls", 0)))
            for name, v in stats.items()
        }

    def acl_denials(self) -> list[str]:
        return [f"{e['username']}: {e['object']}" for e in self.admin().acl_log()]


def _start(folder: Path, certs: dict[str, Path], tls: bool) -> PrivateRedis:
    """Start the server; a port another process took between ``free_port`` and the bind is
    retried with new ports (it must never pass for a missing TLS build)."""
    for _attempt in range(5):
        try:
            return _start_once(folder, certs, tls)
        except RuntimeError as err:
            if "Address already in use" not in str(err):
                raise
    raise RuntimeError("no free port for a private redis-server after 5 attempts")


def _start_once(folder: Path, certs: dict[str, Path], tls: bool) -> PrivateRedis:
    port, tls_port = free_port(), free_port() if tls else None
    lines = [f"port {port}", "bind 127.0.0.1", 'save ""', "appendonly no",
             f"dir {conf_quoted(folder)}",
             "user default off", f"user admin on >{ADMIN_PW} ~* &* +@all"]
    if tls:
        lines += [f"tls-port {tls_port}", f"tls-cert-file {conf_quoted(certs['server.pem'])}",
                  f"tls-key-file {conf_quoted(certs['server.key'])}",
                  f"tls-ca-cert-file {conf_quoted(certs['ca.pem'])}",
                  "tls-auth-clients optional"]
    (folder / "redis.conf").write_text("\n".join(lines) + "\n")
    with (folder / "redis.log").open("wb") as log:
        proc = subprocess.Popen(["redis-server", str(folder / "redis.conf")], stdout=log,
                                stderr=subprocess.STDOUT)
    server = PrivateRedis(proc, port, tls_port, certs)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            server.admin().ping()
            return server
        except redis.RedisError:
            time.sleep(0.05)
    proc.kill()
    proc.wait()
    raise RuntimeError((folder / "redis.log").read_text()[-500:])


@pytest.fixture(scope="module")
def private_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateRedis]:
    if shutil.which("redis-server") is None:
        pytest.skip("no redis-server binary")
    folder = tmp_path_factory.mktemp("private-redis")
    certs: dict[str, Path] = {}
    reason = ""
    if shutil.which("openssl") is None:
        reason = "no openssl CLI to make certificates"
    else:
        certs = make_certificates(folder)
    try:
        server = _start(folder, certs, tls=not reason)
    except RuntimeError as err:
        if reason or "tls" not in str(err).lower():
            raise
        reason = f"redis-server has no TLS support: {str(err)[-200:]}"
        server = _start(folder, certs, tls=False)
    server.tls_skip_reason = reason
    yield server
    server.proc.terminate()
    try:
        server.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait()


# --- the pipeline through ACL users ------------------------------------------------------

N_EVENTS = 40


def enqueue(engine: Engine, prefix: str, n: int = N_EVENTS) -> list[str]:
    producer = Producer(source="sec-test", partitions=2, key_prefix=prefix)
    with engine.begin() as conn:
        return [producer.enqueue(conn, type="sec.ok", stream="sec", data={"i": i},
                                 aggregate_type="thing", aggregate_id=f"a{i}", revision=1)
                for i in range(n)]


def handlers(flaky_id: str = "", *, late: bool = False) -> Handlers:
    """``sec.ok`` fails once for ``flaky_id`` (so XAUTOCLAIM and XPENDING run); ``sec.late``
    has a handler only with ``late`` (before that it is dead-lettered, then replayed)."""
    failed: set[str] = set()

    def handle(conn: Connection, event: Event) -> None:
        if event.id == flaky_id and event.id not in failed:
            failed.add(event.id)
            raise RuntimeError("first attempt fails")

    h = Handlers()
    h.register("sec.ok", handle)
    if late:
        h.register("sec.late", handle)
    return h


def applied(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).where(
            inbox.c.group_name == "sec", inbox.c.outcome == "applied")).scalar_one())


def run_relay(engine: Engine, url: str, prefix: str, *, repairs: int = 0) -> None:
    """Deliver everything (or, after a simulated loss, refill ``repairs`` entries)."""
    settings = RelaySettings(redis_url=url, key_prefix=prefix, partitions=2, node_id="sec-relay")
    client = connect_redis(url)
    relay = Relay(settings, engine, client)
    stats = relay.run(until_idle=True)
    client.close()
    assert stats.delivered == (0 if repairs else N_EVENTS) and stats.failed == 0
    assert relay.repairer.stats.repaired_entries == repairs


def run_trim(engine: Engine, url: str, prefix: str) -> None:
    """Trim both partition streams below what the group acknowledged (keep nothing)."""
    settings = RelaySettings(redis_url=url, key_prefix=prefix, partitions=2, node_id="sec-relay",
                             stream_keep=0, stream_keep_s=0)
    client = connect_redis(url)
    relay = Relay(settings, engine, client)
    relay._refresh_leases()
    relay.repairer.maybe_run(relay.leases)  # learns the streams
    trimmed = relay.trimmer.run(relay.leases, relay.repairer.streams)
    relay._release()
    client.close()
    assert relay.trimmer.stats.trim_errors == 0
    assert trimmed >= N_EVENTS  # everything the group acknowledged


def run_consumer(engine: Engine, url: str, prefix: str, flaky_id: str) -> None:
    settings = ConsumerSettings(redis_url=url, key_prefix=prefix, partitions=2, streams="sec",
                                group="sec", consumer="c1", block_ms=1, claim_idle_ms=100,
                                claim_interval_ms=100)
    client = connect_redis(url)
    consumer = Consumer(settings, engine, client, handlers(flaky_id))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (
        applied(engine) < N_EVENTS or _pending(client, prefix) or not consumer.stats.dead
    ):
        consumer.run_once(block_ms=1)
    assert applied(engine) == N_EVENTS and consumer.stats.autoclaimed >= 1
    assert _pending(client, prefix) == 0 and consumer.stats.dead == 1  # sec.late
    # group hygiene (its script, DELCONSUMER of an idle consumer, XTRIM of the letters)
    key = keys.stream_key(prefix, "sec", 1)
    client.xreadgroup("sec", "gone", {key: "0"})  # creates a consumer with nothing pending
    tidy = hygiene.GroupHygiene(settings.model_copy(update={"consumer_idle_s": 0.05}), engine,
                                client, consumer.leases)
    while time.monotonic() < deadline and not tidy.stats.consumers_removed:
        tidy.run()
        time.sleep(0.01)
    assert tidy.stats.consumers_removed == 1 and tidy.stats.dead_letters_trimmed == 0


def _pending(client: redis.Redis, prefix: str) -> int:
    return sum(int(client.xpending(keys.stream_key(prefix, "sec", p), "sec")["pending"])
               for p in (0, 1))


def run_operator(engine: Engine, url: str, prefix: str) -> None:
    client = connect_redis(url)
    report = status.collect(engine, client, prefix)
    assert {s["partition"] for s in report["streams"]} == {0, 1}
    assert all(g["pending"] == 0 for s in report["streams"] for g in s["groups"])
    (letter,) = dead_letters.list_letters(client, prefix)
    assert letter.reason == "unknown_type"
    assert dead_letters.show(client, prefix, letter.letter_id) == letter
    result = dead_letters.replay(client, engine, letter, handlers(late=True), group="sec")
    assert (result.outcome, result.removed) == ("applied", True)


def pipeline_through_acl(
    server: PrivateRedis, engine: Engine, *, tls: bool
) -> dict[str, set[str]]:
    """Relay, consumer and operator tools, each through its own documented ACL user; returns
    the commands each role sent. Fails on any ACL denial."""
    prefix = f"acl{uuid.uuid4().hex[:10]}"
    roles = server.load_roles(prefix)
    query = f"?ssl_ca_certs={server.certs['ca.pem']}" if tls else ""
    admin = server.admin()
    event_ids = enqueue(engine, prefix)
    late = {b"specversion": b"1.0", b"id": b"late-1", b"source": b"t", b"type": b"sec.late",
            b"time": b"2024-01-01T00:00:00Z"}
    used: dict[str, set[str]] = {}

    def phase(role: str) -> str:
        admin.config_resetstat()
        return server.url(role, tls=tls, query=query)

    def check(role: str) -> None:
        calls = server.commands_used()
        used[role] = used.get(role, set()) | ({c for c, (n, _r) in calls.items() if n} - NOT_A_ROLE)
        assert all(rej == 0 for _n, rej in calls.values()), calls
        assert used[role] <= roles[role], (role, used[role] - roles[role])
        assert server.acl_denials() == [], role

    run_relay(engine, phase("relay"), prefix)
    check("relay")
    lost = int(admin.xlen(keys.stream_key(prefix, "sec", 0)))  # Redis "loses" partition 0:
    admin.delete(keys.stream_key(prefix, "sec", 0))  # the relay's repair refills it
    run_relay(engine, phase("relay"), prefix, repairs=lost)
    check("relay")
    admin.xadd(keys.stream_key(prefix, "sec", 1), late)  # type: ignore[arg-type]
    run_consumer(engine, phase("consumer"), prefix, event_ids[0])
    check("consumer")
    run_trim(engine, phase("relay"), prefix)
    check("relay")
    run_operator(engine, phase("operator"), prefix)
    check("operator")
    return used


def test_documented_acl_has_every_role() -> None:
    acl = documented_acl()
    assert set(acl) == {"relay", "consumer", "operator"}
    for rules in acl.values():
        assert "-@all" in rules and "~outbox:*" in rules and "resetchannels" in rules


def test_pipeline_through_minimal_acl_users(private_redis: PrivateRedis, engine: Engine) -> None:
    used = pipeline_through_acl(private_redis, engine, tls=False)
    print(f"\ncommands used per role: {used}")
    # what each role needs in a normal run (repair's rebuild and PING only run when needed)
    assert used["relay"] >= {"xadd", "exists", "xinfo|stream", "xtrim", "xinfo|groups"}
    assert used["consumer"] >= {"xgroup|create", "xreadgroup", "xpending", "xack", "xadd"}
    assert used["operator"] >= {"scan", "type", "xinfo|groups", "xlen", "xrange", "xdel"}


def test_acl_users_are_confined(private_redis: PrivateRedis) -> None:
    prefix = f"acl{uuid.uuid4().hex[:10]}"
    private_redis.load_roles(prefix)
    relay = connect_redis(private_redis.url("relay"))
    consumer = connect_redis(private_redis.url("consumer"))
    operator = connect_redis(private_redis.url("operator"))
    for attempt in (
        lambda: relay.hset(f"{prefix}:x", "k", 1),  # a command outside its list
        lambda: relay.xadd("elsewhere:{s:0}", {"a": "b"}),  # a key outside the prefix
        lambda: consumer.xdel(keys.stream_key(prefix, "s", 0), "1-1"),
        # a consumer cannot append to or trim a partition stream (only its :dead letters)
        lambda: consumer.xadd(keys.stream_key(prefix, "s", 0), {"id": "forged"}),
        lambda: consumer.xtrim(keys.stream_key(prefix, "s", 0), minid="9-0"),
        lambda: operator.xdel(keys.stream_key(prefix, "s", 0), "1-1"),
        lambda: consumer.flushall(),
        lambda: relay.publish("chan", "x"),
    ):
        with pytest.raises(UnavailableError) as caught, translate_redis_errors():
            attempt()
        assert "ACL" in caught.value.message
    dead = keys.dead_letter_key(prefix, "s", 0)  # what the selectors do allow
    with translate_redis_errors():
        letter = consumer.xadd(dead, {"dlq.reason": "test"})
        assert consumer.xtrim(dead, minid="0-1") == 0
        assert operator.xdel(dead, letter) == 1
    wrong = connect_redis(private_redis.url("relay", pw="not-it"))
    with pytest.raises(CannotConnectError) as caught, translate_redis_errors():
        wrong.ping()
    assert caught.value.message == "Redis refused our credentials (password hidden)"
    assert SECRET not in str(caught.value) and "not-it" not in str(caught.value)
    private_redis.admin().execute_command("ACL", "LOG", "RESET")


# --- TLS ------------------------------------------------------------------------------------

def _need_tls(server: PrivateRedis) -> None:
    if server.tls_port is None:
        pytest.skip(server.tls_skip_reason)


def test_pipeline_over_tls_with_acl_users(private_redis: PrivateRedis, engine: Engine) -> None:
    _need_tls(private_redis)
    used = pipeline_through_acl(private_redis, engine, tls=True)
    assert used["consumer"] and used["relay"] and used["operator"]


def test_tls_url_options(private_redis: PrivateRedis) -> None:
    _need_tls(private_redis)
    s, certs = private_redis, private_redis.certs
    s.load_roles("outbox")  # its users, whichever test of the module ran before
    ok = [
        s.url("operator", tls=True, query=f"?ssl_ca_certs={certs['ca.pem']}"),
        s.url("operator", tls=True, query=f"?ssl_ca_certs={certs['ca.pem']}"
              f"&ssl_certfile={certs['client.pem']}&ssl_keyfile={certs['client.key']}"),
        s.url("operator", tls=True, query="?ssl_cert_reqs=none"),
    ]
    for url in ok:
        with translate_redis_errors():
            assert connect_redis(url, timeout_s=3).ping()
    refused = [
        s.url("operator", tls=True),  # a private CA is not in the system store
        f"redis://outbox-operator:operator-{SECRET}@127.0.0.1:{s.tls_port}/0",  # no TLS
    ]
    for url in refused:
        with pytest.raises(UnavailableError) as caught, translate_redis_errors():
            connect_redis(url, timeout_s=2).ping()
        assert SECRET not in caught.value.message
    verify = connect_redis(refused[0], timeout_s=2)
    with pytest.raises(UnavailableError) as caught, translate_redis_errors():
        verify.ping()
    assert "CERTIFICATE_VERIFY_FAILED" in str(caught.value.__cause__)


# --- credentials in output ------------------------------------------------------------------

@pytest.fixture
def pg_secret_url() -> Iterator[str]:
    """A migrated PostgreSQL schema behind a URL carrying a password (trust auth ignores it)."""
    schema = f"t_{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG_ADMIN_URL)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    url = pg_schema_url(schema).replace("//postgres@", f"//postgres:pg-{SECRET}@")
    assert SECRET in url
    engine = db.make_engine(url)
    runs_schema.upgrade(engine)  # the demo app (a Runs) consumes here
    engine.dispose()
    try:
        yield url
    finally:
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


class Outputs:
    """CLI subprocesses started side by side; all their output is searched at the end."""

    def __init__(self, cwd: Path) -> None:
        self.cwd = cwd
        self.procs: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}

    def start(self, name: str, args: list[str], **env: str) -> None:
        base = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
        full = {**base, "PYTHONPATH": str(ROOT), **{f"OUTBOX_{k.upper()}": v
                                                    for k, v in env.items()}}
        folder = self.cwd / name.replace(" ", "-")
        folder.mkdir()
        with (folder / "output.txt").open("wb") as sink:
            proc = subprocess.Popen([sys.executable, "-m", "outbox_relay", *args], cwd=folder,
                                    env=full, stdout=sink, stderr=subprocess.STDOUT)
        self.procs[name] = (proc, folder)

    def wait(self, name: str) -> tuple[int, str]:
        proc, folder = self.procs[name]
        return proc.wait(timeout=120), (folder / "output.txt").read_text()

    def stop_when(self, name: str, marker: str) -> None:
        """SIGTERM a daemon once ``marker`` shows in its output (it must not exit before)."""
        proc, folder = self.procs[name]
        deadline = time.monotonic() + 60
        while marker not in (folder / "output.txt").read_text():
            assert proc.poll() is None, (folder / "output.txt").read_text()[-2000:]
            assert time.monotonic() < deadline, (folder / "output.txt").read_text()[-2000:]
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)

    def everything(self) -> dict[Path, str]:
        """Every file the processes wrote: their stdout/stderr and the demo's child logs."""
        return {f: f.read_text(errors="replace") for f in sorted(self.cwd.rglob("*"))
                if f.is_file() and f.suffix in (".txt", ".log")}


def run_inline(monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str],
               args: list[str], **env: str) -> tuple[int, str]:
    """``outbox <args>`` in this process (cheap), with only the given OUTBOX_* variables."""
    with monkeypatch.context() as m:
        for name in [k for k in os.environ if k.startswith("OUTBOX_")]:
            m.delenv(name)
        for name, value in env.items():
            m.setenv(f"OUTBOX_{name.upper()}", value)
        with warnings.catch_warnings():  # the CLI leaves its engine to process exit
            warnings.simplefilter("ignore", ResourceWarning)
            code = cli_main.main(args)
            gc.collect()
    out, err = capfd.readouterr()
    return code, out + err


@pytest.mark.acceptance
@pytest.mark.postgresql
@pytest.mark.slow  # every daemon, the demo and the CLI as subprocesses: tens of seconds
def test_secrets_never_reach_any_output(
    private_redis: PrivateRedis, pg_secret_url: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str],
) -> None:
    prefix = f"sec{uuid.uuid4().hex[:10]}"
    private_redis.load_roles(prefix)
    engine = db.make_engine(pg_secret_url)
    enqueue(engine, prefix, 3)  # something for the relay to fail to deliver
    engine.dispose()
    pg, r = pg_secret_url, private_redis
    unreachable = f"redis://outbox-relay:relay-{SECRET}@127.0.0.1:{free_port()}/0"
    no_db = pg.split("?")[0].rsplit("/", 1)[0] + "/no_such_database_xyz"
    daemon = {"key_prefix": prefix, "partitions": "2", "log_level": "DEBUG", "streams": "sec"}
    out = Outputs(tmp_path)  # the daemons and the demo, as subprocesses, side by side
    out.start("relay no db", ["relay", "--until-idle"], database_url=no_db,
              redis_url=unreachable, **daemon)
    consume = ["consume", "--app", DEMO_APP]
    out.start("consume no db", consume, database_url=no_db, redis_url=r.url("consumer"),
              **daemon)
    out.start("demo no db", ["demo", "--runs", "20"], database_url=no_db,
              redis_url=r.url("operator"), **daemon)
    out.start("relay retrying", ["relay"], database_url=pg, redis_url=unreachable, **daemon)
    out.start("consume retrying", consume, database_url=pg, redis_url=unreachable, **daemon)
    out.start("consume ok", consume, database_url=pg, redis_url=r.url("consumer"), **daemon)
    out.start("demo", ["demo", "--runs", "20"], redis_url=r.url("demo"))  # SQLite in its cwd

    texts: dict[str, str] = {}
    status_runs = {  # ``outbox status`` in this process meanwhile: (database, redis, exit code)
        "status ok": (pg, r.url("operator"), 0),
        "status no db": (no_db, r.url("operator"), 2),  # permanent: exit 2
        "status no redis": (pg, unreachable, 1),
        "status wrong password": (pg, r.url("operator", pw=f"x{SECRET}"), 2),
        "status refused by acl": (pg, r.url("relay"), 1),  # the relay may not SCAN
        "status bad redis url": (pg, f"redis://u:{SECRET}@127.0.0.1:notaport/0", 2),
        "status bad pg url": (no_db.replace(":5432/", ":notaport/"), unreachable, 2),
    }
    for name, (database_url, redis_url, expected) in status_runs.items():
        code, texts[name] = run_inline(monkeypatch, capfd, ["status"], database_url=database_url,
                                       redis_url=redis_url, **daemon)
        assert code == expected, (name, texts[name])
    assert "3 undelivered" in texts["status ok"]
    for name in ("relay no db", "consume no db", "demo no db"):
        code, text = out.wait(name)  # an unknown database is permanent: exit 2 at once
        assert code == 2 and "error unavailable: cannot connect to PostgreSQL" in text, (
            name, text[-1500:])
    out.stop_when("relay retrying", "retrying")
    out.stop_when("consume retrying", "retrying")
    out.stop_when("consume ok", "started")
    code, text = out.wait("demo")
    assert code == 0 and f"outbox-demo:***@127.0.0.1:{r.port}" in text, text[-1500:]

    files = out.everything()
    assert any(f.suffix == ".log" for f in files)  # the demo's relay and consumer logs
    texts |= {str(f.relative_to(tmp_path)): t for f, t in files.items()}
    everything = "\n".join(texts.values())
    assert "***" in everything and "error unavailable" in everything
    assert {name for name, t in texts.items() if SECRET in t} == set()
    assert {name for name, t in texts.items() if "Traceback" in t} == set()
