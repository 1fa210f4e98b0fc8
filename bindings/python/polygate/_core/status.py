"""Typed models of what the sidecar reports: :class:`ReportResult` (the answer to
a report) and the ``client.status()`` document as TypedDicts. No I/O here.

The status document is a plain dict (JSON-ready, and the same shape whatever
the transport); the TypedDicts below give it types for mypy and IDEs.
"""

from __future__ import annotations

import json
from typing import Any, Dict, NamedTuple, Optional, TypedDict

from .errmap import snake

__all__ = ["ReportResult", "SourceStatus", "ScopeStatus", "Status", "report_result", "status_from_json"]


class ReportResult(NamedTuple):
    """The sidecar's answer to a report."""

    applied: bool
    """``False`` when the outcome was fenced out (the breaker moved on meanwhile)."""
    state: str
    """The source's breaker state after the report: closed / open / half_open."""
    retry_after_s: float
    """Seconds until a retry of this source is certainly worth attempting (0 = now)."""


class SourceStatus(TypedDict):  # the sidecar may add keys: they are passed through
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


class _StatusAdded(TypedDict, total=False):
    protocol_version: int  # from protocol 2's StatusJson on


class Status(_StatusAdded):
    """What ``client.status()`` returns; ``scopes`` in configuration order.
    Keys the sidecar adds later appear as they come."""

    sidecar_version: str
    backend: str
    scopes: Dict[str, ScopeStatus]


def report_result(body: Dict[str, Any]) -> ReportResult:
    """A ``Reported`` body → :class:`ReportResult`."""
    return ReportResult(body["applied"], snake(body["state"]), body["retry_after_s"])


def status_from_json(text: str) -> Status:
    """The ``StatusJson`` document → the :class:`Status` document: scopes and
    sources keyed by name (``name`` dropped), every other key kept as sent, so
    keys the sidecar adds show up without a client change."""
    doc = json.loads(text)
    if not isinstance(doc, dict) or not isinstance(doc.get("scopes"), list):
        raise ValueError("StatusJson is not a status document: %.200s" % (text,))
    scopes: Dict[str, Any] = {}
    for sc in doc["scopes"]:
        sc = dict(sc)
        name = sc.pop("name")
        sc["sources"] = {src["name"]: {k: v for k, v in src.items() if k != "name"}
                         for src in sc.get("sources") or []}
        scopes[name] = sc
    doc["scopes"] = scopes
    out: Status = doc  # type: ignore[assignment]
    return out
