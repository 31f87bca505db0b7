"""The HTTP API of the run store (FastAPI): create runs, read them, answer their questions.

* ``POST /runs`` ``{"request": {...}}`` → 201 and the run's snapshot (the run and its
  ``run.created`` event commit together);
* ``GET /runs/{id}`` → the snapshot;
* ``POST /runs/{id}/answers`` with an ``Idempotency-Key`` header and
  ``{"interaction_id", "value"}`` → the snapshot; a replay with the same key and answer returns
  the current snapshot with ``Idempotent-Replayed: true`` and writes nothing.

Only snapshots leave the service. Every error is ``{"error": {"code", "message"}}``: 401
``unauthorized`` (with ``WWW-Authenticate: Bearer``), 403 ``read_only`` (the console's
mutations without tokens), 404 ``not_found``/``unknown_interaction``,
409 ``conflict``/``already_answered``/``idempotency_conflict``, 413 ``payload_too_large``, 422
``invalid_request`` (bad input, JSON that does not parse, nests deeper than
:data:`MAX_JSON_DEPTH` or holds a non-finite number such as ``NaN`` or ``1e999``), 429
``rate_limited`` (with ``Retry-After``), 503 ``unavailable``, 500 ``internal``; never a stack
trace or a driver message.

Order of the checks: the caller's token (:mod:`runs.auth`; before the body is read), the body's
size (``max_body_bytes``, before it is parsed), its JSON, its shape, the caller's rate, then the
store. A run another caller created answers exactly as a run that does not exist (404): a
caller learns nothing of other callers' runs, not even that they exist. An id that cannot be a
run's (``RUN_ID``; a NUL byte, say) is such a run too, and never reaches the database.
Open without a token: ``/healthz``, ``/openapi.json`` and ``/docs`` (the API's shape, no data).
"""

from __future__ import annotations

import json
import logging
import math
import re
import uuid
from collections.abc import Callable, Coroutine, Iterable
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header, Request, Response, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import Connection, Engine
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from outbox_relay.runs.auth import ANONYMOUS, Caller, CreateLimit, Tokens
from outbox_relay.runs.errors import (
    IdempotencyConflictError,
    InvalidTransitionError,
    RateLimitedError,
    UnauthorizedError,
)
from outbox_relay.runs.snapshot import RunSnapshot
from outbox_relay.runs.store import RunRow, RunStore
from outbox_relay.shared.db_errors import translate_errors
from outbox_relay.shared.errors import (
    CannotConnectError,
    ConflictError,
    ForbiddenError,
    InvalidRequestError,
    NotFoundError,
    OutboxError,
    UnavailableError,
)

log = logging.getLogger(__name__)

RUN_ID = r"^[A-Za-z0-9_.:\-]{1,128}$"
_RUN_ID = re.compile(r"[A-Za-z0-9_.:\-]{1,128}")
MAX_JSON_DEPTH = 32
"""Deepest nesting of a request body (``{"request": {...}}`` is 2); deeper is 422."""
OPEN_PATHS = frozenset({"/healthz", "/openapi.json", "/docs", "/docs/oauth2-redirect"})
"""Paths answered without a token: liveness and the API's shape, no data."""
CALLER = "outbox.caller"
"""The scope key under which :class:`Authenticate` leaves the request's :class:`Caller`."""


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
    (UnauthorizedError, 401),
    (ForbiddenError, 403),
    (RateLimitedError, 429),
    (NotFoundError, 404),
    (IdempotencyConflictError, 409),
    (ConflictError, 409),
    (InvalidTransitionError, 409),
    (InvalidRequestError, 422),
    (UnavailableError, 503),
    (CannotConnectError, 503),
]
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody} for code in (401, 403, 404, 409, 413, 422, 429, 503)
}
_BEARER = HTTPBearer(auto_error=False, description="A token of OUTBOX_API_TOKENS (not needed "
                     "on a loopback API without tokens).")


def error(status: int, code: str, message: str) -> JSONResponse:
    """The one error shape."""
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status)


def create_app(engine: Engine, store: RunStore, *, max_body_bytes: int = 65_536,
               tokens: Tokens | None = None, create_limit: CreateLimit | None = None,
               open_paths: Iterable[str] = ()) -> FastAPI:
    """The API on ``engine``; each request is one short transaction. With ``tokens`` every
    request but :data:`OPEN_PATHS` (and ``open_paths``: a page that holds no data, such as the
    console's) needs one, and a caller sees only its own runs (admins all); ``create_limit``
    bounds each caller's ``POST /runs``."""
    app = FastAPI(title="outbox runs", version="1", responses=_ERRORS)
    app.router.route_class = StrictJsonRoute
    limit = create_limit or CreateLimit(0, 1)

    def run_of(conn: Connection, run_id: str, caller: Caller, *,
               for_update: bool = False) -> RunRow:
        """The run if ``caller`` may see it; else, as for a run that does not exist, 404."""
        absent = NotFoundError(f"run {run_id!r} does not exist")
        if not _RUN_ID.fullmatch(run_id):  # no such run can exist; keep it from the database
            raise absent
        row = store.get(conn, run_id, for_update=for_update)
        if not caller.sees(row.created_by):
            raise absent
        return row

    @app.get("/healthz", include_in_schema=False)
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/runs", status_code=201, response_model=RunSnapshot)
    def create_run(body: CreateRun, caller: Annotated[Caller, Depends(current_caller)]
                   ) -> RunSnapshot:
        wait = limit.take(caller.name)
        if wait > 0:
            raise RateLimitedError("too many runs created; try again later", retry_after_s=wait)
        run_id = body.run_id or str(uuid.uuid4())
        with translate_errors(), engine.begin() as conn:
            row = store.create(conn, run_id, {"request": body.request}, created_by=caller.name)
        return store.snapshot(row)

    @app.get("/runs/{run_id}", response_model=RunSnapshot)
    def get_run(run_id: str, caller: Annotated[Caller, Depends(current_caller)]) -> RunSnapshot:
        with translate_errors(), engine.connect() as conn:
            return store.snapshot(run_of(conn, run_id, caller))

    @app.post("/runs/{run_id}/answers", response_model=RunSnapshot)
    def answer(
        run_id: str,
        body: Answer,
        response: Response,
        idempotency_key: Annotated[str, Header(min_length=1, max_length=128)],
        caller: Annotated[Caller, Depends(current_caller)],
    ) -> RunSnapshot:
        with translate_errors(), engine.begin() as conn:
            run_of(conn, run_id, caller, for_update=True)
            result = store.submit_answer(conn, run_id, body.interaction_id, body.value,
                                         idempotency_key)
        if result.replayed:
            response.headers["Idempotent-Replayed"] = "true"
        return store.snapshot(result.row)

    _install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.add_middleware(Authenticate, tokens=tokens,  # outermost: before the body is read
                       open_paths=OPEN_PATHS | frozenset(open_paths))
    return app


def current_caller(
    request: Request,
    _token: Annotated[HTTPAuthorizationCredentials | None, Security(_BEARER)],
) -> Caller:
    """The caller :class:`Authenticate` found (``_token`` only documents the scheme)."""
    caller = request.scope.get(CALLER)
    if not isinstance(caller, Caller):  # a route outside the middleware: refuse, never guess
        raise UnauthorizedError("a valid bearer token is required")
    return caller


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OutboxError)
    async def outbox_error(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, OutboxError)
        status = next((s for kind, s in _STATUS if isinstance(exc, kind)), 500)
        if status == 401:
            return _unauthorized(presented=False)
        if status == 429 and isinstance(exc, RateLimitedError):
            response = error(status, exc.code, exc.message)
            response.headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
            return response
        if status == 500:
            log.warning("request failed: %s", exc.code)
        if status == 503:  # which host, file or user failed is for the operator's log only
            log.warning("request failed: %s", exc.message)
            return error(status, exc.code, "the service's database or Redis is unavailable")
        return error(status, exc.code, exc.message)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        for problem in exc.errors():
            if problem.get("type") == "json_invalid":
                reason = problem.get("ctx", {}).get("error", "JSON decode error")
                return error(422, "invalid_request", f"the body is not valid JSON: {reason}")
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


class Authenticate:
    """ASGI middleware: the request's :class:`Caller` from its bearer token, or 401.

    Without ``tokens`` every request is :data:`ANONYMOUS`. The token is never logged; a
    refusal is logged at DEBUG with the client's address only (a flood of bad tokens must not
    flood the log)."""

    def __init__(self, app: ASGIApp, tokens: Tokens | None,
                 open_paths: frozenset[str] = OPEN_PATHS) -> None:
        self.app, self.tokens, self.open_paths = app, tokens, open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.tokens is None:
            scope[CALLER] = ANONYMOUS
        elif scope["path"] not in self.open_paths:
            presented = _bearer_token(scope["headers"])
            caller = None if presented is None else self.tokens.authenticate(presented)
            if caller is None:
                log.debug("refused a request without a valid token from %s",
                          (scope.get("client") or ("?",))[0])
                await _unauthorized(presented is not None)(scope, receive, send)
                return
            scope[CALLER] = caller
        await self.app(scope, receive, send)


def _bearer_token(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The token of the first ``Authorization: Bearer <token>`` header, if any."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            token = token.strip()
            return token if scheme.lower() == b"bearer" and token else None
    return None


def _unauthorized(presented: bool) -> JSONResponse:
    response = error(401, "unauthorized", "a valid bearer token is required "
                     "(Authorization: Bearer <token>)")
    challenge = 'Bearer realm="outbox"' + (', error="invalid_token"' if presented else "")
    response.headers["WWW-Authenticate"] = challenge
    return response


class _NotJson(ValueError):
    pass


def parse_json(body: bytes) -> Any:
    """The body as JSON, strictly: a non-finite number (``NaN``, ``Infinity``, or one too large
    for a double such as ``1e999``), nesting deeper than :data:`MAX_JSON_DEPTH`, an over-long
    integer or invalid UTF-8 raise :class:`json.JSONDecodeError` (FastAPI's 422 path)."""
    try:
        value = json.loads(body, parse_float=_finite, parse_constant=_constant)
    except json.JSONDecodeError:
        raise
    except _NotJson as err:
        raise json.JSONDecodeError(str(err), "", 0) from None
    except (ValueError, RecursionError):  # bad UTF-8, a 5,000-digit integer, absurd nesting
        raise json.JSONDecodeError(f"not JSON, or nested deeper than {MAX_JSON_DEPTH} levels",
                                   "", 0) from None
    if _depth(value) > MAX_JSON_DEPTH:
        raise json.JSONDecodeError(f"nested deeper than {MAX_JSON_DEPTH} levels", "", 0)
    return value


def _finite(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):
        raise _NotJson("a number too large for a double (such as 1e999)")
    return number


def _constant(text: str) -> Any:
    raise _NotJson(f"{text} is not a JSON number")


def _depth(value: Any) -> int:
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(
            item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if deepest > MAX_JSON_DEPTH:
            break
        todo.extend((child, depth + 1) for child in children)
    return deepest


class _StrictJsonRequest(Request):
    async def json(self) -> Any:
        return parse_json(await self.body())


class StrictJsonRoute(APIRoute):
    """Routes whose JSON bodies are read by :func:`parse_json`."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict(request: Request) -> Response:
            return await handler(_StrictJsonRequest(request.scope, request.receive))

        return strict
