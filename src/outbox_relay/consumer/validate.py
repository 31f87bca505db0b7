"""Validating a stream entry before it is claimed: it was small enough to read, it parses, and
(with a signing key) it was signed by a relay holding one of the keys.

An entry that fails is dead-lettered with its reason and acknowledged *without* an inbox
receipt: an unsigned or forged entry (``bad_signature``) must not claim the event id it
carries, or the real event under that id would later be taken for its duplicate (issue 22,
finding 2). The signature is checked before the entry is parsed, over its raw fields, so a
forged entry costs one letter and nothing else. An entry the read refused from its size
(:class:`consumer.streams.OversizedFields`: no fields) is ``oversized`` before anything else.
"""

from __future__ import annotations

from collections.abc import Mapping

from outbox_relay.consumer.streams import OversizedFields
from outbox_relay.shared.envelope import Event
from outbox_relay.shared.errors import InvalidEventError
from outbox_relay.shared.signing import Signer

BAD_SIGNATURE = "bad_signature"
OVERSIZED = "oversized"


def parse(
    fields: Mapping[bytes, bytes], max_data_bytes: int, signer: Signer | None
) -> Event:
    """The entry's event; raises :class:`InvalidEventError` with its reason code
    (``oversized`` for an entry refused unread, ``bad_signature`` when ``signer`` is set and
    no key signed the entry)."""
    if isinstance(fields, OversizedFields):
        raise InvalidEventError(
            f"the entry holds {fields.size} bytes, more than the {fields.limit} a consumer "
            "reads (max_data_bytes plus room for the other fields); it was not read",
            code=OVERSIZED)
    if signer is not None and not signer.verify(fields):
        raise InvalidEventError(
            "the entry carries no valid signature (unsigned, forged, altered, or signed with "
            "a key this consumer does not have)", code=BAD_SIGNATURE)
    return Event.from_fields(fields, max_data_bytes=max_data_bytes)
