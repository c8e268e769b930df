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
