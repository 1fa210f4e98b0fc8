"""Error mapping: the wire ``ErrorReply`` and local socket trouble → the
exceptions of :mod:`polygate.errors`. No I/O here."""

from __future__ import annotations

import os
import re
from typing import Any, Dict, Optional

from ..errors import (
    AllSourcesExhausted,
    CircuitOpenError,
    GatewayUnavailableError,
    PolyGateError,
    SidecarError,
    TenantLimitExceeded,
)

SOCKET_ENV = "POLYGATE_SOCKET"

_CAMEL = re.compile(r"(?<!^)(?=[A-Z])")


def snake(name: str) -> str:
    """``"AllSourcesExhausted"`` → ``"all_sources_exhausted"``."""
    return _CAMEL.sub("_", name).lower()


def error_from_reply(err: Dict[str, Any]) -> PolyGateError:
    """Map a wire ``ErrorReply`` (its dict form) to the matching exception instance."""
    kind: str = err["kind"]
    message: str = err.get("message") or kind
    scope: Optional[str] = err.get("scope")
    retry_after_s = float(err.get("retry_after_s") or 0.0)
    reasons = {src: snake(r) for src, r in err.get("per_source_reasons") or []}
    if kind == "CircuitOpen":
        return CircuitOpenError(message, retry_after_s=retry_after_s, per_source_reasons=reasons, scope=scope)
    if kind == "AllSourcesExhausted":
        ex = err.get("exhausted")
        return AllSourcesExhausted(message, reason=snake(ex) if ex else None, retry_after_s=retry_after_s,
                                   per_source_reasons=reasons, scope=scope)
    if kind == "BackendUnavailable":
        return GatewayUnavailableError(message, kind="backend_unavailable", retry_after_s=retry_after_s,
                                       per_source_reasons=reasons, scope=scope)
    return SidecarError(message, kind=snake(kind), scope=scope, retry_after_s=retry_after_s)


def error_from_tenant_refusal(refusal: Dict[str, Any]) -> TenantLimitExceeded:
    """Map a wire ``TenantRefusal`` (the body of ``Reply::TenantLimited``, v3) to
    :class:`TenantLimitExceeded`."""
    err: Dict[str, Any] = refusal["error"]
    return TenantLimitExceeded(
        err.get("message") or "tenant %r is over its %s limit" % (refusal["tenant"], refusal["limit"]),
        tenant=refusal["tenant"], limit=refusal["limit"],
        retry_after_s=float(err.get("retry_after_s") or 0.0),
        per_source_reasons={src: snake(r) for src, r in err.get("per_source_reasons") or []},
        scope=err.get("scope"))


def protocol_error(message: str) -> SidecarError:
    """The sidecar sent something this client cannot understand."""
    return SidecarError(message, kind="protocol")


SUN_PATH_MAX = 107
"""The longest Unix socket path, in bytes (``sun_path`` is 108 with its NUL)."""


def connect_error(path: str, exc: OSError) -> SidecarError:
    """Why :func:`connect` failed, naming the socket path (and a hint when it is missing)."""
    reason = exc.strerror or str(exc) or type(exc).__name__
    hint = ""
    size = len(os.fsencode(path))
    if isinstance(exc, FileNotFoundError):
        hint = " (is polygate-sidecar running? set $%s or pass path=)" % SOCKET_ENV
    elif size > SUN_PATH_MAX:
        hint = (" (the path is %d bytes, longer than the %d bytes a Unix socket path may have (sun_path): "
                "use a shorter one)" % (size, SUN_PATH_MAX))
    elif isinstance(exc, PermissionError):
        hint = (
            " (this user may not open the socket: ask the sidecar's operator to admit it "
            "(socket_mode, the socket directory's group), or set $%s or pass path= to "
            "a sidecar of this user)" % SOCKET_ENV
        )
    return SidecarError(
        "cannot connect to the PolyGate sidecar at %s: %s%s" % (path, reason, hint), kind="connection"
    )


def lost_error(path: str, exc: BaseException) -> SidecarError:
    """The socket failed under an established connection."""
    return SidecarError("connection to the sidecar at %s lost: %s" % (path, exc), kind="connection")


def undecodable_error(exc: BaseException) -> SidecarError:
    """A frame from the sidecar did not decode: the stream is unusable."""
    return protocol_error("undecodable frame from the sidecar: %s" % exc)


def connection_error(reply: Any) -> Optional[PolyGateError]:
    """An ``Error`` reply with id 0 concerns the connection itself (it precedes the
    sidecar closing it); anything else with an unknown id is ignored."""
    if isinstance(reply, dict) and "Error" in reply:
        return error_from_reply(reply["Error"])
    return None


def closed_error(path: str, fatal: Optional[PolyGateError]) -> SidecarError:
    """Why pending requests fail when the sidecar closed the connection."""
    if fatal is None:
        return SidecarError("the sidecar at %s closed the connection" % path, kind="connection")
    return SidecarError(
        "the sidecar at %s closed the connection: %s" % (path, fatal.message),
        kind=fatal.kind if isinstance(fatal, SidecarError) else "connection",
    )


def client_closed_error(path: str) -> SidecarError:
    """Why pending requests fail after ``client.close()``, and why every later use
    does: a client closed by its user stays closed (only a *lost* connection is
    replaced on the next use)."""
    return SidecarError("this client's connection to the sidecar at %s was closed by client.close(); a closed "
                        "client does not reconnect (connect again for a new one)" % path, kind="connection")


class NotSent(Exception):
    """Internal to the clients: a request's frame never left because its
    connection was already lost (found dead, or the write failed), so the
    sidecar cannot have applied it. A request that depends on nothing of that
    connection (``Start``, ``Begin``, status, admin, ping) is sent again on a
    new connection; any other gets ``error``. Never reaches the user."""

    def __init__(self, error: SidecarError) -> None:
        super().__init__(error.message)
        self.error = error
