"""The operator console's API on the real Redis and both databases (issue 26): dead letters the
real consumer wrote are listed with filters and pages, shown, replayed and purged over HTTP;
every mutation is in the action log with its caller, and repeating one changes nothing and says
so; reads need a token whenever tokens exist, mutations always do; bad input is a 4xx."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import redis
from fastapi import FastAPI
from sqlalchemy import Engine, func, select

from outbox_relay.cli import status
from outbox_relay.console import api as console_api
from outbox_relay.console.letter_actions import Letters
from outbox_relay.relay.daemon import Relay
from outbox_relay.runs import auth
from outbox_relay.runs.http import create_app
from outbox_relay.runs.store import RunStore
from outbox_relay.shared.schema import console_actions
from tests import console_kit
from tests.helpers import GROUP, assert_error, call, effect_counts, enqueue_events, relay_settings

pytestmark = pytest.mark.integration

ALICE = "alice-0123456789abcdef"
BOB = "bob-0123456789abcdef0123"


def bearer(token: str = ALICE) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


class Console:
    """The serve app with the console mounted, on this test's Redis prefix and database."""

    def __init__(self, engine: Engine, client: redis.Redis, prefix: str, *,
                 with_tokens: bool = True, replay_groups: tuple[str, ...] = (GROUP,)) -> None:
        tokens = auth.Tokens(auth.parse_tokens(f"alice:{ALICE},bob:{BOB}", "api_tokens"))
        letters = Letters(client, engine, prefix,
                          dict.fromkeys(replay_groups, console_kit.handlers))
        self.app: FastAPI = create_app(engine, RunStore(), tokens=tokens if with_tokens else None,
                                       open_paths=console_api.PAGE_PATHS)
        self.app.include_router(console_api.router(
            letters, lambda: status.collect(engine, client, prefix), can_mutate=with_tokens))
        self.engine = engine

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        return call(self.app, "GET", f"/console/api{path}", headers=bearer(), **kwargs)

    def post(self, path: str, token: str = ALICE, **kwargs: Any) -> httpx.Response:
        return call(self.app, "POST", f"/console/api{path}", headers=bearer(token), **kwargs)

    def letters(self, **params: Any) -> list[dict[str, Any]]:
        response = self.get("/letters", params=params)
        assert response.status_code == 200, response.text
        return list(response.json()["letters"])


@pytest.fixture
def made(engine: Engine, redis_client: redis.Redis, key_prefix: str) -> tuple[Console, list[str]]:
    ids = console_kit.make_letters(engine, redis_client, key_prefix)
    return Console(engine, redis_client, key_prefix), ids


def test_list_filter_page_and_show(made: tuple[Console, list[str]]) -> None:
    console, _ids = made
    everything = console.letters()
    assert sorted(x["reason"] for x in everything) == ["missing_field"] + ["unknown_type"] * 3
    assert all(x["group"] == GROUP and "fields" not in x for x in everything)
    assert len(console.letters(reason="unknown_type")) == 3
    assert len(console.letters(type=console_kit.LATE)) == 3
    assert [x["reason"] for x in console.letters(stream="runs", partition=0, reason="missing_field")
            ] == ["missing_field"]
    assert console.letters(group="nobody") == [] and console.letters(stream="other") == []
    assert console.letters(older_than="1h") == [] and len(console.letters(newer_than="1h")) == 4
    # Pages: two, then the rest from next_after, then nothing more.
    first = console.get("/letters", params={"limit": 2}).json()
    assert len(first["letters"]) == 2 and first["next_after"]
    rest = console.get("/letters", params={"limit": 2, "after": first["next_after"]}).json()
    assert [x["id"] for x in first["letters"] + rest["letters"]] == [x["id"] for x in everything]
    shown = console.get(f"/letters/{everything[0]['id']}")
    assert shown.status_code == 200 and shown.json()["id"] == everything[0]["id"]
    assert "fields" in shown.json()


@pytest.mark.parametrize(("path", "params", "code"), [
    ("/letters", {"partition": "-1"}, "invalid_request"),
    ("/letters", {"partition": "x"}, "invalid_request"),
    ("/letters", {"stream": "a:b"}, "invalid_request"),
    ("/letters", {"older_than": "soon"}, "invalid_request"),
    ("/letters", {"newer_than": "1e999"}, "invalid_request"),
    ("/letters", {"limit": "0"}, "invalid_request"),
    ("/letters", {"limit": "100000"}, "invalid_request"),
    ("/letters", {"after": "nonsense"}, "invalid_request"),
    ("/letters", {"type": "a\x00b"}, "invalid_request"),
    ("/letters/nonsense", {}, "invalid_request"),
    ("/letters/1-1", {}, "invalid_request"),
    ("/letters/runs:0:1-1", {}, "not_found"),
    ("/letters/a%00b:0:1-1", {}, "invalid_request"),
    ("/actions/0", {}, "invalid_request"),
    ("/actions/99999", {}, "not_found"),
    ("/actions", {"before": "x"}, "invalid_request"),
])
def test_bad_input_is_a_clear_4xx(made: tuple[Console, list[str]], path: str,
                                  params: dict[str, str], code: str) -> None:
    console, _ids = made
    assert_error(console.get(path, params=params), 404 if code == "not_found" else 422, code)


def test_replay_one_is_recorded_and_repeating_it_changes_nothing(
        made: tuple[Console, list[str]]) -> None:
    console, ids = made
    letter = next(x for x in console.letters(type=console_kit.LATE)
                  if console.get(f"/letters/{x['id']}").json()["fields"]["id"] == ids[0])
    done = console.post(f"/letters/{letter['id']}/replay")
    assert done.status_code == 200, done.text
    body = done.json()
    assert body["action"] == "replay" and body["changed"] == 1
    assert body["results"] == [{"id": letter["id"], "outcome": "applied", "detail": "",
                                "changed": True}]
    assert effect_counts(console.engine)[ids[0]] == 1
    assert letter["id"] not in {x["id"] for x in console.letters()}

    again = console.post(f"/letters/{letter['id']}/replay", token=BOB)
    assert again.status_code == 200
    (result,) = again.json()["results"]
    assert result["outcome"] == "already_replayed" and not result["changed"]
    assert f"action {body['seq']} of alice" in result["detail"]
    assert effect_counts(console.engine)[ids[0]] == 1  # never a second application

    log = console.get("/actions").json()["actions"]
    assert [(a["caller"], a["action"], a["target"], a["matched"], a["changed"]) for a in log] == [
        ("bob", "replay", {"ids": [letter["id"]]}, 0, 0),
        ("alice", "replay", {"ids": [letter["id"]]}, 1, 1)]
    assert all(a["finished_at_ms"] >= a["at_ms"] for a in log)
    one = console.get(f"/actions/{body['seq']}").json()
    assert one["letters"] == [{"id": letter["id"], "outcome": "applied", "detail": ""}]


def test_replay_and_purge_by_filter_and_by_id(made: tuple[Console, list[str]]) -> None:
    console, ids = made
    assert_error(console.post("/replay", json={"filter": {}}), 422, "invalid_request")
    assert_error(console.post("/purge", json={}), 422, "invalid_request")
    assert_error(console.post("/purge", json={"ids": ["x"], "filter": {"group": "g"}}), 422,
                 "invalid_request")
    assert_error(console.post("/purge", json={"filter": {"stream": "{x}"}}), 422,
                 "invalid_request")
    assert_error(call(console.app, "POST", "/console/api/replay",
                      content=b'{"filter": {"reason": "x"}, "limit": 1e999}',
                      headers={**bearer(), "content-type": "application/json"}),
                 422, "invalid_request")
    replayed = console.post("/replay", json={"filter": {"type": console_kit.LATE}}).json()
    assert (replayed["matched"], replayed["changed"], replayed["more"]) == (3, 3, False)
    assert {r["outcome"] for r in replayed["results"]} == {"applied"}
    assert [effect_counts(console.engine)[i] for i in ids] == [1, 1, 1]
    # The same filter again: nothing matches any more, nothing is applied twice.
    again = console.post("/replay", json={"filter": {"type": console_kit.LATE}}).json()
    assert (again["matched"], again["changed"]) == (0, 0)
    # The missing_field letter cannot be replayed (it stays), then is purged.
    (broken,) = console.letters()
    stays = console.post(f"/letters/{broken['id']}/replay").json()["results"]
    assert stays[0]["outcome"] == "invalid" and not stays[0]["changed"]
    purged = console.post("/purge", json={"filter": {"reason": "missing_field"}}).json()
    assert [(r["id"], r["outcome"]) for r in purged["results"]] == [(broken["id"], "purged")]
    assert console.letters() == []
    gone = console.post(f"/letters/{broken['id']}/purge").json()["results"]
    assert gone[0]["outcome"] == "already_purged" and not gone[0]["changed"]
    # Letters nobody ever saw: a purge holds already (200), a replay cannot say it applied (404).
    never = console.post("/purge", json={"ids": ["runs:1:1-1"]}).json()["results"]
    assert never[0]["outcome"] == "already_gone"
    assert_error(console.post("/letters/runs:1:1-1/replay"), 404, "not_found")
    with console.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(console_actions)).scalar_one() == 7


def test_a_group_without_handlers_is_skipped_and_everything_can_go(
        engine: Engine, redis_client: redis.Redis, key_prefix: str) -> None:
    console_kit.make_letters(engine, redis_client, key_prefix, aggregates=("b1",))
    console = Console(engine, redis_client, key_prefix, replay_groups=())
    skipped = console.post("/replay", json={"filter": {"group": GROUP}}).json()["results"]
    assert {r["outcome"] for r in skipped} == {"skipped"}
    assert "OUTBOX_CONSOLE_APPS" in skipped[0]["detail"]
    assert len(console.letters()) == 2
    everything = console.post("/purge", json={"filter": {}, "all": True}).json()
    assert everything["changed"] == 2 and console.letters() == []


def test_who_may_read_and_who_may_change(engine: Engine, redis_client: redis.Redis,
                                        key_prefix: str) -> None:
    console_kit.make_letters(engine, redis_client, key_prefix, aggregates=("c1",))
    console = Console(engine, redis_client, key_prefix)
    page = call(console.app, "GET", "/console/")  # the page holds no data: open
    assert page.status_code == 200 and "<title>outbox console</title>" in page.text
    assert "script-src 'sha256-" in page.headers["content-security-policy"]
    for method, path in (("GET", "/letters"), ("GET", "/backlog"), ("GET", "/actions"),
                         ("POST", "/purge"), ("POST", "/letters/runs:0:1-1/replay")):
        for headers in ({}, bearer("not-a-token-of-ours-0000")):
            assert_error(call(console.app, method, f"/console/api{path}", headers=headers,
                              json={"filter": {}, "all": True}), 401, "unauthorized")
    assert console.get("/whoami").json()["caller"] == "alice"
    assert len(console.letters()) == 2

    # Loopback without tokens: anyone on the machine reads; nobody changes anything.
    open_console = Console(engine, redis_client, key_prefix, with_tokens=False)
    anonymous = call(open_console.app, "GET", "/console/api/letters")
    assert anonymous.status_code == 200 and len(anonymous.json()["letters"]) == 2
    who = call(open_console.app, "GET", "/console/api/whoami").json()
    assert who == {"caller": None, "can_mutate": False, "replay_groups": [GROUP]}
    letter_id = anonymous.json()["letters"][0]["id"]
    for path, body in ((f"/letters/{letter_id}/replay", None), (f"/letters/{letter_id}/purge",
                       None), ("/purge", {"filter": {}, "all": True}),
                       ("/replay", {"ids": [letter_id]})):
        assert_error(call(open_console.app, "POST", f"/console/api{path}", json=body), 403,
                     "read_only")
    assert len(console.letters()) == 2
    with engine.connect() as conn:  # refused before anything was recorded or done
        assert conn.execute(select(func.count()).select_from(console_actions)).scalar_one() == 0


def test_backlog_partitions_and_groups(made: tuple[Console, list[str]], key_prefix: str,
                                       redis_client: redis.Redis) -> None:
    console, _ids = made
    enqueue_events(console.engine, 1)
    backlog = console.get("/backlog").json()
    assert backlog["undelivered"] == 1 and backlog["oldest_undelivered_age_s"] >= 0
    assert [(p["stream"], p["undelivered"]) for p in backlog["partitions"]] == [("runs", 1)]
    groups = console.get("/groups").json()
    assert [(g["group"], g["pending"], g["lag"]) for g in groups["groups"]] == [(GROUP, 0, 0)]
    assert {s["stream"] for s in groups["partition_streams"]} == {"runs"}
    assert sum(s["dead_letters"] for s in groups["streams"]) == 4
    assert console.get("/partitions").json()["relay"] == []  # no relay ran yet
    Relay(relay_settings(key_prefix), console.engine, redis_client).run(until_idle=True)
    relay = console.get("/partitions").json()["relay"]
    assert sorted(r["partition"] for r in relay) == [0, 1, 2, 3]
    assert all(r["epoch"] >= 1 for r in relay)  # taken, then released when the relay stopped
    assert console.get("/backlog").json()["undelivered"] == 0
