"""Domain errors raised by services; only api.py files turn them into HTTP responses."""


class DomainError(Exception):
    """Base of every error a user can meet; the message says what was wrong and what to do."""

    status_code = 400

    @property
    def extra(self) -> dict:
        """Fields added to the error body beside `detail`."""
        return {}


class NotFound(DomainError):
    status_code = 404


class Conflict(DomainError):
    status_code = 409


class CapReached(Conflict):
    """A cap of live things reached (runtimes of a deployment or of a token). Where the route's
    policy holds refusals, its answer waits out the refusal hold as a rate refusal does
    (controlplane/guards/holds.py)."""


class BatchTooLarge(DomainError):
    """A body that decodes to more values than EXITPLANE_TELEMETRY_MAX_BATCH_ITEMS, or to more
    memory than the process's whole decode budget: the runtime splits it, as for a body over
    the byte limit."""

    status_code = 413


class Invalid(DomainError):
    status_code = 422


class Unauthorized(DomainError):
    status_code = 401


class Forbidden(DomainError):
    status_code = 403


class Unavailable(DomainError):
    status_code = 503


class RateLimited(DomainError):
    status_code = 429

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


# The JSON body of every error answer (a DomainError's; the app's 422 for a request that does
# not validate adds `errors`, every problem): the OpenAPI component `Error` (controlplane/edge/).
ERROR_SCHEMA = {"type": "object", "required": ["detail"],
                "properties": {
                    "detail": {"type": "string", "description": "what was wrong and what to do"},
                    "index": {"type": "integer", "description": (
                        "the first bad record or cell of a telemetry batch")},
                    "errors": {"type": "array", "description": (
                        "every problem of a request that does not validate"), "items": {
                        "type": "object", "required": ["loc", "msg", "type"], "properties": {
                            "loc": {"type": "array", "items": {
                                "anyOf": [{"type": "string"}, {"type": "integer"}]}},
                            "msg": {"type": "string"}, "type": {"type": "string"}}}}}}


def error_answer(description: str) -> dict:
    """An error answer for OpenAPI, with the `Error` body."""
    return {"description": description, "content": {"application/json": {"schema": {
        "$ref": "#/components/schemas/Error"}}}}


# The app answers a request that does not validate with this body (edge/handlers.py), not
# FastAPI's default list of errors; the OpenAPI document says so wherever FastAPI put its own.
VALIDATION_ERROR = error_answer("the request does not validate: `detail` names the first "
                                "problem, `errors` lists them all")


# What the routes runtimes call may answer besides their success (docs/protocol.md), so that
# the committed OpenAPI document tells a third-party runtime every status it must handle.
RUNTIME_ERRORS = {
    401: error_answer("the token is unknown or revoked: a configuration error, not retried at "
                      "once"),
    403: error_answer("the token is not a runtime token of this deployment, or the runtime id "
                      "was registered by another token"),
    404: error_answer("no such deployment"),
    429: error_answer("rate limited: wait Retry-After seconds"),
    503: error_answer("the store (or Redis) is unavailable: wait Retry-After seconds"),
}


# A JSON route answers a body of another content type (or none) so.
NOT_JSON = error_answer("the body is not JSON: send Content-Type: application/json")
