"""The HTTP app in process (both databases): limits and error shapes a live server rarely hits."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy import Engine

from outbox_relay.runs.http import create_app
from outbox_relay.runs.store import RunStore
from outbox_relay.shared import db
from tests.helpers import assert_error, call

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("runs_tables")]


async def chunks(size: int) -> AsyncIterator[bytes]:
    yield b'{"request": {"cv": "'
    for _ in range(size // 100):
        yield b"x" * 100
    yield b'"}}'


def test_streamed_body_over_the_limit_is_refused(engine: Engine) -> None:
    app = create_app(engine, RunStore(), max_body_bytes=1024)
    json_type = {"content-type": "application/json"}
    small = call(app, "POST", "/runs", content=chunks(200), headers=json_type)
    assert small.status_code == 201
    big = call(app, "POST", "/runs", content=chunks(5_000), headers=json_type)
    assert "content-length" not in big.request.headers
    assert_error(big, 413, "payload_too_large")


def test_database_down_is_503_without_driver_text(tmp_path: Path) -> None:
    broken = db.make_engine(f"sqlite:///{tmp_path}/missing/dir/x.db")
    response = call(create_app(broken, RunStore()), "GET", "/runs/r1")
    assert_error(response, 503, "unavailable")
    assert "sqlite" not in response.text.lower() and str(tmp_path) not in response.text


def test_unexpected_error_is_500_without_trace(engine: Engine) -> None:
    class Exploding(RunStore):
        def get(self, *args: object, **kwargs: object) -> object:  # type: ignore[override]
            raise RuntimeError("secret internals")

    response = call(create_app(engine, Exploding()), "GET", "/runs/r1")
    assert_error(response, 500, "internal")
    assert "secret" not in response.text


def test_openapi_documents_the_error_shape(engine: Engine) -> None:
    spec = call(create_app(engine, RunStore()), "GET", "/openapi.json").json()
    answers = spec["paths"]["/runs/{run_id}/answers"]["post"]
    assert {"404", "409", "422", "503"} <= set(answers["responses"])
    assert any(p["name"].lower() == "idempotency-key" for p in answers["parameters"])
