"""OpenAI's error body for every failure: ``APIError`` and the handlers that turn FastAPI's own
errors (unparsable JSON, a body outside the schema, an unknown route) into it."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException


class APIError(Exception):
    """An error answered with OpenAI's body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status,
            message,
            param,
            code,
            type,
        )

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def install_handlers(app: FastAPI) -> None:
    """Answer every error of ``app`` with OpenAI's body."""

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, e: RequestValidationError):
        error = e.errors()[0]
        if error["type"] == "json_invalid":
            return APIError(
                400,
                f"the body is not valid JSON: {error.get('ctx', {}).get('error', error['msg'])}",
                code="invalid_json",
            ).response()
        loc = [str(part) for part in error["loc"][1:]]
        message = "unsupported field" if error["type"] == "extra_forbidden" else error["msg"]
        return APIError(
            422,
            f"{'.'.join(loc) or 'body'}: {message}",
            param=loc[0] if loc else None,
            code=error["type"],
        ).response()

    @app.exception_handler(HTTPException)
    async def _http(http: HTTPRequest, e: HTTPException):
        return APIError(
            e.status_code,
            f"{http.method} {http.url.path}: {e.detail}",
            code="not_found" if e.status_code == 404 else None,
        ).response()
