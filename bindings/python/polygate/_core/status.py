"""Typed models of what the sidecar reports: :class:`ReportResult` (the answer to
a report) and the ``client.status()`` document as TypedDicts. No I/O here.

The status document is a plain dict (JSON-ready, and the same shape whatever
the transport); the TypedDicts below give it types for mypy and IDEs.
"""

from __future__ import annotations

from typing import Any, Dict, NamedTuple, Optional, TypedDict

from .errmap import snake

__all__ = ["ReportResult", "SourceStatus", "ScopeStatus", "Status", "report_result", "status_dict"]


class ReportResult(NamedTuple):
    """The sidecar's answer to a report."""

    applied: bool
    """``False`` when the outcome was fenced out (the breaker moved on meanwhile)."""
    state: str
    """The source's breaker state after the report: closed / open / half_open."""
    retry_after_s: float
    """Seconds until a retry of this source is certainly worth attempting (0 = now)."""


class SourceStatus(TypedDict):
    """One source of a scope, as ``status()["scopes"][scope]["sources"][name]``."""

    state: str  # "closed" | "open" | "half_open"
    epoch: int
    retry_after_s: float
    cooldown_level: int
    window_successes: int
    window_failures: int
    streak: int
    memo_remaining_s: float
    pacer_ceiling: float
    in_flight: int
    tokens_available: Optional[float]
    requests_available: Optional[float]
    quota_blocked_s: float
    degraded: bool


class ScopeStatus(TypedDict):
    """One scope, as ``status()["scopes"][name]``; ``sources`` in configuration order."""

    circuit_open: str
    quota_full: str
    waiters: int
    calls: int
    sources: Dict[str, SourceStatus]


class Status(TypedDict):
    """What ``client.status()`` returns; ``scopes`` in configuration order."""

    sidecar_version: str
    backend: str
    scopes: Dict[str, ScopeStatus]


def report_result(body: Dict[str, Any]) -> ReportResult:
    """A ``Reported`` body → :class:`ReportResult`."""
    return ReportResult(body["applied"], snake(body["state"]), body["retry_after_s"])


def status_dict(body: Dict[str, Any]) -> Status:
    """A ``Status`` body (``StatusReport``) → the :class:`Status` document."""
    scopes: Dict[str, ScopeStatus] = {}
    for sc in body["scopes"]:
        sources: Dict[str, SourceStatus] = {}
        for src in sc["sources"]:
            d: Any = {k: v for k, v in src.items() if k != "name"}
            d["state"] = snake(src["state"])
            sources[src["name"]] = d
        scopes[sc["name"]] = {
            "circuit_open": sc["circuit_open"],
            "quota_full": sc["quota_full"],
            "waiters": sc["waiters"],
            "calls": sc["calls"],
            "sources": sources,
        }
    return {"sidecar_version": body["sidecar_version"], "backend": body["backend"], "scopes": scopes}
