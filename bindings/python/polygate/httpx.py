"""PolyGate as an ``httpx`` transport (DESIGN §17): gate every request an SDK sends.

::

    import httpx, openai, polygate.httpx
    client = openai.OpenAI(http_client=httpx.Client(transport=polygate.httpx.Transport(scope="chat")))
    # or: openai.OpenAI(http_client=polygate.httpx.client("chat"))

Each HTTP request is one PolyGate call, admitted before it is sent and settled
when its response body (or stream) ends: with the usage in the body, the 429's
``Retry-After``, or the failure its status means. A refusal is a synthetic
503 / 429 the SDK already understands (``on_refusal="raise"`` raises the
PolyGate error instead). ``routes={source: {"base_url": ..., "headers": {...}}}``
sends each request to the granted source's deployment.

This module imports ``httpx``; ``import polygate`` does not. For ``httpx2``
(anthropic 2.x) use :mod:`polygate.httpx2`, the same classes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Optional

import httpx

from . import _gate
from ._gate import Estimator, TenantOption

__all__ = ["Transport", "AsyncTransport", "client", "async_client"]

_gate.trust_headers(httpx.Headers)  # read its header triples as they are


class _Stream(_gate.SyncObserved, httpx.SyncByteStream):
    """The response body, passed through unchanged while its usage is read."""


class _AsyncStream(_gate.AsyncObserved, httpx.AsyncByteStream):
    """The response body (asyncio), passed through unchanged while its usage is read."""


class Transport(_gate.SyncGate, httpx.BaseTransport):
    """An ``httpx.BaseTransport`` that admits every request through PolyGate.

    ``scope``: the PolyGate scope of every request. ``client``: a
    :class:`polygate.Client` (default: connect to ``socket`` — else
    ``$POLYGATE_SOCKET`` / the default path — at the first request; closed with
    the transport). ``base``: the transport that really sends (default
    ``httpx.HTTPTransport()``). ``routes``: ``{source: {"base_url": url,
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

    _lib = httpx
    _Stream = _Stream

    def __init__(self, scope: str, *, client: Any = None, base: Optional[httpx.BaseTransport] = None,
                 routes: Optional[Mapping[str, Any]] = None, estimate: Optional[Estimator] = None,
                 on_refusal: str = "response", priority: Optional[str] = None,
                 socket: Optional[str] = None, tenant: Optional[TenantOption] = None) -> None:
        _gate.SyncGate.__init__(self, scope, client=client, base=base, routes=routes, estimate=estimate,
                                on_refusal=on_refusal, priority=priority, socket=socket, tenant=tenant)

    if TYPE_CHECKING:  # the typed face of _gate.SyncGate.handle_request (no wrapper frame per request)
        def handle_request(self, request: httpx.Request) -> httpx.Response: ...

    def close(self) -> None:
        _gate.SyncGate.close(self)


class AsyncTransport(_gate.AsyncGate, httpx.AsyncBaseTransport):
    """An ``httpx.AsyncBaseTransport`` that admits every request through PolyGate
    (options as :class:`Transport`; ``client`` is a :class:`polygate.aio.Client`)."""

    _lib = httpx
    _Stream = _AsyncStream

    def __init__(self, scope: str, *, client: Any = None, base: Optional[httpx.AsyncBaseTransport] = None,
                 routes: Optional[Mapping[str, Any]] = None, estimate: Optional[Estimator] = None,
                 on_refusal: str = "response", priority: Optional[str] = None,
                 socket: Optional[str] = None, tenant: Optional[TenantOption] = None) -> None:
        _gate.AsyncGate.__init__(self, scope, client=client, base=base, routes=routes, estimate=estimate,
                                 on_refusal=on_refusal, priority=priority, socket=socket, tenant=tenant)

    if TYPE_CHECKING:  # the typed face of _gate.AsyncGate.handle_async_request
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response: ...

    async def aclose(self) -> None:
        await _gate.AsyncGate.aclose(self)


def client(scope: str, *, polygate_client: Any = None, base: Optional[httpx.BaseTransport] = None,
           routes: Optional[Mapping[str, Any]] = None, estimate: Optional[Estimator] = None,
           on_refusal: str = "response", priority: Optional[str] = None, socket: Optional[str] = None,
           tenant: Optional[TenantOption] = None, **kwargs: Any) -> httpx.Client:
    """An ``httpx.Client`` whose requests go through :class:`Transport`
    (``kwargs`` go to ``httpx.Client``: ``base_url``, ``timeout``, ...)."""
    return httpx.Client(transport=Transport(scope, client=polygate_client, base=base, routes=routes,
                                            estimate=estimate, on_refusal=on_refusal, priority=priority,
                                            socket=socket, tenant=tenant), **kwargs)


def async_client(scope: str, *, polygate_client: Any = None, base: Optional[httpx.AsyncBaseTransport] = None,
                 routes: Optional[Mapping[str, Any]] = None, estimate: Optional[Estimator] = None,
                 on_refusal: str = "response", priority: Optional[str] = None, socket: Optional[str] = None,
                 tenant: Optional[TenantOption] = None, **kwargs: Any) -> httpx.AsyncClient:
    """An ``httpx.AsyncClient`` whose requests go through :class:`AsyncTransport`."""
    return httpx.AsyncClient(transport=AsyncTransport(scope, client=polygate_client, base=base, routes=routes,
                                                      estimate=estimate, on_refusal=on_refusal,
                                                      priority=priority, socket=socket, tenant=tenant), **kwargs)
