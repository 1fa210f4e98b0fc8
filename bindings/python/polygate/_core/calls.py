"""The state of a call and its permits, shared by the sync and asyncio clients:
which request to send next, what a reply means, what leaving a call must
release. The clients add only the I/O (send, wait). No I/O here."""

from __future__ import annotations

import threading
from typing import Any, Dict, Generic, List, Optional, Type, TypeVar

from ..errors import PolyGateError, SidecarError
from . import protocol as p
from .status import ReportResult, report_result

__all__ = ["PermitBase", "CallBase"]


class PermitBase:
    """The fields of a granted permit and its report-exactly-once rule."""

    def __init__(self, call: "CallBase[Any]", body: Dict[str, Any]) -> None:
        self._call = call
        self.id: int = body["permit"]
        """The permit id (unique on the connection)."""
        self.source: str = body["source"]
        """The source this attempt may call."""
        self.is_probe: bool = body["is_probe"]
        """True when this attempt is the breaker's half-open probe."""
        self.attempt: int = body["attempt"]
        """1 for the call's first attempt, 2 for the second, ..."""
        self.est_tokens: int = body["est_tokens"]
        """The tokens reserved for this attempt."""
        self.result: Optional[ReportResult] = None
        """The sidecar's answer to the report, once it arrived."""
        self._reported = False
        self._lock = threading.Lock()  # threads of the sync client may race to report

    @property
    def reported(self) -> bool:
        """True once an outcome was given (or the permit was released)."""
        return self._reported

    def _claim(self, outcome: Any) -> p.Request:
        """Mark the permit reported (once only) and return its ``Report``."""
        with self._lock:
            if self._reported:
                raise RuntimeError("permit %d (source %r) was already reported" % (self.id, self.source))
            self._reported = True
        if self._call._permit is self:
            self._call._permit = None
        return p.report(self.id, outcome)

    def _reported_as(self, reply: p.Reply) -> ReportResult:
        self.result = report_result(p.expect(reply, "Reported"))
        return self.result

    def __repr__(self) -> str:
        return "<%s %s source=%r attempt=%d probe=%s est_tokens=%d%s>" % (
            type(self).__name__, self.id, self.source, self.attempt, self.is_probe, self.est_tokens,
            " reported" if self._reported else "")


P = TypeVar("P", bound=PermitBase)


class CallBase(Generic[P]):
    """One logical request in a scope: its id once begun, its unreported permit."""

    _permit_class: Type[P]

    def __init__(self, client: Any, scope: str, est_tokens: Optional[int]) -> None:
        p.begin_call(scope, est_tokens)  # validate before anything is sent
        self._client = client
        self._conn = client._conn
        self.scope = scope
        """The scope this call runs in."""
        self.est_tokens = est_tokens
        """The estimate given to ``call()`` (None: the sidecar's estimate)."""
        self.id: Optional[int] = None
        """The sidecar's call id once begun."""
        self._permit: Optional[P] = None
        self._ended = False

    @property
    def permit(self) -> Optional[P]:
        """The granted permit not yet reported, if any."""
        return self._permit

    def _begin_request(self) -> Optional[p.Request]:
        """The ``BeginCall`` to send, or None when the call has begun already."""
        if self._ended:
            raise RuntimeError("call in scope %r has ended" % self.scope)
        return p.begin_call(self.scope, self.est_tokens) if self.id is None else None

    def _began(self, reply: p.Reply) -> None:
        self.id = p.expect(reply, "CallBegun")["call"]

    def _acquire_request(self) -> p.Request:
        assert self.id is not None
        return p.acquire(self.id)

    def _granted(self, reply: p.Reply) -> P:
        permit = self._permit_class(self, p.expect(reply, "Granted"))
        self._permit = permit
        return permit

    def _release(self) -> List[p.Request]:
        """End the call here; the requests that release what it still holds on
        the sidecar (``Report(Cancelled)`` of an unreported permit, ``EndCall``),
        none when it never began or the connection is gone (the sidecar released
        it all then). Idempotent: a second call returns []."""
        if self._ended:
            return []
        self._ended = True
        permit, self._permit = self._permit, None
        if self.id is None or self._conn.closed:
            return []
        out: List[p.Request] = []
        if permit is not None and not permit._reported:
            permit._reported = True
            out.append(p.report(permit.id, p.OUTCOME_CANCELLED))
        out.append(p.end_call(self.id))
        return out


def check_release(request: p.Request, reply: Optional[p.Reply], error: Optional[BaseException]) -> None:
    """Raise what a release request's answer means for the caller: nothing for a
    refused ``Report(Cancelled)`` (e.g. the lease was reclaimed; EndCall releases
    anyway), a lost connection or an ``EndCall`` of a call already gone."""
    if p.variant(request)[0] == "Report":
        return
    if error is None and reply is not None:
        try:
            p.expect(reply, "Ok")
        except PolyGateError as e:
            error = e
    if error is None:
        return
    if isinstance(error, SidecarError) and error.kind in ("connection", "unknown_call"):
        return
    raise error
