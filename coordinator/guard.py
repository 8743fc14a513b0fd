"""The HTTP API's front door: bearer-token authentication and a bounded number of requests in
flight. With an API key set (`--api-key` or `PDSERVE_API_KEY`), every route but `/health` wants
`Authorization: Bearer KEY` and answers 401 otherwise (compared in constant time). Beyond
`max_active` completion requests in flight a new one gets 429 with `Retry-After` at once,
rather than joining an unbounded wait.
"""

from __future__ import annotations

import hmac

from coordinator.completion_request import APIError


class Unauthorized(APIError):
    """401: a missing or wrong API key."""

    status, type, kind = 401, "authentication_error", "unauthorized"


class Overloaded(APIError):
    """429: too many requests in flight; `retry_after_s` goes out as the Retry-After header."""

    status, type, kind = 429, "rate_limit_error", "overloaded"

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message)
        self.headers = {"Retry-After": str(retry_after_s)}


OPEN_PATHS = ("/health",)


def authorization_bytes(raw_headers) -> bytes | None:
    """The `Authorization` header's value as the client sent its bytes (aiohttp's raw_headers):
    never decoded, so bytes that are not UTF-8 are just a wrong key, not an error."""
    for name, value in raw_headers:
        if name.lower() == b"authorization":
            return value
    return None


def check_api_key(api_key: str | None, path: str, authorization: bytes | str | None) -> None:
    """Raise Unauthorized unless the route is open or the bearer token is the key (compared as
    bytes, in constant time)."""
    if not api_key or path in OPEN_PATHS:
        return
    if isinstance(authorization, str):  # a decoded header: back to its bytes, whatever they were
        authorization = authorization.encode("utf-8", "surrogateescape")
    scheme, _, token = (authorization or b"").partition(b" ")
    key = api_key.encode("utf-8", "surrogateescape")
    if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), key):
        raise Unauthorized("missing or invalid API key: send 'Authorization: Bearer <key>'")


class InFlightLimit:
    """Counts completion requests in flight; `enter` refuses beyond `max_active`."""

    def __init__(self, max_active: int):
        self.max_active, self.active, self.refused = max_active, 0, 0

    def enter(self) -> None:
        if self.active >= self.max_active:
            self.refused += 1
            raise Overloaded(f"{self.active} requests in flight, at most {self.max_active}: retry shortly")
        self.active += 1

    def leave(self) -> None:
        self.active -= 1
