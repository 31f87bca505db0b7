"""The relay fence in Redis: a fenced-out relay cannot write a stream at all.

The database fences every *mark* by the partition lease epoch, but a relay whose lease lapsed
while its ``XADD`` or repair was in flight could still change the stream itself. So every
script of ours that writes a partition stream starts with :data:`PRELUDE`, on the stream's
fence key (:func:`shared.keys.fence_key`, same hash tag, so same cluster slot): the key holds
the highest lease epoch that ever wrote the stream; a caller with a lower epoch is refused
with an error reply ``FENCED <epoch>`` *before* anything is written, atomically with the write
(Redis runs a script alone). A higher epoch raises the fence. If Redis loses the key (a
restart without persistence) the next writer sets it again; the database's own fence still
guards every mark.

Script convention: ``KEYS[1]`` is the stream, ``KEYS[2]`` its fence key, ``ARGV[1]`` the
caller's epoch. :func:`fenced_out` turns the error reply into :class:`LeaseLostError`.
"""

from __future__ import annotations

from typing import Any

import redis

from outbox_relay.shared.errors import LeaseLostError
from outbox_relay.shared.redis_conn import translate_redis_errors

PRELUDE = """
local fence = tonumber(redis.call('GET', KEYS[2]) or '0')
local epoch = tonumber(ARGV[1])
if epoch < fence then
  return redis.error_reply('FENCED ' .. fence)
end
if epoch > fence then
  redis.call('SET', KEYS[2], ARGV[1])
end
"""


def fenced_out(err: redis.ResponseError) -> LeaseLostError | None:
    """The :class:`LeaseLostError` a ``FENCED`` reply means, or None for any other error."""
    text = str(err)
    if not text.startswith("FENCED"):
        return None
    return LeaseLostError(f"a newer relay owns this stream (fence epoch {text[7:].strip()})")


def run_fenced(client: redis.Redis, script: str, keys: list[str], args: list[Any]) -> Any:
    """Run a fenced script (``EVALSHA``, loading it when Redis lacks it); a ``FENCED`` reply
    raises :class:`LeaseLostError`, a lost connection :class:`UnavailableError`."""
    try:
        with translate_redis_errors():
            return client.register_script(script)(keys=keys, args=args)
    except redis.ResponseError as err:
        lost = fenced_out(err)
        if lost is not None:
            raise lost from err
        raise
