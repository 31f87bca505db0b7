"""No password reaches a person, whatever characters it holds (finding 4 of issue 28).

Passwords are drawn from every reserved URL character (RFC 3986 gen-delims and sub-delims),
``%`` and the other printable ASCII characters, unencoded, around two markers; the URL goes
through ``outbox status``'s error paths (in process, as the console script runs it) and
through the JSON log formatter. Neither marker may appear in what is printed or logged.
"""

from __future__ import annotations

import io
import json
import logging
import string

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from outbox_relay.cli.main import main
from outbox_relay.shared.logs import make_handler
from outbox_relay.shared.redaction import redact_url

RESERVED = ":/?#[]@!$&'()*+,;="
ALPHABET = RESERVED + "%\"<>\\^`{|}~-._" + string.ascii_letters + string.digits
MARKERS = ("Sekr1tQ", "Zw9Vyx")
pieces = st.text(alphabet=ALPHABET, max_size=12)


@st.composite
def passwords(draw: st.DrawFn) -> str:
    return f"{draw(pieces)}{MARKERS[0]}{draw(pieces)}{MARKERS[1]}{draw(pieces)}"


def _leaks(text: str) -> list[str]:
    return [m for m in MARKERS if m.lower() in text.lower()]  # hosts are printed lower case


def _cli_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    code = main(argv)
    out, err = capsys.readouterr()
    assert code != 0
    return out + err


common = settings(max_examples=60, deadline=None,
                  suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.mark.slow  # 60 examples, each a CLI run: seconds
@common
@given(password=passwords())
@example(password=f"pa/{MARKERS[0]}@{MARKERS[1]}")
@example(password=f"pw@{MARKERS[0]}x{MARKERS[1]}")
@example(password=f"a@{MARKERS[0]}/{MARKERS[1]}")
@example(password=f"a@{MARKERS[0]}#{MARKERS[1]}")
@example(password=f"Sekr1t?@{MARKERS[0]}{MARKERS[1]}")
def test_redis_url_password_never_printed(password: str, tmp_path_factory: pytest.TempPathFactory,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    database = tmp_path_factory.mktemp("db") / "outbox.db"
    assert main(["db", "upgrade", "--database-url", f"sqlite:///{database}"]) == 0
    capsys.readouterr()
    url = f"redis://user:{password}@127.0.0.1:1/13"
    printed = _cli_error(["status", "--database-url", f"sqlite:///{database}",
                          "--redis-url", url], capsys)
    assert _leaks(printed) == [], printed
    assert _leaks(redact_url(f"cannot reach {url} now")) == []


@common
@given(password=passwords())
@example(password=f"pw@{MARKERS[0]}{MARKERS[1]}")
@example(password=f"Sekr1t?@{MARKERS[0]}{MARKERS[1]}")  # a "?" before the "@": found by hypothesis
def test_database_url_password_never_printed(password: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    url = f"postgresql://postgres:{password}@127.0.0.1:1/x"
    printed = _cli_error(["status", "--database-url", url,
                          "--redis-url", "redis://127.0.0.1:1/0"], capsys)
    assert _leaks(printed) == [], printed
    assert _leaks(redact_url(f"cannot reach {url} now")) == []


@common
@given(password=passwords(), kind=st.sampled_from(["redis", "rediss", "postgresql+psycopg"]))
def test_json_logs_never_hold_the_password(password: str, kind: str) -> None:
    stream = io.StringIO()
    logger = logging.getLogger("tests.redaction.property")
    logger.handlers[:] = [make_handler("json", stream)]
    logger.propagate = False
    try:
        url = f"{kind}://user:{password}@db.example:5432/x"
        logger.warning("connecting to %s", url, extra={"url": url})
        logger.warning(url)
        try:
            raise RuntimeError(f"driver said: cannot reach {url}")
        except RuntimeError:
            logger.exception("failed")
    finally:
        logger.handlers.clear()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3
    for line in lines:
        record = json.loads(line)
        assert _leaks(line) == [] and _leaks(json.dumps(record, ensure_ascii=False)) == [], line
