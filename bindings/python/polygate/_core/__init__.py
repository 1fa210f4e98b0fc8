"""The sans-I/O core shared by the sync and asyncio clients.

* :mod:`.protocol` – building requests and outcomes (validated), the handshake,
  reading replies;
* :mod:`.status`   – typed models: :class:`ReportResult`, the status TypedDicts;
* :mod:`.errmap`   – wire errors and socket trouble → :mod:`polygate.errors`;
* :mod:`.calls`    – call and permit state (``CallBase``, ``PermitBase``).

Nothing here touches a socket; :mod:`polygate._sync` and :mod:`polygate.aio` do
the I/O. The names below are the core's face for both clients (and the tests).
"""

from .._version import __version__ as CLIENT_VERSION
from .calls import CallBase, PermitBase, check_release
from .errmap import (
    SOCKET_ENV,
    client_closed_error,
    closed_error,
    connect_error,
    connection_error,
    error_from_reply,
    lost_error,
    protocol_error,
    snake,
    undecodable_error,
)
from .protocol import (
    DEFAULT_CLIENT_NAME,
    DEFAULT_SOCKET,
    FAILURE_KINDS,
    MAX_INCOMING_FRAME,
    OUTCOME_CANCELLED,
    PING,
    STATUS,
    Reply,
    Request,
    acquire,
    begin_call,
    cancel,
    check_welcome,
    end_call,
    expect,
    force_close,
    force_open,
    frame_request,
    hello,
    late_cleanup,
    outcome_failure,
    outcome_rate_limited,
    outcome_success,
    report,
    reset,
    resolve_path,
    variant,
)
from .status import ReportResult, ScopeStatus, SourceStatus, Status, report_result, status_dict

__all__ = [
    "CLIENT_VERSION", "CallBase", "PermitBase", "check_release",
    "SOCKET_ENV", "client_closed_error", "closed_error", "connect_error", "connection_error",
    "error_from_reply", "lost_error", "protocol_error", "snake", "undecodable_error",
    "DEFAULT_CLIENT_NAME", "DEFAULT_SOCKET", "FAILURE_KINDS", "MAX_INCOMING_FRAME",
    "OUTCOME_CANCELLED", "PING", "STATUS", "Reply", "Request", "acquire", "begin_call", "cancel",
    "check_welcome", "end_call", "expect", "force_close", "force_open", "frame_request", "hello", "late_cleanup",
    "outcome_failure", "outcome_rate_limited", "outcome_success", "report", "reset",
    "resolve_path", "variant",
    "ReportResult", "ScopeStatus", "SourceStatus", "Status", "report_result", "status_dict",
]
