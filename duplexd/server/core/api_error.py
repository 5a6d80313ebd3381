"""OpenAI's error shape for its HTTP endpoints (audio, Realtime calls and keys):
`{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

from fastapi.responses import JSONResponse


class ApiError(Exception):
    """A refusal, as OpenAI words them."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.param = status, code, param

    def response(self) -> JSONResponse:
        kind = "server_error" if self.status >= 500 else "invalid_request_error"
        body = {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)
