"""§18: the provider's rate-limit headers → observed limits, played from the shared
vectors (bindings/vectors/ratelimit_headers.json), and their wire encoding checked
against the golden frames."""

from __future__ import annotations

import json
import math
import pathlib
from typing import Any, Dict, Optional

import pytest

import polygate
from polygate import _frames, _wire
from polygate._core.ratelimit import Limit, Limits, encode_limits, parse_duration, parse_headers

pytestmark = pytest.mark.timeout(30)

VECTORS = pathlib.Path(__file__).resolve().parents[2] / "vectors"
CASES = json.loads((VECTORS / "ratelimit_headers.json").read_text())["cases"]
FRAMES = {v["name"]: v for v in json.loads((VECTORS / "frames.json").read_text())["vectors"]}


def _as_dict(l: Optional[Limit]) -> Optional[Dict[str, Any]]:
    return None if l is None else {"limit": l.limit, "remaining": l.remaining, "reset_s": l.reset_s}


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and math.isclose(a, b, abs_tol=1e-6)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    return bool(a == b)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_header_vectors(case: Dict[str, Any]) -> None:
    limits, retry_after = parse_headers(case["headers"], now=0.0)
    want = case["expected"]
    if want is None:
        assert limits is None
    else:
        assert limits is not None
        got = {k: _as_dict(getattr(limits, k)) for k in ("requests", "tokens", "input_tokens", "output_tokens")}
        assert _close(got, want), (got, want)
    assert _close(retry_after, case["retry_after_s"]) or retry_after == case["retry_after_s"]


def test_headers_as_pairs_and_bytes() -> None:
    limits, _ = parse_headers([(b"X-RateLimit-Remaining-Tokens", b"7")])
    assert limits is not None and limits.tokens == Limit(None, 7, None)


@pytest.mark.parametrize("text,secs", [("1s", 1.0), ("6m0s", 360.0), ("250ms", 0.25), ("1m30.5s", 90.5),
                                       ("2", 2.0), ("", None), ("1x", None), ("s", None)])
def test_durations(text: str, secs: Optional[float]) -> None:
    assert parse_duration(text) == secs


def _limits(v: Dict[str, Any]) -> Limits:
    def one(d: Optional[Dict[str, Any]]) -> Optional[Limit]:
        return None if d is None else Limit(d["limit"], d["remaining"], d["reset_s"])
    return Limits(one(v["requests"]), one(v["tokens"]), one(v["input_tokens"]), one(v["output_tokens"]), v["age_s"])


@pytest.mark.parametrize("name", [n for n in FRAMES if "_observed" in n])
def test_observed_frames_match_the_golden_vectors(name: str) -> None:
    v = FRAMES[name]
    (variant, body), = v["value"]["request"].items()
    limits = encode_limits(_limits(body["limits"]))
    outcome_frame = _wire.encode_client_frame({"id": 0, "request": {variant.replace("Observed", ""): {
        "permit": body["permit"], "outcome": body["outcome"]}}})
    outcome = outcome_frame[8 + 4 + 8:]
    build = {"FinishObserved": _frames.finish, "RetryObserved": _frames.retry, "ReportObserved": _frames.report}[variant]
    got = _frames.frame(v["value"]["id"], build(body["permit"], outcome, limits))
    assert got.hex() == v["frame_hex"]


def test_bad_limits_are_refused_before_anything_is_sent() -> None:
    with pytest.raises(ValueError, match="tokens.remaining"):
        encode_limits(Limits(tokens=Limit(remaining=-1)))
    with pytest.raises(ValueError, match="age_s"):
        encode_limits(Limits(tokens=Limit(remaining=1), age_s=math.nan))
    assert encode_limits(Limits()) is None


def test_exported() -> None:
    assert polygate.parse_headers is parse_headers and polygate.Limits is Limits
