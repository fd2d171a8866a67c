"""The API key on the dashboard's routes (/dashboard...), which a browser opens by itself.

An EventSource cannot send an Authorization header, and a link cannot either, so the dashboard
routes take the key three ways, in this order:

    Authorization: Bearer <key>      as the API (scripts, curl)
    ?key=<key>                       the first visit: /dashboard?key=<key>
    Cookie: memwall_dashboard_key    set by that visit (HttpOnly, SameSite=Strict, Path=/dashboard),
                                     so the page's own requests (its files, the event stream,
                                     the plan) carry it without the key in their URLs

The /v1 routes still take the header only.
"""

from __future__ import annotations

import hmac
from http.cookies import CookieError, SimpleCookie
from urllib.parse import parse_qs

PREFIX = "/dashboard"
COOKIE = "memwall_dashboard_key"
QUERY = "key"


def is_dashboard_path(path: str) -> bool:
    return path == PREFIX or path.startswith(PREFIX + "/")


def query_key(query_string: bytes) -> str | None:
    values = parse_qs(query_string.decode("latin-1")).get(QUERY)
    return values[0] if values else None


def cookie_key(headers: dict[bytes, bytes]) -> str | None:
    raw = headers.get(b"cookie")
    if not raw:
        return None
    try:
        morsel = SimpleCookie(raw.decode("latin-1")).get(COOKIE)
    except CookieError:
        return None
    return morsel.value if morsel is not None else None


def dashboard_key_ok(scope, api_key: str) -> bool:
    """True if the request carries the key by header, query parameter or cookie."""
    headers = dict(scope.get("headers") or [])
    if _same(headers.get(b"authorization", b""), f"Bearer {api_key}".encode()):
        return True
    given = [query_key(scope.get("query_string", b"")), cookie_key(headers)]
    return any(key is not None and _same(key.encode(), api_key.encode()) for key in given)


def _same(given: bytes, expected: bytes) -> bool:
    return hmac.compare_digest(given, expected)  # constant time: no timing oracle
