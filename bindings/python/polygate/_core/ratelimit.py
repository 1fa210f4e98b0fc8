"""The provider's rate-limit headers → observed limits (DESIGN §18).

:func:`parse_headers` reads one response's headers (any mapping with ``get``, or
a list of pairs; names are matched case-insensitively) and returns what the
provider said is left, per dimension, and its retry-after:

* OpenAI: ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}``; a reset is a
  duration (``1s``, ``6m0s``, ``250ms``, ``1m30.5s``, ``2h1m``).
* Anthropic: ``anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-
  {limit,remaining,reset}``; a reset is an RFC 3339 instant, turned into seconds
  from the response's ``date`` header when present, else from ``now``.
* Azure OpenAI: ``x-ratelimit-remaining-{requests,tokens}`` only.
* ``retry-after-ms`` before ``retry-after`` (seconds, or an HTTP date).

The same cases run in every binding (``bindings/vectors/ratelimit_headers.json``).
No I/O, no dependencies.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

from .. import _frames

__all__ = ["Limit", "Limits", "parse_headers", "parse_duration", "encode_limits", "limits_of", "as_limits"]


@dataclass
class Limit:
    """One dimension of a response's rate-limit headers; each part optional."""

    limit: Optional[int] = None
    """The provider's limit (what an ``"auto"`` bucket learns)."""
    remaining: Optional[int] = None
    """What the provider says is left."""
    reset_s: Optional[float] = None
    """Seconds from the response until the counter is whole again."""


@dataclass
class Limits:
    """What one response's headers say (``permit.limits = Limits(...)``)."""

    requests: Optional[Limit] = None
    tokens: Optional[Limit] = None
    input_tokens: Optional[Limit] = None
    output_tokens: Optional[Limit] = None
    age_s: float = 0.0
    """Seconds between the response and the report (a stream's length); the
    sidecar dates the observation ``now - age_s`` and ignores one older than an
    observation it already applied."""

    def empty(self) -> bool:
        return self.requests is None and self.tokens is None and self.input_tokens is None \
            and self.output_tokens is None


_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|us|µs|ns|h|m|s)")
_UNIT_S = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def parse_duration(text: str) -> Optional[float]:
    """A Go-style duration (OpenAI's resets: ``6m0s``, ``250ms``, ``1m30.5s``) or a
    bare number of seconds, in seconds; None when it is neither."""
    t = text.strip()
    if not t:
        return None
    if t[-1].isdecimal() or t[-1] == ".":  # a bare number (a unit ends in a letter: no exception to raise)
        try:
            v = float(t)
            return v if math.isfinite(v) and v >= 0 else None
        except ValueError:
            pass
    if t[-1] == "s":  # one part in seconds or ms (OpenAI's "1s", "6ms", "0.5s"): no regex
        num, unit = t[:-1], 1.0
        if num[-1:] == "m":
            num, unit = num[:-1], 1e-3
        if num.replace(".", "", 1).isdecimal():  # what the regex's number matches, no more
            return float(num) * unit
    pos, total = 0, 0.0
    for m in _DURATION_PART.finditer(t):
        if m.start() != pos:
            return None
        total += float(m.group(1)) * _UNIT_S[m.group(2)]
        pos = m.end()
    return total if pos == len(t) and pos > 0 else None


def _instant(text: str) -> Optional[datetime]:
    t = text.strip()
    if t.endswith(("Z", "z")):
        t = t[:-1] + "+00:00"
    try:
        d = datetime.fromisoformat(t)
    except ValueError:
        return None
    return d if d.tzinfo is not None else d.replace(tzinfo=timezone.utc)


def _http_date(text: str) -> Optional[datetime]:
    try:
        d = parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    if d is None:
        return None
    return d if d.tzinfo is not None else d.replace(tzinfo=timezone.utc)


LIMIT_PREFIXES = ("x-ratelimit-", "anthropic-ratelimit-", "retry-after")
"""How the names :func:`parse_headers` reads begin, besides ``date``: a response
with no header name so beginning has no limits and no retry-after (the transports
skip the parse then)."""
_WANTED = LIMIT_PREFIXES + ("date",)
_WANTED_B = tuple(w.encode() for w in _WANTED)


def _table(headers: Any) -> Tuple[Dict[str, str], bool, bool]:
    """The headers this module reads (rate limits, retry-after, date), by lower-case
    name, first value wins; every other header is skipped undecoded. Takes a
    mapping, a list of pairs, or an httpx ``Headers`` (its lowered triples, else its
    raw byte pairs). With it: whether an ``anthropic-ratelimit-*`` and whether an
    ``x-ratelimit-*`` name was seen (the dimensions of a family not seen are not
    looked up)."""
    table: Dict[str, str] = {}
    anthropic = openai = False
    if headers is None:
        return table, anthropic, openai
    items: Iterable[Tuple[Any, Any]]
    lst = getattr(headers, "_list", None)
    if type(lst) is list and lst and type(lst[0]) is tuple and len(lst[0]) == 3:
        # httpx / httpx2 Headers: (raw name, lower-case name, value) triples, the
        # names lowered already (the .raw pairs would be a new list to lower again)
        for _, kb, v in lst:
            if kb.startswith(_WANTED_B):
                c = kb[0]
                if c == 97:  # b"a": anthropic-ratelimit-
                    anthropic = True
                elif c == 120:  # b"x": x-ratelimit-
                    openai = True
                table.setdefault(kb.decode("latin-1"), v.decode("latin-1"))
        return table, anthropic, openai
    raw = getattr(headers, "raw", None)
    if isinstance(raw, list):
        items = raw
    elif hasattr(headers, "items"):
        items = headers.items()
    else:
        items = headers
    for k, v in items:
        if isinstance(k, bytes):  # httpx's raw pairs: only the wanted names are decoded
            kb = k.lower()
            if kb.startswith(_WANTED_B):
                key = kb.decode("latin-1")
                table.setdefault(key, v.decode("latin-1") if isinstance(v, bytes) else str(v))
            else:
                continue
        else:
            key = str(k).lower()
            if not key.startswith(_WANTED):
                continue
            table.setdefault(key, v.decode("latin-1") if isinstance(v, bytes) else str(v))
        if key[0] == "a":
            anthropic = True
        elif key[0] == "x":
            openai = True
    return table, anthropic, openai


MAX_COUNT = 1_000_000_000
"""The largest count a parsed header gives (the sidecar cuts larger ones to it)."""


def _count(v: Optional[str]) -> Optional[int]:
    if v is None:
        return None
    t = v.strip()
    if t.isdecimal() and len(t) < 16:  # a plain count (the usual header): exact, no float
        return min(int(t), MAX_COUNT)
    try:
        n = float(t)
    except ValueError:
        return None
    if not math.isfinite(n) or n < 0:
        return None
    # The sidecar cuts counts above 10^9 (PROTOCOL §14.6); cutting here keeps an
    # absurd header from failing the report's encoding.
    return min(int(n), MAX_COUNT)


def _keys(prefix: str) -> Tuple[str, str, str]:
    return prefix + "limit", prefix + "remaining", prefix + "reset"


# Each dimension's limit, remaining and reset headers: requests, tokens, input and
# output tokens (Anthropic); requests and tokens (OpenAI, Azure).
_ANTHROPIC = tuple(_keys("anthropic-ratelimit-%s-" % d) for d in ("requests", "tokens", "input-tokens", "output-tokens"))
_OPENAI = tuple(("x-ratelimit-limit-" + d, "x-ratelimit-remaining-" + d, "x-ratelimit-reset-" + d)
                for d in ("requests", "tokens"))


def _base_ts(get: Any, now: Optional[float], base: List[float]) -> float:
    """The response's time (its ``date``, else ``now``, else the clock), parsed once
    per response (``base`` keeps it), when an instant needs it."""
    if not base:
        d = _http_date(get("date") or "")
        base.append(d.timestamp() if d is not None else (time.time() if now is None else now))
    return base[0]


def _reset_of(v: str, get: Any, now: Optional[float], base: List[float]) -> Optional[float]:
    d = parse_duration(v)
    if d is not None:
        return d
    at = _instant(v)
    if at is None:
        return None
    return max(0.0, at.timestamp() - _base_ts(get, now, base))


def _dim(get: Any, keys: Tuple[str, str, str], now: Optional[float], base: List[float]) -> Optional[Limit]:
    lim, rem, rst = get(keys[0]), get(keys[1]), get(keys[2])
    if lim is None and rem is None and rst is None:
        return None
    d = Limit(_count(lim), _count(rem), None if rst is None else _reset_of(rst, get, now, base))
    if d.limit is None and d.remaining is None and d.reset_s is None:
        return None
    return d


def parse_headers(headers: Any, now: Optional[float] = None) -> Tuple[Optional[Limits], Optional[float]]:
    """``(limits, retry_after_s)`` of one response's headers (see the module doc).
    ``limits`` is None when no rate-limit header was found; ``now`` is a Unix
    time (default: the clock) for Anthropic's instants when the response has no
    ``date``."""
    table, anthropic, openai = _table(headers)
    if len(table) <= ("date" in table):  # nothing but a date
        return None, None
    get = table.get
    base: List[float] = []
    limits: Optional[Limits] = None
    if anthropic or openai:
        if anthropic:
            requests = _dim(get, _ANTHROPIC[0], now, base)
            tokens = _dim(get, _ANTHROPIC[1], now, base)
            inp, out = _dim(get, _ANTHROPIC[2], now, base), _dim(get, _ANTHROPIC[3], now, base)
        else:
            requests = tokens = inp = out = None
        if openai:
            requests = requests or _dim(get, _OPENAI[0], now, base)
            tokens = tokens or _dim(get, _OPENAI[1], now, base)
        if requests is not None or tokens is not None or inp is not None or out is not None:
            limits = Limits(requests, tokens, inp, out)

    retry_after: Optional[float] = None
    ms = get("retry-after-ms")
    if ms is not None:
        try:
            v = float(ms.strip()) / 1000.0
            if math.isfinite(v) and v >= 0:
                retry_after = v
        except ValueError:
            pass
    if retry_after is None:
        ra = get("retry-after")
        if ra is not None:
            try:
                v = float(ra.strip())
                if math.isfinite(v) and v >= 0:
                    retry_after = v
            except ValueError:
                when = _http_date(ra)
                if when is not None:
                    retry_after = max(0.0, when.timestamp() - _base_ts(get, now, base))
    return limits, retry_after


def _check(name: str, v: Optional[int]) -> Optional[int]:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 0 or v >= 1 << 64:
        raise ValueError("%s must be an integer >= 0, got %r" % (name, v))
    return v


def _check_s(name: str, v: Optional[float]) -> Optional[float]:
    if v is None:
        return None
    f = float(v)
    if not math.isfinite(f) or f < 0:
        raise ValueError("%s must be a finite number of seconds >= 0, got %r" % (name, v))
    return f


_DIMS = ("requests", "tokens", "input_tokens", "output_tokens")
_LIMITS_KEYS = _DIMS + ("age_s",)
_LIMIT_KEYS = ("limit", "remaining", "reset_s")


def as_limits(value: Any) -> Optional[Limits]:
    """What ``permit.limits = value`` keeps: a :class:`Limits` (or None) as it is, a
    mapping of the same shape (``{"tokens": {"remaining": 200, "reset_s": 20},
    "age_s": 0.5}``, a dimension a :class:`Limit` or a mapping of its keys) made
    into one, its values checked. Anything else raises TypeError naming
    ``polygate.Limits`` (a bad value: ValueError naming it), at the assignment."""
    if value is None or type(value) is Limits:
        return value
    if isinstance(value, Limits):
        return value
    if not isinstance(value, Mapping):
        raise TypeError("permit.limits must be a polygate.Limits, a mapping of its keys (%s) or None, got %s"
                        % (", ".join(_LIMITS_KEYS), type(value).__name__))
    unknown = [k for k in value if k not in _LIMITS_KEYS]
    if unknown:
        raise TypeError("permit.limits: unknown key(s) %s; a polygate.Limits has %s"
                        % (", ".join(map(repr, unknown)), ", ".join(_LIMITS_KEYS)))
    out = Limits()
    for k, v in value.items():
        if k == "age_s":
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError("permit.limits['age_s'] must be a number of seconds, got %r" % (v,))
            out.age_s = _check_s("permit.limits['age_s']", v) or 0.0
        else:
            setattr(out, k, _as_limit(k, v))
    return out


def _as_limit(dim: str, v: Any) -> Optional[Limit]:
    if v is None or isinstance(v, Limit):
        return v
    if not isinstance(v, Mapping):
        raise TypeError("permit.limits[%r] must be a polygate.Limit, a mapping of its keys (%s) or None, got %s"
                        % (dim, ", ".join(_LIMIT_KEYS), type(v).__name__))
    unknown = [k for k in v if k not in _LIMIT_KEYS]
    if unknown:
        raise TypeError("permit.limits[%r]: unknown key(s) %s; a polygate.Limit has %s"
                        % (dim, ", ".join(map(repr, unknown)), ", ".join(_LIMIT_KEYS)))
    where = "permit.limits[%r][%%r]" % dim
    reset = v.get("reset_s")
    if reset is not None and (isinstance(reset, bool) or not isinstance(reset, (int, float))):
        raise TypeError((where % "reset_s") + " must be a number of seconds, got %r" % (reset,))
    return Limit(_check(where % "limit", v.get("limit")), _check(where % "remaining", v.get("remaining")),
                 _check_s(where % "reset_s", reset))


def encode_limits(limits: Optional[Limits]) -> Optional[bytes]:
    """The wire ``ObservedLimits`` of ``limits`` (None for None or no dimension);
    a bad value raises ValueError naming it."""
    if limits is None or limits.empty():
        return None

    def one(name: str, d: Optional[Limit]) -> Optional[bytes]:
        if d is None:
            return None
        if not isinstance(d, Limit):
            raise TypeError("limits.%s must be a polygate.Limit or None, got %s" % (name, type(d).__name__))
        return _frames.observed_limit(_check(name + ".limit", d.limit), _check(name + ".remaining", d.remaining),
                                      _check_s(name + ".reset_s", d.reset_s))

    age = _check_s("age_s", limits.age_s) or 0.0
    return _frames.observed_limits(one("requests", limits.requests), one("tokens", limits.tokens),
                                   one("input_tokens", limits.input_tokens),
                                   one("output_tokens", limits.output_tokens), age)


def limits_of(result: Any) -> Optional[Limits]:
    """``client.run``: the observed limits of a result that carries its response's
    headers (a raw ``httpx`` response, an SDK's raw-response wrapper), else None."""
    h = getattr(result, "headers", None)
    if h is None or not hasattr(h, "get"):
        return None
    return parse_headers(h)[0]
