"""PolyGate wire format: bincode legacy layout + 4-byte big-endian framing.

This module is the only place that knows bytes. It mirrors
``ipc-protocol/src/messages.rs`` field by field and variant by variant; the
message values are the JSON-like form that ``serde_json`` produces for those
Rust types (externally tagged enums), e.g.::

    {"id": 7, "request": {"BeginCall": {"scope": "chat", "est_tokens": None}}}
    {"id": 9, "request": "Ping"}
    {"id": 7, "reply": {"Error": {"kind": "CircuitOpen", ...}}}

Layout rules: u32/u64 little-endian fixed width, f64 8 bytes LE, bool one
byte (0/1), ``Option`` one byte 0/1 then the value, ``String`` u64 LE byte
length + UTF-8, ``Vec`` u64 LE count + items, tuples and structs are their
fields in order, enums are a u32 LE variant index then the variant's fields.
A frame is a 4-byte big-endian payload length followed by the payload.

Malformed values raise :class:`WireError` (a ``ValueError``) naming the path
of the offending field.
"""

from __future__ import annotations

import struct
from typing import Any, Dict, List, Optional, Tuple

PROTOCOL_VERSION = 3
# The newest protocol whose frames this codec can encode and decode (the vectors
# file's version); the client says PROTOCOL_VERSION in Hello.
SCHEMA_VERSION = 3
# The version the client falls back to with a sidecar that refuses 3 (PROTOCOL.md
# §15): every call works there, except those that name a tenant.
FALLBACK_VERSION = 2
# The first version with tenants (StartTenant / BeginTenant / TenantStatus,
# SuccessCached, Reply::TenantLimited).
TENANT_VERSION = 3
# A tenant id's limit in UTF-8 bytes (PROTOCOL.md §15).
MAX_TENANT_BYTES = 128
DEFAULT_MAX_FRAME = 65536
LENGTH_PREFIX = 4

__all__ = [
    "PROTOCOL_VERSION",
    "FALLBACK_VERSION",
    "TENANT_VERSION",
    "MAX_TENANT_BYTES",
    "DEFAULT_MAX_FRAME",
    "WireError",
    "encode_client_frame",
    "decode_client_frame",
    "encode_server_frame",
    "decode_server_frame",
    "encode",
    "decode",
    "frame",
    "FrameDecoder",
    "split_frame",
    "CLIENT_FRAME",
    "SERVER_FRAME",
]


class WireError(ValueError):
    """A value does not fit the wire schema, or bytes do not decode."""


# --------------------------------------------------------------------------
# Schema description
# --------------------------------------------------------------------------


class _T:
    """Base of schema nodes."""

    name = "?"


class _Prim(_T):
    def __init__(self, name: str) -> None:
        self.name = name


U32 = _Prim("u32")
U64 = _Prim("u64")
F64 = _Prim("f64")
BOOL = _Prim("bool")
STR = _Prim("String")


class _Option(_T):
    def __init__(self, inner: _T) -> None:
        self.inner = inner
        self.name = "Option<%s>" % inner.name


class _Vec(_T):
    def __init__(self, inner: _T) -> None:
        self.inner = inner
        self.name = "Vec<%s>" % inner.name


class _Tuple(_T):
    def __init__(self, *items: _T) -> None:
        self.items = items
        self.name = "(%s)" % ", ".join(i.name for i in items)


class _Struct(_T):
    def __init__(self, name: str, fields: List[Tuple[str, _T]]) -> None:
        self.name = name
        self.fields = fields


# Variant shapes
_UNIT = "unit"


class _Enum(_T):
    """variants: list of (name, shape); shape is _UNIT, a list of fields
    (struct variant) or a schema node (newtype variant)."""

    def __init__(self, name: str, variants: List[Tuple[str, Any]]) -> None:
        self.name = name
        self.variants = variants
        self.index = {v[0]: i for i, v in enumerate(variants)}


def _unit_enum(name: str, *variants: str) -> _Enum:
    return _Enum(name, [(v, _UNIT) for v in variants])


FAILURE_KIND = _unit_enum("FailureKind", "Timeout", "ServerError", "Connection", "BadResult", "Error")
BREAKER_STATE = _unit_enum("BreakerState", "Closed", "Open", "HalfOpen")
ERROR_KIND = _unit_enum(
    "ErrorKind",
    "CircuitOpen",
    "AllSourcesExhausted",
    "UnknownScope",
    "UnknownCall",
    "UnknownPermit",
    "InvalidArgument",
    "Malformed",
    "FrameTooLarge",
    "ProtocolViolation",
    "PermissionDenied",
    "ShuttingDown",
    "BackendUnavailable",
    "Cancelled",
    "Busy",
    "Internal",
    "Overloaded",
    "TenantLimited",
)
SKIP_REASON = _unit_enum("SkipReason", "CircuitOpen", "Paced", "RateLimited", "BackendUnavailable", "TenantLimited")
EXHAUSTION_REASON = _unit_enum("ExhaustionReason", "Stalled", "QuotaExhausted", "RetryExhausted")

USAGE = _Struct(
    "Usage",
    [("tokens", _Option(U64)), ("input_tokens", _Option(U64)), ("output_tokens", _Option(U64))],
)

OUTCOME = _Enum(
    "Outcome",
    [
        ("Success", [("tokens", _Option(U64)), ("count_attempt", BOOL)]),
        ("Failure", [("kind", FAILURE_KIND)]),
        ("RateLimited", [("retry_after_s", _Option(F64))]),
        ("Cancelled", _UNIT),
        ("SuccessUsage", [("usage", USAGE), ("count_attempt", BOOL)]),
        ("FailureUsage", [("kind", FAILURE_KIND), ("usage", USAGE)]),
        ("SuccessCached", [("usage", USAGE), ("cached_input_tokens", U64), ("count_attempt", BOOL)]),
    ],
)

CALL_SPEC = _Struct(
    "CallSpec",
    [
        ("scope", STR),
        ("est_tokens", _Option(U64)),
        ("priority", _Option(STR)),
        ("est_input_tokens", _Option(U64)),
        ("est_output_tokens", _Option(U64)),
    ],
)

OBSERVED_LIMIT = _Struct(
    "ObservedLimit",
    [("limit", _Option(U64)), ("remaining", _Option(U64)), ("reset_s", _Option(F64))],
)

OBSERVED_LIMITS = _Struct(
    "ObservedLimits",
    [
        ("requests", _Option(OBSERVED_LIMIT)),
        ("tokens", _Option(OBSERVED_LIMIT)),
        ("input_tokens", _Option(OBSERVED_LIMIT)),
        ("output_tokens", _Option(OBSERVED_LIMIT)),
        ("age_s", F64),
    ],
)

REQUEST = _Enum(
    "Request",
    [
        ("Hello", [("protocol_version", U32), ("client_name", STR), ("pid", U32)]),
        ("BeginCall", [("scope", STR), ("est_tokens", _Option(U64))]),
        ("Acquire", [("call", U64)]),
        ("Report", [("permit", U64), ("outcome", OUTCOME)]),
        ("EndCall", [("call", U64)]),
        ("Status", _UNIT),
        ("ForceOpen", [("source", STR), ("seconds", F64)]),
        ("ForceClose", [("source", STR)]),
        ("Reset", [("source", STR)]),
        ("Ping", _UNIT),
        ("Cancel", [("target", U64)]),
        ("Start", CALL_SPEC),
        ("Retry", [("permit", U64), ("outcome", OUTCOME)]),
        ("Finish", [("permit", U64), ("outcome", OUTCOME)]),
        ("Begin", CALL_SPEC),
        ("StatusJson", _UNIT),
        ("ReportObserved", [("permit", U64), ("outcome", OUTCOME), ("limits", OBSERVED_LIMITS)]),
        ("RetryObserved", [("permit", U64), ("outcome", OUTCOME), ("limits", OBSERVED_LIMITS)]),
        ("FinishObserved", [("permit", U64), ("outcome", OUTCOME), ("limits", OBSERVED_LIMITS)]),
        ("StartTenant", [("spec", CALL_SPEC), ("tenant", STR)]),
        ("BeginTenant", [("spec", CALL_SPEC), ("tenant", STR)]),
        ("TenantStatus", [("scope", _Option(STR)), ("tenant", STR)]),
    ],
)

ERROR_REPLY = _Struct(
    "ErrorReply",
    [
        ("kind", ERROR_KIND),
        ("message", STR),
        ("retry_after_s", F64),
        ("per_source_reasons", _Vec(_Tuple(STR, SKIP_REASON))),
        ("exhausted", _Option(EXHAUSTION_REASON)),
        ("scope", _Option(STR)),
    ],
)

SOURCE_STATUS = _Struct(
    "SourceStatus",
    [
        ("name", STR),
        ("state", BREAKER_STATE),
        ("epoch", U64),
        ("retry_after_s", F64),
        ("cooldown_level", U32),
        ("window_successes", U64),
        ("window_failures", U64),
        ("streak", U32),
        ("memo_remaining_s", F64),
        ("pacer_ceiling", F64),
        ("in_flight", U32),
        ("tokens_available", _Option(F64)),
        ("requests_available", _Option(F64)),
        ("quota_blocked_s", F64),
        ("degraded", BOOL),
    ],
)

SCOPE_STATUS = _Struct(
    "ScopeStatus",
    [
        ("name", STR),
        ("circuit_open", STR),
        ("quota_full", STR),
        ("waiters", U32),
        ("calls", U32),
        ("sources", _Vec(SOURCE_STATUS)),
    ],
)

STATUS_REPORT = _Struct(
    "StatusReport",
    [("sidecar_version", STR), ("backend", STR), ("scopes", _Vec(SCOPE_STATUS))],
)

REPLY = _Enum(
    "Reply",
    [
        ("Welcome", [("protocol_version", U32), ("sidecar_version", STR), ("max_frame", U32)]),
        ("CallBegun", [("call", U64)]),
        (
            "Granted",
            [
                ("permit", U64),
                ("source", STR),
                ("is_probe", BOOL),
                ("attempt", U32),
                ("est_tokens", U64),
            ],
        ),
        (
            "Reported",
            [("applied", BOOL), ("state", BREAKER_STATE), ("retry_after_s", F64)],
        ),
        ("Ok", _UNIT),
        ("Status", STATUS_REPORT),
        ("Pong", _UNIT),
        ("Error", ERROR_REPLY),
        (
            "Started",
            [
                ("call", U64),
                ("permit", U64),
                ("source", STR),
                ("is_probe", BOOL),
                ("attempt", U32),
                ("est_tokens", U64),
            ],
        ),
        ("StatusJson", STR),
        ("TenantLimited", _Struct("TenantRefusal", [("error", ERROR_REPLY), ("tenant", STR), ("limit", STR)])),
    ],
)

CLIENT_FRAME = _Struct("ClientFrame", [("id", U64), ("request", REQUEST)])
SERVER_FRAME = _Struct("ServerFrame", [("id", U64), ("reply", REPLY)])


# --------------------------------------------------------------------------
# Encoding
# --------------------------------------------------------------------------

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_F64 = struct.Struct("<d")
_BE32 = struct.Struct(">I")


def _fail(path: str, what: str, value: Any) -> WireError:
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return WireError("%s: expected %s, got %s" % (path or "<value>", what, shown))


def _enc(t: _T, v: Any, out: bytearray, path: str) -> None:
    if t is U64 or t is U32:
        if not isinstance(v, int) or isinstance(v, bool):
            raise _fail(path, t.name, v)
        limit = 1 << (64 if t is U64 else 32)
        if not 0 <= v < limit:
            raise _fail(path, "%s in [0, %d]" % (t.name, limit - 1), v)
        out += (_U64 if t is U64 else _U32).pack(v)
    elif t is F64:
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise _fail(path, "f64 (a number)", v)
        out += _F64.pack(float(v))
    elif t is BOOL:
        if not isinstance(v, bool):
            raise _fail(path, "bool", v)
        out.append(1 if v else 0)
    elif t is STR:
        if not isinstance(v, str):
            raise _fail(path, "string", v)
        try:
            b = v.encode("utf-8")
        except UnicodeEncodeError:
            raise _fail(path, "a string encodable as UTF-8", v) from None
        out += _U64.pack(len(b))
        out += b
    elif isinstance(t, _Option):
        if v is None:
            out.append(0)
        else:
            out.append(1)
            _enc(t.inner, v, out, path)
    elif isinstance(t, _Vec):
        if not isinstance(v, (list, tuple)):
            raise _fail(path, "a list (%s)" % t.name, v)
        out += _U64.pack(len(v))
        for i, item in enumerate(v):
            _enc(t.inner, item, out, "%s[%d]" % (path, i))
    elif isinstance(t, _Tuple):
        if not isinstance(v, (list, tuple)) or len(v) != len(t.items):
            raise _fail(path, "a %d-item list %s" % (len(t.items), t.name), v)
        for i, (it, item) in enumerate(zip(t.items, v)):
            _enc(it, item, out, "%s[%d]" % (path, i))
    elif isinstance(t, _Struct):
        _enc_fields(t.name, t.fields, v, out, path)
    elif isinstance(t, _Enum):
        if isinstance(v, str):
            name, body = v, None
            has_body = False
        elif isinstance(v, dict) and len(v) == 1:
            ((name, body),) = v.items()
            has_body = True
        else:
            raise _fail(path, "%s: a variant name or a one-key dict" % t.name, v)
        idx = t.index.get(name)
        if idx is None:
            raise WireError(
                "%s: unknown %s variant %r (allowed: %s)"
                % (path or "<value>", t.name, name, ", ".join(x[0] for x in t.variants))
            )
        shape = t.variants[idx][1]
        vpath = "%s.%s" % (path, name) if path else name
        out += _U32.pack(idx)
        if shape == _UNIT:
            if has_body and body is not None:
                raise _fail(vpath, "unit variant (no fields)", body)
        elif not has_body:
            raise _fail(path, "%s::%s with fields, as {%r: ...}" % (t.name, name, name), v)
        elif isinstance(shape, list):
            _enc_fields("%s::%s" % (t.name, name), shape, body, out, vpath)
        else:
            _enc(shape, body, out, vpath)
    else:  # pragma: no cover - schema bug
        raise TypeError("bad schema node %r" % (t,))


def _enc_fields(name: str, fields: List[Tuple[str, _T]], v: Any, out: bytearray, path: str) -> None:
    if not isinstance(v, dict):
        raise _fail(path, "%s as a dict" % name, v)
    extra = set(v) - {f for f, _ in fields}
    if extra:
        raise WireError(
            "%s: unknown field(s) %s for %s" % (path or "<value>", ", ".join(sorted(map(str, extra))), name)
        )
    for fname, ft in fields:
        fpath = "%s.%s" % (path, fname) if path else fname
        if fname not in v:
            if isinstance(ft, _Option):
                _enc(ft, None, out, fpath)
                continue
            raise WireError("%s: missing field of %s" % (fpath, name))
        _enc(ft, v[fname], out, fpath)


def encode(schema: _T, value: Any) -> bytes:
    """Encode ``value`` (JSON-like form) as a payload of type ``schema``."""
    out = bytearray()
    _enc(schema, value, out, "")
    return bytes(out)


# --------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------


class _Reader:
    __slots__ = ("buf", "pos")

    def __init__(self, buf: bytes) -> None:
        self.buf = memoryview(buf)
        self.pos = 0

    def take(self, n: int, path: str, what: str) -> memoryview:
        end = self.pos + n
        if end > len(self.buf):
            raise WireError(
                "%s: truncated payload: need %d byte(s) for %s at offset %d, have %d"
                % (path or "<value>", n, what, self.pos, len(self.buf) - self.pos)
            )
        b = self.buf[self.pos:end]
        self.pos = end
        return b


def _dec(t: _T, r: _Reader, path: str) -> Any:
    if t is U64:
        return _U64.unpack(r.take(8, path, "u64"))[0]
    if t is U32:
        return _U32.unpack(r.take(4, path, "u32"))[0]
    if t is F64:
        return _F64.unpack(r.take(8, path, "f64"))[0]
    if t is BOOL:
        b = r.take(1, path, "bool")[0]
        if b > 1:
            raise WireError("%s: invalid bool byte %d at offset %d" % (path, b, r.pos - 1))
        return b == 1
    if t is STR:
        n = _U64.unpack(r.take(8, path, "string length"))[0]
        raw = r.take(n, path, "string bytes")
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError as e:
            raise WireError("%s: string is not valid UTF-8 (%s)" % (path, e)) from None
    if isinstance(t, _Option):
        tag = r.take(1, path, "option tag")[0]
        if tag == 0:
            return None
        if tag != 1:
            raise WireError("%s: invalid Option tag %d at offset %d" % (path, tag, r.pos - 1))
        return _dec(t.inner, r, path)
    if isinstance(t, _Vec):
        n = _U64.unpack(r.take(8, path, "sequence length"))[0]
        remaining = len(r.buf) - r.pos
        if n > remaining:  # every item takes at least one byte
            raise WireError("%s: sequence length %d exceeds the %d remaining byte(s)" % (path, n, remaining))
        return [_dec(t.inner, r, "%s[%d]" % (path, i)) for i in range(n)]
    if isinstance(t, _Tuple):
        return [_dec(it, r, "%s[%d]" % (path, i)) for i, it in enumerate(t.items)]
    if isinstance(t, _Struct):
        return _dec_fields(t.fields, r, path)
    if isinstance(t, _Enum):
        idx = _U32.unpack(r.take(4, path, "%s tag" % t.name))[0]
        if idx >= len(t.variants):
            raise WireError(
                "%s: unknown %s tag %d (known: 0..%d)" % (path or "<value>", t.name, idx, len(t.variants) - 1)
            )
        name, shape = t.variants[idx]
        vpath = "%s.%s" % (path, name) if path else name
        if shape == _UNIT:
            return name
        if isinstance(shape, list):
            return {name: _dec_fields(shape, r, vpath)}
        return {name: _dec(shape, r, vpath)}
    raise TypeError("bad schema node %r" % (t,))  # pragma: no cover


def _dec_fields(fields: List[Tuple[str, _T]], r: _Reader, path: str) -> Dict[str, Any]:
    return {f: _dec(ft, r, "%s.%s" % (path, f) if path else f) for f, ft in fields}


def decode(schema: _T, payload: bytes) -> Any:
    """Decode one complete payload of type ``schema``; trailing bytes are an error."""
    r = _Reader(payload)
    value = _dec(schema, r, "")
    if r.pos != len(r.buf):
        raise WireError("%d trailing byte(s) after %s" % (len(r.buf) - r.pos, schema.name))
    return value


def encode_client_frame(value: Dict[str, Any]) -> bytes:
    """Payload (no length prefix) of a ``ClientFrame``."""
    return encode(CLIENT_FRAME, value)


def decode_client_frame(payload: bytes) -> Dict[str, Any]:
    value: Dict[str, Any] = decode(CLIENT_FRAME, payload)
    return value


def encode_server_frame(value: Dict[str, Any]) -> bytes:
    """Payload (no length prefix) of a ``ServerFrame``."""
    return encode(SERVER_FRAME, value)


def decode_server_frame(payload: bytes) -> Dict[str, Any]:
    value: Dict[str, Any] = decode(SERVER_FRAME, payload)
    return value


# --------------------------------------------------------------------------
# Framing
# --------------------------------------------------------------------------


def frame(payload: bytes, max_frame: Optional[int] = None) -> bytes:
    """Prefix ``payload`` with its 4-byte big-endian length."""
    if max_frame is not None and len(payload) > max_frame:
        raise WireError("frame payload of %d bytes exceeds max_frame %d" % (len(payload), max_frame))
    if len(payload) > 0xFFFFFFFF:
        raise WireError("frame payload of %d bytes does not fit a u32 length" % len(payload))
    return _BE32.pack(len(payload)) + payload


class FrameDecoder:
    """Incremental splitter: ``feed(bytes)`` returns the complete payloads.

    A length above ``max_frame`` raises :class:`WireError` before buffering
    the payload (the stream is unusable afterwards).
    """

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()

    def feed(self, data: "bytes | bytearray | memoryview") -> List[bytes]:
        """Add ``data``; return the payloads now complete (copies, so ``data``'s
        buffer may be reused at once)."""
        if self._buf:
            self._buf += data
            data = self._buf
        frames = []
        pos = 0
        size = len(data)
        while size - pos >= LENGTH_PREFIX:
            (n,) = _BE32.unpack_from(data, pos)
            if n > self.max_frame:
                raise WireError("incoming frame of %d bytes exceeds max_frame %d" % (n, self.max_frame))
            end = pos + LENGTH_PREFIX + n
            if end > size:
                break
            frames.append(bytes(data[pos + LENGTH_PREFIX:end]))
            pos = end
        self._buf = bytearray(data[pos:])
        return frames

    @property
    def pending(self) -> int:
        """Bytes buffered that do not yet form a complete frame."""
        return len(self._buf)


def split_frame(data: bytes) -> Tuple[bytes, bytes]:
    """Split one complete frame ``data`` into (payload, rest)."""
    if len(data) < LENGTH_PREFIX:
        raise WireError("frame shorter than its 4-byte length prefix")
    (n,) = _BE32.unpack_from(data, 0)
    if len(data) < LENGTH_PREFIX + n:
        raise WireError("frame declares %d payload bytes, only %d present" % (n, len(data) - LENGTH_PREFIX))
    return bytes(data[LENGTH_PREFIX:LENGTH_PREFIX + n]), bytes(data[LENGTH_PREFIX + n:])

