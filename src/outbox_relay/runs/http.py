"""The HTTP API of the run store (FastAPI): create runs, read them, answer their questions.

* ``POST /runs`` ``{"request": {...}}`` → 201 and the run's snapshot (the run and its
  ``run.created`` event commit together);
* ``GET /runs/{id}`` → the snapshot;
* ``POST /runs/{id}/answers`` with an ``Idempotency-Key`` header and
  ``{"interaction_id", "value"}`` → the snapshot; a replay with the same key and answer returns
  the current snapshot with ``Idempotent-Replayed: true`` and writes nothing.

Only snapshots leave the service. Every error is ``{"error": {"code", "message"}}``: 404
``not_found``/``unknown_interaction``, 409 ``conflict``/``already_answered``/
``idempotency_conflict``, 413 ``payload_too_large``, 422 for invalid input, 503
``unavailable``, 500 ``internal``; never a stack trace or a driver message. Request bodies
larger than ``max_body_bytes`` are refused before they are parsed. OpenAPI: ``/openapi.json``.
"""

from __future__ import annotations

import logging
import uuid
from typing import Annotated, Any

from fastapi import FastAPI, Header, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import Engine
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from outbox_relay.runs.snapshot import RunSnapshot
from outbox_relay.runs.store import RunStore
from outbox_relay.shared.db import translate_errors
from outbox_relay.shared.errors import (
    CannotConnectError,
    ConflictError,
    IdempotencyConflictError,
    InvalidRequestError,
    InvalidTransitionError,
    NotFoundError,
    OutboxError,
    UnavailableError,
)

log = logging.getLogger(__name__)

RUN_ID = r"^[A-Za-z0-9_.:\-]{1,128}$"


class CreateRun(BaseModel):
    """Body of ``POST /runs``."""

    model_config = ConfigDict(extra="forbid")

    request: dict[str, Any] = Field(default_factory=dict, description="The run's input.")
    run_id: str | None = Field(None, pattern=RUN_ID, description="Optional id (default: UUID).")


class Answer(BaseModel):
    """Body of ``POST /runs/{id}/answers``."""

    model_config = ConfigDict(extra="forbid")

    interaction_id: str = Field(min_length=1, max_length=128)
    value: str = Field(max_length=10_000)


class ErrorDetail(BaseModel):
    """A reason code and a message for people."""

    code: str
    message: str


class ErrorBody(BaseModel):
    """Every error response."""

    error: ErrorDetail


_STATUS: list[tuple[type[OutboxError], int]] = [
    (NotFoundError, 404),
    (IdempotencyConflictError, 409),
    (ConflictError, 409),
    (InvalidTransitionError, 409),
    (InvalidRequestError, 422),
    (UnavailableError, 503),
    (CannotConnectError, 503),
]
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody} for code in (404, 409, 413, 422, 503)
}


def error(status: int, code: str, message: str) -> JSONResponse:
    """The one error shape."""
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status)


def create_app(engine: Engine, store: RunStore, *, max_body_bytes: int = 65_536) -> FastAPI:
    """The API on ``engine``; each request is one short transaction."""
    app = FastAPI(title="outbox runs", version="1", responses=_ERRORS)

    @app.post("/runs", status_code=201, response_model=RunSnapshot)
    def create_run(body: CreateRun) -> RunSnapshot:
        run_id = body.run_id or str(uuid.uuid4())
        with translate_errors(), engine.begin() as conn:
            row = store.create(conn, run_id, {"request": body.request})
        return store.snapshot(row)

    @app.get("/runs/{run_id}", response_model=RunSnapshot)
    def get_run(run_id: str) -> RunSnapshot:
        with translate_errors(), engine.connect() as conn:
            return store.snapshot(store.get(conn, run_id))

    @app.post("/runs/{run_id}/answers", response_model=RunSnapshot)
    def answer(
        run_id: str,
        body: Answer,
        response: Response,
        idempotency_key: Annotated[str, Header(min_length=1, max_length=128)],
    ) -> RunSnapshot:
        with translate_errors(), engine.begin() as conn:
            result = store.submit_answer(conn, run_id, body.interaction_id, body.value,
                                         idempotency_key)
        if result.replayed:
            response.headers["Idempotent-Replayed"] = "true"
        return store.snapshot(result.row)

    _install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OutboxError)
    async def outbox_error(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, OutboxError)
        status = next((s for kind, s in _STATUS if isinstance(exc, kind)), 500)
        if status == 500:
            log.warning("request failed: %s", exc.code)
        if status == 503:  # which host, file or user failed is for the operator's log only
            log.warning("request failed: %s", exc.message)
            return error(status, exc.code, "the service's database or Redis is unavailable")
        return error(status, exc.code, exc.message)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        where = sorted({".".join(str(p) for p in e.get("loc", ())) for e in exc.errors()})
        return error(422, "invalid_request", f"invalid input at: {', '.join(where)}")

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        code = {404: "not_found", 405: "method_not_allowed",
                413: "payload_too_large"}.get(exc.status_code, "http_error")
        return error(exc.status_code, code, str(exc.detail))

    @app.exception_handler(Exception)
    async def internal(_request: Request, exc: Exception) -> JSONResponse:
        log.error("unexpected %s", type(exc).__name__)
        log.debug("unexpected error", exc_info=exc)
        return error(500, "internal", "internal error")


class BodyLimit:
    """ASGI middleware refusing bodies over ``max_bytes`` (by Content-Length, or while read)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await self._refuse(scope, receive, send)
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:  # FastAPI passes HTTPException through to our handler
                raise HTTPException(413, f"the request body is larger than {self.max_bytes} bytes")
            return message

        await self.app(scope, limited, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error(413, "payload_too_large",
                         f"the request body is larger than {self.max_bytes} bytes")
        await response(scope, receive, send)
