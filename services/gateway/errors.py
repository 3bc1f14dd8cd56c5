"""GatewayError: a request the gateway cannot serve, with the HTTP status every front door maps from
(gRPC codes and NATS error replies are derived from the same status)."""

from __future__ import annotations

from shared.input_ids import PROMPT_FIELDS

BAD_REQUEST = 400
FORBIDDEN = 403  # a key without the scope the action needs (services/gateway/auth.py)
NOT_FOUND = 404
METHOD_NOT_ALLOWED = 405
PAYLOAD_TOO_LARGE = 413
CLIENT_CLOSED = 499  # nginx's convention: the client left before the answer (counted, never seen)
INTERNAL_ERROR = 500
SERVICE_UNAVAILABLE = 503
GATEWAY_TIMEOUT = 504

_ERROR_TYPES = {
    BAD_REQUEST: "invalid_request_error",
    FORBIDDEN: "permission_error",
    NOT_FOUND: "not_found_error",
    METHOD_NOT_ALLOWED: "invalid_request_error",
    PAYLOAD_TOO_LARGE: "invalid_request_error",
    SERVICE_UNAVAILABLE: "service_unavailable",
    GATEWAY_TIMEOUT: "timeout",
}


class GatewayError(Exception):
    """A failed request: `status` (HTTP), a message for the client, and the offending field if any."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    @property
    def error_type(self) -> str:
        return _ERROR_TYPES.get(self.status, "internal_error")

    def body(self) -> dict[str, object]:
        """The OpenAI-style error object, used by every HTTP route."""
        return {
            "error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.status}
        }


def bad_request(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(BAD_REQUEST, message, param)


def pipeline_error(status: int, message: str, param: str | None, prompt_param: str) -> GatewayError:
    """An error a service reported about a request, naming the prompt field as the client sent it
    (`prompt_param`): the services name the prompt `text`, `messages` or `input_ids`, which is not
    what OpenAI's completions call it, nor what a chat's tokenized ids were sent as."""
    if param in PROMPT_FIELDS and param != prompt_param:
        message = message.replace(f"`{param}`", f"`{prompt_param}`")
        param = prompt_param
    return GatewayError(status, message, param)
