"""The Redis side of broker-loss repair: fenced scripts that refill or rebuild one stream.

Every write is a Lua script that starts with :data:`relay.fence.PRELUDE` on the stream's fence
key, so a relay whose lease was taken over (the new owner raised the fence) changes nothing,
and the check is atomic with the write. Each script does bounded work:

* :func:`refill` appends a chunk of entries above the stream top under their ids, in order,
  stopping at the first refusal;
* a **rebuild** never touches the live stream until its last step. :func:`begin_rebuild`
  records the stream's state (``XINFO STREAM``: exists, length, last-generated-id,
  entries-added, max-deleted-entry-id) and empties the temporary key ``<stream>:rebuild`` (same
  hash tag, same cluster slot); :func:`add_to_rebuild` fills it in chunks; :func:`swap` then,
  in one script: refuses if the stream's state changed since :func:`begin_rebuild` (anything
  appended, deleted or trimmed meanwhile: the next check starts over), sets the top and
  ``entries-added`` (never lower than before), re-creates every consumer group with its
  last-delivered id and entries-read, its consumers and its whole pending entries list
  (``XCLAIM … FORCE`` keeps each entry's consumer, idle time and delivery count), and
  ``RENAME`` s the temporary key over the stream.

A group that had already read past an entry the rebuild restores is rewound to just before the
first restored entry (entries-read then unknown): otherwise the group would never be given the
restored entries, a silent loss; re-reading the entries after it is absorbed by the inboxes.

The swap copies the whole pending lists in one script (paged ``XPENDING`` inside it), because
the swap must be atomic with them: a pending list copied earlier could miss an entry delivered
meanwhile. Its cost grows with the entries pending, not with the stream's length.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from outbox_relay.relay import entry_ids, fence
from outbox_relay.shared.redis_conn import translate_redis_errors

Fields = Sequence[bytes | str]


@dataclass(frozen=True)
class Entry:
    """One entry of a (re)built stream; ``restored`` when the stream did not hold it."""

    id: str
    fields: Fields
    restored: bool


@dataclass(frozen=True)
class StreamState:
    """What Redis says about one partition stream (all zero when the key is missing)."""

    exists: bool
    length: int = 0
    top: str = entry_ids.ZERO
    entries_added: int = 0
    max_deleted: str = entry_ids.ZERO

    def signature(self) -> str:
        """The state as the scripts spell it; the swap compares it whole."""
        return " ".join(
            [str(int(self.exists)), str(self.length), self.top, str(self.entries_added),
             self.max_deleted]
        )

    @classmethod
    def parse(cls, text: str) -> StreamState:
        """Inverse of :meth:`signature`."""
        exists, length, top, added, max_deleted = text.split(" ")
        return cls(exists == "1", int(length), top, int(added), max_deleted)


_STATE = """
local function state(key)
  if redis.call('EXISTS', key) == 0 then return '0 0 0-0 0 0-0' end
  local info = redis.call('XINFO', 'STREAM', key)
  local s = {}
  for i = 1, #info, 2 do s[info[i]] = info[i + 1] end
  return table.concat({'1', tostring(s['length']), s['last-generated-id'],
    tostring(s['entries-added']), s['max-deleted-entry-id']}, ' ')
end
"""

# ARGV[2..]: per entry its id, the number n of field/value strings, then those n strings.
_ADD_ENTRIES = """
local function add_entries(key, stop_at_refusal)
  local i, landed = 2, 0
  while i <= #ARGV do
    local n = tonumber(ARGV[i + 1])
    local args = {'XADD', key, ARGV[i]}
    for j = i + 2, i + 1 + n do args[#args + 1] = ARGV[j] end
    if stop_at_refusal then
      local ok = redis.pcall(unpack(args))
      if type(ok) == 'table' and ok.err then return {landed, ok.err} end
    else
      redis.call(unpack(args))
    end
    landed = landed + 1
    i = i + 2 + n
  end
  return {landed, ''}
end
"""

_REFILL = fence.PRELUDE + _ADD_ENTRIES + "return add_entries(KEYS[1], true)\n"

_BEGIN = fence.PRELUDE + _STATE + """
redis.call('DEL', KEYS[3])
return state(KEYS[1])
"""

# The temporary key expires unless swapped in: a rebuild fenced out midway leaves no garbage.
_ADD = fence.PRELUDE + _ADD_ENTRIES + """
local added = add_entries(KEYS[3], false)
redis.call('PEXPIRE', KEYS[3], 3600000)
return added
"""

# Entry id order on the ids' text (exact for 20-digit numbers, which Lua's doubles are not).
_ID_LT = """
local function id_lt(a, b)
  local am, as = string.match(a, '(%d+)-(%d+)')
  local bm, bs = string.match(b, '(%d+)-(%d+)')
  if #am ~= #bm then return #am < #bm end
  if am ~= bm then return am < bm end
  if #as ~= #bs then return #as < #bs end
  return as < bs
end
"""

# KEYS: stream, fence, temporary key, dead-letter stream. ARGV: epoch, state signature,
# entries in KEYS[3], new top, entries-added, max-deleted id, first restored id ('' if none),
# the id a group that read past it is rewound to, the foreign ceiling ('' if none: every
# entry above it is copied to the dead-letter stream as foreign_entry, and is not in KEYS[3]),
# the time (ms) of those letters. A group that read past the new top is set back to it.
_SWAP = fence.PRELUDE + _STATE + _ID_LT + """
local function map(flat)
  local m = {}
  for i = 1, #flat, 2 do m[flat[i]] = flat[i + 1] end
  return m
end
if state(KEYS[1]) ~= ARGV[2] or redis.call('XLEN', KEYS[3]) ~= tonumber(ARGV[3]) then
  redis.call('DEL', KEYS[3])
  return {-1, 0}
end
if ARGV[9] ~= '' then
  local start = '(' .. ARGV[9]
  while true do
    local page = redis.call('XRANGE', KEYS[1], start, '+', 'COUNT', 200)
    for _, e in ipairs(page) do
      local args, fields = {'XADD', KEYS[4], '*'}, e[2]
      local n = math.min(#fields, 4000)
      for i = 1, n do args[#args + 1] = fields[i] end
      if n < #fields then
        args[#args + 1] = 'dlq.truncated'
        args[#args + 1] = tostring(#fields / 2)
      end
      for _, v in ipairs({'dlq.reason', 'foreign_entry', 'dlq.message',
          'not appended by the relay: above every id it assigned (' .. ARGV[9] .. ')',
          'dlq.stream', KEYS[1], 'dlq.entry_id', e[1], 'dlq.time_ms', ARGV[10]}) do
        args[#args + 1] = v
      end
      redis.call(unpack(args))
    end
    if #page < 200 then break end
    start = '(' .. page[#page][1]
  end
end
if redis.call('EXISTS', KEYS[3]) == 0 then
  redis.call('XADD', KEYS[3], 'MAXLEN', '0', '0-1', 'outbox.placeholder', '1')
end
redis.call('XSETID', KEYS[3], ARGV[4], 'ENTRIESADDED', ARGV[5], 'MAXDELETEDID', ARGV[6])
local groups, claimed = 0, 0
if redis.call('EXISTS', KEYS[1]) == 1 then
  for _, flat in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
    local g = map(flat)
    local last, read = g['last-delivered-id'], g['entries-read']
    if ARGV[7] ~= '' and not id_lt(last, ARGV[7]) then
      last, read = ARGV[8], false
    end
    if id_lt(ARGV[4], last) then  -- read past the new last id (foreign entries): set back
      last, read = ARGV[4], false
    end
    if read then
      redis.call('XGROUP', 'CREATE', KEYS[3], g['name'], last, 'ENTRIESREAD', read)
    else
      redis.call('XGROUP', 'CREATE', KEYS[3], g['name'], last)
    end
    groups = groups + 1
    for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], g['name'])) do
      redis.call('XGROUP', 'CREATECONSUMER', KEYS[3], g['name'], map(c)['name'])
    end
    local start = '-'
    while true do
      local page = redis.call('XPENDING', KEYS[1], g['name'], start, '+', 1000)
      for _, p in ipairs(page) do
        redis.call('XCLAIM', KEYS[3], g['name'], p[2], 0, p[1], 'IDLE', p[3],
          'RETRYCOUNT', p[4], 'FORCE', 'JUSTID')
        claimed = claimed + 1
      end
      if #page < 1000 then break end
      start = '(' .. page[#page][1]
    end
  end
end
redis.call('RENAME', KEYS[3], KEYS[1])
redis.call('PERSIST', KEYS[1])
return {groups, claimed}
"""


# ARGV: epoch, id. The stream's last id becomes ``id`` if it is below it: a stream whose every
# delivered entry was trimmed on purpose, then lost with Redis, gets its top back so appends
# (which must go above every delivered id) are accepted. A missing stream is created by an
# XADD trimmed away at once (MAXLEN 0): no entry is ever visible.
_RAISE_TOP = fence.PRELUDE + """
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('XADD', KEYS[1], 'MAXLEN', '0', ARGV[2], 'outbox.placeholder', '1')
  return 1
end
local info = redis.call('XINFO', 'STREAM', KEYS[1])
local s = {}
for i = 1, #info, 2 do s[info[i]] = info[i + 1] end
local tm, ts = string.match(ARGV[2], '(%d+)-(%d+)')
local lm, ls = string.match(s['last-generated-id'], '(%d+)-(%d+)')
if tonumber(lm) > tonumber(tm) or (tonumber(lm) == tonumber(tm) and tonumber(ls) >= tonumber(ts))
then
  return 0
end
redis.call('XSETID', KEYS[1], ARGV[2])
return 1
"""


def entry_ids_above(client: redis.Redis, key: str, after: str, page: int = 1000) -> list[str]:
    """The ids of the stream's entries above ``after``, in order (``XRANGE (after +``)."""
    out: list[str] = []
    start = f"({after}"
    while True:
        with translate_redis_errors():
            got: Any = client.xrange(key, min=start, max="+", count=page)
        out += [i.decode() if isinstance(i, bytes) else str(i) for i, _fields in got]
        if len(got) < page:
            return out
        start = f"({out[-1]}"


def raise_top(client: redis.Redis, key: str, fence_key: str, epoch: int, top: str) -> bool:
    """Raise the stream's last id to ``top`` (never lower it); whether it changed."""
    return bool(fence.run_fenced(client, _RAISE_TOP, [key, fence_key], [epoch, top]))


def rebuild_key(key: str) -> str:
    """The temporary key a rebuild fills: ``<stream key>:rebuild`` (same hash tag)."""
    return f"{key}:rebuild"


def _entry_args(entries: Sequence[tuple[str, Fields]]) -> list[bytes | str | int]:
    args: list[bytes | str | int] = []
    for entry_id, fields in entries:
        args += [entry_id, len(fields), *fields]
    return args


def stream_state(client: redis.Redis, key: str) -> StreamState:
    """``XINFO STREAM`` reduced to what the comparison and the rebuild need."""
    with translate_redis_errors():
        if not client.exists(key):
            return StreamState(exists=False)
        info: Any = client.xinfo_stream(key)

    def text(name: str) -> str:
        value = info.get(name, entry_ids.ZERO)
        return value.decode() if isinstance(value, bytes) else str(value)

    return StreamState(
        exists=True,
        length=int(info.get("length", 0)),
        top=text("last-generated-id"),
        entries_added=int(info.get("entries-added", info.get("length", 0))),
        max_deleted=text("max-deleted-entry-id"),
    )


def refill(
    client: redis.Redis, key: str, fence_key: str, epoch: int,
    entries: Sequence[tuple[str, Fields]],
) -> tuple[int, str]:
    """``XADD`` one chunk in order under its ids; ``(entries landed, first refusal or "")``.

    Redis refuses an id at or below the top, so an entry can never land twice; the script
    stops at the first refusal, so what landed is always a prefix of the chunk.
    """
    landed, refusal = fence.run_fenced(client, _REFILL, [key, fence_key],
                                       [epoch, *_entry_args(entries)])
    return int(landed), refusal.decode() if isinstance(refusal, bytes) else str(refusal)


def begin_rebuild(client: redis.Redis, key: str, fence_key: str, epoch: int) -> StreamState:
    """Empty the temporary key; the stream's state the swap will require unchanged."""
    state = fence.run_fenced(client, _BEGIN, [key, fence_key, rebuild_key(key)], [epoch])
    return StreamState.parse(state.decode() if isinstance(state, bytes) else str(state))


def read_entries(client: redis.Redis, key: str, top: str, page: int) -> Iterator[Entry]:
    """The stream's entries up to ``top``, in id order, ``page`` per ``XRANGE``."""
    start = "-"
    while True:
        with translate_redis_errors():
            got: Any = client.xrange(key, min=start, max=top, count=page)
        for entry_id, fields in got:
            flat = [part for pair in fields.items() for part in pair]
            yield Entry(entry_id.decode(), flat, restored=False)
        if len(got) < page:
            return
        start = f"({got[-1][0].decode()}"


def add_to_rebuild(
    client: redis.Redis, key: str, fence_key: str, epoch: int, entries: Sequence[Entry]
) -> None:
    """Append one chunk (ids above everything added before) to the temporary key."""
    fence.run_fenced(client, _ADD, [key, fence_key, rebuild_key(key)],
         [epoch, *_entry_args([(e.id, e.fields) for e in entries])])


def swap(
    client: redis.Redis, key: str, fence_key: str, epoch: int, before: StreamState, *,
    length: int, top: str, entries_added: int, first_restored: str, rewind_to: str,
    ceiling: str = "", dead_key: str = "", now_ms: int = 0,
) -> tuple[int, int] | None:
    """Move groups and pending lists over and replace the stream, atomically.

    ``(groups, pending entries)`` moved, or None (temporary key dropped, stream untouched)
    when the stream changed since :func:`begin_rebuild` or the temporary key is incomplete.
    With a ``ceiling``, the entries above it (foreign: left out of the rebuilt stream) are
    copied to ``dead_key`` first, in the same script, with reason ``foreign_entry``, their
    original id and fields; their pending entries are not carried over (``XCLAIM`` skips an
    id the stream does not hold) and groups that read past ``top`` are set back to it.
    """
    deleted = before.max_deleted
    if entry_ids.greater(deleted, top):
        deleted = top
    groups, claimed = fence.run_fenced(
        client, _SWAP, [key, fence_key, rebuild_key(key), dead_key or f"{key}:dead"],
        [epoch, before.signature(), length, top, entries_added, deleted,
         first_restored, rewind_to, ceiling, now_ms],
    )
    return None if int(groups) < 0 else (int(groups), int(claimed))
