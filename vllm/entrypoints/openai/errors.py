"""OpenAIError: an error answered in OpenAI's shape {"error": {message, type, param, code}}."""
from typing import Optional

from fastapi.responses import JSONResponse

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
          500: "internal_server_error", 503: "service_unavailable"}


class OpenAIError(Exception):
    def __init__(self, message: str, status: int = 400, param: Optional[str] = None,
                 code: Optional[str] = None, err_type: Optional[str] = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = err_type or _TYPES.get(status, "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code if self.code is not None else self.status}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)
