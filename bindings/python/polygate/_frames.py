"""Pre-built encoders and decoders for the hot frames (DESIGN §16).

A call costs two frames each way (``Start``/``Started``, ``Finish``/``Reported``),
and each of them is built or read here with fixed :mod:`struct` formats, no walk
over the schema of :mod:`polygate._wire` (about 35 µs a frame pair there, a few
µs here). Everything else — the handshake, status, admin — and every frame this
module does not recognise go through the generic codec, which stays the
reference: the golden vectors pass through both.

Encoders return the encoded ``Request`` *body* (the bytes after the frame's
``id``); :func:`frame` puts the length prefix and the id in front. Outcomes are
encoded bytes too, so a report is one concatenation. Callers validate values
first (``polygate._core.protocol``); a value out of range here raises
``struct.error``.

:func:`decode_server_frame` returns exactly what
``_wire.decode_server_frame`` returns. For a hot reply tag it decodes with
struct; anything unusual (a bad bool byte, a truncated or over-long payload,
invalid UTF-8, an unknown tag) drops to the generic decoder, which then raises
its precise :class:`~polygate._wire.WireError` — so the two can never disagree.
"""

from __future__ import annotations

import struct
from typing import Any, Callable, Dict, List, Optional, Tuple

from . import _wire

__all__ = [
    "frame", "call_spec", "tenant", "start", "begin", "start_tenant", "begin_tenant", "acquire", "report", "retry", "finish", "end_call", "cancel",
    "observed_limit", "observed_limits",
    "success", "success_usage", "success_cached", "failure", "failure_usage", "rate_limited", "CANCELLED",
    "decode_server_frame", "HOT_REQUESTS", "HOT_REPLIES",
]

_BE32 = struct.Struct(">I")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_TAG_U64 = struct.Struct("<IQ")
_TAG_U32 = struct.Struct("<II")
_ID_TAG = struct.Struct("<QI")
_U64_U64 = struct.Struct("<QQ")
_U64_U64_U64 = struct.Struct("<QQQ")
_BOOL_U32_U64 = struct.Struct("<BIQ")
_BOOL_U32_F64 = struct.Struct("<BId")
_F64_U64 = struct.Struct("<dQ")
_SOME_F64 = struct.Struct("<IBd")
_SOME_U64 = struct.Struct("<BQ")


def _tag(name: str, enum: Any = _wire.REQUEST) -> int:
    index: int = enum.index[name]
    return index


# Request tags (the layout's source of truth is _wire's schema; these follow it).
_ACQUIRE, _REPORT, _END_CALL, _CANCEL = (_tag(n) for n in ("Acquire", "Report", "EndCall", "Cancel"))
_START, _RETRY, _FINISH, _BEGIN = (_tag(n) for n in ("Start", "Retry", "Finish", "Begin"))
_REPORT_OBS, _RETRY_OBS, _FINISH_OBS = (_tag(n) for n in ("ReportObserved", "RetryObserved", "FinishObserved"))
_START_TAG = _U32.pack(_START)
_BEGIN_TAG = _U32.pack(_BEGIN)
_START_TENANT_TAG = _U32.pack(_tag("StartTenant"))
_BEGIN_TENANT_TAG = _U32.pack(_tag("BeginTenant"))

HOT_REQUESTS = ("Start", "StartTenant", "Retry", "Finish", "Report", "Acquire", "EndCall", "Cancel")
"""The request variants built here (``Begin`` and ``BeginTenant`` too: they share
``Start``'s and ``StartTenant``'s bodies)."""


def frame(rid: int, body: bytes) -> bytes:
    """The complete frame of request ``body`` with id ``rid``."""
    return _BE32.pack(8 + len(body)) + _U64.pack(rid) + body


# ---------------------------------------------------------------- requests

_NONE = b"\x00"


def _opt_u64(value: Optional[int]) -> bytes:
    return _NONE if value is None else _SOME_U64.pack(1, value)


def _string(value: str) -> bytes:
    raw = value.encode("utf-8")
    return _U64.pack(len(raw)) + raw


def call_spec(scope: str, est_tokens: Optional[int], priority: Optional[str],
              est_input_tokens: Optional[int], est_output_tokens: Optional[int]) -> bytes:
    """An encoded ``CallSpec`` (built once per call, sent by ``Start`` / ``Begin``)."""
    return b"".join((
        _string(scope),
        _opt_u64(est_tokens),
        _NONE if priority is None else b"\x01" + _string(priority),
        _opt_u64(est_input_tokens),
        _opt_u64(est_output_tokens),
    ))


def start(spec: bytes) -> bytes:
    """``Start(CallSpec)``: BeginCall + Acquire in one frame."""
    return _START_TAG + spec


def begin(spec: bytes) -> bytes:
    """``Begin(CallSpec)``: BeginCall with the version-2 fields."""
    return _BEGIN_TAG + spec


def tenant(tenant_id: str) -> bytes:
    """An encoded tenant id (built once per call, appended to the ``CallSpec``)."""
    return _string(tenant_id)


def start_tenant(spec: bytes, tenant_id: bytes) -> bytes:
    """``StartTenant{spec, tenant}`` (v3): ``Start`` on behalf of a tenant;
    ``tenant_id`` from :func:`tenant`."""
    return _START_TENANT_TAG + spec + tenant_id


def begin_tenant(spec: bytes, tenant_id: bytes) -> bytes:
    """``BeginTenant{spec, tenant}`` (v3): ``Begin`` on behalf of a tenant."""
    return _BEGIN_TENANT_TAG + spec + tenant_id


def acquire(call: int) -> bytes:
    return _TAG_U64.pack(_ACQUIRE, call)


def end_call(call: int) -> bytes:
    return _TAG_U64.pack(_END_CALL, call)


def cancel(target: int) -> bytes:
    return _TAG_U64.pack(_CANCEL, target)


def report(permit: int, outcome: bytes, limits: Optional[bytes] = None) -> bytes:
    """``Report{permit, outcome}``, or ``ReportObserved`` with encoded ``limits``."""
    if limits is not None:
        return _TAG_U64.pack(_REPORT_OBS, permit) + outcome + limits
    return _TAG_U64.pack(_REPORT, permit) + outcome


def retry(permit: int, outcome: bytes, limits: Optional[bytes] = None) -> bytes:
    """``Retry{permit, outcome}``: Report + Acquire of the permit's call
    (``RetryObserved`` with encoded ``limits``, DESIGN §18)."""
    if limits is not None:
        return _TAG_U64.pack(_RETRY_OBS, permit) + outcome + limits
    return _TAG_U64.pack(_RETRY, permit) + outcome


def finish(permit: int, outcome: bytes, limits: Optional[bytes] = None) -> bytes:
    """``Finish{permit, outcome}``: Report + EndCall (``FinishObserved`` with
    encoded ``limits``)."""
    if limits is not None:
        return _TAG_U64.pack(_FINISH_OBS, permit) + outcome + limits
    return _TAG_U64.pack(_FINISH, permit) + outcome


_F64 = struct.Struct("<d")


def _opt_f64(value: Optional[float]) -> bytes:
    return _NONE if value is None else b"\x01" + _F64.pack(value)


def observed_limit(limit: Optional[int], remaining: Optional[int], reset_s: Optional[float]) -> bytes:
    """``Some(ObservedLimit{limit, remaining, reset_s})`` (DESIGN §18)."""
    return b"\x01" + _opt_u64(limit) + _opt_u64(remaining) + _opt_f64(reset_s)


def observed_limits(requests: Optional[bytes], tokens: Optional[bytes], input_tokens: Optional[bytes],
                    output_tokens: Optional[bytes], age_s: float) -> bytes:
    """``ObservedLimits``: each dimension from :func:`observed_limit` or None."""
    return b"".join(d if d is not None else _NONE for d in (requests, tokens, input_tokens, output_tokens)) \
        + _F64.pack(age_s)


# ---------------------------------------------------------------- outcomes

_O = _wire.OUTCOME
_SUCCESS, _FAILURE, _RATE_LIMITED, _CANCELLED_TAG, _SUCCESS_USAGE, _FAILURE_USAGE, _SUCCESS_CACHED = (
    _tag(n, _O) for n in ("Success", "Failure", "RateLimited", "Cancelled", "SuccessUsage", "FailureUsage",
                          "SuccessCached"))
_FAILURE_KIND_INDEX = dict(_wire.FAILURE_KIND.index)

CANCELLED = _U32.pack(_CANCELLED_TAG)
_SUCCESS_NO_TOKENS = {True: _U32.pack(_SUCCESS) + b"\x00\x01", False: _U32.pack(_SUCCESS) + b"\x00\x00"}
_FAILURES = {k: _TAG_U32.pack(_FAILURE, i) for k, i in _FAILURE_KIND_INDEX.items()}
_RATE_LIMITED_NONE = _U32.pack(_RATE_LIMITED) + _NONE


def success(tokens: Optional[int], count_attempt: bool) -> bytes:
    """``Success{tokens, count_attempt}``."""
    if tokens is None:
        return _SUCCESS_NO_TOKENS[count_attempt]
    return _U32.pack(_SUCCESS) + _SOME_U64.pack(1, tokens) + (b"\x01" if count_attempt else b"\x00")


def _usage(tokens: Optional[int], input_tokens: Optional[int], output_tokens: Optional[int]) -> bytes:
    return _opt_u64(tokens) + _opt_u64(input_tokens) + _opt_u64(output_tokens)


def success_usage(tokens: Optional[int], input_tokens: Optional[int], output_tokens: Optional[int],
                  count_attempt: bool) -> bytes:
    """``SuccessUsage{usage, count_attempt}``."""
    return (_U32.pack(_SUCCESS_USAGE) + _usage(tokens, input_tokens, output_tokens)
            + (b"\x01" if count_attempt else b"\x00"))


def success_cached(tokens: Optional[int], input_tokens: Optional[int], output_tokens: Optional[int],
                   cached_input_tokens: int, count_attempt: bool) -> bytes:
    """``SuccessCached{usage, cached_input_tokens, count_attempt}`` (v3)."""
    return (_U32.pack(_SUCCESS_CACHED) + _usage(tokens, input_tokens, output_tokens)
            + _U64.pack(cached_input_tokens) + (b"\x01" if count_attempt else b"\x00"))


def failure(kind: str) -> bytes:
    """``Failure{kind}``; ``kind`` is the wire name (``"Timeout"``, ...)."""
    return _FAILURES[kind]


def failure_usage(kind: str, tokens: Optional[int], input_tokens: Optional[int],
                  output_tokens: Optional[int]) -> bytes:
    """``FailureUsage{kind, usage}``."""
    return _TAG_U32.pack(_FAILURE_USAGE, _FAILURE_KIND_INDEX[kind]) + _usage(tokens, input_tokens, output_tokens)


def rate_limited(retry_after_s: Optional[float]) -> bytes:
    """``RateLimited{retry_after_s}``."""
    if retry_after_s is None:
        return _RATE_LIMITED_NONE
    return _SOME_F64.pack(_RATE_LIMITED, 1, retry_after_s)


# ---------------------------------------------------------------- replies
#
# Each decoder gets the payload and the offset after the reply tag and returns
# the reply value, or None for anything it does not vouch for (the generic
# decoder then has the last word). Lengths are checked before any slice: a
# slice past the end would silently come back short.

_Value = Optional[Any]
_BREAKER = [v for v, _ in _wire.BREAKER_STATE.variants]
_ERROR_KINDS = [v for v, _ in _wire.ERROR_KIND.variants]
_SKIP_REASONS = [v for v, _ in _wire.SKIP_REASON.variants]
_EXHAUSTION = [v for v, _ in _wire.EXHAUSTION_REASON.variants]


def _granted(b: bytes, o: int) -> _Value:
    permit, n = _U64_U64.unpack_from(b, o)
    o += 16
    end = o + n
    if end + 13 != len(b):
        return None
    probe, attempt, est = _BOOL_U32_U64.unpack_from(b, end)
    if probe > 1:
        return None
    return {"Granted": {"permit": permit, "source": str(b[o:end], "utf-8"), "is_probe": probe == 1,
                        "attempt": attempt, "est_tokens": est}}


def _started(b: bytes, o: int) -> _Value:
    call, permit, n = _U64_U64_U64.unpack_from(b, o)
    o += 24
    end = o + n
    if end + 13 != len(b):
        return None
    probe, attempt, est = _BOOL_U32_U64.unpack_from(b, end)
    if probe > 1:
        return None
    return {"Started": {"call": call, "permit": permit, "source": str(b[o:end], "utf-8"),
                        "is_probe": probe == 1, "attempt": attempt, "est_tokens": est}}


def _reported(b: bytes, o: int) -> _Value:
    if o + 13 != len(b):
        return None
    applied, state, retry_after_s = _BOOL_U32_F64.unpack_from(b, o)
    if applied > 1 or state >= len(_BREAKER):
        return None
    return {"Reported": {"applied": applied == 1, "state": _BREAKER[state], "retry_after_s": retry_after_s}}


def _call_begun(b: bytes, o: int) -> _Value:
    if o + 8 != len(b):
        return None
    return {"CallBegun": {"call": _U64.unpack_from(b, o)[0]}}


def _unit(name: str) -> Callable[[bytes, int], _Value]:
    def dec(b: bytes, o: int) -> _Value:
        return name if o == len(b) else None
    return dec


def _error(b: bytes, o: int) -> _Value:
    size = len(b)
    kind, n = _TAG_U64.unpack_from(b, o)  # u32 kind, u64 message length
    o += 12
    if kind >= len(_ERROR_KINDS) or o + n > size:
        return None
    message = str(b[o:o + n], "utf-8")
    o += n
    retry_after_s, count = _F64_U64.unpack_from(b, o)
    o += 16
    if count > size - o:
        return None
    reasons: List[List[str]] = []
    for _ in range(count):
        (n,) = _U64.unpack_from(b, o)
        o += 8
        if o + n + 4 > size:
            return None
        name = str(b[o:o + n], "utf-8")
        o += n
        (reason,) = _U32.unpack_from(b, o)
        o += 4
        if reason >= len(_SKIP_REASONS):
            return None
        reasons.append([name, _SKIP_REASONS[reason]])
    exhausted: Optional[str] = None
    if b[o] == 1:
        (ex,) = _U32.unpack_from(b, o + 1)
        if ex >= len(_EXHAUSTION):
            return None
        exhausted = _EXHAUSTION[ex]
        o += 5
    elif b[o] == 0:
        o += 1
    else:
        return None
    scope: Optional[str] = None
    if b[o] == 1:
        (n,) = _U64.unpack_from(b, o + 1)
        o += 9
        if o + n != size:
            return None
        scope = str(b[o:o + n], "utf-8")
        o += n
    elif b[o] == 0:
        o += 1
    else:
        return None
    if o != size:
        return None
    return {"Error": {"kind": _ERROR_KINDS[kind], "message": message, "retry_after_s": retry_after_s,
                      "per_source_reasons": reasons, "exhausted": exhausted, "scope": scope}}


_R = _wire.REPLY
_HOT_REPLY_DECODERS: Dict[int, Callable[[bytes, int], _Value]] = {
    _tag("Granted", _R): _granted,
    _tag("Started", _R): _started,
    _tag("Reported", _R): _reported,
    _tag("CallBegun", _R): _call_begun,
    _tag("Ok", _R): _unit("Ok"),
    _tag("Pong", _R): _unit("Pong"),
    _tag("Error", _R): _error,
}
HOT_REPLIES = tuple(sorted(_R.variants[t][0] for t in _HOT_REPLY_DECODERS))
"""The reply variants decoded here."""

_HOT_DECODE_ERRORS = (struct.error, UnicodeDecodeError, IndexError)


def decode_hot_reply(payload: bytes) -> Optional[Tuple[int, Any]]:
    """``(id, reply)`` by the struct path, or None when it does not vouch for the
    payload (a cold tag, or anything malformed)."""
    try:
        rid, tag = _ID_TAG.unpack_from(payload, 0)
        dec = _HOT_REPLY_DECODERS.get(tag)
        if dec is not None:
            value = dec(payload, 12)
            if value is not None:
                return rid, value
    except _HOT_DECODE_ERRORS:
        pass
    return None


def decode_server_frame(payload: bytes) -> Dict[str, Any]:
    """Decode one ``ServerFrame`` payload: struct path for the hot replies, the
    generic codec for the rest (and for the exact error of a bad payload)."""
    hot = decode_hot_reply(payload)
    if hot is not None:
        return {"id": hot[0], "reply": hot[1]}
    return _wire.decode_server_frame(payload)
