"""What ``client.run`` decides, shared by the sync and asyncio clients (DESIGN
§13/§14): how an exception raised by the user's function becomes an outcome, and
how a result's usage becomes token counts. No I/O here, and no imports of the
SDKs it recognises: the ``openai`` and ``httpx`` exception classes are looked up
only if the program already imported those packages (``sys.modules``), and
anything else that looks like an HTTP error (a ``status_code`` / ``status``, a
``response``) is read by duck typing.

Built-in classification, first match wins (a ``classify`` hook runs before it and
wins when it returns an :class:`Outcome`):

=====================================================  ===========================
exception                                              outcome
=====================================================  ===========================
``KeyboardInterrupt``, ``SystemExit``,                  ``cancelled``, not retried
``asyncio.CancelledError`` (anything not an Exception)
``TimeoutError``, ``asyncio.TimeoutError``,             ``timeout``, retried
``socket.timeout``, ``httpx.TimeoutException``,
``openai.APITimeoutError``
``ConnectionError``, ``socket.gaierror``, network       ``connection``, retried
``OSError`` errnos, ``ssl.SSLError``,
``httpx.TransportError``, ``openai.APIConnectionError``
HTTP 429                                                ``rate_limited`` with the
                                                        response's ``Retry-After``
                                                        (``retry-after-ms``,
                                                        seconds or an HTTP date),
                                                        retried
HTTP 408                                                ``timeout``, retried
HTTP 5xx                                                ``server_error``, retried
HTTP 401, 403, 404                                      ``error``, retried: this
                                                        source's key, permission or
                                                        deployment is wrong, another
                                                        source may work
any other HTTP 4xx (400, 413, 422, ...)                 ``rejected``: the request is
                                                        at fault, not the source —
                                                        not retried, not held
                                                        against the breaker
anything else                                           ``error``, not retried
=====================================================  ===========================

A not-retried outcome is reported (it ends the call) and the exception is
re-raised at once: a bug in the caller's code or request must not burn every
source's attempts, nor be tried blindly again. A retried one is reported with the
next attempt; when the call's budget runs out, the sidecar's final error
(``AllSourcesExhausted``, ``CircuitOpenError``, ...) is raised *from* the last
exception.
"""

from __future__ import annotations

import errno
import math
import sys
import time
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Any, Callable, Optional, Tuple

from . import protocol as p

__all__ = ["Outcome", "classify_exception", "outcome_report", "usage_of", "Usage", "Classifier"]

_FAILURES = ("timeout", "server_error", "connection", "bad_result", "error")


@dataclass(frozen=True)
class Outcome:
    """How one failed attempt is reported, and whether the call goes on.

    ``kind``: a failure kind (``timeout``, ``server_error``, ``connection``,
    ``bad_result``, ``error``), ``rate_limited``, ``cancelled`` (nothing was
    sent: the reservation is refunded) or ``rejected`` (the upstream refused
    *this request* — a 400 — reported as an uncounted success: the source is
    not blamed). ``retry``: try another attempt (the sidecar picks the source
    and counts the budget) or end the call and re-raise. ``retry_after_s``:
    a 429's ``Retry-After``. ``tokens``: what the failed request still consumed.
    """

    kind: str
    retry: bool = True
    retry_after_s: Optional[float] = None
    tokens: Optional[int] = None

    def __post_init__(self) -> None:
        if self.kind not in _FAILURES + ("rate_limited", "cancelled", "rejected"):
            raise ValueError("unknown outcome kind %r; allowed: %s" % (
                self.kind, ", ".join(_FAILURES + ("rate_limited", "cancelled", "rejected"))))

    @classmethod
    def failure(cls, kind: str, *, retry: bool = True, tokens: Optional[int] = None) -> "Outcome":
        if kind not in _FAILURES:
            raise ValueError("unknown failure kind %r; allowed kinds: %s" % (kind, ", ".join(_FAILURES)))
        return cls(kind, retry=retry, tokens=tokens)

    @classmethod
    def rate_limited(cls, retry_after_s: Optional[float] = None) -> "Outcome":
        return cls("rate_limited", retry=True, retry_after_s=retry_after_s)

    @classmethod
    def cancelled(cls, *, retry: bool = False) -> "Outcome":
        return cls("cancelled", retry=retry)

    @classmethod
    def rejected(cls, *, tokens: Optional[int] = None) -> "Outcome":
        return cls("rejected", retry=False, tokens=tokens)


Classifier = Callable[[BaseException], Optional[Outcome]]
"""A ``classify`` hook: an :class:`Outcome` for the exceptions it knows, else None."""


def outcome_report(outcome: Outcome) -> bytes:
    """The encoded outcome a permit is reported with."""
    if outcome.kind == "rate_limited":
        return p.outcome_rate_limited(outcome.retry_after_s)
    if outcome.kind == "cancelled":
        return p.OUTCOME_CANCELLED
    if outcome.kind == "rejected":
        return p.outcome_success(outcome.tokens or 0, False)
    return p.outcome_failure(outcome.kind, outcome.tokens)


# ---------------------------------------------------------------- classification

_NETWORK_ERRNOS = frozenset(
    getattr(errno, n) for n in (
        "ECONNREFUSED", "ECONNRESET", "ECONNABORTED", "EPIPE", "ENETUNREACH", "ENETDOWN", "ENETRESET",
        "EHOSTUNREACH", "EHOSTDOWN", "ENOTCONN", "ESHUTDOWN", "EADDRNOTAVAIL",
    ) if hasattr(errno, n)
)


def _loaded(module: str, *names: str) -> Tuple[type, ...]:
    """Exception classes of an SDK the program already imported (never imports it)."""
    mod = sys.modules.get(module)
    if mod is None:
        return ()
    found = []
    for n in names:
        c = getattr(mod, n, None)
        if isinstance(c, type) and issubclass(c, BaseException):
            found.append(c)
    return tuple(found)


def _attr(obj: Any, name: str) -> Any:
    if isinstance(obj, dict):
        return obj.get(name)
    return getattr(obj, name, None)


def _status(exc: BaseException) -> Optional[int]:
    """The HTTP status an exception carries, by duck typing (openai, httpx,
    anthropic, requests, aiohttp all spell one of these)."""
    for holder in (exc, getattr(exc, "response", None)):
        if holder is None:
            continue
        for name in ("status_code", "status"):
            v = getattr(holder, name, None)
            if isinstance(v, int) and not isinstance(v, bool) and 100 <= v <= 599:
                return v
    return None


def _headers(exc: BaseException) -> Any:
    for holder in (getattr(exc, "response", None), exc):
        h = getattr(holder, "headers", None) if holder is not None else None
        if h is not None and hasattr(h, "get"):
            return h
    return None


def retry_after_seconds(headers: Any, now: Optional[float] = None) -> Optional[float]:
    """Seconds from ``retry-after-ms`` or ``retry-after`` (a number of seconds or
    an HTTP date); None when absent or unreadable. Header lookup is
    case-insensitive for plain dicts too."""
    if headers is None:
        return None

    def get(name: str) -> Optional[str]:
        v = headers.get(name)
        if v is None and isinstance(headers, dict):
            v = next((val for k, val in headers.items() if str(k).lower() == name), None)
        return None if v is None else str(v).strip()

    ms = get("retry-after-ms")
    if ms:
        try:
            v = float(ms) / 1000.0
            if math.isfinite(v) and v >= 0:
                return v
        except ValueError:
            pass
    ra = get("retry-after")
    if not ra:
        return None
    try:
        v = float(ra)
        return v if math.isfinite(v) and v >= 0 else None
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(ra).timestamp()
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    return max(0.0, when - (time.time() if now is None else now))


def _from_status(status: int, exc: BaseException) -> Outcome:
    if status == 429:
        return Outcome.rate_limited(retry_after_seconds(_headers(exc)))
    if status == 408:
        return Outcome.failure("timeout")
    if status >= 500:
        return Outcome.failure("server_error")
    if status in (401, 403, 404):
        return Outcome.failure("error", retry=True)
    if 400 <= status < 500:
        return Outcome.rejected()
    return Outcome.failure("error", retry=False)


def classify_exception(exc: BaseException, classify: Optional[Classifier] = None) -> Outcome:
    """The outcome of an attempt that raised ``exc`` (see the module doc)."""
    if classify is not None:
        mine = classify(exc)
        if mine is not None:
            if not isinstance(mine, Outcome):
                raise TypeError("classify must return a polygate.Outcome or None, got %r" % (mine,))
            return mine
    if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit, CancelledError, GeneratorExit
        return Outcome.cancelled()
    # openai first: its timeout class is a connection error too, and its status errors carry a response
    if isinstance(exc, _loaded("openai", "APITimeoutError")):
        return Outcome.failure("timeout")
    if isinstance(exc, _loaded("openai", "APIConnectionError")):
        return Outcome.failure("connection")
    if isinstance(exc, _loaded("httpx", "TimeoutException")):
        return Outcome.failure("timeout")
    if isinstance(exc, _loaded("httpx", "TransportError")):
        return Outcome.failure("connection")
    status = _status(exc)
    if status is not None:
        return _from_status(status, exc)
    if isinstance(exc, (TimeoutError,) + _loaded("asyncio", "TimeoutError") + _loaded("socket", "timeout")):
        return Outcome.failure("timeout")
    if isinstance(exc, ConnectionError) or isinstance(exc, _loaded("socket", "gaierror", "herror")) \
            or isinstance(exc, _loaded("ssl", "SSLError")):
        return Outcome.failure("connection")
    if isinstance(exc, OSError) and exc.errno in _NETWORK_ERRNOS:
        return Outcome.failure("connection")
    return Outcome.failure("error", retry=False)


# ---------------------------------------------------------------- usage


def _count(v: Any) -> Optional[int]:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0 or v > p.MAX_COUNT:
        return None
    return v


Usage = Tuple[Optional[int], Optional[int], Optional[int], Optional[int]]
"""``(tokens, input_tokens, output_tokens, cached_input_tokens)``."""


def usage_of(result: Any, permit_tokens: Optional[int] = None) -> Usage:
    """``(tokens, input_tokens, output_tokens, cached_input_tokens)`` to report
    for a successful ``result``: ``permit.tokens`` if the function set it, else
    the result's ``usage`` (attribute or ``"usage"`` key) read as

    * OpenAI chat: ``total_tokens``; input = ``prompt_tokens`` minus
      ``prompt_tokens_details.cached_tokens``, which are the cached input;
      output = ``completion_tokens``;
    * OpenAI responses: ``total_tokens``; input = ``input_tokens`` minus
      ``input_tokens_details.cached_tokens`` (the cached input); output =
      ``output_tokens``;
    * Anthropic: input = ``input_tokens`` (which already excludes cache reads),
      cached input = ``cache_read_input_tokens``, output = ``output_tokens``
      (no total: the sidecar sums the split).

    Values that are not plausible counts are ignored (the estimate is kept; a
    cached count that is not one is None)."""
    if permit_tokens is not None:  # set by the caller's function: a bad value is a bug, say so
        return p._check_count("permit.tokens", permit_tokens), None, None, None
    usage = _attr(result, "usage") if result is not None else None
    if usage is None:
        return None, None, None, None
    total = _count(_attr(usage, "total_tokens"))
    prompt = _count(_attr(usage, "prompt_tokens"))
    cached: Optional[int]
    if prompt is not None:
        cached = _count(_attr(_attr(usage, "prompt_tokens_details") or {}, "cached_tokens"))
        inp: Optional[int] = max(0, prompt - (cached or 0))
        out = _count(_attr(usage, "completion_tokens"))
    else:
        inp = _count(_attr(usage, "input_tokens"))
        cached = None
        if inp is not None:
            cached = _count(_attr(_attr(usage, "input_tokens_details") or {}, "cached_tokens"))
            inp = max(0, inp - (cached or 0))
        if cached is None:  # Anthropic: input_tokens already excludes the cache reads
            cached = _count(_attr(usage, "cache_read_input_tokens"))
        out = _count(_attr(usage, "output_tokens"))
    if inp is not None and out is not None and inp + out > p.MAX_COUNT:
        inp = out = None
    return total, inp, out, cached
