"""``outbox dlq list | show | replay`` as a user runs them (the CLI as a subprocess).

Dead letters are made by a consumer that has no handler for ``run.created``; the replay then
uses the demo app, which has one, so the letters go through the claim path and are applied.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import redis
from sqlalchemy import select

from outbox_relay.consumer import Handlers
from outbox_relay.consumer.daemon import Consumer
from outbox_relay.runs import schema as runs_schema
from outbox_relay.shared import db, keys
from outbox_relay.shared.schema import inbox
from outbox_relay.shared.settings import ConsumerSettings
from tests.conftest import REDIS_URL
from tests.helpers import ROOT

pytestmark = pytest.mark.acceptance

GROUP = "cli-g"
DEMO_APP = "outbox_relay.cli.demo_app:handlers"


def event(kind: str = "run.created") -> dict[bytes, bytes]:
    return {b"specversion": b"1.0", b"id": f"r-{uuid.uuid4()}:{kind}:1".encode(),
            b"source": b"test", b"type": kind.encode(), b"time": b"2024-05-01T12:00:00Z",
            b"data": b"null"}


@pytest.fixture
def env(tmp_path: Path, key_prefix: str, redis_client: redis.Redis) -> dict[str, str]:
    database_url = f"sqlite:///{tmp_path}/cli.db"
    runs_schema.upgrade(db.make_engine(database_url))  # replays go to the demo app (runs)
    return {**os.environ, "OUTBOX_DATABASE_URL": database_url, "OUTBOX_REDIS_URL": REDIS_URL,
            "OUTBOX_KEY_PREFIX": key_prefix, "OUTBOX_PARTITIONS": "2", "OUTBOX_GROUP": GROUP,
            "OUTBOX_STREAMS": "runs"}


def outbox(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "outbox_relay", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


def make_dead_letters(env: dict[str, str], client: redis.Redis) -> list[bytes]:
    """Two unknown-type letters (partitions 0 and 1) and one that never parses."""
    prefix = env["OUTBOX_KEY_PREFIX"]
    ids = [client.xadd(keys.stream_key(prefix, "runs", 0), event()),  # type: ignore[arg-type]
           client.xadd(keys.stream_key(prefix, "runs", 1), event()),  # type: ignore[arg-type]
           client.xadd(keys.stream_key(prefix, "runs", 1), {b"type": b"\xff"})]
    settings = ConsumerSettings(database_url=env["OUTBOX_DATABASE_URL"], key_prefix=prefix,
                                partitions=2, group=GROUP, consumer="c", block_ms=1,
                                streams=env["OUTBOX_STREAMS"])
    engine = db.make_engine(settings.database_url)
    Consumer(settings, engine, client, Handlers()).run_once(block_ms=1)
    engine.dispose()
    return ids


def test_list_show_replay(env: dict[str, str], redis_client: redis.Redis) -> None:
    make_dead_letters(env, redis_client)
    table = outbox(env, "dlq", "list")
    assert table.returncode == 0, table.stderr
    assert table.stdout.count("unknown_type") == 2 and "bad_encoding" in table.stdout
    listed = json.loads(outbox(env, "dlq", "list", "--json").stdout)
    # Per partition, unparsable entries are lettered before the claim, dead outcomes after it.
    assert [x["reason"] for x in listed] == ["unknown_type", "bad_encoding", "unknown_type"]
    listed = [listed[0], listed[2], listed[1]]  # unknown (p0), unknown (p1), unparsable (p1)
    assert listed[2]["fields"] == {"type": "\\xff"}
    only = json.loads(outbox(env, "dlq", "list", "--stream", "runs", "--partition", "0",
                             "--json").stdout)
    assert [x["id"] for x in only] == [listed[0]["id"]]
    assert outbox(env, "dlq", "list", "--partition", "0").returncode == 2

    shown = outbox(env, "dlq", "show", listed[0]["id"])
    assert shown.returncode == 0
    assert "unknown_type" in shown.stdout and "run.created" in shown.stdout
    assert json.loads(outbox(env, "dlq", "show", listed[1]["id"], "--json").stdout) == listed[1]
    missing = outbox(env, "dlq", "show", "runs:0:1-1")
    assert missing.returncode == 1 and "error not_found" in missing.stderr

    one = outbox(env, "dlq", "replay", listed[0]["id"], "--app", DEMO_APP)
    assert one.returncode == 0, one.stdout + one.stderr
    assert "applied" in one.stdout and "1 replayed" in one.stdout
    again = outbox(env, "dlq", "replay", listed[0]["id"], "--app", DEMO_APP)
    assert again.returncode == 1 and "error not_found" in again.stderr

    rest = outbox(env, "dlq", "replay", "--all", "--app", DEMO_APP, "--json")
    assert rest.returncode == 1  # the unparsable letter stays
    outcomes = {r["letter_id"]: (r["outcome"], r["removed"]) for r in json.loads(rest.stdout)}
    assert outcomes == {listed[1]["id"]: ("applied", True),
                        listed[2]["id"]: ("invalid", False)}
    left = json.loads(outbox(env, "dlq", "list", "--json").stdout)
    assert [x["id"] for x in left] == [listed[2]["id"]]
    engine = db.make_engine(env["OUTBOX_DATABASE_URL"])
    with engine.connect() as conn:
        receipts = sorted(conn.execute(select(inbox.c.outcome)).scalars())
    engine.dispose()
    assert receipts == ["applied", "applied"]


def test_replay_needs_an_id_or_all(env: dict[str, str]) -> None:
    result = outbox(env, "dlq", "replay")
    assert result.returncode == 2 and "--all" in result.stderr
    assert outbox(env, "dlq", "replay", "x:0:1-1", "--all").returncode == 2


def test_replay_all_without_a_group_lists_the_groups_that_have_letters(
    env: dict[str, str], redis_client: redis.Redis
) -> None:
    make_dead_letters(env, redis_client)
    no_group = {k: v for k, v in env.items() if k != "OUTBOX_GROUP"}
    result = outbox(no_group, "dlq", "replay", "--all", "--app", DEMO_APP)
    assert result.returncode == 2
    assert result.stderr.strip() == ("error invalid_config: replay --all needs --group (or "
                                     f"OUTBOX_GROUP): letters by group: {GROUP}: 3")
    assert len(json.loads(outbox(env, "dlq", "list", "--json").stdout)) == 3  # untouched


def test_purge_by_age_group_and_dry_run(env: dict[str, str], redis_client: redis.Redis) -> None:
    make_dead_letters(env, redis_client)
    assert "0 dead letter(s) deleted" in outbox(env, "dlq", "purge", "--older-than", "1h").stdout
    assert "0 dead letter(s) deleted" in outbox(env, "dlq", "purge", "--group", "other").stdout
    dry = outbox(env, "dlq", "purge", "--dry-run")
    assert dry.returncode == 0 and "3 dead letter(s) would be deleted" in dry.stdout
    assert len(json.loads(outbox(env, "dlq", "list", "--json").stdout)) == 3
    one = outbox(env, "dlq", "purge", "--stream", "runs", "--partition", "0")
    assert "1 dead letter(s) deleted" in one.stdout
    rest = outbox(env, "dlq", "purge", "--group", GROUP)
    assert "2 dead letter(s) deleted" in rest.stdout
    assert json.loads(outbox(env, "dlq", "list", "--json").stdout) == []
    bad = outbox(env, "dlq", "purge", "--older-than", "soon")
    assert bad.returncode == 2 and bad.stderr.startswith("error invalid_config: --older-than")


def test_purge_without_a_filter_needs_all(env: dict[str, str], redis_client: redis.Redis) -> None:
    make_dead_letters(env, redis_client)
    for flags in ([], ["--older-than", "0"], ["--older-than", "off"]):
        refused = outbox(env, "dlq", "purge", *flags)  # OUTBOX_GROUP is set: not a filter
        assert refused.returncode == 2, refused.stdout
        assert refused.stderr.startswith(
            "error invalid_config: purge with no filter would delete every dead letter of "
            "every group for good"), refused.stderr
        assert "--all" in refused.stderr and refused.stdout == ""
    assert len(json.loads(outbox(env, "dlq", "list", "--json").stdout)) == 3  # untouched
    everything = outbox(env, "dlq", "purge", "--all")
    assert everything.returncode == 0 and "3 dead letter(s) deleted" in everything.stdout
    assert json.loads(outbox(env, "dlq", "list", "--json").stdout) == []


def test_show_cuts_long_fields_unless_full(env: dict[str, str], redis_client: redis.Redis) -> None:
    prefix = env["OUTBOX_KEY_PREFIX"]
    big = event()
    big[b"data"] = b'"' + b"x" * 10_000 + b'"'
    redis_client.xadd(keys.stream_key(prefix, "runs", 0), big)  # type: ignore[arg-type]
    settings = ConsumerSettings(database_url=env["OUTBOX_DATABASE_URL"], key_prefix=prefix,
                                partitions=2, group=GROUP, consumer="c", block_ms=1,
                                streams=env["OUTBOX_STREAMS"])
    engine = db.make_engine(settings.database_url)
    Consumer(settings, engine, redis_client, Handlers()).run_once(block_ms=1)
    engine.dispose()
    [letter] = json.loads(outbox(env, "dlq", "list", "--json").stdout)
    cut = outbox(env, "dlq", "show", letter["id"])
    assert "more characters; --full shows all" in cut.stdout and len(cut.stdout) < 5_000
    full = outbox(env, "dlq", "show", letter["id"], "--full")
    assert "x" * 10_000 in full.stdout
