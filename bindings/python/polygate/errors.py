"""Exceptions raised by the PolyGate client.

Two families, both under :class:`PolyGateError`:

* :class:`GatewayUnavailableError` (and its subclasses :class:`CircuitOpenError`,
  :class:`AllSourcesExhausted` and :class:`TenantLimitExceeded`): the sidecar answered, and the answer is
  that this *call* cannot be served. The call-level budget is spent: retries,
  back-off, failover between sources and waiting already happened inside
  PolyGate. Re-submitting the job later is a *task-level* retry, a different
  thing; ``retry_after_s`` says when that is certainly worth it (0 = unknown/now).

* :class:`SidecarError`: trouble with the sidecar itself or with the request
  (connection refused or lost, protocol violation, unknown scope, permission
  denied, shutting down, ...). ``.kind`` is the wire ``ErrorKind`` in
  snake_case (``"unknown_scope"``, ``"shutting_down"``, ...) or, for trouble
  detected on this side of the socket, ``"connection"`` (cannot connect /
  connection lost) or ``"protocol"`` (the sidecar sent something this client
  cannot understand).
"""

from __future__ import annotations

from typing import Dict, Optional

__all__ = [
    "PolyGateError",
    "SidecarError",
    "GatewayUnavailableError",
    "CircuitOpenError",
    "AllSourcesExhausted",
    "TenantLimitExceeded",
    "RouteMissingError",
]


class PolyGateError(Exception):
    """Base class of every exception raised by ``polygate``."""

    def __init__(self, message: str, *, kind: str, scope: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        self.kind = kind
        self.scope = scope

    def __str__(self) -> str:
        return self.message


class SidecarError(PolyGateError):
    """Protocol/connection trouble, or a sidecar-side error not about the gateway.

    ``.kind``: the wire ``ErrorKind`` in snake_case (``unknown_scope``,
    ``unknown_call``, ``unknown_permit``, ``invalid_argument``, ``malformed``,
    ``frame_too_large``, ``protocol_violation``, ``permission_denied``,
    ``shutting_down``, ``cancelled``, ``busy``, ``internal``), or
    ``connection`` / ``protocol`` for trouble detected by this client.
    ``.message``: the sidecar's message (or a local one naming the socket path).
    """

    def __init__(
        self,
        message: str,
        *,
        kind: str = "connection",
        scope: Optional[str] = None,
        retry_after_s: float = 0.0,
    ) -> None:
        super().__init__(message, kind=kind, scope=scope)
        self.retry_after_s = retry_after_s


class GatewayUnavailableError(PolyGateError):
    """The call-level budget is spent: no source can serve this call.

    Retries, back-off, failover and waiting already happened inside PolyGate;
    do not retry the call in a loop. Re-submitting the whole job later is a
    task-level retry, a different thing.

    Attributes:
        retry_after_s: seconds until a retry is certainly worth attempting
            (0.0 = unknown or now).
        per_source_reasons: ``{source: reason}`` in config order, reason one of
            ``"circuit_open"``, ``"paced"``, ``"rate_limited"``,
            ``"backend_unavailable"``, ``"tenant_limited"``.
        scope: the scope of the call (or ``None``).
        kind: ``"circuit_open"``, ``"all_sources_exhausted"``,
            ``"tenant_limited"`` or ``"backend_unavailable"`` (the latter
            raised as this base class).
    """

    def __init__(
        self,
        message: str,
        *,
        kind: str = "backend_unavailable",
        retry_after_s: float = 0.0,
        per_source_reasons: Optional[Dict[str, str]] = None,
        scope: Optional[str] = None,
    ) -> None:
        super().__init__(message, kind=kind, scope=scope)
        self.retry_after_s = retry_after_s
        self.per_source_reasons = dict(per_source_reasons or {})


class CircuitOpenError(GatewayUnavailableError):
    """Every source of the scope refused for circuit reasons (fail-fast mode).

    ``retry_after_s`` is when the first breaker's cooldown ends.
    """

    def __init__(
        self,
        message: str,
        *,
        kind: str = "circuit_open",
        retry_after_s: float = 0.0,
        per_source_reasons: Optional[Dict[str, str]] = None,
        scope: Optional[str] = None,
    ) -> None:
        super().__init__(message, kind=kind, retry_after_s=retry_after_s,
                         per_source_reasons=per_source_reasons, scope=scope)


class AllSourcesExhausted(GatewayUnavailableError):
    """The call ran out of a budget; ``.reason`` says which.

    ``reason``: ``"stalled"`` (waited longer than ``stall_window``),
    ``"quota_exhausted"`` (quota/pacer refused and ``quota_full = fail_fast``)
    or ``"retry_exhausted"`` (``max_attempts`` attempts were made).
    """

    def __init__(
        self,
        message: str,
        *,
        reason: Optional[str] = None,
        kind: str = "all_sources_exhausted",
        retry_after_s: float = 0.0,
        per_source_reasons: Optional[Dict[str, str]] = None,
        scope: Optional[str] = None,
    ) -> None:
        super().__init__(message, kind=kind, retry_after_s=retry_after_s,
                         per_source_reasons=per_source_reasons, scope=scope)
        self.reason = reason


class TenantLimitExceeded(GatewayUnavailableError):
    """The call's tenant is over one of its limits (DESIGN §19): the call is over.

    Nothing was started (or the retry was refused); ``client.run`` raises it at
    once, without another attempt — every source of the scope would refuse the
    same tenant. ``tenant`` names the tenant (``""``: the scope's anonymous
    tenant), ``limit`` the limit that refused: ``"tpm"``, ``"rpm"``, ``"tpd"``,
    ``"rpd"``, ``"usd_per_day"`` or ``"usd_per_month"``. ``retry_after_s`` is how
    long until the tenant's bucket certainly holds the call, or, for a spent dollar
    budget, until its calendar window (UTC day or month) ends; re-submitting a job
    before then is refused again. ``per_source_reasons`` names ``"tenant_limited"``
    for each source the tenant refused.
    """

    def __init__(
        self,
        message: str,
        *,
        tenant: str,
        limit: str,
        kind: str = "tenant_limited",
        retry_after_s: float = 0.0,
        per_source_reasons: Optional[Dict[str, str]] = None,
        scope: Optional[str] = None,
    ) -> None:
        super().__init__(message, kind=kind, retry_after_s=retry_after_s,
                         per_source_reasons=per_source_reasons, scope=scope)
        self.tenant = tenant
        self.limit = limit


class RouteMissingError(PolyGateError):
    """An HTTP transport with ``routes`` was granted a source it has no route for
    (DESIGN §17 item 2): nothing was sent, the permit was released. Add the source to
    ``routes`` (or remove it from the scope). ``.source`` names it."""

    def __init__(self, message: str, *, source: str, scope: Optional[str] = None) -> None:
        super().__init__(message, kind="route_missing", scope=scope)
        self.source = source
