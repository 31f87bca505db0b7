"""The console's HTTP API: ``/console/api/...`` on the app of ``outbox serve``.

Reads: ``GET letters`` (filters ``stream``, ``partition``, ``group``, ``reason``, ``type``,
``older_than``, ``newer_than``; paging ``limit`` and ``after``), ``GET letters/{id}``,
``GET backlog``, ``GET partitions``, ``GET groups``, ``GET actions`` (the action log, newest
first; ``before`` pages), ``GET actions/{seq}``, ``GET whoami``.
Mutations: ``POST letters/{id}/replay``, ``POST letters/{id}/purge``, and ``POST replay`` /
``POST purge`` with ``{"ids": [...]}`` or ``{"filter": {...}, "limit": N}`` (a filter that
narrows nothing is refused unless ``"all": true``, as ``outbox dlq purge`` refuses one without
``--all``).

Who may do what: the app's :class:`runs.http.Authenticate` has already found the caller (a
token is needed on every path whenever tokens are configured). Reads are open to any caller;
without tokens (loopback only) that is everyone on the machine, so **mutations always need a
configured token**: the anonymous caller gets 403 ``read_only``. Every error is the API's
``{"error": {"code", "message"}}`` (422 ``invalid_request`` for bad input, 404 ``not_found``);
Redis and database failures are 503 ``unavailable`` without their driver's text.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Query
from fastapi.responses import HTMLResponse
from pydantic import BaseModel, ConfigDict, Field

from outbox_relay.console import action_log, filters, letter_actions, overview, page
from outbox_relay.console.letter_actions import Letters
from outbox_relay.console.overview import StatusReport
from outbox_relay.consumer import dead_letters
from outbox_relay.consumer.dead_letters import DeadLetter
from outbox_relay.runs.auth import Caller
from outbox_relay.runs.http import StrictJsonRoute, current_caller
from outbox_relay.shared.db import now_ms
from outbox_relay.shared.errors import ForbiddenError, InvalidRequestError, NotFoundError

PREFIX = "/console"
PAGE_PATHS = frozenset({PREFIX, PREFIX + "/"})
"""The page: HTML and script, no data, so it loads without a token (its requests carry one)."""
MAX_PAGE = 500
MAX_ACTION = 1000

CallerDep = Annotated[Caller, Depends(current_caller)]


class FilterBody(BaseModel):
    """Which letters: every field narrows (see :class:`console.filters.Asked`)."""

    model_config = ConfigDict(extra="forbid")

    stream: str | None = Field(None, max_length=64)
    partition: int | None = Field(None, ge=0)
    group: str | None = Field(None, max_length=256)
    reason: str | None = Field(None, max_length=256)
    type: str | None = Field(None, max_length=256)
    older_than: str | None = Field(None, max_length=32, description="e.g. 90s, 15m, 7d")
    newer_than: str | None = Field(None, max_length=32)


class Selection(BaseModel):
    """Body of ``POST /console/api/replay`` and ``/purge``: ``ids`` or ``filter``."""

    model_config = ConfigDict(extra="forbid")

    ids: list[str] | None = Field(None, max_length=letter_actions.MAX_IDS)
    filter: FilterBody | None = None
    limit: int = Field(100, ge=1, le=MAX_ACTION, description="Letters a filter takes at most.")
    all: bool = Field(False, description="A filter that narrows nothing means every letter.")


def router(letters: Letters, status: StatusReport, *, can_mutate: bool) -> APIRouter:
    """The console's routes on ``letters`` (Redis, database, handlers per group) and the
    ``outbox status`` report; ``can_mutate`` is whether tokens are configured."""
    api = APIRouter(prefix=PREFIX, route_class=StrictJsonRoute, tags=["console"])

    @api.get("/", include_in_schema=False, response_class=HTMLResponse)
    def console_page() -> HTMLResponse:
        return page.response()

    @api.get("/api/whoami")
    def whoami(caller: CallerDep) -> dict[str, Any]:
        return {"caller": caller.name, "can_mutate": can_mutate and caller.name is not None,
                "replay_groups": sorted(letters.handlers)}

    _letter_routes(api, letters)
    _mutation_routes(api, letters, can_mutate)
    _overview_routes(api, letters, status)
    return api


def _letter_routes(api: APIRouter, letters: Letters) -> None:
    @api.get("/api/letters")
    def list_letters(
        caller: CallerDep,
        stream: str | None = None, partition: int | None = None, group: str | None = None,
        reason: str | None = None, type: str | None = None,
        older_than: str | None = None, newer_than: str | None = None,
        after: Annotated[str | None, Query(max_length=200)] = None,
        limit: int = 50,
    ) -> dict[str, Any]:
        chosen = filters.to_filter(filters.Asked(stream, partition, group, reason, type,
                                                 older_than, newer_than))
        found = dead_letters.find(letters.client, letters.prefix, chosen, now_ms=now_ms(),
                                  after=after, limit=filters.page_size(limit, MAX_PAGE))
        return {"letters": [_summary(x) for x in found.letters], "next_after": found.next_after,
                "scanned": found.scanned}

    @api.get("/api/letters/{letter_id}")
    def show_letter(letter_id: str, caller: CallerDep) -> dict[str, Any]:
        return _detail(dead_letters.show(letters.client, letters.prefix, _full_id(letter_id)))


def _mutation_routes(api: APIRouter, letters: Letters, can_mutate: bool) -> None:
    def mutator(caller: Caller) -> str:
        """The caller's name, for the log; the anonymous caller may not change anything."""
        if not can_mutate or caller.name is None:
            raise ForbiddenError("the console is read-only: replay and purge need an API token "
                                 "(OUTBOX_API_TOKENS, docs/operations.md#console)",
                                 code="read_only")
        return caller.name

    @api.post("/api/letters/{letter_id}/replay")
    def replay_letter(letter_id: str, caller: CallerDep) -> dict[str, Any]:
        return _one(letter_actions.by_ids(letters, mutator(caller), "replay",
                                          [_full_id(letter_id)]))

    @api.post("/api/letters/{letter_id}/purge")
    def purge_letter(letter_id: str, caller: CallerDep) -> dict[str, Any]:
        return _one(letter_actions.by_ids(letters, mutator(caller), "purge",
                                          [_full_id(letter_id)]))

    @api.post("/api/replay")
    def replay(body: Selection, caller: CallerDep) -> dict[str, Any]:
        return _selected(letters, mutator(caller), "replay", body)

    @api.post("/api/purge")
    def purge(body: Selection, caller: CallerDep) -> dict[str, Any]:
        return _selected(letters, mutator(caller), "purge", body)


def _overview_routes(api: APIRouter, letters: Letters, status: StatusReport) -> None:
    @api.get("/api/actions")
    def actions(caller: CallerDep, limit: int = 50,
                before: Annotated[int | None, Query(ge=1, le=2**62)] = None) -> dict[str, Any]:
        return {"actions": action_log.recent(letters.engine, limit=filters.page_size(
            limit, MAX_PAGE), before=before)}

    @api.get("/api/actions/{seq}")
    def action(seq: Annotated[int, Path(ge=1, le=2**62)], caller: CallerDep) -> dict[str, Any]:
        found = action_log.one(letters.engine, seq)
        if found is None:
            raise NotFoundError(f"no console action {seq}")
        return found

    @api.get("/api/backlog")
    def backlog(caller: CallerDep) -> dict[str, Any]:
        return overview.backlog(letters.engine)

    @api.get("/api/partitions")
    def partitions(caller: CallerDep) -> dict[str, Any]:
        return overview.partitions(status())

    @api.get("/api/groups")
    def groups(caller: CallerDep) -> dict[str, Any]:
        return overview.groups(status())


def _selected(letters: Letters, caller: str, action: str, body: Selection) -> dict[str, Any]:
    if (body.ids is None) == (body.filter is None):
        raise InvalidRequestError('give either "ids" or "filter"')
    if body.ids is not None:
        return letter_actions.by_ids(letters, caller, action, body.ids).to_json()
    assert body.filter is not None
    chosen = filters.to_filter(filters.Asked(**body.filter.model_dump()))
    if chosen.is_empty() and not body.all:
        raise InvalidRequestError(f"an empty filter would {action} every dead letter of every "
                                  'group: narrow it, or send "all": true')
    return letter_actions.by_filter(letters, caller, action, chosen,
                                    limit=body.limit).to_json()


def _one(done: letter_actions.Done) -> dict[str, Any]:
    """One letter's answer; a replay of a letter nobody knows is 404 (it is still logged)."""
    (result,) = done.outcomes
    if result.outcome == "not_found":
        raise NotFoundError(f"no dead letter {result.letter_id!r}: {result.detail}")
    return done.to_json()


def _full_id(letter_id: str) -> str:
    if dead_letters.parse_letter_id(letter_id)[0] is None:
        raise InvalidRequestError(f"{letter_id!r}: give the full id, stream:partition:id")
    return letter_id


def _summary(letter: DeadLetter) -> dict[str, Any]:
    """A list row: the record without the original fields (a payload may be 1 MiB)."""
    view = letter.to_json()
    fields = view.pop("fields")
    return {**view, "type": fields.get("type", ""), "written_at_ms": int(
        letter.dead_id.partition("-")[0])}


def _detail(letter: DeadLetter) -> dict[str, Any]:
    return {**_summary(letter), "fields": letter.to_json()["fields"]}

