"""The error every `moedesk serve` API answers with: an HTTP status and OpenAI's error object (the Ollama routes
reshape it into Ollama's)."""
from __future__ import annotations

from starlette.responses import JSONResponse


class ApiError(Exception):
    """Becomes an OpenAI error object with this HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        message, param = _encodable(message), _encodable(param)
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.kind, self.param, self.code), self.status,
                            headers=self.headers)


def error_body(message: str, kind: str, param=None, code=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _encodable(text):
    """`text` with what UTF-8 cannot carry (a lone surrogate a client sent, echoed back in the message) escaped:
    left in, it failed the response's encoding, and every such request became a 500 and two tracebacks."""
    if not isinstance(text, str):
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
