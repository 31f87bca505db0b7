"""shared/signing.py: HMAC-SHA256 over the canonical form, key rotation, and what it refuses."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from outbox_relay.shared.envelope import canonical
from outbox_relay.shared.errors import ConfigError
from outbox_relay.shared.signing import Signer

OLD, NEW = "old-key-0123456789", "new-key-0123456789"
FIELDS = {"specversion": "1.0", "id": "o-3:order.placed:1", "source": "shop",
          "type": "order.placed", "time": "2026-01-01T00:00:00Z", "data": '{"total":30}'}


def test_the_signature_is_the_documented_hmac_of_the_canonical_form() -> None:
    signed = Signer.from_setting(OLD).signed(FIELDS)  # type: ignore[union-attr]
    # docs/wire-format.md: sorted names, <len>:<name><len>:<value>, lengths in UTF-8 bytes
    form = b"".join(b"%d:%s%d:%s" % (len(k.encode()), k.encode(), len(v.encode()), v.encode())
                    for k, v in sorted(FIELDS.items()))
    assert canonical(signed, exclude="signature") == form
    assert signed["signature"] == hmac.new(OLD.encode(), form, hashlib.sha256).hexdigest()


def test_rotation_first_key_signs_every_key_verifies() -> None:
    old = Signer.from_setting(OLD)
    both = Signer.from_setting(f"{NEW}, {OLD}")
    new = Signer.from_setting(NEW)
    assert old and both and new
    by_old = {k.encode(): v.encode() for k, v in old.signed(FIELDS).items()}
    assert both.verify(by_old) and not new.verify(by_old)
    assert new.verify(both.signed(FIELDS))


@pytest.mark.parametrize("change", [
    {"data": '{"total":333}'},  # altered
    {"source": "evil"},
    {"extra": "x"},  # added
    {"signature": "0" * 64},  # forged
])
def test_any_change_breaks_the_signature(change: dict[str, str]) -> None:
    signer = Signer.from_setting(OLD)
    assert signer is not None
    assert not signer.verify({**signer.signed(FIELDS), **change})
    assert not signer.verify(FIELDS)  # unsigned


def test_off_when_empty_and_short_keys_are_refused_without_being_named() -> None:
    assert Signer.from_setting("") is None and Signer.from_setting(" , ") is None
    with pytest.raises(ConfigError) as caught:
        Signer.from_setting(f"{OLD},short-secret")
    assert "short-secret" not in str(caught.value) and "key 2" in str(caught.value)
