"""Protocol building: the requests and outcomes a client sends (validated before
anything is sent), the handshake, and reading replies back. No I/O here.

Values are the JSON-like form of :mod:`polygate._wire` (externally tagged
enums: ``{"BeginCall": {...}}``, ``"Ping"``).
"""

from __future__ import annotations

import functools
import os
import re
from typing import Any, Dict, Generic, Optional, Protocol, Tuple, TypeVar

from .. import _frames, _wire
from .._version import __version__
from ..errors import SidecarError
from .errmap import SOCKET_ENV, error_from_reply, error_from_tenant_refusal, protocol_error

DEFAULT_SOCKET = "/run/polygate/sidecar.sock"
"""Root's default socket; :func:`default_socket` gives any user's."""
USER_SOCKET = "polygate/sidecar.sock"
"""A non-root user's default socket, under ``$XDG_RUNTIME_DIR``."""
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


def default_socket(uid: Optional[int] = None, xdg_runtime_dir: Optional[str] = None) -> str:
    """The sidecar's default socket for ``uid`` (default: this process's effective
    uid) — the same rule as the sidecar's (DESIGN §12): root
    ``/run/polygate/sidecar.sock``, anyone else
    ``$XDG_RUNTIME_DIR/polygate/sidecar.sock`` (``xdg_runtime_dir`` default: the
    environment's). Raises :class:`SidecarError` naming what to set when a non-root
    user has no absolute ``XDG_RUNTIME_DIR``."""
    if uid is None:
        uid = os.geteuid()
    if uid == 0:
        return DEFAULT_SOCKET
    if xdg_runtime_dir is None:
        xdg_runtime_dir = os.environ.get("XDG_RUNTIME_DIR")
    if xdg_runtime_dir and xdg_runtime_dir.startswith("/"):
        return xdg_runtime_dir.rstrip("/") + "/" + USER_SOCKET
    raise SidecarError(
        "no default PolyGate socket for uid %d: XDG_RUNTIME_DIR is not set (or not an "
        "absolute path); set $%s or pass path= (the root default %s is for uid 0)"
        % (uid, SOCKET_ENV, DEFAULT_SOCKET),
        kind="connection",
    )


def resolve_path(path: Optional[str]) -> str:
    """The socket path: ``path``, else ``$POLYGATE_SOCKET``, else
    :func:`default_socket` for this uid."""
    if path is not None:
        return os.fspath(path)
    return os.environ.get(SOCKET_ENV) or default_socket()


# ---------------------------------------------------------------- validation

MAX_COUNT = 1_000_000_000
"""The sidecar's limit on every token estimate and count (PROTOCOL.md §7): checked
here too, so a bad value fails where it is given, not at a later frame."""


def _check_count(name: str, value: Any) -> Optional[int]:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_COUNT:
        raise ValueError("%s must be an integer in [0, %d] or None, got %r" % (name, MAX_COUNT, value))
    return value


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


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError("%s must be a bool, got %r" % (name, value))
    return value


# ---------------------------------------------------------------- requests
#
# The hot requests are encoded bytes (polygate._frames builds them with struct);
# the cold ones are values for the generic codec. frame_request takes either.


def tenant_id(tenant: Optional[str]) -> Optional[bytes]:
    """The encoded tenant id of a call (validated: at most 128 bytes of UTF-8), or
    None for ``None`` / ``""``, the scope's anonymous tenant (a plain ``Start``)."""
    if tenant is None:
        return None
    if not isinstance(tenant, str):
        raise ValueError("tenant must be a string (a tenant id) or None, got %r" % (tenant,))
    return _tenant_wire(tenant) if tenant else None


@functools.lru_cache(maxsize=256)  # a worker repeats a few tenants: validate, encode once
def _tenant_wire(tenant: str) -> bytes:
    _check_tenant(tenant)
    return _frames.tenant(tenant)


def _check_tenant(tenant: Any) -> None:
    if not isinstance(tenant, str):
        raise ValueError("tenant must be a string (a tenant id), got %r" % (tenant,))
    try:
        size = len(tenant.encode("utf-8"))
    except UnicodeEncodeError:
        raise ValueError("tenant must be encodable as UTF-8, got %r" % (tenant,)) from None
    if size > _wire.MAX_TENANT_BYTES:
        raise ValueError("tenant id %r... is %d bytes of UTF-8; the limit is %d bytes"
                         % (tenant[:32], size, _wire.MAX_TENANT_BYTES))


def tenants_unsupported(version: int, what: str) -> SidecarError:
    """A tenant call (or tenant status) on a connection older than version 3: it is
    refused here, never sent without its tenant (PROTOCOL.md §15)."""
    return SidecarError(
        "%s: the sidecar speaks protocol %d; tenants need %d: upgrade polygate-sidecar"
        % (what, version, _wire.TENANT_VERSION),
        kind="protocol_violation",
    )


def require_tenants(welcome: Dict[str, Any], what: str) -> None:
    """Raise :func:`tenants_unsupported` unless the connection of ``welcome`` speaks 3."""
    version: int = welcome["protocol_version"]
    if version < _wire.TENANT_VERSION:
        raise tenants_unsupported(version, what)


def tenant_status(tenant: str, scope: Optional[str] = None) -> Request:
    """``TenantStatus{scope, tenant}`` (v3): ``""`` is the anonymous tenant."""
    _check_tenant(tenant)
    if scope is not None:
        _check_name("scope", scope)
    return {"TenantStatus": {"scope": scope, "tenant": tenant}}


def hello(client_name: Optional[str], version: int = _wire.PROTOCOL_VERSION) -> Request:
    """``Hello`` saying ``version`` (3; :data:`_wire.FALLBACK_VERSION` to an older sidecar)."""
    return {
        "Hello": {
            "protocol_version": version,
            "client_name": client_name or DEFAULT_CLIENT_NAME,
            "pid": os.getpid() & 0xFFFFFFFF,
        }
    }


@functools.lru_cache(maxsize=256, typed=True)  # a worker repeats a few specs: validate, encode once
def call_spec(scope: str, est_tokens: Optional[int] = None, priority: Optional[str] = None,
              est_input_tokens: Optional[int] = None, est_output_tokens: Optional[int] = None) -> bytes:
    """The encoded ``CallSpec`` of a call (validated; built once per call). An
    empty ``priority`` means the scope's default, as ``None`` does."""
    _check_name("scope", scope)
    if priority is not None and not isinstance(priority, str):
        raise ValueError("priority must be a priority class name (a string) or None, got %r" % (priority,))
    return _frames.call_spec(scope, _check_count("est_tokens", est_tokens), priority or None,
                             _check_count("est_input_tokens", est_input_tokens),
                             _check_count("est_output_tokens", est_output_tokens))


start = _frames.start
begin = _frames.begin
start_tenant = _frames.start_tenant
begin_tenant = _frames.begin_tenant
acquire = _frames.acquire
end_call = _frames.end_call
cancel = _frames.cancel
report = _frames.report
retry = _frames.retry
finish = _frames.finish


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


STATUS_JSON: Request = "StatusJson"
PING: Request = "Ping"


def frame_request(rid: int, request: Request, max_frame: int) -> bytes:
    """The complete frame (length prefix included) of ``request`` — encoded bytes
    from :mod:`polygate._frames`, or a value for the generic codec — with id
    ``rid``; a request larger than the sidecar's ``max_frame`` is refused here."""
    body = request if type(request) is bytes else _wire.encode(_wire.REQUEST, request)
    if len(body) + 8 > max_frame:
        raise SidecarError(
            "request of %d bytes exceeds the sidecar's max_frame %d" % (len(body) + 8, max_frame),
            kind="frame_too_large",
        )
    return _frames.frame(rid, body)


# ---------------------------------------------------------------- outcomes (encoded bytes)


def outcome_success(tokens: Optional[int] = None, count_attempt: bool = True,
                    input_tokens: Optional[int] = None, output_tokens: Optional[int] = None,
                    cached_input_tokens: Optional[int] = None, version: int = _wire.PROTOCOL_VERSION) -> bytes:
    """``Success``, or ``SuccessUsage`` when the input/output split is given, or
    ``SuccessCached`` (v3) when ``cached_input_tokens`` > 0 on a ``version`` 3
    connection (an older one gets ``SuccessUsage`` without the cached count)."""
    tokens = _check_count("tokens", tokens)
    input_tokens = _check_count("input_tokens", input_tokens)
    output_tokens = _check_count("output_tokens", output_tokens)
    cached = _check_count("cached_input_tokens", cached_input_tokens)
    _check_bool("count_attempt", count_attempt)
    if cached and version >= _wire.TENANT_VERSION:
        if (input_tokens or 0) + (output_tokens or 0) > MAX_COUNT:
            raise ValueError("input_tokens + output_tokens must be at most %d, got %r + %r"
                             % (MAX_COUNT, input_tokens, output_tokens))
        return _frames.success_cached(tokens, input_tokens, output_tokens, cached, count_attempt)
    if input_tokens is None and output_tokens is None:
        return _frames.success(tokens, count_attempt)
    if (input_tokens or 0) + (output_tokens or 0) > MAX_COUNT:
        raise ValueError("input_tokens + output_tokens must be at most %d, got %r + %r"
                         % (MAX_COUNT, input_tokens, output_tokens))
    return _frames.success_usage(tokens, input_tokens, output_tokens, count_attempt)


def outcome_failure(kind: str, tokens: Optional[int] = None) -> bytes:
    """``Failure``, or ``FailureUsage`` when the tokens the upstream still consumed are given."""
    wire = FAILURE_KINDS.get(kind) if isinstance(kind, str) else None
    if wire is None:
        raise ValueError(
            "unknown failure kind %r; allowed kinds: %s" % (kind, ", ".join(sorted(FAILURE_KINDS)))
        )
    tokens = _check_count("tokens", tokens)
    if tokens is None:
        return _frames.failure(wire)
    return _frames.failure_usage(wire, tokens, None, None)


def outcome_rate_limited(retry_after_s: Optional[float] = None) -> bytes:
    r = _check_seconds("retry_after_s", retry_after_s)
    if r is not None and r == float("inf"):
        raise ValueError("retry_after_s must be finite, got %r" % (retry_after_s,))
    return _frames.rate_limited(r)


OUTCOME_CANCELLED = _frames.CANCELLED


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
    if name == "TenantLimited":
        raise error_from_tenant_refusal(body)
    raise protocol_error("unexpected reply %s from the sidecar (expected %s)" % (name, " or ".join(names)))


class WelcomeSource(Protocol):
    """What a connection keeps of its handshake (both clients' ``_Connection``)."""

    welcome: Dict[str, Any]
    max_frame: int


C = TypeVar("C", bound=WelcomeSource)


class WelcomeInfo(Generic[C]):
    """The ``Welcome``-derived properties of a client, shared by the sync and
    asyncio ``Client``: read from the current connection (``_conn``), so a
    reconnect shows the new handshake."""

    _conn: C

    @property
    def protocol_version(self) -> int:
        """The protocol version of the current connection (from ``Welcome``)."""
        v: int = self._conn.welcome["protocol_version"]
        return v

    @property
    def sidecar_version(self) -> str:
        """The sidecar's version (from the current connection's ``Welcome``)."""
        v: str = self._conn.welcome["sidecar_version"]
        return v

    @property
    def max_frame(self) -> int:
        """The sidecar's frame size limit (from the current connection's ``Welcome``)."""
        return self._conn.max_frame


class VersionFallback(Exception):
    """Internal to the clients: the sidecar refused ``Hello`` 3 naming the versions
    it speaks, and 2 is one of them (an older sidecar, PROTOCOL.md §15). It has
    closed the connection: open a new one saying ``version``. Never reaches the user."""

    def __init__(self, version: int, said: str) -> None:
        super().__init__(said)
        self.version = version


def check_welcome(reply: Reply, version: int = _wire.PROTOCOL_VERSION) -> Dict[str, Any]:
    """The ``Welcome`` body of a ``Hello`` that said ``version``; raises
    :class:`VersionFallback` when an older sidecar refused 3 but speaks 2, and a
    clear error when it speaks no version this client does (a version-1 sidecar)."""
    name, body = variant(reply)
    theirs: Optional[int] = None
    if name == "Welcome":
        if _wire.FALLBACK_VERSION <= body["protocol_version"] <= version:
            welcome: Dict[str, Any] = body
            return welcome
        theirs = body["protocol_version"]
    elif name == "Error" and body["kind"] == "ProtocolViolation" and "version" in body["message"]:
        # "... this sidecar speaks versions 1 to 2" (or "speaks version 1", "speaks 1")
        m = re.search(r"sidecar speaks (?:versions? )?(\d+)(?: to (\d+))?", body["message"])
        theirs = int(m.group(2) or m.group(1)) if m else None
        if version > _wire.FALLBACK_VERSION and (theirs is None or theirs >= _wire.FALLBACK_VERSION):
            raise VersionFallback(_wire.FALLBACK_VERSION, body["message"])
    else:
        expect(reply, "Welcome")  # raises the mapped error / a protocol error
    raise SidecarError(
        "the sidecar speaks protocol %s, this client needs %d: upgrade polygate-sidecar%s"
        % (theirs if theirs is not None else "an older version", _wire.FALLBACK_VERSION,
           " (it said: %s)" % body["message"] if name == "Error" else ""),
        kind="protocol_violation",
    )


def late_cleanup(reply: Reply) -> Optional[Request]:
    """For a reply that arrived after its requester gave up: the request that
    releases what it created, or None. ``Started`` (a call and its permit) is
    finished as cancelled, a ``Granted`` permit reported cancelled, a begun
    call ended. (A call's own acquires pass sharper cleanups, see calls.py.)"""
    name, body = variant(reply)
    if name == "Started":
        return finish(body["permit"], OUTCOME_CANCELLED)
    if name == "Granted":
        return report(body["permit"], OUTCOME_CANCELLED)
    if name == "CallBegun":
        return end_call(body["call"])
    return None
