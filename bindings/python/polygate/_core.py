"""Logic shared by the sync and asyncio clients: request construction,
reply interpretation, error mapping. No I/O here."""

from __future__ import annotations

import os
import re
from typing import Any, Dict, NamedTuple, Optional, Tuple

from . import _wire
from .errors import AllSourcesExhausted, CircuitOpenError, GatewayUnavailableError, PolyGateError, SidecarError

DEFAULT_SOCKET = "/run/polygate/sidecar.sock"
SOCKET_ENV = "POLYGATE_SOCKET"
CLIENT_VERSION = "0.1.0"
DEFAULT_CLIENT_NAME = "polygate-python/" + CLIENT_VERSION
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

_CAMEL = re.compile(r"(?<!^)(?=[A-Z])")


def snake(name: str) -> str:
    """``"AllSourcesExhausted"`` → ``"all_sources_exhausted"``."""
    return _CAMEL.sub("_", name).lower()


def resolve_path(path: Optional[str]) -> str:
    if path is not None:
        return os.fspath(path)
    return os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET


def connect_error(path: str, exc: OSError) -> SidecarError:
    reason = exc.strerror or str(exc) or type(exc).__name__
    hint = ""
    if isinstance(exc, FileNotFoundError):
        hint = " (is polygate-sidecar running? set $%s or pass path=)" % SOCKET_ENV
    return SidecarError(
        "cannot connect to the PolyGate sidecar at %s: %s%s" % (path, reason, hint), kind="connection"
    )


# ---------------------------------------------------------------- requests


def hello(client_name: Optional[str]) -> Any:
    return {
        "Hello": {
            "protocol_version": _wire.PROTOCOL_VERSION,
            "client_name": client_name or DEFAULT_CLIENT_NAME,
            "pid": os.getpid() & 0xFFFFFFFF,
        }
    }


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


def begin_call(scope: str, est_tokens: Optional[int]) -> Any:
    _check_name("scope", scope)
    _check_count("est_tokens", est_tokens)
    return {"BeginCall": {"scope": scope, "est_tokens": est_tokens}}


def acquire(call_id: int) -> Any:
    return {"Acquire": {"call": call_id}}


def end_call(call_id: int) -> Any:
    return {"EndCall": {"call": call_id}}


def report(permit_id: int, outcome: Any) -> Any:
    return {"Report": {"permit": permit_id, "outcome": outcome}}


def cancel(target: int) -> Any:
    return {"Cancel": {"target": target}}


def force_open(source: str, seconds: float) -> Any:
    _check_name("source", source)
    s = _check_seconds("seconds", seconds, optional=False)
    if not s or s == float("inf"):
        raise ValueError("seconds must be a finite number > 0, got %r" % (seconds,))
    return {"ForceOpen": {"source": source, "seconds": s}}


def force_close(source: str) -> Any:
    return {"ForceClose": {"source": _check_name("source", source)}}


def reset(source: str) -> Any:
    return {"Reset": {"source": _check_name("source", source)}}


STATUS = "Status"
PING = "Ping"


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


def variant(reply: Any) -> Tuple[str, Any]:
    """Split an externally tagged reply into (variant name, body or None)."""
    if isinstance(reply, str):
        return reply, None
    ((name, body),) = reply.items()
    return name, body


def error_from_reply(err: Dict[str, Any]) -> PolyGateError:
    """Map a wire ``ErrorReply`` to the matching exception instance."""
    kind = err["kind"]
    message = err.get("message") or kind
    scope = err.get("scope")
    retry_after_s = float(err.get("retry_after_s") or 0.0)
    reasons = {src: snake(r) for src, r in err.get("per_source_reasons") or []}
    common = dict(retry_after_s=retry_after_s, per_source_reasons=reasons, scope=scope)
    if kind == "CircuitOpen":
        return CircuitOpenError(message, **common)
    if kind == "AllSourcesExhausted":
        ex = err.get("exhausted")
        return AllSourcesExhausted(message, reason=snake(ex) if ex else None, **common)
    if kind == "BackendUnavailable":
        return GatewayUnavailableError(message, kind="backend_unavailable", **common)
    return SidecarError(message, kind=snake(kind), scope=scope, retry_after_s=retry_after_s)


def expect(reply: Any, *names: str) -> Any:
    """Return the body of ``reply`` if its variant is one of ``names``; raise the
    mapped error for ``Error``, a protocol ``SidecarError`` for anything else."""
    name, body = variant(reply)
    if name in names:
        return body
    if name == "Error":
        raise error_from_reply(body)
    raise SidecarError(
        "unexpected reply %s from the sidecar (expected %s)" % (name, " or ".join(names)), kind="protocol"
    )


def check_welcome(reply: Any) -> Dict[str, Any]:
    body = expect(reply, "Welcome")
    if body["protocol_version"] != _wire.PROTOCOL_VERSION:
        raise SidecarError(
            "sidecar speaks protocol version %d, this client speaks %d"
            % (body["protocol_version"], _wire.PROTOCOL_VERSION),
            kind="protocol_violation",
        )
    return body


class ReportResult(NamedTuple):
    """The sidecar's answer to a report."""

    applied: bool
    """``False`` when the outcome was fenced out (the breaker moved on meanwhile)."""
    state: str
    """The source's breaker state after the report: closed / open / half_open."""
    retry_after_s: float
    """Seconds until a retry of this source is certainly worth attempting (0 = now)."""


def report_result(reply: Any) -> ReportResult:
    body = expect(reply, "Reported")
    return ReportResult(body["applied"], snake(body["state"]), body["retry_after_s"])


def status_dict(reply: Any) -> Dict[str, Any]:
    body = expect(reply, "Status")
    scopes: Dict[str, Any] = {}
    for sc in body["scopes"]:
        sources: Dict[str, Any] = {}
        for src in sc["sources"]:
            d = {k: v for k, v in src.items() if k != "name"}
            d["state"] = snake(src["state"])
            sources[src["name"]] = d
        scopes[sc["name"]] = {
            "circuit_open": sc["circuit_open"],
            "quota_full": sc["quota_full"],
            "waiters": sc["waiters"],
            "calls": sc["calls"],
            "sources": sources,
        }
    return {"sidecar_version": body["sidecar_version"], "backend": body["backend"], "scopes": scopes}


def late_cleanup(reply: Any) -> Optional[Any]:
    """For a reply that arrived after its requester gave up: the request that
    releases what it created (a call or a permit), or None."""
    name, body = variant(reply)
    if name == "Granted":
        return report(body["permit"], OUTCOME_CANCELLED)
    if name == "CallBegun":
        return end_call(body["call"])
    return None


def fmt_permit(p: Any) -> str:
    return "<%s %s source=%r attempt=%d probe=%s est_tokens=%d%s>" % (
        type(p).__name__,
        p.id,
        p.source,
        p.attempt,
        p.is_probe,
        p.est_tokens,
        " reported" if p.reported else "",
    )


class PermitBase:
    """The fields of a granted permit, shared by the sync and asyncio ``Permit``."""

    def __init__(self, call: Any, body: Dict[str, Any]) -> None:
        self._call = call
        self.id: int = body["permit"]
        self.source: str = body["source"]
        self.is_probe: bool = body["is_probe"]
        self.attempt: int = body["attempt"]
        self.est_tokens: int = body["est_tokens"]
        self.result: Optional[ReportResult] = None
        self._reported = False


def connection_error(reply: Any) -> Optional[PolyGateError]:
    """An ``Error`` reply with id 0 concerns the connection itself (it precedes the
    sidecar closing it); anything else with an unknown id is ignored."""
    kind, body = variant(reply)
    return error_from_reply(body) if kind == "Error" else None


def closed_error(path: str, fatal: Optional[PolyGateError]) -> SidecarError:
    """Why pending requests fail when the sidecar closed the connection."""
    if fatal is None:
        return SidecarError("the sidecar at %s closed the connection" % path, kind="connection")
    return SidecarError(
        "the sidecar at %s closed the connection: %s" % (path, fatal.message),
        kind=fatal.kind if isinstance(fatal, SidecarError) else "connection",
    )


def client_closed_error(path: str) -> SidecarError:
    """Why pending requests fail after the client closed its own connection."""
    return SidecarError("the client closed its connection to %s" % path, kind="connection")
