"""Who may call the runs API, and how many runs a caller may create.

* **Callers.** Each bearer token names its caller (``name:token`` entries in
  ``OUTBOX_API_TOKENS`` or in the file ``OUTBOX_API_TOKENS_FILE``). A name may have several
  tokens, so a token is rotated by adding the new one, moving clients over, dropping the old.
  Only SHA-256 digests of the tokens are kept; a presented token is compared with every one of
  them by :func:`hmac.compare_digest`, so neither which token matched nor how much of it did
  shows in the time taken. Errors about a token name its position (and caller), never the token.
* **When.** Tokens are required whenever some are configured, on any address that is not
  loopback (the service refuses to start there without them: ``api_tokens_required``), and on
  loopback too with ``api_auth``. Without tokens (loopback only) every request is the one
  anonymous caller, who sees every run — the behaviour of a single-user development setup.
* **What a caller sees.** The runs it created; a caller named in ``api_admins`` sees all.
* **How fast.** :class:`CreateLimit`: a token bucket per caller for ``POST /runs``.

Nothing here imports FastAPI: ``outbox serve`` checks its configuration before loading it.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from outbox_relay.runs.settings import ServeSettings
from outbox_relay.shared.errors import ConfigError

NAME = re.compile(r"^[A-Za-z0-9_.@-]{1,64}$")
TOKEN = re.compile(r"^[A-Za-z0-9._~+/-]{16,512}=*$")  # RFC 6750 b64token, 16+ characters
"""What a token may look like: ``openssl rand -hex 32`` or ``-base64 32`` output fits."""


@dataclass(frozen=True)
class Caller:
    """Who sent a request: ``name`` (``None`` when authentication is off) and its scope."""

    name: str | None
    admin: bool = False

    def sees(self, created_by: str | None) -> bool:
        """May this caller read and answer a run created by ``created_by``?"""
        return self.admin or self.name is None or created_by == self.name


ANONYMOUS = Caller(None)
"""Every request when authentication is off (a loopback API without tokens)."""


class Tokens:
    """The configured tokens, as digests, each with its caller."""

    def __init__(self, entries: Iterable[tuple[str, str]], admins: Iterable[str] = ()) -> None:
        admin_names = frozenset(admins)
        self._known: list[tuple[bytes, Caller]] = []
        for name, token in entries:
            digest = _digest(token.encode("ascii"))
            if any(hmac.compare_digest(digest, known) for known, _ in self._known):
                raise ConfigError(f"the same API token is given twice (the second time to {name})")
            self._known.append((digest, Caller(name, admin=name in admin_names)))
        names = {caller.name for _, caller in self._known}
        if unknown := sorted(admin_names - names):
            raise ConfigError(f"api_admins names callers without a token: {', '.join(unknown)}")

    def __len__(self) -> int:
        return len(self._known)

    def __repr__(self) -> str:
        return f"Tokens({len(self._known)} tokens)"

    def authenticate(self, presented: bytes) -> Caller | None:
        """The caller whose token ``presented`` is, or ``None``; every digest is compared."""
        digest = _digest(presented)
        found = None
        for known, caller in self._known:
            if hmac.compare_digest(digest, known):
                found = caller
        return found


def parse_tokens(text: str, source: str) -> list[tuple[str, str]]:
    """``[(name, token)]`` from ``name:token`` entries separated by commas or lines (``#``
    starts a comment line); ``source`` names the setting or file in errors."""
    entries = []
    for position, raw in enumerate(re.split(r"[,\n]", text), start=1):
        entry = raw.strip()
        if not entry or entry.startswith("#"):
            continue
        name, colon, token = (part.strip() for part in entry.partition(":"))
        if not colon or not NAME.match(name):
            raise ConfigError(f"{source}, entry {position}: expected name:token, the name 1-64 "
                              "letters, digits or _.@-")
        if not TOKEN.match(token):
            raise ConfigError(f"{source}, entry {position} ({name}): a token is 16-512 "
                              "characters of A-Z a-z 0-9 - . _ ~ + / (then = padding)")
        entries.append((name, token))
    return entries


def load_tokens(settings: ServeSettings) -> Tokens:
    """The tokens of ``api_tokens`` and ``api_tokens_file`` together (maybe none)."""
    entries = parse_tokens(settings.api_tokens.get_secret_value(), "api_tokens")
    if settings.api_tokens_file:
        path = Path(settings.api_tokens_file)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            reason = getattr(err, "strerror", None) or "not UTF-8 text"
            raise ConfigError(f"cannot read api_tokens_file {path}: {reason}") from None
        entries += parse_tokens(text, f"api_tokens_file {path}")
    admins = [name.strip() for name in settings.api_admins.split(",") if name.strip()]
    return Tokens(entries, admins)


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses; any other name or address is not (a
    name could resolve anywhere, ``0.0.0.0`` is every interface)."""
    host = host.strip().strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def api_tokens(settings: ServeSettings) -> Tokens | None:
    """The tokens the API requires, or ``None`` (authentication off: loopback, no tokens, no
    ``api_auth``). Refuses (``api_tokens_required``) a setting that would serve unauthenticated
    callers beyond loopback."""
    tokens = load_tokens(settings)
    if tokens:
        return tokens
    if not is_loopback(settings.host):
        raise ConfigError(
            f"the API would answer anyone who reaches {settings.host}: set OUTBOX_API_TOKENS "
            "or OUTBOX_API_TOKENS_FILE (name:token entries, docs/security.md); only a loopback "
            "host may run without tokens", code="api_tokens_required")
    if settings.api_auth:
        raise ConfigError("api_auth is on but no API tokens are configured (OUTBOX_API_TOKENS "
                          "or OUTBOX_API_TOKENS_FILE)", code="api_tokens_required")
    return None


class CreateLimit:
    """A token bucket per caller: ``burst`` creations at once, refilled at ``rate`` a second
    (0: no limit). Callers are the configured names (or the one anonymous caller), so the
    buckets are as many as the tokens' names."""

    def __init__(self, rate: float, burst: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst, self._clock = rate, burst, clock
        self._buckets: dict[str | None, tuple[float, float]] = {}  # caller: (left, at)
        self._lock = threading.Lock()

    def take(self, caller: str | None) -> float:
        """Take one creation for ``caller``: 0 when allowed, else the seconds until one is."""
        if self.rate <= 0:
            return 0.0
        with self._lock:
            now = self._clock()
            left, at = self._buckets.get(caller, (float(self.burst), now))
            left = min(float(self.burst), left + (now - at) * self.rate)
            if left >= 1:
                self._buckets[caller] = (left - 1, now)
                return 0.0
            self._buckets[caller] = (left, now)
            return (1 - left) / self.rate


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()
