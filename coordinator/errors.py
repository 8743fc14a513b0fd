"""The HTTP API's typed errors, each the OpenAI error body `{"error": {"message", "type", "param",
"code"}}` with its HTTP status. Parsers (coordinator.completion_request, coordinator.fields), backends and
the HTTP layer raise these, so the status of every failure is decided in one place;
coordinator.completion_request re-exports them.
"""

from __future__ import annotations


class APIError(Exception):
    """An error the client sees as the OpenAI error body with `status`."""

    status = 500
    type = "internal_error"
    kind = "internal"  # the `kind` label of pdserve_errors_total

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class InvalidRequest(APIError):
    """400: malformed JSON, missing or out-of-range fields, prompt beyond the context."""

    status, type, kind = 400, "invalid_request_error", "invalid_request"


class ModelNotFound(APIError):
    """404: the `model` field names no model this server serves."""

    status, type, kind = 404, "invalid_request_error", "model_not_found"

    def __init__(self, message: str, **kw):
        kw.setdefault("param", "model")
        kw.setdefault("code", "model_not_found")
        super().__init__(message, **kw)


class ServiceUnavailable(APIError):
    """503: no live worker can take the request (the backend's message says which role)."""

    status, type, kind = 503, "service_unavailable", "unavailable"


class Timeout(APIError):
    """504: the backend produced nothing within the configured bound."""

    status, type, kind = 504, "timeout", "timeout"


class InternalError(APIError):
    """500: a bug or a failed component; the message says what failed."""

