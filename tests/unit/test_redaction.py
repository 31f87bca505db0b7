"""Credentials never reach a person: URLs in text and log records are redacted."""

from __future__ import annotations

import logging

import pytest

from outbox_relay.shared.redaction import RedactingFilter, redact_url


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("redis://user:s3cret@host:6379/0", "redis://user:***@host:6379/0"),
        ("rediss://:s3cret@host:6380", "rediss://:***@host:6380"),
        ("postgresql+psycopg://app:s3cret@db:5432/x", "postgresql+psycopg://app:***@db:5432/x"),
        ("postgresql://app:p%40ss%2Fw@db/x", "postgresql://app:***@db/x"),
        ("postgresql://app@db/x?password=s3cret&sslmode=require",
         "postgresql://app@db/x?password=***&sslmode=require"),
        ("redis://host:6379/0?PASSWORD=s3cret", "redis://host:6379/0?PASSWORD=***"),
        ("cannot reach redis://a:s3cret@h1 or postgresql://b:s3cret@h2/db now",
         "cannot reach redis://a:***@h1 or postgresql://b:***@h2/db now"),
    ],
)
def test_passwords_are_replaced(text: str, expected: str) -> None:
    assert redact_url(text) == expected
    assert "s3cret" not in redact_url(text)


@pytest.mark.parametrize(
    "text",
    ["redis://localhost:6379/0", "redis://user@host/0", "sqlite:///./outbox.db", "plain text",
     "postgresql+psycopg://postgres@127.0.0.1:5432/test?options=-csearch_path%3Dx"],
)
def test_text_without_passwords_is_unchanged(text: str) -> None:
    assert redact_url(text) == text


def test_redaction_is_idempotent() -> None:
    once = redact_url("redis://u:pw@h/0")
    assert redact_url(once) == once


def test_log_records_are_redacted(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("tests.redaction")
    logger.addFilter(RedactingFilter())
    try:
        with caplog.at_level(logging.INFO, logger="tests.redaction"):
            logger.info("connecting to %s", "redis://app:hunter2@cache:6379")
            logger.info("no secrets here: %d rows", 3)
    finally:
        logger.filters.clear()
    assert [r.getMessage() for r in caplog.records] == [
        "connecting to redis://app:***@cache:6379",
        "no secrets here: 3 rows",
    ]
    assert "hunter2" not in caplog.text


@pytest.mark.parametrize(
    ("text", "expected"),
    [  # passwords that were not percent-encoded: the user-info ends at the last "@"
        ("redis://u:pa/Sl4shSecret9@127.0.0.1:6379/13", "redis://u:***@127.0.0.1:6379/13"),
        ("postgresql://postgres:pw@Leak7xFrag@127.0.0.1:5432/x",
         "postgresql://postgres:***@127.0.0.1:5432/x"),
        ("redis://u:a?b#c@d@h:1/0", "redis://u:***@h:1/0"),
        ("redis://u:a b@h:1/0", "redis://u:***@h:1/0"),
        ("error: cannot reach redis://u:a/b@c@h:1/0 now",
         "error: cannot reach redis://u:***@h:1/0 now"),
    ],
)
def test_unencoded_passwords_are_hidden_whole(text: str, expected: str) -> None:
    assert redact_url(text) == expected


@pytest.mark.parametrize("url", ["postgresql://u:Leak7@[::1/x", "redis://u:Leak7@h:notaport/0"])
def test_an_unparsable_url_with_a_password_is_never_echoed(url: str) -> None:
    assert redact_url(url) == "<unparsable URL>"
    assert "Leak7" not in redact_url(f"failed: {url}")
