"""Trim each partition stream below what every consumer group has acknowledged.

Redis 7.0 has no ``XTRIM … ACKED``, and ``MAXLEN`` ignores consumer groups (a lagging group
loses entries it never read). So the owner of a partition runs :data:`SCRIPT` on each of its
streams every ``trim_interval_s``. The script decides and trims in one atomic step, so no group
can move between the decision and the trim:

* for every group, the lowest id it may still need: its oldest pending entry, else the entry
  after its last-delivered id (an entry it has not read yet); the threshold is the lowest of
  those over all groups;
* a stream with **no group** is never trimmed (nobody has acknowledged anything, and the
  consumers may simply not have started yet);
* a stream missing a **known group** is not trimmed either. Every group a trim sees is recorded
  in ``outbox_stream_groups``; when Redis loses its data each group comes back only when its
  own consumers recreate it (at ``0``), and a trim that looked only at the groups already back
  would remove what a group still missing had not read. The hold ends when the group is back,
  or when it has been missing longer than ``OUTBOX_GROUP_FORGET_S`` (1 day: it was deleted on
  purpose; forgotten with a warning). The one window left: a group created less than one trim
  interval before Redis lost its data was never seen, so it is not waited for;
* a **declared group** (``OUTBOX_STREAM_GROUPS``, e.g. ``runs:workers``) is created at ``0`` by
  the script when the stream lacks it, before the threshold is taken: it then needs every entry,
  so nothing is trimmed before its consumers have read it, even if they have never started
  (a group first created by its consumers after a trim sees only what that trim left);
* the newest ``stream_keep`` entries and every entry younger than ``stream_keep_s`` are kept
  (for a group created later, and for ``redis-cli`` inspection);
* every entry of a batch the partition's lease row still records as unsettled is kept: a relay
  that died after its ``XADD`` and before marking leaves the batch to be retried under the same
  ids, and the retry must find those entries there (trimmed, they would look like a gap and be
  appended a second time);
* the threshold is a whole millisecond (``<ms>-0``: the millisecond of the first entry still
  needed, so every entry below it is not needed) so the database can select the rows at or
  above it by entry id text (13-digit milliseconds sort as text); when nothing is needed, the
  millisecond after the newest entry (the relay's ids never reuse a millisecond:
  relay/entry_ids.batch_ms);
* ``XTRIM MINID =`` the threshold: only entries strictly below it go.

After the trim the relay records the threshold as the stream's **trim floor** in
``outbox_stream_trims`` (it only ever rises). Repair refills only delivered rows at or above the
floor, so it never re-adds what was trimmed on purpose. The floor is recorded after the trim, so
it is never above what was trimmed; if the relay dies between the two, the floor stays lower and
a repair after a Redis loss could re-add a few acknowledged entries: the consumers' receipts
(kept while their entries are at or above the floor) make those duplicates, never a second
application.

**Off the relay thread.** The relay runs :meth:`Trimmer.run` as a background housekeeping task
(shared/periodic.py) while it appends: on its own thread it held every round for 50-70 ms each
time (the tail of the relay's latency). What the trim keeps must then also cover batches being
taken meanwhile, so :meth:`Trimmer.run` first reads each stream's newest entry, then the lease
rows' unsettled batches, and trims nothing above the newest entry's millisecond. A batch
appended later was either recorded on its lease row before that read (its ids are assigned and
recorded before any ``XADD``), so it is unsettled when the lease row is read and the trim keeps
it whole; or taken after it, and then its millisecond is above every id assigned before
(relay/entry_ids.batch_ms), the newest entry's included. That holds whatever the clocks do (the
keep-for cutoff alone would also keep such a batch, but only while the database's clock never
steps back).
It holds the repair check's lock (relay/repair.py), so it never runs in the middle of a
rebuild.

Redis 8.2's ``XTRIM … ACKED`` would give the same guarantee server-side; the script computes it
atomically on every version, so it is used everywhere (our CI runs Redis 7.0).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import redis
from sqlalchemy import Engine

from outbox_relay.relay import entry_ids, fence, stream_book
from outbox_relay.relay.leases import database_now
from outbox_relay.shared import keys
from outbox_relay.shared.errors import LeaseLostError
from outbox_relay.shared.redaction import redact_url
from outbox_relay.shared.redis_conn import translate_redis_errors
from outbox_relay.shared.settings import RetentionSettings

log = logging.getLogger(__name__)

# KEYS: stream, fence key. ARGV: epoch, keep (entries), cutoff ms (entries at or after it kept),
# cap ms ('' for none: entries from this millisecond up belong to an unsettled batch; kept),
# the number n of declared groups, the n declared groups (created at 0 when absent, so they
# need every entry), then the names of the groups known to read the stream (any of them
# missing: no trim).
# Returns {threshold "<ms>-0" or "" (nothing trimmed), entries trimmed, length after,
# groups present, known groups missing}; just {'', 0, 0} when the key does not exist.
# allow-oom: trimming is how a stream gives memory back; refusing it under maxmemory would
# keep Redis full.
SCRIPT = "#!lua flags=allow-oom\n" + fence.PRELUDE + """
if redis.call('EXISTS', KEYS[1]) == 0 then return {'', 0, 0} end
local function parse(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(ms), tonumber(seq)
end
local function below(a_ms, a_seq, b_ms, b_seq)
  return a_ms < b_ms or (a_ms == b_ms and a_seq < b_seq)
end
local function groups()
  local infos, names, present = {}, {}, {}
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
    local info = {}
    for i = 1, #g, 2 do info[g[i]] = g[i + 1] end
    infos[#infos + 1] = info
    names[#names + 1] = info['name']
    present[info['name']] = true
  end
  return infos, names, present
end
local infos, names, present = groups()
local declared = tonumber(ARGV[5])
local created = 0
for i = 6, 5 + declared do
  if not present[ARGV[i]] then
    redis.call('XGROUP', 'CREATE', KEYS[1], ARGV[i], '0')
    created = created + 1
  end
end
if created > 0 then infos, names, present = groups() end
local missing = {}
for i = 6 + declared, #ARGV do
  if not present[ARGV[i]] then missing[#missing + 1] = ARGV[i] end
end
if #infos == 0 or #missing > 0 then
  return {'', 0, redis.call('XLEN', KEYS[1]), names, missing}
end
local t_ms, t_seq = math.huge, 0
for _, info in ipairs(infos) do
  local ms, seq = parse(info['last-delivered-id'])
  seq = seq + 1
  if tonumber(info['pending']) > 0 then
    local summary = redis.call('XPENDING', KEYS[1], info['name'])
    local p_ms, p_seq = parse(summary[2])
    if below(p_ms, p_seq, ms, seq) then ms, seq = p_ms, p_seq end
  end
  if below(ms, seq, t_ms, t_seq) then t_ms, t_seq = ms, seq end
end
local cutoff = tonumber(ARGV[3])
if below(cutoff, 0, t_ms, t_seq) then t_ms, t_seq = cutoff, 0 end
if ARGV[4] ~= '' and below(tonumber(ARGV[4]), 0, t_ms, t_seq) then
  t_ms, t_seq = tonumber(ARGV[4]), 0
end
local keep = tonumber(ARGV[2])
local length = redis.call('XLEN', KEYS[1])
if length <= keep then return {'', 0, length, names, missing} end
if keep > 0 then
  local newest = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', keep)
  local k_ms, k_seq = parse(newest[#newest][1])
  if below(k_ms, k_seq, t_ms, t_seq) then t_ms, t_seq = k_ms, k_seq end
end
-- Whole milliseconds: every entry of a millisecond below the first entry still needed is
-- below the threshold. With nothing needed, the millisecond after the newest entry (the relay
-- never appends again in a millisecond it has used: relay/entry_ids.batch_ms).
local floor_ms
local first = redis.call('XRANGE', KEYS[1], string.format('%d-%d', t_ms, t_seq), '+', 'COUNT', 1)
if #first > 0 then
  floor_ms = parse(first[1][1])
else
  local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
  if #last == 0 then return {'', 0, 0, names, missing} end
  floor_ms = parse(last[1][1]) + 1
end
local threshold = string.format('%d-0', floor_ms)
local trimmed = redis.call('XTRIM', KEYS[1], 'MINID', '=', threshold)
return {threshold, trimmed, length - trimmed, names, missing}
"""


@dataclass
class TrimStats:
    """Counters since start (exported as metrics)."""

    trims: int = 0  # script runs
    trimmed_entries: int = 0
    trim_fenced: int = 0  # refused: a newer relay owns the stream
    trim_errors: int = 0  # refused by Redis (ACL, wrong type): logged, retried next interval
    trims_held: int = 0  # not trimmed: a known group is missing from the stream
    groups_forgotten: int = 0  # known groups missing longer than group_forget_s


class Trimmer:
    """Trims the streams of the partitions this relay leases (a housekeeping task)."""

    def __init__(
        self, settings: RetentionSettings, engine: Engine, client: redis.Redis,
        lock: threading.Lock | None = None,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.client = client
        self.stats = TrimStats()
        self.declared = settings.declared()
        self.lock = lock or threading.Lock()  # the repair check's (relay/repair.py)

    def run(self, leases: dict[int, int], streams: set[tuple[str, int]]) -> int:
        """Trim each of ``streams`` (``(stream, partition)``) whose partition is in the given
        ``{partition: epoch}`` leases; entries removed. The relay passes the streams its repair
        check found (those with delivered rows or a trim floor) and every stream it has
        delivered to since it started, so a stream's groups are known from its first
        delivery on."""
        if not self.settings.stream_trim or not leases:
            return 0
        with self.lock:
            return self._run(leases, streams)

    def _run(self, leases: dict[int, int], streams: set[tuple[str, int]]) -> int:
        """:meth:`run` (see the module docstring, "Off the relay thread", for the order of
        its reads)."""
        removed = 0
        mine = sorted(k for k in streams if k[1] in leases)
        tops = self._above_newest_ms(mine)  # first: see the module docstring
        caps: dict[int, int | None] = {}
        known = stream_book.known_groups(self.engine, sorted(leases))
        now = database_now(self.engine)
        for stream, partition in mine:
            if partition not in caps:
                caps[partition] = stream_book.unsettled_ms(self.engine, partition)
            cap = min((c for c in (caps[partition], tops[(stream, partition)]) if c is not None),
                      default=None)
            try:
                removed += self.trim(stream, partition, leases[partition], cap,
                                     known.get((stream, partition), {}), now=now)
            except LeaseLostError:
                self.stats.trim_fenced += 1
                log.info("trim of %s:%s skipped: a newer relay owns the stream", stream, partition)
            except redis.ResponseError as err:  # not transient: say so, keep relaying
                self.stats.trim_errors += 1
                log.warning("trim of %s:%s refused by Redis: %s", stream, partition,
                            redact_url(str(err)).split("\n")[0][:200],
                            extra={"stream": stream, "partition": partition})
        return removed

    def _above_newest_ms(self, streams: list[tuple[str, int]]) -> dict[tuple[str, int], int]:
        """The millisecond after each stream's newest entry, one pipelined ``XREVRANGE …
        COUNT 1`` each: nothing from it up is trimmed by this run. 0 (nothing trimmed) when
        the stream has no entry, or when Redis refused the read (a key of another type:
        :meth:`trim` meets the same refusal and counts it)."""
        if not streams:
            return {}
        pipe = self.client.pipeline(transaction=False)
        for stream, partition in streams:
            pipe.xrevrange(keys.stream_key(self.settings.key_prefix, stream, partition),
                           count=1)
        with translate_redis_errors():
            replies = pipe.execute(raise_on_error=False)
        return {pair: entry_ids.parse(_text(reply[0][0]))[0] + 1
                if isinstance(reply, list) and reply else 0
                for pair, reply in zip(streams, replies, strict=True)}

    def trim(
        self,
        stream: str,
        partition: int,
        epoch: int,
        cap_ms: int | None = None,
        known: dict[str, int | None] | None = None,
        *,
        now: int | None = None,
    ) -> int:
        """Trim one stream as the owner of ``epoch``, then record its floor and the groups
        seen; entries removed. ``cap_ms``: the partition's oldest unsettled batch
        (:func:`relay.stream_book.unsettled_ms`); nothing from that millisecond up is trimmed.
        ``known``: the groups known to read the stream (``{name: missing since ms or None}``,
        :func:`relay.stream_book.known_groups`; read here when not given); if one is missing,
        nothing is trimmed. ``now``: the database's clock (read here when not given), never
        this host's: the keep-for cutoff is compared with entry ids, whose milliseconds are
        the database's, and "missing since" with times other relay hosts recorded."""
        s = self.settings
        if known is None:
            known = stream_book.known_groups(self.engine, [partition]).get((stream, partition), {})
        declared = self.declared.get(stream, [])
        if now is None:
            now = database_now(self.engine)
        cutoff = now - int(s.stream_keep_s * 1000)
        reply = fence.run_fenced(
            self.client,
            SCRIPT,
            [keys.stream_key(s.key_prefix, stream, partition),
             keys.fence_key(s.key_prefix, stream, partition)],
            [epoch, s.stream_keep, cutoff, "" if cap_ms is None else cap_ms,
             len(declared), *declared, *sorted(known)],
        )
        threshold, trimmed = reply[0], int(reply[1])
        self.stats.trims += 1
        if len(reply) > 3:  # the key exists: what its groups say
            self._note_groups(stream, partition, known, _names(reply[3]), _names(reply[4]), now)
        floor = threshold.decode() if isinstance(threshold, bytes) else str(threshold)
        if floor and entry_ids.greater(floor, entry_ids.ZERO):
            stream_book.record_trim(self.engine, stream, partition, floor, trimmed, now)
        if trimmed:
            self.stats.trimmed_entries += trimmed
            log.debug("trimmed %d entries of %s:%s below %s", trimmed, stream, partition, floor)
        return trimmed

    def _note_groups(
        self,
        stream: str,
        partition: int,
        known: dict[str, int | None],
        present: list[str],
        missing: list[str],
        now: int,
    ) -> None:
        """Record groups seen for the first time, back, or newly missing; forget those missing
        longer than ``group_forget_s`` (the next trim goes on without them)."""
        if missing:
            self.stats.trims_held += 1
        limit = self.settings.group_forget_s
        forget = [g for g in missing if limit and (at := known.get(g)) is not None
                  and now - at >= limit * 1000]
        new = [g for g in present if g not in known]
        back = [g for g in present if known.get(g) is not None]
        gone = [g for g in missing if known.get(g) is None]
        for group in gone:
            log.warning("group %s is missing from stream %s:%s (Redis lost it?): the stream is "
                        "not trimmed until it is back", group, stream, partition,
                        extra={"stream": stream, "partition": partition, "group": group})
        for group in forget:
            self.stats.groups_forgotten += 1
            log.warning("group %s has been missing from stream %s:%s for over %gs: forgotten, "
                        "trimming resumes without it", group, stream, partition, limit,
                        extra={"stream": stream, "partition": partition, "group": group})
        if new or back or gone or forget:
            stream_book.record_groups(self.engine, stream, partition, seen=new + back, missing=gone,
                                forget=forget, now=now)


def _text(raw: object) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def _names(raw: object) -> list[str]:
    """Group names from a script reply (bytes or str)."""
    items = raw if isinstance(raw, list) else []
    return [n.decode() if isinstance(n, bytes) else str(n) for n in items]
