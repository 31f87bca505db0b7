"""Keep credentials out of anything a person reads: logs, status output, errors, summaries.

URLs are *parsed*, never pattern-matched for a password: a password that was not
percent-encoded may hold any character, ``/ ? # @ :`` included. The rule that holds for every
URL form we accept: the user-info is everything between ``scheme://`` and the **last** ``@`` of
the URL (a host, port or Redis database number never holds an ``@``); its first ``:`` separates
the user from the password. The password is replaced by ``***`` and the rest is re-rendered by
its parser — SQLAlchemy's ``make_url(...).render_as_string(hide_password=True)`` for database
URLs, ``urllib.parse`` for Redis URLs. A URL whose remainder neither parser accepts is never
echoed: it becomes ``<unparsable URL>``. A ``password=`` query parameter is hidden too.

In free text (a driver's message) a URL runs from its ``scheme://`` to the next white space;
a text that is one URL (one ``scheme://``, at its start) is parsed whole.
"""

from __future__ import annotations

import logging
import re
from urllib.parse import quote, urlsplit

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

_URL = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.\-]*)://(?P<rest>\S*)")
_WHOLE = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.\-]*)://(?P<rest>.*)", re.DOTALL)
_PASSWORD_PARAM = re.compile(r"(?i)(password=)[^&\s]+")
_REDIS_SCHEMES = frozenset({"redis", "rediss", "unix", "redis+cluster", "rediss+cluster",
                            "redis+sentinel", "rediss+sentinel", "valkey", "valkeys"})
HIDDEN = "***"
UNPARSABLE = "<unparsable URL>"


def redact_url(text: str) -> str:
    """``text`` with the password of every URL in it replaced by ``***``; a URL with a password
    whose remainder cannot be parsed is replaced whole by ``<unparsable URL>``."""
    whole = _WHOLE.fullmatch(text)
    if whole is not None and text.count("://") == 1:  # one URL: white space may be its own
        return _redact_one(whole["scheme"], whole["rest"])
    return _URL.sub(lambda m: _redact_one(m["scheme"], m["rest"]), text)


def _redact_one(scheme: str, rest: str) -> str:
    at = rest.rfind("@")
    if at < 0 or ":" not in rest[:at]:  # no password in the user-info (maybe a parameter)
        return _PASSWORD_PARAM.sub(rf"\1{HIDDEN}", f"{scheme}://{rest}")
    user = rest[:at].split(":", 1)[0]
    after = rest[at + 1:]
    if scheme.lower() in _REDIS_SCHEMES:
        rendered = f"{scheme}://{user}:{HIDDEN}@{after}"
        try:
            urlsplit(rendered).port  # noqa: B018 — parses host and port, raises if malformed
        except ValueError:
            return UNPARSABLE
    else:
        try:
            url = make_url(f"{scheme}://{quote(user, safe='')}:x@{after}")
            rendered = url.render_as_string(hide_password=True)
        except (ArgumentError, ValueError):
            return UNPARSABLE
    return _PASSWORD_PARAM.sub(rf"\1{HIDDEN}", rendered)


class RedactingFilter(logging.Filter):
    """A logging filter that rewrites each record's message with :func:`redact_url`."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        redacted = redact_url(message)
        if redacted != message:
            record.msg, record.args = redacted, None
        return True


def configure_logging(level: str, fmt: str = "text") -> None:
    """Root logging for a daemon (kept here for existing imports): see
    :func:`shared.logs.configure_logging`."""
    from outbox_relay.shared.logs import (
        configure_logging as configure,  # shared.logs imports this module
    )

    configure(level, fmt)
