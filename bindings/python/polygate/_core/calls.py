"""The state of a call and its permits, shared by the sync and asyncio clients:
which frame to send next, what a reply means, what leaving a call must release.
The clients add only the I/O (send, wait). No I/O here.

Protocol version 2 (PROTOCOL.md §14), in the fewest frames:

* the first ``acquire()`` sends ``Start`` (BeginCall + Acquire); ``begin()``, if
  called first, sends ``Begin`` and the first ``acquire()`` a plain ``Acquire``;
  a call for a tenant sends ``StartTenant`` / ``BeginTenant`` instead (version 3,
  §15), and is refused here, before anything is sent, on an older connection;
* a ``failure`` / ``rate_limited`` / ``cancel`` / uncounted ``success`` report is
  *held* and travels with the next ``acquire()`` as ``Retry`` — or with the end of
  the call as ``Finish``;
* a counted ``success`` sends ``Finish`` at once: the call is over;
* leaving the call sends one frame at most: ``Finish`` of a held report, else
  ``EndCall`` of a call still open (an unreported permit is abandoned: its
  estimate stays charged, PROTOCOL.md §8).

An error answering ``Start`` or ``Retry`` (other than the validation errors
``UnknownPermit`` / ``InvalidArgument``), or a tenant's refusal
(``TenantLimited``), means the sidecar has no call any more: the call is over
here too, and nothing is sent at its end.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, Generic, Mapping, NamedTuple, Optional, Tuple, Type, TypeVar

from . import protocol as p
from .errmap import error_from_reply
from .ratelimit import Limits, as_limits, encode_limits, parse_headers
from .run import Classifier, Outcome, _headers, classify_exception, outcome_report
from .status import ReportResult, report_result

__all__ = ["PermitBase", "CallBase", "Acquisition", "Release"]

# Errors after which Retry / Finish changed nothing: the call is still open.
_VALIDATION = ("UnknownPermit", "InvalidArgument")

OnReply = Callable[[p.Reply], Optional[bytes]]
"""Reads a reply nobody awaits (or a release's reply); returns a follow-up request."""


def _nothing(reply: p.Reply) -> Optional[bytes]:
    return None


class _Unbound:
    """The connection of a call that has sent nothing yet: holds nothing on any sidecar."""

    closed = True


UNBOUND: Any = _Unbound()


class Acquisition(NamedTuple):
    """What one ``acquire()`` sends, and how a reply nobody awaits is cleaned up."""

    request: bytes
    kind: str
    """``"start"``, ``"retry"`` or ``"acquire"``."""
    on_late: OnReply
    fresh: bool
    """The call's first frame (``Start``): it needs nothing of a connection, so
    if it cannot leave the one it is bound to (found lost) it goes out on a new one."""


class Release(NamedTuple):
    """The one frame that releases what a call still holds on the sidecar."""

    request: bytes
    on_reply: OnReply
    """Reads its reply (records a permit's result; may ask for an ``EndCall``)."""


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
        self.tokens: Optional[int] = None
        """Usage a ``client.run`` function may set (``permit.tokens = n``) when its
        result carries none; ``run`` reports it."""
        self._limits: Optional[Limits] = None
        self._wire_limits: Optional[bytes] = None
        self.result: Optional[ReportResult] = None
        """The sidecar's answer to this permit's report, once one arrived (a report
        sent with ``Retry`` gets none: the answer to Retry is the next permit)."""
        self._reported = False
        self._lock = threading.Lock()  # threads of the sync client may race to report

    @property
    def limits(self) -> Optional[Limits]:
        """The provider's rate-limit headers of this attempt's response (DESIGN §18),
        sent with its report: set by hand (``permit.limits = Limits(...)``, a mapping
        of its keys such as ``{"tokens": {"remaining": 200}}``, or
        ``parse_headers(response.headers)[0]``), or by ``client.run`` from the
        result's or the exception's headers. Another type raises TypeError here."""
        return self._limits

    @limits.setter
    def limits(self, value: "Limits | Mapping[str, Any] | None") -> None:
        self._limits = as_limits(value)

    @property
    def reported(self) -> bool:
        """True once an outcome was given (or the permit was released)."""
        return self._reported

    def _claim(self) -> None:
        with self._lock:
            if self._reported:
                raise RuntimeError("permit %d (source %r) was already reported" % (self.id, self.source))
            self._reported = True
        if self._call._permit is self:
            self._call._permit = None

    def __repr__(self) -> str:
        return "<%s %s source=%r attempt=%d probe=%s est_tokens=%d%s>" % (
            type(self).__name__, self.id, self.source, self.attempt, self.is_probe, self.est_tokens,
            " reported" if self._reported else "")


P = TypeVar("P", bound=PermitBase)


class CallBase(Generic[P]):
    """One logical request in a scope: its spec, its id once the sidecar has it,
    its unreported permit or its held report."""

    _permit_class: Type[P]

    def __init__(self, client: Any, scope: str, est_tokens: Optional[int] = None,
                 priority: Optional[str] = None, est_input_tokens: Optional[int] = None,
                 est_output_tokens: Optional[int] = None, tenant: Optional[str] = None) -> None:
        # validated and encoded once, before anything is sent
        self._spec = p.call_spec(scope, est_tokens, priority, est_input_tokens, est_output_tokens)
        # None: the anonymous tenant (plain Start / Begin)
        self._tenant = None if tenant is None else p.tenant_id(tenant)
        self._client = client
        # The connection this call's frames go to: bound by its first frame (Start
        # or Begin), so a call made before a lost connection was replaced uses the
        # new one; a call begun on a connection that is lost dies with it.
        self._conn: Any = UNBOUND
        self.scope = scope
        """The scope this call runs in."""
        self.est_tokens = est_tokens
        """The per-attempt estimate given (None: the sidecar's)."""
        self.priority = priority or None
        """The priority class asked for (None: the scope's default)."""
        self.tenant = tenant or None
        """The tenant the call is made for (None: the scope's anonymous tenant)."""
        self.id: Optional[int] = None
        """The sidecar's call id, once the call began there."""
        self._permit: Optional[P] = None
        self._held: Optional[Tuple[P, bytes]] = None
        self._live = False  # the sidecar holds the call: something must end it
        self._ended: Optional[str] = None  # why no acquire is possible any more
        self._released = False

    @property
    def permit(self) -> Optional[P]:
        """The granted permit not yet reported, if any."""
        return self._permit

    @property
    def ended(self) -> bool:
        """True once the call is over (success, a final error, or released)."""
        return self._ended is not None

    def _close(self, reason: str) -> None:
        if self._ended is None:
            self._ended = reason

    def _check_open(self) -> None:
        if self._ended is not None:
            raise RuntimeError("call in scope %r has ended: %s" % (self.scope, self._ended))

    def _bind(self, conn: Any) -> Any:
        """Bind the call to ``conn`` for its first frame. A call for a tenant needs a
        version-3 connection: on an older one it is refused here, before anything
        is sent — never sent without its tenant. (A connection found lost is
        checked once it is replaced, see the clients' ``_resend``.)"""
        if self._tenant is not None and not conn.closed:
            p.require_tenants(conn.welcome, "call in scope %r for tenant %r" % (self.scope, self.tenant))
        self._conn = conn
        return conn

    @property
    def _protocol_version(self) -> int:
        """The version of the connection the call is bound to (a permit's report
        picks its outcome by it: ``SuccessCached`` needs 3)."""
        v: int = self._conn.welcome["protocol_version"]
        return v

    # ------------------------------------------------------------ begin

    def _begin_request(self) -> Optional[bytes]:
        """The ``Begin`` to send, or None when the sidecar has the call already."""
        self._check_open()
        if self._live:
            return None
        self._bind(self._client._conn)  # the first frame binds the call to the client's connection
        if self._tenant is not None:
            return p.begin_tenant(self._spec, self._tenant)
        return p.begin(self._spec)

    def _began(self, reply: p.Reply) -> None:
        self.id = p.expect(reply, "CallBegun")["call"]
        self._live = True

    # ------------------------------------------------------------ acquire

    def _acquisition(self) -> Acquisition:
        self._check_open()
        if self._permit is not None:
            raise RuntimeError("permit %d of this call is not reported: report it (success, failure, "
                               "rate_limited or cancel) before acquiring again" % self._permit.id)
        if self._held is not None:
            held = self._held[0]
            return Acquisition(p.retry(held.id, self._held[1], held._wire_limits), "retry", self._late_retry, False)
        if not self._live:
            self._bind(self._client._conn)  # the first frame binds the call to the client's connection
            request = p.start(self._spec) if self._tenant is None else p.start_tenant(self._spec, self._tenant)
            return Acquisition(request, "start", self._late_grant_ends_call, True)
        assert self.id is not None
        return Acquisition(p.acquire(self.id), "acquire", p.late_cleanup, False)

    def _acquired(self, acq: Acquisition, reply: p.Reply) -> P:
        name, body = p.variant(reply)
        if acq.kind == "retry":
            self._held = None
        if name in ("Started", "Granted") and (name == "Started") == (acq.kind == "start"):
            if name == "Started":
                self.id = body["call"]
                self._live = True
            permit = self._permit_class(self, body)
            self._permit = permit
            return permit
        if name == "Error" and (acq.kind == "acquire" or (acq.kind == "retry" and body["kind"] in _VALIDATION)):
            raise error_from_reply(body)  # the call is still open (the held report is dropped)
        if acq.kind != "acquire":  # any other answer to Start / Retry: the sidecar has no call
            self._live = False
            said = body["message"] if name == "Error" else body["error"]["message"] if name == "TenantLimited" \
                else name
            self._close("%s (the sidecar ended the call)" % said)
        p.expect(reply, "Started" if acq.kind == "start" else "Granted")
        raise AssertionError("unreachable")  # pragma: no cover

    def _acquire_abandoned(self, acq: Acquisition) -> None:
        """The wait was interrupted / cancelled. A cancelled Start or Retry leaves
        no call (a grant that raced the Cancel is finished by ``on_late``)."""
        if acq.kind != "acquire":
            self._held = None
            self._live = False
            self._close("its acquire() was interrupted")

    def _late_grant_ends_call(self, reply: p.Reply) -> Optional[bytes]:
        name, body = p.variant(reply)
        if name in ("Started", "Granted"):
            return p.finish(body["permit"], p.OUTCOME_CANCELLED)
        return None

    def _late_retry(self, reply: p.Reply) -> Optional[bytes]:
        name, body = p.variant(reply)
        if name == "Error" and body["kind"] in _VALIDATION and self.id is not None:
            return p.end_call(self.id)  # Retry changed nothing: the call is still open
        return self._late_grant_ends_call(reply)

    # ------------------------------------------------------------ reports

    def _report(self, permit: P, outcome: bytes, final: bool) -> Optional[bytes]:
        """Claim ``permit`` for ``outcome``. A final (counted success) report is
        returned as the ``Finish`` to send now; any other is held for the next
        ``acquire()`` (as ``Retry``) or the end of the call (as ``Finish``)."""
        wire_limits = encode_limits(permit.limits)  # a bad value raises before the claim
        permit._claim()
        permit._wire_limits = wire_limits
        if not final:
            self._held = (permit, outcome)
            return None
        # _live stays set until Reported arrives: if the wait for it is interrupted,
        # the end of the call still sends EndCall, in case the Finish never went out.
        self._close("it succeeded (a counted success ends the call); start a new call")
        return p.finish(permit.id, outcome, wire_limits)

    def _attempt_failed(self, permit: P, exc: BaseException, classify: Optional[Classifier]) -> Outcome:
        """``client.run``: the function raised ``exc`` during ``permit``'s attempt.
        Classify it and hold the report (it goes out as Retry or Finish)."""
        outcome = classify_exception(exc, classify)
        if permit.limits is None:  # §18: an SDK's HTTP error carries the response's headers
            permit.limits = parse_headers(_headers(exc))[0]
        if not permit._reported:
            self._report(permit, outcome_report(outcome), final=False)
        return outcome

    def _finished(self, permit: P, reply: p.Reply) -> ReportResult:
        name, body = p.variant(reply)
        if name == "Reported":
            self._live = False
            permit.result = report_result(body)
            return permit.result
        if not (name == "Error" and body["kind"] in _VALIDATION):
            self._live = False  # the call is gone either way (e.g. BackendUnavailable)
        return report_result(p.expect(reply, "Reported"))  # raises

    # ------------------------------------------------------------ release

    def _release(self) -> Optional[Release]:
        """End the call here (idempotent); the one frame that releases what it
        still holds, or None (nothing on the sidecar, or the connection is gone)."""
        if self._released:
            return None
        self._released = True
        self._close("the call has ended")
        held, permit, live = self._held, self._permit, self._live
        self._held, self._permit, self._live = None, None, False
        if self._conn.closed:
            return None  # nothing sent yet (UNBOUND), or the sidecar released it all with the connection
        if held is not None:
            return Release(p.finish(held[0].id, held[1], held[0]._wire_limits), self._after_finish(held[0]))
        if permit is not None and not permit._reported:
            # Never reported: the request may have been sent, so the call is ended
            # and the permit *abandoned* (PROTOCOL.md §8): its estimate stays
            # charged, its probe lease and pacer slot are released, the breaker
            # learns nothing — as on a closed connection, and as the Node and Go
            # bindings do. Report ``cancel()`` first if nothing was sent.
            permit._reported = True
        if live and self.id is not None:
            return Release(p.end_call(self.id), _nothing)
        return None

    def _after_finish(self, permit: P) -> OnReply:
        call_id = self.id

        def on_reply(reply: p.Reply) -> Optional[bytes]:
            name, body = p.variant(reply)
            if name == "Reported":
                permit.result = report_result(body)
            elif name == "Error" and body["kind"] in _VALIDATION and call_id is not None:
                return p.end_call(call_id)  # Finish changed nothing: end the call itself
            return None
        return on_reply
