"""Authenticated stream entries: an HMAC-SHA256 the relay adds and consumers check.

Off by default. With ``OUTBOX_SIGNING_KEY`` set (one key, or several separated by commas for
rotation), the relay adds a ``signature`` field to every entry it writes: the lowercase hex
HMAC-SHA256, under the *first* key, of :func:`shared.envelope.canonical` (every other field,
sorted, length-prefixed). A consumer with keys set accepts an entry only if its signature
matches under *any* of its keys, so a key is rotated in three steps: add the new key second
everywhere, move it first (relays sign with it), then drop the old one once no entry signed
with it is left unread.

What it guarantees: a client that can ``XADD`` to a partition stream but does not hold a key
(a forged or altered entry) gets its entry dead-lettered as ``bad_signature``: never applied,
and no inbox receipt is written for its id, so the real event under that id still applies.
What it does not: it is no encryption (fields stay readable), and a client holding a key can
sign anything; an old signed entry re-added verbatim is the same event (the inbox absorbs it).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass

from outbox_relay.shared.envelope import canonical
from outbox_relay.shared.errors import ConfigError

FIELD = "signature"
MIN_KEY_LENGTH = 16


@dataclass(frozen=True)
class Signer:
    """The keys of one process: the first signs, every one verifies."""

    keys: tuple[bytes, ...]

    @classmethod
    def from_setting(cls, value: str) -> Signer | None:
        """The signer of an ``OUTBOX_SIGNING_KEY`` value; None when it is empty (off).
        Raises :class:`ConfigError` (never naming the key) for a key shorter than
        :data:`MIN_KEY_LENGTH` characters."""
        parts = [p.strip() for p in value.split(",") if p.strip()]
        if not parts:
            return None
        for n, part in enumerate(parts, 1):
            if len(part) < MIN_KEY_LENGTH:
                raise ConfigError(f"signing key {n} is shorter than {MIN_KEY_LENGTH} characters")
        return cls(tuple(p.encode("utf-8") for p in parts))

    def sign(self, fields: Mapping[str, str]) -> str:
        """The ``signature`` value of ``fields`` (any ``signature`` among them is ignored)."""
        return _mac(self.keys[0], fields)

    def signed(self, fields: dict[str, str]) -> dict[str, str]:
        """``fields`` with its ``signature`` added (last, after the CloudEvents fields)."""
        return {**fields, FIELD: self.sign(fields)}

    def verify(self, fields: Mapping[bytes, bytes] | Mapping[str, str]) -> bool:
        """Whether ``fields`` carries a signature that matches under one of the keys."""
        given = _field(fields, FIELD)
        return given is not None and any(
            hmac.compare_digest(_mac(k, fields), given) for k in self.keys)


def _field(fields: Mapping[bytes, bytes] | Mapping[str, str], name: str) -> str | None:
    for key, value in fields.items():
        if (key.decode("utf-8", "replace") if isinstance(key, bytes) else key) == name:
            return value.decode("ascii", "replace") if isinstance(value, bytes) else value
    return None


def _mac(key: bytes, fields: Mapping[bytes, bytes] | Mapping[str, str]) -> str:
    return hmac.new(key, canonical(fields, exclude=FIELD), hashlib.sha256).hexdigest()
