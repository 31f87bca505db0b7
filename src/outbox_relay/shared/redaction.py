"""Keep credentials out of anything a person reads: logs, status output, errors, summaries."""

from __future__ import annotations

import logging
import re

# scheme://user:password@host  and  scheme://:password@host
_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.\-]*://)(?P<user>[^:/@\s]*):[^@/\s]*@")
_PASSWORD_PARAM = re.compile(r"(?i)(password=)[^&\s]+")


def redact_url(text: str) -> str:
    """Replace the password of every URL in ``text`` with ``***``."""
    text = _USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:***@", text)
    return _PASSWORD_PARAM.sub(r"\1***", text)


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
