"""Protocol building: the requests and outcomes a client sends (validated before
anything is sent), the handshake, and reading replies back. No I/O here.

Values are the JSON-like form of :mod:`polygate._wire` (externally tagged
enums: ``{"BeginCall": {...}}``, ``"Ping"``).
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional, Tuple

from .. import _wire
from .._version import __version__
from ..errors import SidecarError
from .errmap import SOCKET_ENV, error_from_reply, protocol_error

DEFAULT_SOCKET = "/run/polygate/sidecar.sock"
DEFAULT_CLIENT_NAME = "polygate-python/" + __version__
# Largest frame we accept from the sidecar (a status report of a big config can be
# larger than the sidecar's own inbound limit).
MAX_INCOMING_FRAME = 16 * 1024 * 1024

FAILURE_KINDS = {
    "timeout": "Timeout",
    "server_error": "ServerError",
    "connection": "Connection",
    "bad_result": "BadResult",
    "error": "Error",
}

Request = Any
"""A request value (``{"Acquire": {"call": 7}}``, ``"Ping"``, ...)."""
Reply = Any
"""A reply value as decoded (``{"Granted": {...}}``, ``"Ok"``, ...)."""


def resolve_path(path: Optional[str]) -> str:
    """The socket path: ``path``, else ``$POLYGATE_SOCKET``, else the default."""
    if path is not None:
        return os.fspath(path)
    return os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET


# ---------------------------------------------------------------- validation


def _check_count(name: str, value: Any, optional: bool = True) -> None:
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 64:
        raise ValueError("%s must be a non-negative integer%s, got %r" % (name, " or None" if optional else "", value))


def _check_seconds(name: str, value: Any, optional: bool = True) -> Optional[float]:
    if value is None and optional:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value or value < 0:
        raise ValueError("%s must be a non-negative number of seconds%s, got %r"
                         % (name, " or None" if optional else "", value))
    return float(value)


def _check_name(what: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError("%s must be a non-empty string, got %r" % (what, value))
    return value


# ---------------------------------------------------------------- requests


def hello(client_name: Optional[str]) -> Request:
    return {
        "Hello": {
            "protocol_version": _wire.PROTOCOL_VERSION,
            "client_name": client_name or DEFAULT_CLIENT_NAME,
            "pid": os.getpid() & 0xFFFFFFFF,
        }
    }


def begin_call(scope: str, est_tokens: Optional[int]) -> Request:
    _check_name("scope", scope)
    _check_count("est_tokens", est_tokens)
    return {"BeginCall": {"scope": scope, "est_tokens": est_tokens}}


def acquire(call_id: int) -> Request:
    return {"Acquire": {"call": call_id}}


def end_call(call_id: int) -> Request:
    return {"EndCall": {"call": call_id}}


def report(permit_id: int, outcome: Any) -> Request:
    return {"Report": {"permit": permit_id, "outcome": outcome}}


def cancel(target: int) -> Request:
    return {"Cancel": {"target": target}}


def force_open(source: str, seconds: float) -> Request:
    _check_name("source", source)
    s = _check_seconds("seconds", seconds, optional=False)
    if not s or s == float("inf"):
        raise ValueError("seconds must be a finite number > 0, got %r" % (seconds,))
    return {"ForceOpen": {"source": source, "seconds": s}}


def force_close(source: str) -> Request:
    return {"ForceClose": {"source": _check_name("source", source)}}


def reset(source: str) -> Request:
    return {"Reset": {"source": _check_name("source", source)}}


STATUS: Request = "Status"
PING: Request = "Ping"


def frame_request(rid: int, request: Request, max_frame: int) -> bytes:
    """The complete frame (length prefix included) of ``request`` with id ``rid``;
    a request larger than the sidecar's ``max_frame`` is refused here, unsent."""
    payload = _wire.encode_client_frame({"id": rid, "request": request})
    if len(payload) > max_frame:
        raise SidecarError(
            "request of %d bytes exceeds the sidecar's max_frame %d" % (len(payload), max_frame),
            kind="frame_too_large",
        )
    return _wire.frame(payload)


# ---------------------------------------------------------------- outcomes


def outcome_success(tokens: Optional[int], count_attempt: bool) -> Any:
    _check_count("tokens", tokens)
    if not isinstance(count_attempt, bool):
        raise ValueError("count_attempt must be a bool, got %r" % (count_attempt,))
    return {"Success": {"tokens": tokens, "count_attempt": count_attempt}}


def outcome_failure(kind: str) -> Any:
    wire = FAILURE_KINDS.get(kind) if isinstance(kind, str) else None
    if wire is None:
        raise ValueError(
            "unknown failure kind %r; allowed kinds: %s" % (kind, ", ".join(sorted(FAILURE_KINDS)))
        )
    return {"Failure": {"kind": wire}}


def outcome_rate_limited(retry_after_s: Optional[float]) -> Any:
    return {"RateLimited": {"retry_after_s": _check_seconds("retry_after_s", retry_after_s)}}


OUTCOME_CANCELLED = "Cancelled"


# ---------------------------------------------------------------- replies


def variant(reply: Reply) -> Tuple[str, Any]:
    """Split an externally tagged reply into (variant name, body or None)."""
    if isinstance(reply, str):
        return reply, None
    ((name, body),) = reply.items()
    return name, body


def expect(reply: Reply, *names: str) -> Any:
    """Return the body of ``reply`` if its variant is one of ``names``; raise the
    mapped error for ``Error``, a protocol ``SidecarError`` for anything else."""
    name, body = variant(reply)
    if name in names:
        return body
    if name == "Error":
        raise error_from_reply(body)
    raise protocol_error("unexpected reply %s from the sidecar (expected %s)" % (name, " or ".join(names)))


def check_welcome(reply: Reply) -> Dict[str, Any]:
    """The ``Welcome`` body, or a clear error when the sidecar speaks another version."""
    body: Dict[str, Any] = expect(reply, "Welcome")
    if body["protocol_version"] != _wire.PROTOCOL_VERSION:
        raise SidecarError(
            "sidecar speaks protocol version %d, this client speaks %d"
            % (body["protocol_version"], _wire.PROTOCOL_VERSION),
            kind="protocol_violation",
        )
    return body


def late_cleanup(reply: Reply) -> Optional[Request]:
    """For a reply that arrived after its requester gave up: the request that
    releases what it created (a call or a permit), or None."""
    name, body = variant(reply)
    if name == "Granted":
        return report(body["permit"], OUTCOME_CANCELLED)
    if name == "CallBegun":
        return end_call(body["call"])
    return None
