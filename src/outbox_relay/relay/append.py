"""The relay's append to Redis: the batch append script, its verdicts, the barrier.

The relay's other Redis commands: the fence every writing script starts with
(:mod:`relay.fence`, which also runs them), broker-loss repair (:mod:`relay.repair_streams`)
and the trim script (:data:`relay.trim.SCRIPT`, run fenced).

``append`` sends one partition's batch as one server-side script call per stream key
(:data:`SCRIPT`, run with ``EVALSHA``; several keys go in one pipeline). The script first
checks the stream's fence (:data:`relay.fence.PRELUDE`: a relay whose lease epoch is below the
fence cannot append at all), then appends the entries in order and stops at the first one Redis
refuses: a batch lands as a **prefix** per stream, so a later row never overtakes an earlier
refused one (the rows after the refusal wait, pending, and go out behind it in a later batch).
Every row comes back sorted into ``delivered`` (Redis holds it under its id: just added, or
already there from an earlier attempt of the same batch), ``gaps`` (its id fell behind the
stream's top and the entry is not there: it is republished at the top), ``failed`` (refused,
with our error code) or ``not_appended`` (after the stop; known not to be there).

A connection error or timeout raises :class:`UnavailableError`: the outcome is unknown, nothing
may be marked, and the retry with the same ids is what tells the cases apart (an entry that
landed comes back "already", never twice). Moving the argument packing into one JSON argument
decoded by Redis also takes redis-py's per-``XADD`` command building off the relay's CPU.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime
from json.encoder import encode_basestring
from typing import Any

import redis

from outbox_relay.relay import entry_ids, fence
from outbox_relay.relay.outgoing import OutboxRow
from outbox_relay.shared import keys, tracing
from outbox_relay.shared.envelope import JSON_CONTENT_TYPE, SPECVERSION, encode_fields
from outbox_relay.shared.errors import OutboxError, StreamBehindError, UnavailableError
from outbox_relay.shared.redis_conn import is_cluster, node_of, translate_redis_errors
from outbox_relay.shared.signing import Signer

log = logging.getLogger(__name__)

# KEYS: stream, fence key. ARGV: epoch, JSON [[entry id, [field, value, ...] (, 1: check
# only)], ...], maxlen (0: none), floor (the newest id the outbox knows this stream holds, ''
# when unknown: a stream whose last generated id is below it lost data, and nothing may be
# appended above the hole before repair refills it, or consumers would read newer events
# before older ones: BEHIND <top>), the stream's appended channel (shared/keys.py: one
# PUBLISH when anything was added, so idle consumers read at once; its failure is ignored).
# Reply: {stream top behind a gap or '', one status per entry}. Each refused XADD is
# checked with XRANGE id id: the same event already there (an earlier attempt of this batch
# landed) is "already"; otherwise the script stops appending, and checks each remaining entry
# the same way so none that landed before is re-taken under a new id (it would land twice).
_BODY = """
local entries = cjson.decode(ARGV[2])
local maxlen = ARGV[3]
local function present(entry)
  local found = redis.pcall('XRANGE', KEYS[1], entry[1], entry[1])
  if type(found) ~= 'table' or found.err or #found == 0 then return false end
  local stored, fields = found[1][2], entry[2]
  local wanted
  for i = 1, #fields, 2 do
    if fields[i] == 'id' then wanted = fields[i + 1] end
  end
  for i = 1, #stored, 2 do
    if stored[i] == 'id' then return stored[i + 1] == wanted end
  end
  return false
end
local function top()
  local info = redis.pcall('XINFO', 'STREAM', KEYS[1])
  if type(info) ~= 'table' or info.err then return '' end
  for i = 1, #info, 2 do
    if info[i] == 'last-generated-id' then return info[i + 1] end
  end
  return ''
end
local function older(a, b)
  local am, as = string.match(a, '^(%d+)-(%d+)$')
  local bm, bs = string.match(b, '^(%d+)-(%d+)$')
  am, as, bm, bs = tonumber(am), tonumber(as), tonumber(bm), tonumber(bs)
  return am < bm or (am == bm and as < bs)
end
local floor = ARGV[4]
if floor ~= nil and floor ~= '' then
  local now_top = top()
  if now_top == '' then now_top = '0-0' end
  if older(now_top, floor) then
    return redis.error_reply('BEHIND ' .. now_top)
  end
end
local out = {''}
local stopped = false
local rang = false
for i, entry in ipairs(entries) do
  local status
  if entry[3] then stopped = true end  -- check only: never appended, found if it landed
  if stopped then
    status = present(entry) and 'already' or 'not_appended'
  else
    local added
    if maxlen == '0' then
      added = redis.pcall('XADD', KEYS[1], entry[1], unpack(entry[2]))
    else
      added = redis.pcall('XADD', KEYS[1], 'MAXLEN', '~', maxlen, entry[1], unpack(entry[2]))
    end
    if type(added) ~= 'table' or not added.err then
      status = 'added'
    elseif present(entry) then
      status = 'already'
    else
      stopped = true
      if string.find(added.err, 'equal or smaller than the target stream top item', 1, true) then
        status = 'gap'
        out[1] = top()
      else
        status = 'failed:' .. added.err
      end
    end
  end
  out[i + 1] = status
  if status == 'added' then rang = true end
end
if rang and ARGV[5] and ARGV[5] ~= '' then redis.pcall('PUBLISH', ARGV[5], '1') end
return out
"""
SCRIPT = fence.PRELUDE + _BODY
SCRIPT_SHA = hashlib.sha1(SCRIPT.encode()).hexdigest()


@dataclass
class Verdicts:
    """What Redis said about each row of a batch."""

    delivered: list[tuple[int, str]] = field(default_factory=list)
    already: int = 0
    gaps: list[int] = field(default_factory=list)
    failed: list[tuple[int, str]] = field(default_factory=list)
    not_appended: list[int] = field(default_factory=list)  # behind a stop in their stream
    stream_top: str | None = None  # highest last-generated id seen behind a gap

    @property
    def complete(self) -> bool:
        """Whether every row is in its stream (no gap, refusal or row left behind a stop)."""
        return not (self.gaps or self.failed or self.not_appended)


def to_fields(row: OutboxRow, signer: Signer | None = None) -> dict[str, str]:
    """The CloudEvents fields of a row, by the one encoder (:func:`shared.envelope.encode_fields`).

    Built directly from the row instead of through the pydantic model, which cost more than
    the ``XADD`` itself. The payload is stored as compact JSON text by the producer and goes
    out as it is (the model would parse and re-serialize it to the same text); a row that is
    not valid JSON reaches consumers, which dead-letter it with ``bad_json``. With a
    ``signer`` (``OUTBOX_SIGNING_KEY``) the fields end with their ``signature``
    (shared/signing.py).
    """
    traceparent, tracestate = _trace_headers(row)
    fields = encode_fields(
        event_id=row.event_id,
        source=row.source,
        type=row.type,
        time=datetime.fromtimestamp(row.created_at_ms / 1000, tz=UTC),
        data_json=row.payload,
        subject=row.aggregate_id,
        aggregatetype=row.aggregate_type,
        aggregateid=row.aggregate_id,
        revision=row.revision,
        traceparent=traceparent,
        tracestate=tracestate,
    )
    return fields if signer is None else signer.signed(fields)


def _trace_headers(row: OutboxRow) -> tuple[Any, Any]:
    """The row's ``traceparent`` and ``tracestate`` headers (``None`` when absent)."""
    traceparent = tracestate = None
    if row.headers and row.headers != "{}":
        headers = json.loads(row.headers)
        traceparent = headers.get("traceparent")
        if traceparent is not None:
            tracestate = headers.get("tracestate") or None
    return traceparent, tracestate


# The script argument is a JSON array of ``[entry id, [field, value, ...]]``, one per row, in
# :func:`to_fields`'s field order. :func:`entry_json` writes a row's element directly: building
# the fields dict (a ``datetime`` and its ``isoformat`` per row), flattening it and letting
# ``json.dumps`` escape the constant field names again took the append thread about 40 % of its
# time. ``encode_basestring`` is the escaper ``json.dumps(..., ensure_ascii=False)`` itself
# calls for every string, so the text is byte for byte the one ``json.dumps`` wrote (a unit
# test compares the two, tests/unit/test_entry_json.py). The constant parts are escaped once.
_HEAD = ",[" + ",".join(encode_basestring(x) for x in ("specversion", SPECVERSION, "id"))
_TYPE = "," + encode_basestring("type") + ","
_TIME = "," + encode_basestring("time") + ","
_DATA = "," + ",".join(encode_basestring(x) for x in (
    "datacontenttype", JSON_CONTENT_TYPE, "data")) + ","
_SOURCE = "," + encode_basestring("source") + ","
_SUBJECT = "," + encode_basestring("subject") + ","
_AGGTYPE = "," + encode_basestring("aggregatetype") + ","
_AGGID = "," + encode_basestring("aggregateid") + ","
_REVISION = "," + encode_basestring("revision") + ","
_TRACEPARENT = "," + encode_basestring("traceparent") + ","
_TRACESTATE = "," + encode_basestring("tracestate") + ","
# ``datetime.fromtimestamp(ms / 1000)`` is exact to the microsecond (the float's error stays
# below half a microsecond) while ``ms / 1000 < 2**33``; :func:`_time_text` takes ms below
# 2**32 s (year 2106) and at or above 0, and leaves any other value to :func:`to_fields`.
_EXACT_MS = 2**32 * 1000
_second_text: tuple[int, str] = (-1, "")  # the last second formatted (one tuple: thread-safe)


def _time_text(ms: int) -> str:
    """The quoted RFC 3339 ``time`` of epoch ``ms`` as :func:`to_fields` writes it
    (``isoformat``: microseconds, none when zero; ``Z``), the seconds formatted once per
    distinct second (a batch's rows mostly share a few)."""
    global _second_text
    second, frac = divmod(ms, 1000)
    cached = _second_text
    if cached[0] != second:
        text = datetime.fromtimestamp(second, tz=UTC).isoformat()[:19]  # to the seconds
        cached = _second_text = (second, text)
    return f'"{cached[1]}.{frac:03d}000Z"' if frac else f'"{cached[1]}Z"'


def entry_json(row: OutboxRow) -> str:
    """The JSON text of a row's ``[entry id, [field, value, ...]]`` in the script argument:
    exactly ``json.dumps([row.entry_id, <to_fields(row) flattened>], ensure_ascii=False,
    separators=(",", ":"))``. Rows whose values are all strings (the revision an int) and
    whose time is in :data:`_EXACT_MS` take the direct path; any other goes through
    :func:`to_fields` and ``json.dumps``, so the two never differ."""
    ms, agg_type, agg_id, revision = (
        row.created_at_ms, row.aggregate_type, row.aggregate_id, row.revision)
    traceparent, tracestate = _trace_headers(row)
    if not (type(ms) is int and 0 <= ms < _EXACT_MS
            and type(row.entry_id) is str and type(row.event_id) is str
            and type(row.source) is str and type(row.type) is str
            and type(row.payload) is str
            and (agg_type is None or type(agg_type) is str)
            and (agg_id is None or type(agg_id) is str)
            and (revision is None or type(revision) is int)
            and (traceparent is None or type(traceparent) is str)
            and (tracestate is None or type(tracestate) is str)):
        flat = [x for kv in to_fields(row).items() for x in kv]
        return json.dumps([row.entry_id, flat], ensure_ascii=False, separators=(",", ":"))
    text = (f"[{encode_basestring(row.entry_id)}{_HEAD},{encode_basestring(row.event_id)}"
            f"{_SOURCE}{encode_basestring(row.source)}{_TYPE}{encode_basestring(row.type)}"
            f"{_TIME}{_time_text(ms)}{_DATA}{encode_basestring(row.payload)}")
    if agg_id is not None:
        subject = encode_basestring(agg_id)
        text += _SUBJECT + subject
    if agg_type is not None:
        text += _AGGTYPE + encode_basestring(agg_type)
    if agg_id is not None:
        text += _AGGID + subject
    if revision is not None:
        text += f'{_REVISION}"{revision}"'
    if traceparent is not None:
        text += _TRACEPARENT + encode_basestring(traceparent)
    if tracestate is not None:
        text += _TRACESTATE + encode_basestring(tracestate)
    return text + "]]"


def batch_json(rows: list[OutboxRow], signer: Signer | None = None) -> str:
    """The script's entries argument: ``json.dumps`` of ``[[entry id, [field, value, ...]],
    ...]`` (``ensure_ascii=False``, compact), written by :func:`entry_json` row by row; with a
    ``signer``, from :func:`to_fields` (signed) and ``json.dumps``. A ``check_only`` row
    (:func:`relay.outgoing.recorded_rows`) gets a third element, ``1``: the script appends
    nothing from it on in its stream and only reports which of those entries are there."""
    if signer is not None:
        return json.dumps([[r.entry_id, [x for kv in to_fields(r, signer).items() for x in kv],
                            *([1] if r.check_only else [])]
                           for r in rows], ensure_ascii=False, separators=(",", ":"))
    return "[" + ",".join([entry_json(r)[:-1] + ",1]" if r.check_only else entry_json(r)
                           for r in rows]) + "]"


def append(
    client: redis.Redis,
    prefix: str,
    rows: list[OutboxRow],
    epoch: int,
    maxlen: int = 0,
    floors: dict[str, str] | None = None,
    signer: Signer | None = None,
) -> Verdicts:
    """Append a partition's batch (rows in id order) with :data:`SCRIPT`, one call per stream
    key, under the fence of lease ``epoch``; classify every row.

    ``floors`` maps a stream key to the newest entry id this relay knows the stream holds
    (delivered and marked, or seen by the repair check); it is raised here to the ids that
    land. Raises :class:`LeaseLostError` when a stream's fence is above ``epoch`` (nothing of
    that stream was written), :class:`StreamBehindError` when a stream's last id is below its
    floor (Redis lost data: nothing was written; repair first) and :class:`UnavailableError`
    when the outcome is unknown.
    """
    (outcome,) = append_many(client, prefix, [(rows, epoch)], maxlen, floors, signer)
    if isinstance(outcome, OutboxError):
        raise outcome
    return outcome


def append_many(
    client: redis.Redis,
    prefix: str,
    batches: list[tuple[list[OutboxRow], int]],
    maxlen: int = 0,
    floors: dict[str, str] | None = None,
    signer: Signer | None = None,
) -> list[Verdicts | OutboxError]:
    """:func:`append` of several partitions' batches ``(rows, epoch)`` with one Redis round
    trip: every stream's call in one pipeline (on a cluster, one call after the other).

    Why: a relay round at a trickle appends a few rows to each of several partitions; one
    ``EVALSHA`` round trip after the other was a quarter of the round (bench/PERFORMANCE.md,
    issue 24). Each batch's outcome, in order: its :class:`Verdicts`, or the error
    :func:`append` raises for it (the others' outcomes stand: partitions are independent).
    An outcome Redis never told (the connection lost) raises :class:`UnavailableError` for
    all of them. Each batch has its own ``outbox publish`` span."""
    floors = {} if floors is None else floors
    plans: list[dict[str, list[OutboxRow]]] = []
    calls: list[tuple[Any, ...]] = []
    for rows, epoch in batches:
        subs: dict[str, list[OutboxRow]] = {}
        for row in rows:
            subs.setdefault(keys.stream_key(prefix, row.stream, row.partition), []).append(row)
        plans.append(subs)
        calls += [_call_args(prefix, sub, epoch, maxlen, floors.get(key, ""), signer)
                  for key, sub in subs.items()]
    outcomes: list[Verdicts | OutboxError] = []
    traced = [i for i, (rows, _epoch) in enumerate(batches) if rows]
    with tracing.publish_spans([(list(plans[i]), (r.headers for r in batches[i][0]),
                                 len(batches[i][0])) for i in traced]) as spans:
        with translate_redis_errors():
            answers = _run(client, calls) if calls else []
        span_of = dict(zip(traced, spans, strict=True))
        for i, subs in enumerate(plans):
            chunk, answers = answers[:len(subs)], answers[len(subs):]
            outcome = _classify_batch(subs, chunk, floors)
            if isinstance(outcome, OutboxError):
                tracing.failed(span_of.get(i), outcome)
            outcomes.append(outcome)
    return outcomes


def _classify_batch(
    subs: dict[str, list[OutboxRow]], answers: list[Any], floors: dict[str, str]
) -> Verdicts | OutboxError:
    """One batch's verdicts from its streams' answers (raising its floors), or its error."""
    verdicts = Verdicts()
    try:
        with translate_redis_errors():
            for (key, sub), answer in zip(subs.items(), answers, strict=True):
                newest = _classify(sub, answer, verdicts)
                if newest is not None:
                    _raise_floor(floors, key, newest)
    except OutboxError as err:
        return err
    return verdicts


def _raise_floor(floors: dict[str, str], key: str, newest: str) -> None:
    """Raise ``floors[key]`` to ``newest``, an id Redis now holds, unless it is above it."""
    if key not in floors or entry_ids.greater(newest, floors[key]):
        floors[key] = newest


def _call_args(
    prefix: str, sub: list[OutboxRow], epoch: int, maxlen: int, floor: str,
    signer: Signer | None = None,
) -> tuple[Any, ...]:
    first = sub[0]
    return (
        keys.stream_key(prefix, first.stream, first.partition),
        keys.fence_key(prefix, first.stream, first.partition),
        epoch,
        batch_json(sub, signer),
        maxlen,
        floor,
        keys.appended_channel(keys.stream_key(prefix, first.stream, first.partition)),
    )


def _run(client: redis.Redis, calls: list[tuple[Any, ...]]) -> list[Any]:
    """``EVALSHA`` each call (one pipeline); load the script where Redis does not have it.

    On Redis Cluster the calls go one by one: redis-py's cluster pipeline refuses scripts, and
    each call (one partition stream and its fence, one slot) is routed to its slot's master.
    """
    if len(calls) == 1 or is_cluster(client):
        answers: list[Any] = [_evalsha(client, args) for args in calls]
    else:
        pipe = client.pipeline(transaction=False)
        for args in calls:
            pipe.evalsha(SCRIPT_SHA, 2, *args)
        answers = pipe.execute(raise_on_error=False)
    for i, answer in enumerate(answers):
        if isinstance(answer, redis.exceptions.NoScriptError):
            client.script_load(SCRIPT)
            answers[i] = _evalsha(client, calls[i])
    return answers


def _evalsha(client: redis.Redis, args: tuple[Any, ...]) -> Any:
    """One call; a refusal of the whole call, or its connection lost, comes back as a value
    (one stream's outcome: on a cluster the calls of a round go to several masters, and the
    ones answered stand, :func:`append_many`)."""
    try:
        return client.evalsha(SCRIPT_SHA, 2, *args)
    except (redis.ResponseError, redis.ConnectionError, redis.TimeoutError) as err:
        return err


def _classify(sub: list[OutboxRow], answer: Any, verdicts: Verdicts) -> str | None:
    """Add one stream's rows to ``verdicts`` by the script's answer; return the newest id of
    them Redis holds (None: none). ``sub`` is in id order (:func:`append`), so that is the
    last row held: no id is parsed."""
    if isinstance(answer, Exception):
        _refused_call(sub, answer, verdicts)
        return None
    newest: str | None = None
    top, *statuses = (a.decode() if isinstance(a, bytes) else str(a) for a in answer)
    for row, status in zip(sub, statuses, strict=True):
        if status in ("added", "already"):
            verdicts.delivered.append((row.seq, row.entry_id))
            verdicts.already += status == "already"
            newest = row.entry_id
        elif status == "not_appended":
            verdicts.not_appended.append(row.seq)
        elif status == "gap":
            log.warning("ordering gap: event %s republished at the stream top", row.event_id,
                        extra=_fields_of(row))
            verdicts.gaps.append(row.seq)
            if top and (verdicts.stream_top is None or entry_ids.greater(top, verdicts.stream_top)):
                verdicts.stream_top = top
        else:
            code = error_code(status.removeprefix("failed:"))
            # DEBUG: the stream's backoff logs one WARNING per change (relay/refusals.py)
            log.debug("append of event %s failed: %s", row.event_id, code,
                        extra={**_fields_of(row), "error": code})
            verdicts.failed.append((row.seq, code))
    return newest


def _fields_of(row: OutboxRow) -> dict[str, object]:
    """Structured log fields of a row (shared/logs.py)."""
    return {"event_id": row.event_id, "event_type": row.type, "stream": row.stream,
            "partition": row.partition}


def _refused_call(sub: list[OutboxRow], err: Exception, verdicts: Verdicts) -> None:
    """Redis refused the whole script call (before it ran: ACL on EVALSHA, BUSY, LOADING …).

    A fresh batch was never sent before, so none of its rows is in Redis: the first is failed
    and the rest wait. A retried batch may have landed in an earlier attempt: only the retry by
    id can tell, so the outcome is unknown (:class:`UnavailableError`).
    """
    if isinstance(err, redis.ResponseError):
        lost = fence.fenced_out(err)
        if lost is not None:
            raise lost
        if str(err).startswith("BEHIND"):
            key = keys.stream_key("", sub[0].stream, sub[0].partition).lstrip(":")
            raise StreamBehindError(f"stream {key} lost entries (its last id is "
                                    f"{str(err)[7:]}); it is repaired before anything is appended")
    if isinstance(err, redis.ConnectionError | redis.TimeoutError):
        raise err
    code = error_code(err)
    if any(r.retry for r in sub):
        raise UnavailableError(f"Redis refused the append of a retried batch ({code})")
    log.debug("append of %d events refused: %s", len(sub), code,
                extra={**_fields_of(sub[0]), "error": code, "count": len(sub)})
    verdicts.failed.append((sub[0].seq, code))
    verdicts.not_appended.extend(r.seq for r in sub[1:])


def error_code(answer: object) -> str:
    """Our code for a Redis refusal (an exception, or an error text from the script)."""
    # redis-py strips the prefix of the errors it has a class for ("OOM", "NOPERM", ...)
    if isinstance(answer, redis.exceptions.NoPermissionError):
        return "redis_acl"
    if isinstance(answer, redis.exceptions.OutOfMemoryError):
        return "redis_oom"
    if isinstance(answer, redis.exceptions.ReadOnlyError | redis.exceptions.BusyLoadingError):
        return "redis_not_ready"
    text = str(answer)
    if text.startswith("OOM"):
        return "redis_oom"
    if text.startswith(("NOPERM", "NOAUTH")) or "no permissions" in text:
        return "redis_acl"
    if text.startswith("WRONGTYPE"):
        return "redis_wrongtype"
    if text.startswith(("READONLY", "MASTERDOWN", "LOADING", "BUSY")):
        return "redis_not_ready"
    return "redis_error"


def durability_barrier(
    client: redis.Redis, replicas: int, timeout_ms: int, aof: bool, written: list[str]
) -> bool:
    """``WAIT`` / ``WAITAOF`` before marking; False when fewer copies than asked confirmed.

    ``written``: the stream keys the batch wrote. On Redis Cluster the barrier goes to the
    master of each (a master confirms only the writes it took); elsewhere to the one server.
    """
    with translate_redis_errors():
        nodes = {id(node): node for node in (node_of(client, key) for key in written)}
        for node in nodes.values() or [None]:
            target = {} if node is None else {"target_nodes": node}
            if replicas > 0 and int(client.execute_command(  # type: ignore[no-untyped-call]
                    "WAIT", replicas, timeout_ms, **target)) < replicas:
                return False
            if aof:
                reply = client.execute_command(  # type: ignore[no-untyped-call]
                    "WAITAOF", 1, replicas, timeout_ms, **target)
                if int(reply[0]) < 1:
                    return False
    return True
