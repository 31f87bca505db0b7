"""Who may call the runs API (both databases): bearer tokens, callers that see only their own
runs, a rate on run creation, strict JSON, and ids that cannot be a run's.

Every test here fails on the API without authentication (issue 28, finding 1; issue 26,
finding 7): there, no token is 201/200, another caller's run is 200, and ``NaN``, ``1e999``
and ``a%00b`` are accepted or read as an outage.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import Engine, update

from outbox_relay.runs import auth
from outbox_relay.runs import pipeline as rs
from outbox_relay.runs.auth import CreateLimit, Tokens
from outbox_relay.runs.http import MAX_JSON_DEPTH, create_app
from outbox_relay.runs.prune import prune_terminal_runs
from outbox_relay.runs.schema import runs
from outbox_relay.runs.settings import RunsRetentionSettings, ServeSettings
from outbox_relay.runs.snapshot import Question
from outbox_relay.runs.store import RunStore
from outbox_relay.shared.errors import ConfigError
from tests.helpers import assert_error, call

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("runs_tables")]

ALICE = "alice-0123456789abcdef"
ALICE_NEW = "alice-rotated-fedcba9876543210"
BOB = "bob-0123456789abcdef0123"
OPS = "ops-0123456789abcdef0123"
TOKENS = f"alice:{ALICE},alice:{ALICE_NEW},bob:{BOB},ops:{OPS}"


def tokens() -> Tokens:
    return Tokens(auth.parse_tokens(TOKENS, "api_tokens"), admins=["ops"])


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def api(engine: Engine, **kwargs: Any) -> FastAPI:
    return create_app(engine, RunStore(), tokens=tokens(), **kwargs)


def create(app: FastAPI, token: str, run_id: str) -> httpx.Response:
    return call(app, "POST", "/runs", json={"request": {"n": 1}, "run_id": run_id},
                headers=bearer(token))


def test_no_or_bad_token_is_401_with_a_bearer_challenge(engine: Engine,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    app = api(engine)
    assert create(app, ALICE, "r1").status_code == 201
    with caplog.at_level(logging.DEBUG):
        for headers in ({}, bearer("not-a-token-of-ours-0000"), {"authorization": f"Basic {ALICE}"},
                        {"authorization": "Bearer"}):
            for method, url in (("POST", "/runs"), ("GET", "/runs/r1"),
                                ("POST", "/runs/r1/answers")):
                response = call(app, method, url, headers=headers, json={"request": {}})
                assert_error(response, 401, "unauthorized")
                assert response.headers["www-authenticate"].startswith('Bearer realm="outbox"')
    wrong = call(app, "GET", "/runs/r1", headers=bearer("not-a-token-of-ours-0000"))
    assert 'error="invalid_token"' in wrong.headers["www-authenticate"]
    assert "not-a-token-of-ours" not in caplog.text and ALICE not in caplog.text
    # Refused before the body is read: an unauthenticated caller cannot make us parse 1 MiB.
    huge = call(app, "POST", "/runs", content=b"[" * 1_000_000,
                headers={"content-type": "application/json"})
    assert_error(huge, 401, "unauthorized")
    # Liveness and the API's shape stay open.
    assert call(app, "GET", "/healthz").json() == {"status": "ok"}
    spec = call(app, "GET", "/openapi.json").json()
    assert "HTTPBearer" in spec["components"]["securitySchemes"]


def test_a_caller_sees_only_its_own_runs(engine: Engine) -> None:
    app = api(engine)
    assert create(app, ALICE, "mine").status_code == 201
    ask(engine, "mine")
    absent = call(app, "GET", "/runs/nobody-has-this", headers=bearer(BOB))
    assert_error(absent, 404, "not_found")
    # Bob: another caller's run is a run that does not exist, to the byte.
    hidden = call(app, "GET", "/runs/mine", headers=bearer(BOB))
    assert_error(hidden, 404, "not_found")
    assert hidden.json()["error"]["message"] == "run 'mine' does not exist"
    answer = {"interaction_id": "q1", "value": "yes"}
    steal = call(app, "POST", "/runs/mine/answers", json=answer,
                 headers={**bearer(BOB), "idempotency-key": "k1"})
    assert_error(steal, 404, "not_found")
    assert steal.json() == hidden.json()
    # Alice, with either of her tokens (rotation), and the admin see it and may answer.
    assert call(app, "GET", "/runs/mine", headers=bearer(ALICE_NEW)).json()["status"] == (
        rs.NEEDS_INPUT)
    assert call(app, "GET", "/runs/mine", headers=bearer(OPS)).status_code == 200
    answered = call(app, "POST", "/runs/mine/answers", json=answer,
                    headers={**bearer(ALICE), "idempotency-key": "k1"})
    assert answered.status_code == 200, answered.text
    # Bob's own run is his; the creator is recorded on the run.
    assert create(app, BOB, "his").status_code == 201
    assert call(app, "GET", "/runs/his", headers=bearer(ALICE)).status_code == 404
    with engine.connect() as conn:
        assert RunStore().get(conn, "his").created_by == "bob"
        assert RunStore().get(conn, "mine").created_by == "alice"


def test_tokens_are_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every configured token's digest goes through hmac.compare_digest, whichever matches (or
    none): no early exit, no ``==`` on the secret."""
    known = tokens()
    compared: list[tuple[bytes, bytes]] = []

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return a == b

    monkeypatch.setattr("hmac.compare_digest", spy)
    for presented, name in ((ALICE, "alice"), (OPS, "ops"), ("x" * 20, None)):
        compared.clear()
        caller = known.authenticate(presented.encode())
        assert (caller.name if caller else None) == name
        assert len(compared) == len(known) == 4
        assert all(len(a) == len(b) == 32 for a, b in compared)  # digests, not the tokens
    assert ALICE not in repr(known)


def test_token_settings_are_checked_without_echoing_tokens(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as short:
        auth.parse_tokens("alice:short-Secret9", "api_tokens")
    assert "short-Secret9" not in str(short.value) and "entry 1 (alice)" in str(short.value)
    with pytest.raises(ConfigError, match="given twice"):
        Tokens([("a", ALICE), ("b", ALICE)])
    with pytest.raises(ConfigError, match="without a token: root"):
        Tokens([("a", ALICE)], admins=["root"])
    file = tmp_path / "tokens"
    file.write_text(f"# the API's callers\nalice:{ALICE}\n\nbob:{BOB}\n")
    loaded = auth.load_tokens(ServeSettings(api_tokens_file=str(file), api_tokens=f"ops:{OPS}"))
    assert len(loaded) == 3
    assert all(auth.is_loopback(h) for h in ("127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"))
    assert auth.api_tokens(ServeSettings(host="127.0.0.1")) is None  # loopback, no tokens: off
    for host in ("0.0.0.0", "::", "10.1.2.3", "api.example.com"):
        with pytest.raises(ConfigError) as refused:
            auth.api_tokens(ServeSettings(host=host))
        assert refused.value.code == "api_tokens_required"
    with pytest.raises(ConfigError):
        auth.api_tokens(ServeSettings(host="127.0.0.1", api_auth=True))
    assert auth.api_tokens(ServeSettings(host="0.0.0.0", api_tokens=f"a:{ALICE}")) is not None


def test_serve_refuses_a_non_loopback_host_without_tokens(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "OUTBOX_DATABASE_URL": f"sqlite:///{tmp_path}/x.db"}
    proc = subprocess.run([sys.executable, "-m", "outbox_relay", "serve", "--host", "0.0.0.0"],
                          env=env, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error api_tokens_required: ")
    assert "Traceback" not in proc.stderr and not (tmp_path / "x.db").exists()


def test_run_creation_is_rate_limited_per_caller(engine: Engine) -> None:
    now = [1000.0]
    app = api(engine, create_limit=CreateLimit(0.5, 2, clock=lambda: now[0]))
    assert [create(app, ALICE, f"a{i}").status_code for i in range(2)] == [201, 201]
    limited = create(app, ALICE_NEW, "a2")  # the same caller, with its other token
    assert_error(limited, 429, "rate_limited")
    assert limited.headers["retry-after"] == "2"
    assert create(app, BOB, "b0").status_code == 201  # callers have buckets of their own
    now[0] += 2.0
    assert create(app, ALICE, "a2").status_code == 201
    assert_error(create(app, ALICE, "a3"), 429, "rate_limited")
    defaults = ServeSettings()
    assert (defaults.api_create_rate, defaults.api_create_burst) == (5.0, 20)


@pytest.mark.parametrize("body", [
    b'{"request": {"x": NaN}}', b'{"request": {"x": Infinity}}', b'{"request": {"x": -1e999}}',
    b'{"request": {"x": 1e999}}', b'{"request": {"x": 1' + b"0" * 5000 + b"}}",
    b'{"request": {"x": ' + b"[" * 20_000 + b"]" * 20_000 + b"}}",
    b'{"request": {"x": ' + b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH + b"}}",
    b'{"request": {"x": "\xff"}}',
])
def test_non_finite_numbers_and_deep_json_are_422(engine: Engine, body: bytes) -> None:
    app = create_app(engine, RunStore(), max_body_bytes=1 << 20)
    response = call(app, "POST", "/runs", content=body,
                    headers={"content-type": "application/json"})
    assert_error(response, 422, "invalid_request")
    assert response.json()["error"]["message"].startswith("the body is not valid JSON")
    with engine.connect() as conn:
        assert conn.execute(runs.select()).first() is None
    nested = b'{"request": {"x": ' + b"[" * 29 + b"1.5" + b"]" * 29 + b"}}"  # 31 levels: fine
    ok = call(app, "POST", "/runs", content=nested, headers={"content-type": "application/json"})
    assert ok.status_code == 201, ok.text


@pytest.mark.parametrize("path", ["/runs/a%00b", "/runs/a%0Ab", "/runs/" + "x" * 129,
                                  "/runs/a%C3%A9"])
def test_an_id_that_cannot_be_a_run_is_404_not_an_outage(
    engine: Engine, path: str, caplog: pytest.LogCaptureFixture
) -> None:
    app = create_app(engine, RunStore())
    with caplog.at_level(logging.WARNING):
        assert_error(call(app, "GET", path), 404, "not_found")
        answer = call(app, "POST", f"{path}/answers", json={"interaction_id": "q", "value": "v"},
                      headers={"idempotency-key": "k"})
        assert_error(answer, 404, "not_found")
    assert "unavailable" not in caplog.text


def test_terminal_runs_are_pruned_by_default(engine: Engine) -> None:
    window = RunsRetentionSettings().retention_runs
    assert window == 30 * 86400
    store = RunStore()
    with engine.begin() as conn:
        for run_id in ("old", "recent"):
            row = store.create(conn, run_id, {"request": {}})
            store.fail(conn, row, "stage_failed")
        conn.execute(update(runs).where(runs.c.id == "old").values(updated_at_ms=0))
    assert prune_terminal_runs(engine, window, batch=10) == (1, False)
    with engine.connect() as conn:
        assert [r.id for r in conn.execute(runs.select())] == ["recent"]


def ask(engine: Engine, run_id: str) -> None:
    """Drive a run to needs_input the way a worker would."""
    from outbox_relay.cli import demo_app as jobs

    store = RunStore(pipeline=jobs.PIPELINE)
    with engine.begin() as conn:
        row = store.get(conn, run_id)
        leased = store.lease_for_event(conn, run_id, row.revision, "w", ttl_ms=60_000).row
        assert leased is not None
        row = store.checkpoint(conn, leased, "w", {}, ttl_ms=60_000)
        store.checkpoint(conn, row, "w", {}, ttl_ms=60_000,
                         questions=[Question(interaction_id="q1", prompt="Dates right?")])
