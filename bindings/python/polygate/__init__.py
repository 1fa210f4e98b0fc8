"""PolyGate client: ask the per-host admission sidecar which source to call.

::

    import polygate
    client = polygate.connect()
    with client.call("chat", est_tokens=1200) as call:
        permit = call.acquire()
        ...
        permit.success(tokens=1234)

``polygate.aio`` has the same names, awaitable. See README.md.
"""

from ._core import Limit, Limits, Outcome, ReportResult, ScopeStatus, SourceStatus, Status, parse_headers
from ._autostart import sidecar_path
from ._version import __version__
from ._sync import Call, Client, Permit, connect
from .errors import (
    AllSourcesExhausted,
    CircuitOpenError,
    GatewayUnavailableError,
    PolyGateError,
    RouteMissingError,
    SidecarError,
    TenantLimitExceeded,
)

__all__ = [
    "Limit",
    "Limits",
    "parse_headers",
    "connect",
    "sidecar_path",
    "Client",
    "Call",
    "Permit",
    "ReportResult",
    "Outcome",
    "Status",
    "ScopeStatus",
    "SourceStatus",
    "PolyGateError",
    "SidecarError",
    "GatewayUnavailableError",
    "CircuitOpenError",
    "AllSourcesExhausted",
    "TenantLimitExceeded",
    "RouteMissingError",
    "__version__",
]
