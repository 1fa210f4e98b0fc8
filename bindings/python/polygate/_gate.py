"""The HTTP transport of DESIGN §17, written once for every httpx-shaped library
(``httpx`` and ``httpx2``, sync and asyncio). It imports neither: the library's
module is handed in (``_lib``) by :mod:`polygate.httpx` / :mod:`polygate.httpx2`,
which add only the classes that must subclass the library's own
(``BaseTransport``, ``SyncByteStream``, ...). What is decided — estimates, status
→ outcome, usage, refusal responses — lives in the sans-I/O
:mod:`polygate._core.transport`.

One HTTP request is one PolyGate call: ``Start`` before it is sent, the report
(``Finish``) when its response body ends or is closed — for a stream, when the
stream ends or the caller abandons it; the permit (and its pacer slot) is held
until then.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
import weakref
from typing import Any, AsyncIterator, Callable, Iterator, Mapping, Optional, Tuple, Union

from . import _core
from ._core import transport as t
from ._core.ratelimit import LIMIT_PREFIXES
from .errors import GatewayUnavailableError, PolyGateError, RouteMissingError

Estimator = Callable[[Any], Tuple[Optional[int], Optional[int]]]
"""``estimate(request) -> (input_tokens, output_tokens)``; either may be None."""

TenantOption = Union[str, Callable[[Any], Optional[str]]]
"""A transport's ``tenant=``: the tenant of every request, or ``tenant(request)``."""


def _aged(s: "_Settlement") -> None:
    """The observation's age at the report: how long the body took since the
    response's headers (a stream's length), so the sidecar dates it right."""
    limits = s.permit.limits
    if limits is not None:
        limits.age_s = max(0.0, time.monotonic() - s.at)


class _Base:
    """Options and decisions common to the sync and async transports."""

    _lib: Any  # the HTTP library's module (httpx or httpx2), set by the subclass

    def __init__(self, scope: str, *, routes: Optional[Mapping[str, Any]] = None,
                 estimate: Optional[Estimator] = None, on_refusal: str = "response",
                 priority: Optional[str] = None, socket: Optional[str] = None,
                 tenant: Optional[TenantOption] = None) -> None:
        if not isinstance(scope, str) or not scope:
            raise ValueError("scope must be a non-empty string, got %r" % (scope,))
        if on_refusal not in t.ON_REFUSAL:
            raise ValueError("on_refusal must be one of %s, got %r" % (", ".join(t.ON_REFUSAL), on_refusal))
        if estimate is not None and not callable(estimate):
            raise TypeError("estimate must be a function estimate(request) -> (input, output), got %r" % (estimate,))
        self.scope = scope
        """The scope every request of this transport is admitted in."""
        self.routes = t.parse_routes(routes)
        """source → :class:`polygate._core.transport.Route`, or None (send where the SDK sent it)."""
        self._bases = t.route_bases(self.routes) if self.routes is not None else ()
        self.on_refusal = on_refusal
        """``"response"``: a refusal is a synthetic 503/429; ``"raise"``: the PolyGate error."""
        self.priority = priority
        """The priority class of every call (None: the scope's default)."""
        self._estimate = estimate
        self._tenant = t.check_tenant(tenant)
        """§19: the tenant of a request naming none in its header (None: anonymous)."""
        # decided once: the tenant of a request without the header, when it is not a function's answer
        self._fixed_tenant = None if callable(self._tenant) else (self._tenant or None)
        self._tenant_fn = callable(self._tenant)
        self._socket = socket  # where to connect when no client was given (None: the default path)

    def _admission(self, request: Any) -> Tuple[Optional[int], Optional[int], Optional[str], Optional[str]]:
        """``(est_input, est_output, named, tenant)`` of a request: its estimates
        (``estimate=``'s answer, checked, else from the body), its ``x-polygate-tenant`` header
        (None: none) and its tenant (:meth:`_tenant_of`, decided at construction
        unless ``tenant=`` is a function). Once per request: kept flat."""
        if self._estimate is None:
            try:
                body = request.content
            except Exception:  # a streaming upload not read yet: no size to go by
                body = None
            est_in, est_out = t.estimate_request(body)
        else:
            est_in, est_out = t.check_estimate(self._estimate(request))
        named = _tenant_header(request)
        if named is not None:
            return est_in, est_out, named, named or None
        if self._tenant_fn:
            return est_in, est_out, None, self._tenant_of(request, None)
        return est_in, est_out, None, self._fixed_tenant

    def _tenant_of(self, request: Any, named: Optional[str]) -> Optional[str]:
        """§19: the request's tenant: ``named``, its ``x-polygate-tenant`` header
        (:func:`_tenant_header`), else the ``tenant=`` option (a function is called
        with the request); None or ``""`` is the scope's anonymous tenant."""
        if named is not None:
            return named or None
        opt = self._tenant
        if opt is None or isinstance(opt, str):
            return opt or None
        got = opt(request)
        if got is not None and not isinstance(got, str):
            raise TypeError("tenant(request) must return a string or None, got %r" % (got,))
        return got or None

    def _routed(self, request: Any, source: str, named: bool) -> Any:
        """The request to send for a grant on ``source``, without its tenant header
        when it has one (``named``); never the caller's own object changed: a
        request sent again keeps its tenant header."""
        if self.routes is None:
            if not named:
                return request
            headers = request.headers.copy()
            del headers[t.TENANT_HEADER]
            return self._lib.Request(request.method, request.url, headers=headers, stream=request.stream,
                                     extensions=request.extensions)
        route = self.routes.get(source)
        if route is None:
            raise RouteMissingError(
                "PolyGate granted source \"%s\" of scope \"%s\" but the transport's routes have no entry for "
                "it (routes name %s); nothing was sent" % (source, self.scope, ", ".join(sorted(self.routes))),
                source=source, scope=self.scope)
        lib = self._lib
        u = request.url
        raw, cross = t.rebase(self._bases, route, u.scheme, u.host, u.port, u.raw_path.decode("ascii"))
        url = u.copy_with(scheme=route.scheme, host=route.host, port=route.port, raw_path=raw.encode("ascii"))
        headers = request.headers.copy()
        headers["host"] = url.netloc.decode("ascii")
        if named:
            del headers[t.TENANT_HEADER]
        if cross:  # the SDK's keys stay with their origin (§17); the route's headers give this one its own
            for k in t.CREDENTIAL_HEADERS:
                if k in headers:
                    del headers[k]
        for k, v in route.headers:
            headers[k] = v
        if route.model is not None:
            try:
                body: Optional[bytes] = request.content
            except Exception:  # a streaming upload: sent as it is
                body = None
            new = t.set_model(body, route.model) if body else None
            if new is not None and new is not body:
                headers["content-length"] = str(len(new))
                return lib.Request(request.method, url, headers=headers, content=new, extensions=request.extensions)
        return lib.Request(request.method, url, headers=headers, stream=request.stream,
                           extensions=request.extensions)

    def _relocate(self, request: Any, sent: Any, response: Any, source: str) -> None:
        """§17: a routed request's 3xx ``Location``, made the SDK's own URL. Resolved
        against the URL actually sent (RFC 9110, section 10.2.2: relative to the
        request's target), a target under the granted route's base URL is written
        back under the base URL the SDK's request was under
        (:func:`~polygate._core.transport.sdk_location`): the HTTP client follows
        redirects above the transport, and a Location left relative would be
        resolved against the SDK's URL and routed twice (a doubled base path), one
        made absolute on the route's host would be sent there with the SDK's keys
        (the client drops only ``Authorization`` and ``Cookie`` on another origin).
        Any other target is made absolute."""
        loc = response.headers.get("location")
        route = self.routes.get(source) if self.routes is not None else None
        if loc is None or route is None:
            return
        try:
            to = str(sent.url.join(loc))
        except Exception:  # a Location the URL parser refuses: the client's to deal with
            return
        back = t.sdk_location(str(request.url), str(sent.url), route, to)
        if back is not None:
            response.headers["location"] = back
        elif not _ABSOLUTE.match(loc):
            response.headers["location"] = to

    def _refusal(self, request: Any, err: GatewayUnavailableError) -> Any:
        status, headers, body = t.refusal(err, self.scope)
        headers.append(("content-length", str(len(body))))
        # a stream, not content=: a caller streaming the response must be able to read it
        return self._lib.Response(status, headers=headers, stream=self._lib.ByteStream(body), request=request)

    def _report(self, s: "_Settlement", error: Optional[BaseException],
                usage: Optional[t.Usage]) -> Callable[[Any], Any]:
        """The report that settles ``s``, as a call on its permit (the sync and the
        async settle make it; the async permit's methods return awaitables): the
        error that broke the body (a failure of its kind, else a cancel), the 2xx's
        usage (``usage``, else what the reader saw), the 429's retry-after, or the
        status's failure kind. The observed limits are aged first (§18)."""
        _aged(s)
        if error is not None:
            kind = self._error_kind(error)
            if kind is None:
                return lambda p: p.cancel()
            return lambda p: p.failure(kind)
        outcome = s.outcome
        if outcome is None:
            tokens, inp, out, cached = usage or (s.reader.usage() if s.reader is not None else t.NO_USAGE)
            return lambda p: p.success(tokens, input_tokens=inp, output_tokens=out, cached_input_tokens=cached)
        if outcome.kind == "rate_limited":
            return lambda p: p.rate_limited(outcome.retry_after_s)
        if outcome.kind == "rejected":  # a 3xx: answered, no work done (status_outcome)
            return lambda p: p.success(0, count_attempt=False)
        return lambda p: p.failure(outcome.kind)

    def _error_kind(self, exc: BaseException) -> Optional[str]:
        """The failure kind of an exception from the wrapped transport (None: cancel)."""
        if not isinstance(exc, Exception):
            return None  # KeyboardInterrupt, CancelledError: the caller gave up
        if isinstance(exc, self._lib.TimeoutException):
            return "timeout"
        if isinstance(exc, (self._lib.TransportError, OSError)):
            return "connection"
        return None  # not the upstream's doing (a bug, a bad argument): no blame


class _Settlement:
    """One request's permit between the response headers and the end of its body."""

    __slots__ = ("call", "permit", "outcome", "reader", "done", "at")

    def __init__(self, call: Any, permit: Any, outcome: Optional[_core.Outcome],
                 reader: Optional[t.UsageReader], at: Optional[float] = None) -> None:
        self.call = call
        self.permit = permit
        self.outcome = outcome  # None: a 2xx, settled as a success with the usage read
        self.reader = reader  # None: a body read whole, its usage passed to settle()
        self.done = False
        self.at = time.monotonic() if at is None else at  # when the response's headers arrived (§18: the age)


_TENANT_B = t.TENANT_HEADER.encode()
_ABSOLUTE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")  # a URI with a scheme (RFC 3986, section 3.1): not relative
_LIMIT_NAMES_B = tuple(n.encode() for n in LIMIT_PREFIXES)


_TRIPLES: "set[type]" = set()
"""``Headers`` classes whose ``_list`` is known to hold ``(raw name, lower-case
name, value)`` byte triples (httpx's and httpx2's do; see :func:`trust_headers`)."""


def trust_headers(cls: type) -> None:
    """Let the transports read ``cls``'s own header triples (``Headers._list``) as
    they are: no decoding, no list built, no name lowered per request. Called by
    :mod:`polygate.httpx` / :mod:`polygate.httpx2` at import with the library's
    ``Headers``, and trusted only if a probe shows exactly that layout; any other
    class (a subclass, another version's layout) goes by the public ``.raw``."""
    try:
        ok = getattr(cls([("X-Probe", "v")]), "_list", None) == [(b"X-Probe", b"x-probe", b"v")]
    except Exception:
        ok = False
    if ok:
        _TRIPLES.add(cls)


def _triples(headers: Any) -> Any:
    """The ``(raw, lower, value)`` triples of a ``Headers`` not trusted above."""
    return [(k, k.lower(), v) for k, v in headers.raw]


def _tenant_header(request: Any) -> Optional[str]:
    """The request's ``x-polygate-tenant`` value (None: no such header), in one pass
    over the header triples (``Headers.get`` decodes every pair, per lookup: a few
    µs a request). HTTP whitespace around it (space, tab, CR, LF) is not part of it,
    and a header given more than once is its values joined by ``", "`` (RFC 9110,
    section 5.3): what fetch's ``Headers`` gives the Node binding, and the Go binding
    reads, so one request names one tenant in all three."""
    h = request.headers
    found = None
    for _, k, v in (h._list if type(h) in _TRIPLES else _triples(h)):
        if k == _TENANT_B:
            try:
                v = str(v.decode("utf-8")).strip(" \t\r\n")
            except UnicodeDecodeError:
                raise ValueError("the %s header must be UTF-8, got %r" % (t.TENANT_HEADER, v)) from None
            found = v if found is None else found + ", " + v
    return found


def _head(response: Any) -> Tuple[Optional[str], Optional[str], Optional[str], bool]:
    """``(content-type, content-encoding, content-length, limits)`` in one pass over
    the response's header triples (``Headers.get`` decodes them all, per lookup);
    ``limits``: whether a header name starts as a rate-limit or retry-after header
    does (§18: without one, there is nothing for ``parse_headers`` to find)."""
    ctype = cenc = clen = None
    limits = False
    h = response.headers
    for _, n, v in (h._list if type(h) in _TRIPLES else _triples(h)):
        if n == b"content-type":
            ctype = v.decode("latin-1")
        elif n == b"content-length":
            clen = v.decode("latin-1")
        elif n == b"content-encoding":
            cenc = v.decode("latin-1")
        elif not limits and n.startswith(_LIMIT_NAMES_B):
            limits = True
    return ctype, cenc, clen, limits


# ---------------------------------------------------------------- sync


class SyncGate(_Base):
    """``BaseTransport.handle_request`` under admission (see :mod:`polygate.httpx`)."""

    _Stream: Callable[[Any, "SyncGate", _Settlement], Any]  # the library's SyncByteStream subclass

    def __init__(self, scope: str, *, client: Any = None, base: Any = None, **kw: Any) -> None:
        super().__init__(scope, **kw)
        self._client = client
        self._own_client = client is None
        self._connect_lock = threading.Lock()
        self._base = base if base is not None else self._lib.HTTPTransport()

    def _gate(self) -> Any:
        c = self._client
        if c is None:
            with self._connect_lock:
                c = self._client
                if c is None:
                    from ._sync import connect
                    c = self._client = connect(self._socket)
        return c

    def handle_request(self, request: Any) -> Any:
        est_in, est_out, named, tenant = self._admission(request)
        c = self._client
        call = (c if c is not None else self._gate()).call(self.scope, priority=self.priority,
                                                             est_input_tokens=est_in, est_output_tokens=est_out,
                                                             tenant=tenant)
        try:
            permit = call.acquire()
        except GatewayUnavailableError as e:
            call.end()
            if self.on_refusal == "raise":
                raise
            return self._refusal(request, e)
        except BaseException:
            call.end(_quiet=True)
            raise
        try:
            sent = request if self.routes is None and named is None else \
                self._routed(request, permit.source, named is not None)
            response = self._base.handle_request(sent)
        except BaseException as exc:
            kind = self._error_kind(exc)
            if kind is None:
                permit.cancel()
            else:
                permit.failure(kind)
            call.end(_quiet=not isinstance(exc, Exception))
            raise
        if 300 <= response.status_code < 400 and self.routes is not None:
            self._relocate(request, sent, response, permit.source)
        ctype, cenc, clen, limits = _head(response)
        # §18: the provider's rate-limit headers become the report's observed limits
        # (None when it sent none: then there is nothing to parse). The sidecar applies
        # them only to a source that observes (observe_limits = "on" or an "auto"
        # limit); the report's age is set when it is sent (_aged).
        permit.limits = _core.parse_headers(response.headers)[0] if limits else None
        status = response.status_code
        outcome = None if 200 <= status < 300 else t.status_outcome(status, response.headers)
        if response.is_closed:  # a base transport that read the body itself (MockTransport, a cache)
            self.settle(_Settlement(call, permit, outcome, None), usage=t.body_usage(response.content))
            return response
        if t.eager(ctype, clen):
            # A small JSON body: read it here, settle, hand the same bytes on (no
            # stream wrapper, no finalizer; the SDK reads it at once anyway).
            inner = response.stream
            at = time.monotonic()
            try:
                raw = b"".join(inner)
            except BaseException as exc:
                inner.close()
                self.settle(_Settlement(call, permit, outcome, None, at), exc)
                raise
            inner.close()
            usage = t.body_usage(raw, cenc)
            if outcome is None:  # a 2xx: settled here as settle() would, without a settlement
                observed = permit.limits
                if observed is not None:  # _aged
                    observed.age_s = max(0.0, time.monotonic() - at)
                try:
                    permit.success(usage[0], input_tokens=usage[1], output_tokens=usage[2],
                                   cached_input_tokens=usage[3])
                    call.end()
                except PolyGateError:
                    call.end(_quiet=True)  # the sidecar is gone: it released the permit with the connection
            else:
                self.settle(_Settlement(call, permit, outcome, None, at), usage=usage)
            response.stream = self._lib.ByteStream(raw)
            return response
        settlement = _Settlement(call, permit, outcome, t.UsageReader(ctype, cenc))
        inner = response.stream
        response.stream = self._Stream(inner, self, settlement)
        weakref.finalize(response.stream, self._dropped, inner, settlement)
        return response

    def _dropped(self, inner: Any, s: _Settlement) -> None:
        """Safety net: the response was garbage-collected with its body neither
        read to the end nor closed. Settle it (with what was seen, else the
        estimate) from a thread of its own: a finalizer may run anywhere,
        even where this thread holds the client's connection lock."""
        if not s.done:
            threading.Thread(target=self._settle_dropped, args=(inner, s), daemon=True,
                             name="polygate-settle").start()

    def _settle_dropped(self, inner: Any, s: _Settlement) -> None:
        try:
            inner.close()
        except Exception:
            pass
        self.settle(s)

    def settle(self, s: _Settlement, error: Optional[BaseException] = None, usage: Optional[t.Usage] = None) -> None:
        """Report the request's permit and end its call (once): at the end of the
        body, when the caller closes it (abandoned: what was seen, else the
        estimate), or with the error that broke the body."""
        if s.done:
            return
        s.done = True
        call = s.call
        try:
            if error is None and s.outcome is None:  # a 2xx's usage: the common case, no closure
                _aged(s)
                tokens, inp, out, cached = usage or (s.reader.usage() if s.reader is not None else t.NO_USAGE)
                s.permit.success(tokens, input_tokens=inp, output_tokens=out, cached_input_tokens=cached)
            else:
                self._report(s, error, usage)(s.permit)
            call.end()
        except PolyGateError:
            call.end(_quiet=True)  # the sidecar is gone: it released the permit with the connection

    def close(self) -> None:
        self._base.close()
        if self._own_client and self._client is not None:
            self._client.close()
            self._client = None


class SyncObserved:
    """Mixin of the library's ``SyncByteStream`` subclass: passes the body through
    unchanged, feeding the usage reader, and settles at the end or on close."""

    def __init__(self, inner: Any, gate: SyncGate, settlement: _Settlement) -> None:
        assert settlement.reader is not None  # a passed-through body is read as it passes
        self._inner = inner
        self._gate = gate
        self._s = settlement
        self._reader: t.UsageReader = settlement.reader

    def __iter__(self) -> Iterator[bytes]:
        reader = self._reader
        pending, batch = reader.pending, reader.BATCH
        try:
            for chunk in self._inner:
                pending.append(chunk)  # read in batches: per chunk, an append (1,000-chunk streams)
                if len(pending) >= batch:
                    reader.flush()
                yield chunk
        except Exception as e:
            self._gate.settle(self._s, e)
            raise
        self._gate.settle(self._s)

    def close(self) -> None:
        try:
            self._inner.close()
        finally:
            self._gate.settle(self._s)


# ---------------------------------------------------------------- async


class AsyncGate(_Base):
    """``AsyncBaseTransport.handle_async_request`` under admission."""

    _Stream: Callable[[Any, "AsyncGate", _Settlement], Any]  # the library's AsyncByteStream subclass

    def __init__(self, scope: str, *, client: Any = None, base: Any = None, **kw: Any) -> None:
        super().__init__(scope, **kw)
        self._client = client
        self._own_client = client is None
        self._connect_lock: Optional[asyncio.Lock] = None
        self._base = base if base is not None else self._lib.AsyncHTTPTransport()
        self._tasks: "set[asyncio.Future[None]]" = set()  # settlements of dropped responses, running

    async def _gate(self) -> Any:
        c = self._client
        if c is None:
            if self._connect_lock is None:
                self._connect_lock = asyncio.Lock()
            async with self._connect_lock:
                c = self._client
                if c is None:
                    from .aio import connect
                    c = self._client = await connect(self._socket)
        return c

    async def handle_async_request(self, request: Any) -> Any:
        est_in, est_out, named, tenant = self._admission(request)
        call = (await self._gate()).call(self.scope, priority=self.priority, est_input_tokens=est_in,
                                         est_output_tokens=est_out, tenant=tenant)
        try:
            permit = await call.acquire()
        except GatewayUnavailableError as e:
            await call.end()
            if self.on_refusal == "raise":
                raise
            return self._refusal(request, e)
        except BaseException:
            call._release_now()
            raise
        try:
            sent = request if self.routes is None and named is None else \
                self._routed(request, permit.source, named is not None)
            response = await self._base.handle_async_request(sent)
        except BaseException as exc:
            kind = self._error_kind(exc)
            if kind is None:
                await permit.cancel()
            else:
                await permit.failure(kind)
            if isinstance(exc, Exception):
                await call.end()
            else:
                call._release_now()
            raise
        if 300 <= response.status_code < 400 and self.routes is not None:
            self._relocate(request, sent, response, permit.source)
        ctype, cenc, clen, limits = _head(response)
        # §18: the provider's rate-limit headers become the report's observed limits
        # (None when it sent none: then there is nothing to parse). The sidecar applies
        # them only to a source that observes (observe_limits = "on" or an "auto"
        # limit); the report's age is set when it is sent (_aged).
        permit.limits = _core.parse_headers(response.headers)[0] if limits else None
        status = response.status_code
        outcome = None if 200 <= status < 300 else t.status_outcome(status, response.headers)
        if response.is_closed:  # a base transport that read the body itself
            await self.settle(_Settlement(call, permit, outcome, None), usage=t.body_usage(response.content))
            return response
        if t.eager(ctype, clen):  # a small JSON body: read it here (see SyncGate)
            inner = response.stream
            s = _Settlement(call, permit, outcome, None)
            try:
                raw = b"".join([chunk async for chunk in inner])
            except BaseException as exc:
                await inner.aclose()
                await self.settle(s, exc)
                raise
            await inner.aclose()
            await self.settle(s, usage=t.body_usage(raw, cenc))
            response.stream = self._lib.ByteStream(raw)
            return response
        settlement = _Settlement(call, permit, outcome, t.UsageReader(ctype, cenc))
        inner = response.stream
        response.stream = self._Stream(inner, self, settlement)
        weakref.finalize(response.stream, self._dropped, asyncio.get_running_loop(), inner, settlement)
        return response

    def _dropped(self, loop: asyncio.AbstractEventLoop, inner: Any, s: _Settlement) -> None:
        """Safety net, as :meth:`SyncGate._dropped`: settle on the response's loop."""
        if s.done:
            return
        try:
            loop.call_soon_threadsafe(self._spawn_settle, inner, s)
        except RuntimeError:
            pass  # the loop is closed: its connection to the sidecar is gone, and with it the permit

    def _spawn_settle(self, inner: Any, s: _Settlement) -> None:
        task = asyncio.ensure_future(self._settle_dropped(inner, s))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _settle_dropped(self, inner: Any, s: _Settlement) -> None:
        try:
            await inner.aclose()
        except Exception:
            pass
        await self.settle(s)

    async def settle(self, s: _Settlement, error: Optional[BaseException] = None,
                     usage: Optional[t.Usage] = None) -> None:
        """As :meth:`SyncGate.settle`, awaited."""
        if s.done:
            return
        s.done = True
        call = s.call
        try:
            await self._report(s, error, usage)(s.permit)
            await call.end()
        except PolyGateError:
            call._release_now()
        except BaseException:  # cancelled while settling: release without waiting
            call._release_now()
            raise

    async def aclose(self) -> None:
        await self._base.aclose()
        if self._own_client and self._client is not None:
            await self._client.close()
            self._client = None


class AsyncObserved:
    """Mixin of the library's ``AsyncByteStream`` subclass (see :class:`SyncObserved`)."""

    def __init__(self, inner: Any, gate: AsyncGate, settlement: _Settlement) -> None:
        assert settlement.reader is not None  # a passed-through body is read as it passes
        self._inner = inner
        self._gate = gate
        self._s = settlement
        self._reader: t.UsageReader = settlement.reader

    async def __aiter__(self) -> AsyncIterator[bytes]:
        reader = self._reader
        pending, batch = reader.pending, reader.BATCH
        try:
            async for chunk in self._inner:
                pending.append(chunk)
                if len(pending) >= batch:
                    reader.flush()
                yield chunk
        except Exception as e:
            await self._gate.settle(self._s, e)
            raise
        await self._gate.settle(self._s)

    async def aclose(self) -> None:
        try:
            await self._inner.aclose()
        finally:
            await self._gate.settle(self._s)
