"""Domain errors raised by services; only api.py files turn them into HTTP responses."""


class DomainError(Exception):
    """Base of every error a user can meet; the message says what was wrong and what to do."""

    status_code = 400


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
