"""The console's web page: one static HTML file with its script inline (page.html).

No build step and nothing fetched from elsewhere: the page calls ``/console/api`` on its own
origin, with the token the operator typed (kept in the tab's ``sessionStorage``, sent as a
bearer token). It is served without a token because it holds no data. Its Content Security
Policy allows only that one inline script (by its SHA-256) and requests to the same origin, so
a letter's content, which the script only ever sets as text, cannot run anything either.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import re
from importlib import resources

from fastapi.responses import HTMLResponse


@functools.cache
def html() -> str:
    """The page's text (read once)."""
    return resources.files("outbox_relay.console").joinpath("page.html").read_text("utf-8")


@functools.cache
def content_security_policy() -> str:
    """Same-origin requests, the page's own inline style and exactly its one script."""
    match = re.search(r"<script>(.*?)</script>", html(), re.DOTALL)
    assert match is not None, "page.html has its script inline"
    digest = base64.b64encode(hashlib.sha256(match.group(1).encode()).digest()).decode()
    return (f"default-src 'none'; script-src 'sha256-{digest}'; style-src 'unsafe-inline'; "
            "connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; "
            "frame-ancestors 'none'")


def response() -> HTMLResponse:
    """The page, not cached (a new release's page with an old script would be confusing)."""
    return HTMLResponse(html(), headers={
        "Content-Security-Policy": content_security_policy(),
        "Cache-Control": "no-store", "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer"})
