"""The sans-I/O core shared by the sync and asyncio clients.

* :mod:`.protocol` – building requests and outcomes (validated), the handshake,
  reading replies;
* :mod:`.status`   – typed models: :class:`ReportResult`, the status TypedDicts;
* :mod:`.errmap`   – wire errors and socket trouble → :mod:`polygate.errors`;
* :mod:`.calls`    – call and permit state (``CallBase``, ``PermitBase``);
* :mod:`.run`      – what ``client.run`` decides: exception → :class:`Outcome`,
  a result's usage → token counts.

Nothing here touches a socket; :mod:`polygate._sync` and :mod:`polygate.aio` do
the I/O. The names below are the core's face for both clients (and the tests).
"""

from .._version import __version__ as CLIENT_VERSION
from .calls import Acquisition, CallBase, OnReply, PermitBase, Release
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
    STATUS_JSON,
    MAX_COUNT,
    Reply,
    Request,
    acquire,
    begin,
    call_spec,
    cancel,
    check_welcome,
    end_call,
    finish,
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
    retry,
    start,
    resolve_path,
    variant,
)
from .run import Classifier, Outcome, classify_exception, retry_after_seconds, usage_of
from .status import ReportResult, ScopeStatus, SourceStatus, Status, report_result, status_from_json

__all__ = [
    "CLIENT_VERSION", "Acquisition", "CallBase", "OnReply", "PermitBase", "Release",
    "SOCKET_ENV", "client_closed_error", "closed_error", "connect_error", "connection_error",
    "error_from_reply", "lost_error", "protocol_error", "snake", "undecodable_error",
    "DEFAULT_CLIENT_NAME", "DEFAULT_SOCKET", "FAILURE_KINDS", "MAX_INCOMING_FRAME",
    "OUTCOME_CANCELLED", "PING", "STATUS", "STATUS_JSON", "MAX_COUNT", "Reply", "Request", "acquire", "begin", "call_spec", "cancel",
    "check_welcome", "end_call", "finish", "expect", "force_close", "force_open", "frame_request", "hello", "late_cleanup",
    "outcome_failure", "outcome_rate_limited", "outcome_success", "report", "reset", "retry", "start",
    "resolve_path", "variant",
    "Classifier", "Outcome", "classify_exception", "retry_after_seconds", "usage_of",
    "ReportResult", "ScopeStatus", "SourceStatus", "Status", "report_result", "status_from_json",
]
