"""What the HTTP transports decide (DESIGN §17), shared by ``polygate.httpx`` and
``polygate.httpx2`` (sync and asyncio alike). No I/O and no HTTP library here: the
transports hand in bytes, statuses and header mappings.

* :func:`parse_routes` / :class:`Route` / :func:`rebase` / :func:`set_model` –
  ``routes = {source: {base_url, headers, query, model}}``: where a granted source's
  request goes, and the model name its body gets;
* :func:`estimate_request` – a request body → ``(input, output)`` token estimates:
  input = body bytes / 4, output = ``max_tokens`` / ``max_completion_tokens`` /
  ``max_output_tokens`` (None: the source's ``est_output_tokens`` applies);
* :func:`status_outcome` – a response status → the report (2xx: None, success);
* :class:`UsageReader` – fed the response body as it passes through (JSON, or SSE
  events), it finds the usage: OpenAI chat / responses / embeddings and Anthropic
  messages, including the final usage events of streams;
* :func:`check_tenant` / :data:`TENANT_HEADER` – the transports' ``tenant=`` option
  and the request header that names a request's tenant (DESIGN §19);
* :func:`refusal` – a PolyGate refusal → the synthetic response the SDK understands.
"""

from __future__ import annotations

import inspect
import json
import math
import re
import zlib
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Tuple
from urllib.parse import quote, unquote_plus, urlsplit

from ..errors import AllSourcesExhausted, GatewayUnavailableError, TenantLimitExceeded
from . import protocol as p
from .run import Outcome, retry_after_seconds

__all__ = ["Route", "parse_routes", "route_bases", "rebase", "set_model", "estimate_request", "status_outcome", "UsageReader", "refusal",
           "Usage", "NO_USAGE", "ON_REFUSAL", "TENANT_HEADER", "check_tenant"]

ON_REFUSAL = ("response", "raise")

TENANT_HEADER = "x-polygate-tenant"
"""The request header naming a request's tenant (DESIGN §19). It wins over the
transport's ``tenant=`` option, and is removed before the request is sent."""


def check_tenant(tenant: Any) -> Any:
    """Validate a transport's ``tenant=`` option: None, a string (the tenant of every
    request; ``""``: the anonymous tenant) or a function ``tenant(request) -> str |
    None``. Raises TypeError naming the option."""
    if isinstance(tenant, str):
        p.tenant_id(tenant)  # at most 128 bytes: said now, not at every request
        return tenant
    if inspect.iscoroutinefunction(tenant):
        raise TypeError("tenant must be a plain function tenant(request) -> str | None, not a coroutine "
                        "function (the transport calls it before the request is admitted, without awaiting)")
    if tenant is None or callable(tenant):
        return tenant
    raise TypeError("tenant must be a string or a function tenant(request) -> str | None, got %r" % (tenant,))


Usage = Tuple[Optional[int], Optional[int], Optional[int], Optional[int]]
"""``(tokens, input_tokens, output_tokens, cached_input_tokens)`` as ``Permit.success``
takes them (§19: a tenant's dollar cost prices the cached input at its own rate)."""


# ---------------------------------------------------------------- routes


class Route(NamedTuple):
    """Where a granted source's requests go: scheme/host/port come from ``base_url``,
    and the request's path is re-rooted under its path (see :func:`rebase`)."""

    scheme: str
    host: str
    port: Optional[int]
    prefix: str
    """``base_url``'s path, percent-encoded as it is sent (a space as ``%20``, a
    non-ASCII character as its UTF-8 bytes), without its trailing ``/`` ("" for none)."""
    headers: Tuple[Tuple[str, str], ...]
    """Extra headers (API key, ...): they replace same-named request headers."""
    query: Tuple[Tuple[str, str], ...] = ()
    """Query parameters (Azure's ``api-version``), sorted by name: they replace
    same-named parameters of the request's query, the others are kept."""
    model: Optional[str] = None
    """The ``"model"`` a JSON-object request body gets on this route (a deployment
    that serves the model under another name); None: the body is sent as it is."""

    def path(self, request_path: str) -> str:
        """The path put in front: for a request URL under none of the routes' base URLs."""
        return self.prefix + request_path if self.prefix else request_path

    def origin(self) -> Tuple[str, str, int]:
        """``(scheme, host, port)`` with the scheme's default port filled in."""
        return _origin(self.scheme, self.host, self.port)


_DEFAULT_PORT = {"http": 80, "https": 443}


def _origin(scheme: str, host: str, port: Optional[int]) -> Tuple[str, str, int]:
    """A URL's origin as the routes compare it: scheme and host lower-cased, the
    scheme's default port filled in (0 for another scheme)."""
    scheme = scheme.lower()
    return scheme, host.lower(), port if port is not None else _DEFAULT_PORT.get(scheme, 0)
_ROUTE_KEYS = ("base_url", "headers", "query", "model")


def parse_routes(routes: Optional[Mapping[str, Any]]) -> Optional[Dict[str, Route]]:
    """Validate ``routes``: ``{source: {"base_url": url, "headers": {...}, "query":
    {...}, "model": name}}`` (or ``{source: url}``). Raises ValueError naming the bad
    entry."""
    if routes is None:
        return None
    if not isinstance(routes, Mapping) or not routes:
        raise ValueError("routes must be a non-empty mapping {source: {\"base_url\": ..., \"headers\": {...}}}, "
                         "got %r" % (routes,))
    out: Dict[str, Route] = {}
    for source, spec in routes.items():
        if not isinstance(source, str) or not source:
            raise ValueError("routes: a source name must be a non-empty string, got %r" % (source,))
        if isinstance(spec, str):
            spec = {"base_url": spec}
        if not isinstance(spec, Mapping):
            raise ValueError("routes[%r] must be {\"base_url\": ..., \"headers\": {...}}, got %r" % (source, spec))
        unknown = set(spec) - set(_ROUTE_KEYS)
        if unknown:
            raise ValueError("routes[%r]: unknown key(s) %s; allowed: %s"
                             % (source, sorted(unknown), ", ".join(_ROUTE_KEYS)))
        base = spec.get("base_url")
        parts = urlsplit(base) if isinstance(base, str) else None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("routes[%r].base_url must be an http(s) URL with a host, got %r" % (source, base))
        if parts.query or parts.fragment:
            raise ValueError("routes[%r].base_url must not have a query or fragment (give query parameters as "
                             "routes[%r][\"query\"]), got %r" % (source, source, base))
        try:
            port = parts.port
        except ValueError:
            raise ValueError("routes[%r].base_url has a bad port: %r" % (source, base)) from None
        headers = spec.get("headers") or {}
        if not isinstance(headers, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in headers.items()):
            raise ValueError("routes[%r].headers must map header names to string values, got %r" % (source, headers))
        query = spec.get("query") or {}
        if not isinstance(query, Mapping) or not all(
                isinstance(k, str) and k and isinstance(v, str) for k, v in query.items()):
            raise ValueError("routes[%r].query must map parameter names to string values, got %r" % (source, query))
        model = spec.get("model")
        if model is not None and (not isinstance(model, str) or not model):
            raise ValueError("routes[%r].model must be a non-empty string, got %r" % (source, model))
        out[source] = Route(parts.scheme, parts.hostname, port, _path_escaped(parts.path).rstrip("/"),
                            tuple((k, v) for k, v in headers.items()), tuple(sorted(query.items())), model)
    return out


# WHATWG's path percent-encode set, as httpx (and fetch's URL, and so the Node binding)
# applies it: printable ASCII is kept but for space " # < > ? ` { }; "%" is kept, so
# an existing %XX escape stays as it is.
_PATH_SAFE = "".join(chr(i) for i in range(0x21, 0x7F) if chr(i) not in '"#<>?`{}')


def _path_escaped(path: str) -> str:
    """A base URL's path as it is sent (and as a request URL's raw path reads): a
    space, a non-ASCII character (as UTF-8) or a control character percent-encoded,
    existing escapes kept — the prefix a request's raw path is matched against and
    put under (:func:`rebase`)."""
    return quote(path, safe=_PATH_SAFE)


Bases = Tuple[Tuple[Tuple[str, str, int], str], ...]
"""The routes' base URLs as ``(origin, path prefix)``, the longest prefix first."""


def route_bases(routes: Mapping[str, Route]) -> Bases:
    """The base URLs a request URL is matched against (:func:`rebase`)."""
    seen = {(r.origin(), r.prefix) for r in routes.values()}
    return tuple(sorted(seen, key=lambda b: -len(b[1])))


def _under(path: str, prefix: str) -> bool:
    """Whether ``path`` is ``prefix`` or below it, at a segment boundary."""
    return not prefix or path == prefix or (path.startswith(prefix) and path[len(prefix)] == "/")


CREDENTIAL_HEADERS = ("authorization", "proxy-authorization", "cookie", "api-key", "x-api-key", "x-goog-api-key")
"""Headers that carry a caller's credentials (HTTP auth, cookies; Azure's, Anthropic's
and Gemini's API key headers): they stay with the origin the SDK sent them to
(:func:`rebase`'s ``cross``)."""


def rebase(bases: Bases, route: Route, scheme: str, host: str, port: Optional[int],
           raw_path: str) -> Tuple[str, bool]:
    """``(raw path, cross)``: the raw path (path and query) of a request for
    ``route``, and whether it leaves the origin the SDK addressed. A request URL under
    one of the routes' base URLs (the SDK's own base URL is one of them, as a user
    writes it in ``routes``) has that prefix replaced by the route's: same scheme,
    host and port, and a path prefix ending at a segment boundary (``/v1`` matches
    ``/v1/chat`` and ``/v1``, not ``/v10``); the longest such base URL wins; ``cross``
    when the route's origin is another (its :data:`CREDENTIAL_HEADERS` are then not
    sent, §17). A request under none keeps its whole path, with the route's path put
    in front (not ``cross``: the routes are its only destinations). The route's
    ``query`` replaces same-named parameters, the others are kept."""
    path, _, query = raw_path.partition("?")
    origin = _origin(scheme, host, port)
    cross = False
    for o, prefix in bases:
        if o == origin and _under(path, prefix):
            path = route.prefix + path[len(prefix):]
            cross = o != route.origin()
            break
    else:
        path = route.prefix + path
    if not path.startswith("/"):
        path = "/" + path
    if route.query:
        query = with_query(query, route.query)
    return (path + "?" + query if query else path), cross


def _origin_of(parts: Any) -> Tuple[str, str, int]:
    """:func:`_origin` of a ``urlsplit`` result."""
    return _origin(parts.scheme, parts.hostname or "", parts.port)


def sdk_location(sdk_url: str, sent_url: str, route: Route, target: str) -> Optional[str]:
    """§17: a routed 3xx's ``Location`` (``target``, absolute) as the SDK's own URL:
    a target under the granted route's base URL (the origin ``sent_url`` went to,
    and its path prefix) has that prefix replaced by the one the SDK's request
    ``sdk_url`` was under, so the client follows the redirect to the SDK's origin
    and the next hop is admitted and routed as any request (its credentials kept or
    left behind by the rule for its own grant), never sent with the SDK's keys to
    the route's host as a request under that host's own base URL. None: a target
    elsewhere (left absolute)."""
    t, sent, sdk = urlsplit(target), urlsplit(sent_url), urlsplit(sdk_url)
    try:
        if _origin_of(t) != _origin_of(sent) or not _under(t.path, route.prefix):
            return None
    except ValueError:  # a bad port
        return None
    rest = sent.path[len(route.prefix):] if sent.path.startswith(route.prefix) else None
    if rest is None or not sdk.path.endswith(rest):
        return None
    path = sdk.path[:len(sdk.path) - len(rest)] + t.path[len(route.prefix):]
    if not path.startswith("/"):
        path = "/" + path
    return "%s://%s%s%s%s" % (sdk.scheme, sdk.netloc, path, "?" + t.query if t.query else "",
                              "#" + t.fragment if t.fragment else "")


def with_query(query: str, params: Tuple[Tuple[str, str], ...]) -> str:
    """``query`` (raw, no ``?``) without its parameters named in ``params``, then
    ``params`` percent-encoded (everything but ``A-Za-z0-9-._~``)."""
    names = {k for k, _ in params}
    kept = [kv for kv in query.split("&") if kv and unquote_plus(kv.partition("=")[0]) not in names]
    kept.extend("%s=%s" % (quote(k, safe=""), quote(v, safe="")) for k, v in params)
    return "&".join(kept)


_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)
_JSON_SCALAR = re.compile(rb'[^,}\]\s]*')
_JSON_NESTED = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.S)
_JSON_WS = re.compile(rb'[ \t\r\n]*')


def _value_end(b: bytes, i: int) -> int:
    """The index after the JSON value at ``b[i]`` (``b`` is valid JSON)."""
    c = b[i:i + 1]
    if c == b'"':
        m = _JSON_STRING.match(b, i)
        assert m is not None
        return m.end()
    if c not in (b"{", b"["):
        m = _JSON_SCALAR.match(b, i)
        assert m is not None
        return m.end()
    depth = 0
    for m in _JSON_NESTED.finditer(b, i):
        t = m.group()
        if t in (b"{", b"["):
            depth += 1
        elif t in (b"}", b"]"):
            depth -= 1
            if depth == 0:
                return m.end()
    return len(b)


def _ws(b: bytes, i: int) -> int:
    m = _JSON_WS.match(b, i)
    return m.end() if m is not None else i


def _not_json(name: str) -> Any:
    raise ValueError("%s is not JSON (RFC 8259)" % name)


def set_model(body: bytes, model: str) -> Optional[bytes]:
    """``body`` with its top-level ``"model"`` set to ``model`` (added first when it
    has none), every other byte kept; None when the body is not a JSON object (sent
    as it is). Byte-for-byte, not a re-serialisation: the request's other fields,
    their order and their numbers reach the upstream as the SDK wrote them.

    Only a body that is strict UTF-8 and standard JSON is changed (the bytes are
    spliced as UTF-8): ``json.loads`` on bytes would also read UTF-16/32 (whose
    bytes the splice would corrupt) and Python's ``NaN`` / ``Infinity``; a body
    nested too deep to parse is sent as it is too."""
    try:
        doc = json.loads(body.decode("utf-8"), parse_constant=_not_json)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None
    i = _ws(body, 0)
    if not isinstance(doc, dict) or body[i:i + 1] != b"{":  # not a (UTF-8) JSON object
        return None
    if doc.get("model") == model:
        return body
    lit = json.dumps(model).encode()
    spans: List[Tuple[int, int]] = []
    i = _ws(body, i + 1)
    while body[i:i + 1] == b'"':
        m = _JSON_STRING.match(body, i)
        assert m is not None
        key = m.group()
        i = _ws(body, _ws(body, m.end()) + 1)  # past the ':'
        end = _value_end(body, i)
        if key == b'"model"' or (b"\\" in key and json.loads(key) == "model"):
            spans.append((i, end))
        i = _ws(body, end)
        if body[i:i + 1] != b",":
            break
        i = _ws(body, i + 1)
    if not spans:
        at = body.index(b"{") + 1
        return body[:at] + b'"model":' + lit + (b"," if doc else b"") + body[at:]
    out = body
    for start, end in reversed(spans):
        out = out[:start] + lit + out[end:]
    return out


# ---------------------------------------------------------------- estimate

# "max_ written out in front (not inside the alternation): the regex engine then
# skips to each "max_ with a literal search instead of trying the alternation at
# every '"' of the body (a chat body has dozens). The same matches as before.
_OUTPUT = re.compile(rb'"max_(?:tokens|completion_tokens|output_tokens)"\s*:\s*(\d{1,10})(?![\d.eE])')


def estimate_request(body: Optional[bytes]) -> Tuple[Optional[int], Optional[int]]:
    """``(input, output)`` token estimates of a request body: input = ceil(bytes / 4)
    (None without a body), output = the body's first ``"max_tokens"`` /
    ``"max_completion_tokens"`` / ``"max_output_tokens"`` with an integer value
    (None when it has none: the source's ``est_output_tokens`` applies).

    A regex search, not a JSON parse: it costs well under a microsecond where
    parsing costs one per few hundred bytes of prompt. (A tool's JSON schema naming
    a ``max_tokens`` property has an object there, not an integer, so it does not
    match.)"""
    if not body:
        return None, None
    inp = (len(body) + 3) // 4
    if inp > _HALF_COUNT:
        inp = _HALF_COUNT
    m = _OUTPUT.search(body)
    if m is None:
        return inp, None
    out = int(m[1])
    return inp, out if out <= _HALF_COUNT else None


_HALF_COUNT = p.MAX_COUNT // 2  # the largest estimate (the sidecar adds input and output)


def check_estimate(value: Any) -> Tuple[Optional[int], Optional[int]]:
    """The user's ``estimate(request)`` answer, checked: a pair of counts or None."""
    if not (isinstance(value, tuple) and len(value) == 2):
        raise TypeError("estimate(request) must return (input_tokens, output_tokens) (each an int or None), "
                        "got %r" % (value,))
    inp, out = value
    return p._check_count("estimate input", inp), p._check_count("estimate output", out)


# ---------------------------------------------------------------- outcome


def status_outcome(status: int, headers: Any) -> Optional[Outcome]:
    """The report for a response status: None for 2xx (a success, settled with
    its usage when the body ends); 3xx → ``rejected``, an uncounted success with
    no tokens (the source answered but did no work: a redirect's next hop is a
    call of its own, a 304 has no completion; the breaker does not count it and
    the estimate is refunded); 429 → rate-limited with ``retry-after-ms`` /
    ``Retry-After``; 408 → timeout; 409 and 5xx → server_error; any other status
    → error."""
    if 200 <= status < 300:
        return None
    if 300 <= status < 400:
        return Outcome.rejected(tokens=0)
    if status == 429:
        return Outcome.rate_limited(retry_after_seconds(headers))
    if status == 408:
        return Outcome.failure("timeout")
    if status == 409 or status >= 500:
        return Outcome.failure("server_error")
    return Outcome.failure("error", retry=False)


# ---------------------------------------------------------------- usage

_MAX_JSON = 64 << 20  # a JSON body larger than this is passed through unread (the estimate stays)
_MAX_LINE = 1 << 20  # an SSE line longer than this is skipped
_EAGER_MAX = 1 << 20  # a non-stream body up to this size is read whole by the transport
_USAGE_OBJ = re.compile(rb'"usage"\s*:\s*\{')  # a usage object (not "usage": null)
_find_usage = _USAGE_OBJ.search


NO_USAGE: Usage = (None, None, None, None)
"""Usage unknown: every count None (the estimate stays)."""


def _count(v: Any, _max: int = p.MAX_COUNT) -> Optional[int]:
    return v if type(v) is int and 0 <= v <= _max else None  # bool is not int here


def usage_fields(usage: Any, _max: int = p.MAX_COUNT) -> Usage:
    """``(total, input, output, cached)`` of one provider ``usage`` object: input
    excludes the cached reads (Anthropic's ``input_tokens`` already does), cached is
    ``prompt_tokens_details.cached_tokens`` (OpenAI chat),
    ``input_tokens_details.cached_tokens`` (OpenAI responses) or
    ``cache_read_input_tokens`` (Anthropic), as ``run()`` reads them. A count is an
    int (not a bool) in ``0..MAX_COUNT``, else None (:func:`_count`, inlined: this
    runs on every response)."""
    if not isinstance(usage, dict):
        return NO_USAGE
    get = usage.get
    total = get("total_tokens")
    if type(total) is not int or not 0 <= total <= _max:
        total = None
    prompt = get("prompt_tokens")
    if type(prompt) is int and 0 <= prompt <= _max:  # OpenAI chat / embeddings
        details = get("prompt_tokens_details")
        cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else None
        out = get("completion_tokens")
        return (total, max(0, prompt - (cached or 0)), out if type(out) is int and 0 <= out <= _max else None,
                cached)
    inp = _count(get("input_tokens"))
    cached = None
    if inp is not None:  # OpenAI responses (cached in details) / Anthropic (cache reads apart)
        details = get("input_tokens_details")
        cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else None
        inp = max(0, inp - (cached or 0))
    if cached is None:  # Anthropic: input_tokens already excludes the cache reads
        cached = _count(get("cache_read_input_tokens"))
    return total, inp, _count(get("output_tokens")), cached


def _usage_in(doc: Any) -> Any:
    """The usage object of a body or an SSE event: top level (OpenAI bodies and
    chunks, Anthropic bodies and ``message_delta``), ``message.usage`` (Anthropic
    ``message_start``) or ``response.usage`` (``response.completed``)."""
    if not isinstance(doc, dict):
        return None
    u = doc.get("usage")
    if isinstance(u, dict):
        return u
    for holder in ("message", "response"):
        inner = doc.get(holder)
        if isinstance(inner, dict) and isinstance(inner.get("usage"), dict):
            return inner["usage"]
    return None


_SSE: Dict[str, bool] = {}  # content-type value → is_sse (the same few values on every response)


def is_sse(content_type: Optional[str]) -> bool:
    if content_type is None:
        return False
    sse = _SSE.get(content_type)
    if sse is None:
        sse = content_type.split(";", 1)[0].strip().lower() == "text/event-stream"
        if len(_SSE) < 64:  # a server inventing values (a boundary, a nonce) fills it once, no more
            _SSE[content_type] = sse
    return sse


def eager(content_type: Optional[str], content_length: Optional[str]) -> bool:
    """Whether a transport may read this body whole before handing the response
    on: not a stream, and a declared length of at most 1 MiB."""
    if content_length is None:
        return False
    if content_type is not None:  # is_sse, inline (every response)
        sse = _SSE.get(content_type)
        if sse is None:
            sse = is_sse(content_type)
        if sse:
            return False
    try:
        return 0 <= int(content_length) <= _EAGER_MAX
    except ValueError:
        return False




def body_usage(body: bytes, content_encoding: Optional[str] = None) -> Usage:
    """The usage of a whole (non-stream) body as received (gzip/deflate decoded
    here; another encoding: unknown)."""
    if content_encoding is not None:
        enc = content_encoding.strip().lower()
        if enc in ("gzip", "x-gzip", "deflate"):
            try:
                body = zlib.decompressobj(47).decompress(body)
            except zlib.error:
                return NO_USAGE
        elif enc not in ("", "identity"):
            return NO_USAGE
    if not body or len(body) > _MAX_JSON:
        return NO_USAGE
    return _json_usage(body)


class UsageReader:
    """Reads a response body as it passes through (never changes it) and keeps
    the last usage seen. Chunks are queued as received (still content-encoded:
    gzip/deflate are decoded here, other encodings leave the usage unknown) and
    read in batches: the pass-through loop only appends to :attr:`pending` and
    calls :meth:`flush` every :data:`BATCH` chunks, so a 1,000-chunk stream costs
    a list append per chunk and a regex search per batch. :meth:`usage` answers
    at any time — after the end, or with what was seen when a stream is
    abandoned. All-None means "unknown": keep the estimate."""

    __slots__ = ("sse", "pending", "_inflate", "_off", "_buf", "_tail", "total", "input", "output", "cached")

    BATCH = 64
    """Chunks queued before they are read (the pass-through loop checks ``len(pending)``)."""

    def __init__(self, content_type: Optional[str], content_encoding: Optional[str] = None) -> None:
        self.sse = is_sse(content_type)
        self.pending: List[bytes] = []
        """Chunks received, not read yet."""
        enc = (content_encoding or "").strip().lower()
        self._inflate: Any = None
        self._off = False  # usage cannot be read (unknown encoding, oversize body)
        if enc in ("gzip", "x-gzip", "deflate"):
            self._inflate = zlib.decompressobj(47)  # gzip or zlib header, detected
        elif enc not in ("", "identity"):
            self._off = True
        self._buf = bytearray()  # JSON: the body so far
        self._tail = b""  # SSE: an unfinished line
        self.total: Optional[int] = None
        self.input: Optional[int] = None
        self.output: Optional[int] = None
        self.cached: Optional[int] = None

    def feed(self, chunk: bytes) -> None:
        """Queue one chunk (reading the queue every :data:`BATCH` chunks)."""
        self.pending.append(chunk)
        if len(self.pending) >= self.BATCH:
            self.flush()

    def flush(self) -> None:
        """Read the queued chunks."""
        if not self.pending:
            return
        data = self.pending[0] if len(self.pending) == 1 else b"".join(self.pending)
        self.pending.clear()
        if self._off or not data:
            return
        if self._inflate is not None:
            try:
                data = self._inflate.decompress(data)
            except zlib.error:
                self._off = True
                return
        if not self.sse:
            if len(self._buf) + len(data) > _MAX_JSON:
                self._off = True
                self._buf = bytearray()
            else:
                self._buf += data
            return
        if self._tail:
            data = self._tail + data
        # Most batches have no usage object: keep the unfinished line only.
        if _find_usage(data) is None:
            if data.endswith(b"\n"):
                self._tail = b""
            else:
                nl = data.rfind(b"\n")
                tail = data[nl + 1:] if nl >= 0 else data
                self._tail = tail if len(tail) <= _MAX_LINE else b""
            return
        lines = data.split(b"\n")
        tail = lines.pop()
        self._tail = tail if len(tail) <= _MAX_LINE else b""
        for line in lines:
            if line.startswith(b"data:") and _find_usage(line) is not None:
                try:
                    doc = json.loads(line[5:])
                except (ValueError, RecursionError):
                    continue
                self._merge(usage_fields(_usage_in(doc)))

    def _merge(self, found: Usage) -> None:
        total, inp, out, cached = found
        if total is not None:
            self.total = total
        if inp is not None:
            self.input = inp
        if out is not None:
            self.output = out  # Anthropic's message_delta carries the cumulative count
        if cached is not None:
            self.cached = cached

    def usage(self) -> Usage:
        """``(tokens, input_tokens, output_tokens, cached_input_tokens)`` for
        ``Permit.success``."""
        self.flush()
        if not self.sse and self._buf and not self._off:
            self._merge(_json_usage(bytes(self._buf)))
            self._buf = bytearray()
        inp, out = self.input, self.output
        if inp is not None and out is not None and inp + out > p.MAX_COUNT:
            return NO_USAGE
        return self.total, inp, out, self.cached


_DECODER = json.JSONDecoder()
# raw_decode without its Python frame (the C scanner it calls): (value, end), StopIteration at no value
_scan: Callable[[str, int], Tuple[Any, int]] = getattr(_DECODER, "scan_once", _DECODER.raw_decode)


def _json_usage(body: bytes) -> Usage:
    """The usage of a JSON body. Fast path: the last ``"usage"`` key's object
    (providers put it at the end; a big body — embeddings — is not parsed whole);
    else the whole document — unless the body has no ``"usage"`` at all, no
    ``\\u`` escape that could spell one and is UTF-8 (a UTF-16/32 JSON text has a
    NUL in its first four bytes; ``json.loads`` reads those too): an error body,
    another API's answer, with nothing to find."""
    i = body.rfind(b'"usage"')
    if i < 0:
        if b"\\u" not in body and b"\x00" not in body[:4]:
            return NO_USAGE
    else:
        if body.startswith(b':{', i + 7):  # compact JSON, or json.dumps's ": ": no regex needed
            at = i + 8
        elif body.startswith(b': {', i + 7):
            at = i + 9
        else:
            m = _USAGE_OBJ.match(body, i)
            at = m.end() - 1 if m is not None else -1
        if at >= 0:
            try:
                obj = _scan(body[at:].decode("utf-8", "replace"), 0)[0]
                found = usage_fields(obj)
                if found != NO_USAGE:
                    return found
            except (ValueError, RecursionError, StopIteration):
                pass
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: nested too deep to parse
        return NO_USAGE
    return usage_fields(_usage_in(doc))


# ---------------------------------------------------------------- refusal


def refusal(err: GatewayUnavailableError, scope: str) -> Tuple[int, List[Tuple[str, str]], bytes]:
    """``(status, headers, body)`` of the synthetic response for a refused call:
    503 for an open circuit (and stalled / retry_exhausted / backend trouble), 429
    for an exhausted quota and for a tenant's limit (§19: the body adds
    ``"limit_source": "tenant"``, the tenant and the limit); ``Retry-After`` = ceil(retry_after_s), ``retry-after-ms``,
    ``x-should-retry: false`` and a JSON body naming PolyGate and the reason."""
    code = getattr(err, "reason", None) if isinstance(err, AllSourcesExhausted) else err.kind
    code = code or err.kind
    status = 429 if code == "quota_exhausted" else 503
    ra = err.retry_after_s if isinstance(err.retry_after_s, (int, float)) and math.isfinite(err.retry_after_s) \
        and err.retry_after_s >= 0 else 0.0
    doc = {"error": {
        "type": "polygate",
        "code": code,
        "message": "PolyGate refused the request (%s): %s" % (code, err.message),
        "scope": err.scope if err.scope is not None else scope,
        "retry_after_s": float(ra),
        "per_source_reasons": dict(err.per_source_reasons),
    }}
    if isinstance(err, TenantLimitExceeded):
        # §19: the caller's own customer budget, not the provider's quota: say so,
        # and whose and which, so nothing retries a spent budget blindly.
        status = 429
        doc["error"].update({"limit_source": "tenant", "tenant": err.tenant, "limit": err.limit})
    body = json.dumps(doc, separators=(",", ":")).encode()
    headers = [
        ("content-type", "application/json"),
        ("retry-after", str(int(math.ceil(ra)))),
        ("retry-after-ms", str(int(round(ra * 1000)))),
        ("x-polygate-refusal", code),
        # The call-level budget is spent: PolyGate already retried, failed over and
        # waited as the scope says. SDKs (openai, anthropic) honour this header and
        # do not retry the refusal on their own.
        ("x-should-retry", "false"),
    ]
    return status, headers, body
