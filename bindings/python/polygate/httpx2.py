"""PolyGate as an ``httpx2`` transport (DESIGN §17): gate every request an SDK sends.

::

    import httpx2, anthropic, polygate.httpx2
    client = anthropic.Anthropic(http_client=httpx2.Client(transport=polygate.httpx2.Transport(scope="chat")))
    # or: anthropic.Anthropic(http_client=polygate.httpx2.client("chat"))

Each HTTP request is one PolyGate call, admitted before it is sent and settled
when its response body (or stream) ends: with the usage in the body, the 429's
``Retry-After``, or the failure its status means. A refusal is a synthetic
503 / 429 the SDK already understands (``on_refusal="raise"`` raises the
PolyGate error instead). ``routes={source: {"base_url": ..., "headers": {...}}}``
sends each request to the granted source's deployment.

``httpx2`` is what anthropic 2.x accepts (openai takes either). This module
imports ``httpx2``; ``import polygate`` does not. The implementation is the one
of :mod:`polygate.httpx` (shared in ``polygate._gate``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Optional

import httpx2

from . import _gate
from ._gate import Estimator, TenantOption

__all__ = ["Transport", "AsyncTransport", "client", "async_client"]

_gate.trust_headers(httpx2.Headers)  # read its header triples as they are


class _Stream(_gate.SyncObserved, httpx2.SyncByteStream):
    """The response body, passed through unchanged while its usage is read."""


class _AsyncStream(_gate.AsyncObserved, httpx2.AsyncByteStream):
    """The response body (asyncio), passed through unchanged while its usage is read."""


class Transport(_gate.SyncGate, httpx2.BaseTransport):
    """An ``httpx2.BaseTransport`` that admits every request through PolyGate.

    ``scope``: the PolyGate scope of every request. ``client``: a
    :class:`polygate.Client` (default: connect to ``socket`` — else
    ``$POLYGATE_SOCKET`` / the default path — at the first request; closed with
    the transport). ``base``: the transport that really sends (default
    ``httpx2.HTTPTransport()``). ``routes``: ``{source: {"base_url": url,
    "headers": {...}, "query": {...}, "model": name}}`` — the request goes to the
    granted source's base URL with those headers (a request URL under one of the
    routes' base URLs — write the SDK's base URL among them — has that prefix
    replaced; one under none keeps its path, the base URL's path in front), its
    ``query`` parameters set and a JSON body's ``"model"`` set to ``model``;
    a granted source without a route raises :class:`polygate.RouteMissingError`
    before anything is sent. ``estimate(request) -> (input, output)``: token
    estimates (default: body bytes / 4 and the body's ``max_tokens`` /
    ``max_completion_tokens`` / ``max_output_tokens``). ``on_refusal``:
    ``"response"`` (a synthetic 503 / 429) or ``"raise"``. ``priority``: the
    priority class of every call. ``tenant``: the tenant of every request (DESIGN
    §19), or a function ``tenant(request) -> str | None``; a request's
    ``x-polygate-tenant`` header wins over it and is removed before sending. A
    tenant over its limit gets a synthetic 429 whose JSON body says
    ``"limit_source": "tenant"`` with the tenant and the limit, and
    ``x-should-retry: false`` (``on_refusal="raise"``: :class:`polygate.TenantLimitExceeded`)."""

    _lib = httpx2
    _Stream = _Stream

    def __init__(self, scope: str, *, client: Any = None, base: Optional[httpx2.BaseTransport] = None,
                 routes: Optional[Mapping[str, Any]] = None, estimate: Optional[Estimator] = None,
                 on_refusal: str = "response", priority: Optional[str] = None,
                 socket: Optional[str] = None, tenant: Optional[TenantOption] = None) -> None:
        _gate.SyncGate.__init__(self, scope, client=client, base=base, routes=routes, estimate=estimate,
                                on_refusal=on_refusal, priority=priority, socket=socket, tenant=tenant)

    if TYPE_CHECKING:  # the typed face of _gate.SyncGate.handle_request (no wrapper frame per request)
        def handle_request(self, request: httpx2.Request) -> httpx2.Response: ...

    def close(self) -> None:
        _gate.SyncGate.close(self)


class AsyncTransport(_gate.AsyncGate, httpx2.AsyncBaseTransport):
    """An ``httpx2.AsyncBaseTransport`` that admits every request through PolyGate
    (options as :class:`Transport`; ``client`` is a :class:`polygate.aio.Client`)."""

    _lib = httpx2
    _Stream = _AsyncStream

    def __init__(self, scope: str, *, client: Any = None, base: Optional[httpx2.AsyncBaseTransport] = None,
                 routes: Optional[Mapping[str, Any]] = None, estimate: Optional[Estimator] = None,
                 on_refusal: str = "response", priority: Optional[str] = None,
                 socket: Optional[str] = None, tenant: Optional[TenantOption] = None) -> None:
        _gate.AsyncGate.__init__(self, scope, client=client, base=base, routes=routes, estimate=estimate,
                                 on_refusal=on_refusal, priority=priority, socket=socket, tenant=tenant)

    if TYPE_CHECKING:  # the typed face of _gate.AsyncGate.handle_async_request
        async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response: ...

    async def aclose(self) -> None:
        await _gate.AsyncGate.aclose(self)


def client(scope: str, *, polygate_client: Any = None, base: Optional[httpx2.BaseTransport] = None,
           routes: Optional[Mapping[str, Any]] = None, estimate: Optional[Estimator] = None,
           on_refusal: str = "response", priority: Optional[str] = None, socket: Optional[str] = None,
           tenant: Optional[TenantOption] = None, **kwargs: Any) -> httpx2.Client:
    """An ``httpx2.Client`` whose requests go through :class:`Transport`
    (``kwargs`` go to ``httpx2.Client``: ``base_url``, ``timeout``, ...)."""
    return httpx2.Client(transport=Transport(scope, client=polygate_client, base=base, routes=routes,
                                            estimate=estimate, on_refusal=on_refusal, priority=priority,
                                            socket=socket, tenant=tenant), **kwargs)


def async_client(scope: str, *, polygate_client: Any = None, base: Optional[httpx2.AsyncBaseTransport] = None,
                 routes: Optional[Mapping[str, Any]] = None, estimate: Optional[Estimator] = None,
                 on_refusal: str = "response", priority: Optional[str] = None, socket: Optional[str] = None,
                 tenant: Optional[TenantOption] = None, **kwargs: Any) -> httpx2.AsyncClient:
    """An ``httpx2.AsyncClient`` whose requests go through :class:`AsyncTransport`."""
    return httpx2.AsyncClient(transport=AsyncTransport(scope, client=polygate_client, base=base, routes=routes,
                                                      estimate=estimate, on_refusal=on_refusal,
                                                      priority=priority, socket=socket, tenant=tenant), **kwargs)
