"""Domain errors. Each maps to one gRPC status code in one place (grpcutil)."""

from __future__ import annotations


class OrlError(Exception):
    """Base of every error OrchestrRL reports to a person or a caller."""


class InvalidArgument(OrlError):
    """The request or file is wrong: names the field, the value and what is allowed."""


class FailedPrecondition(OrlError):
    """The request is well-formed but the system is not in a state to do it."""


class NotFound(OrlError):
    """A named thing (node, OCS, pod) does not exist."""


class Aborted(OrlError):
    """A conflicting operation is in progress; try again."""


class Unavailable(OrlError):
    """A dependency (switch, agent, controller) could not be reached."""


def field_error(field: str, value: object, allowed: str) -> InvalidArgument:
    """The one shape of a bad-input message: field, value, what is allowed."""
    return InvalidArgument(f"{field}={value!r} is not valid: {allowed}")


class Unauthenticated(OrlError):
    """The caller presented no acceptable identity."""


class PermissionDenied(OrlError):
    """The caller is known but not allowed to do this."""
