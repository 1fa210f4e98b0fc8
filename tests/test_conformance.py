"""Conformance scenarios (DESIGN §14, `bindings/conformance/README.md`) played by the
Python binding's asyncio client against the real daemon, once per scenario × backend.

The scenario files are language-neutral; the Node and Go runners play the same
files. This runner uses only the binding's public API (`polygate.aio`).
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

import polygate
import polygate.aio

from .polygate_e2e import REPO, RedisServer

SCENARIOS = REPO / "bindings" / "conformance" / "scenarios"

TOP_KEYS = {"name", "description", "backends", "timeout_s", "config", "steps"}
RUNNER_KEYS = ("socket", "admin_uids", "backend", "redis_url", "key_prefix", "redis_timeout")
BACKENDS = ("memory", "redis")

# op -> (required fields, optional fields)
OPS: Dict[str, Any] = {
    "call": ({"call", "scope"}, {"est_tokens", "priority", "est_input_tokens", "est_output_tokens"}),
    "acquire": ({"call"}, {"expect"}),
    "acquire_cancel": ({"call", "after_s"}, set()),
    "success": ({"call"}, {"tokens", "input_tokens", "output_tokens", "count_attempt", "expect"}),
    "failure": ({"call", "kind"}, {"tokens", "expect"}),
    "rate_limited": ({"call"}, {"retry_after_s", "expect"}),
    "cancel": ({"call"}, {"expect"}),
    "end": ({"call"}, set()),
    "status": ({"expect"}, set()),
    "admin": ({"action", "source"}, {"seconds", "expect"}),
    "sleep": ({"seconds"}, set()),
}
GRANT_KEYS = {"source", "attempt", "is_probe", "est_tokens"}
ERROR_KEYS = {"type", "reason", "kind", "retry_after_s", "per_source_reasons", "scope", "message_contains"}
RESULT_KEYS = {"applied", "state", "retry_after_s"}


class Mismatch(AssertionError):
    pass


def load_scenarios() -> List[Dict[str, Any]]:
    files = sorted(SCENARIOS.glob("*.json"))
    if not files:  # never pass vacuously
        raise RuntimeError("no conformance scenarios in %s" % SCENARIOS)
    out = []
    for f in files:
        sc = json.loads(f.read_text())
        sc["_file"] = f.name
        out.append(sc)
    return out


def _params():
    ps = []
    for sc in load_scenarios():
        for backend in sc.get("backends", ["memory"]):
            ps.append(pytest.param(sc, backend, id="%s-%s" % (sc.get("name", sc["_file"]), backend)))
    return ps


# ------------------------------------------------------------------ matching


def is_range(v: Any) -> bool:
    return isinstance(v, dict) and bool(v) and set(v) <= {"min", "max"}


def match_number(want: Any, got: Any, where: str) -> None:
    if isinstance(got, bool) or not isinstance(got, (int, float)):
        raise Mismatch("%s: expected a number, got %r" % (where, got))
    if is_range(want):
        lo, hi = want.get("min"), want.get("max")
        if (lo is not None and got < lo) or (hi is not None and got > hi):
            raise Mismatch("%s: %r is outside [%s, %s]" % (where, got, lo, hi))
    elif got != want:
        raise Mismatch("%s: expected %r, got %r" % (where, want, got))


def match_value(want: Any, got: Any, where: str) -> None:
    """Partial match: dicts compare only the listed keys (recursively)."""
    if is_range(want) or (isinstance(want, (int, float)) and not isinstance(want, bool)):
        match_number(want, got, where)
    elif isinstance(want, dict):
        if not isinstance(got, dict):
            raise Mismatch("%s: expected an object, got %r" % (where, got))
        for k, w in want.items():
            if k not in got:
                raise Mismatch("%s: key %r missing (have %s)" % (where, k, sorted(got)))
            match_value(w, got[k], "%s.%s" % (where, k))
    elif want != got:
        raise Mismatch("%s: expected %r, got %r" % (where, want, got))


def check_keys(obj: Dict[str, Any], allowed: set, where: str) -> None:
    unknown = set(obj) - allowed
    if unknown:
        raise Mismatch("%s: unknown key(s) %s (runner knows %s)" % (where, sorted(unknown), sorted(allowed)))


def check_grant(want: Dict[str, Any], permit: Any, where: str) -> None:
    check_keys(want, GRANT_KEYS, where + ".grant")
    got = {"source": permit.source, "attempt": permit.attempt, "is_probe": permit.is_probe,
           "est_tokens": permit.est_tokens}
    match_value(want, got, where + ".grant")


ERROR_TYPES = {
    "circuit_open": polygate.CircuitOpenError,
    "all_sources_exhausted": polygate.AllSourcesExhausted,
    "gateway_unavailable": polygate.GatewayUnavailableError,
    "sidecar_error": polygate.SidecarError,
}


def check_error(want: Dict[str, Any], err: BaseException, where: str) -> None:
    check_keys(want, ERROR_KEYS, where + ".error")
    typ = want.get("type")
    if typ not in ERROR_TYPES:
        raise Mismatch("%s: unknown error type %r" % (where, typ))
    cls = ERROR_TYPES[typ]
    exact = typ == "gateway_unavailable"  # the base class only
    if not isinstance(err, cls) or (exact and type(err) is not cls):
        raise Mismatch("%s: expected %s, got %s: %s" % (where, typ, type(err).__name__, err))
    if "reason" in want and getattr(err, "reason", None) != want["reason"]:
        raise Mismatch("%s: reason %r, expected %r (%s)" % (where, getattr(err, "reason", None), want["reason"], err))
    if "kind" in want and err.kind != want["kind"]:
        raise Mismatch("%s: kind %r, expected %r (%s)" % (where, err.kind, want["kind"], err))
    if "retry_after_s" in want:
        match_number(want["retry_after_s"], getattr(err, "retry_after_s", None), where + ".retry_after_s")
    if "per_source_reasons" in want:
        got = dict(getattr(err, "per_source_reasons", {}) or {})
        if got != want["per_source_reasons"]:
            raise Mismatch("%s: per_source_reasons %r, expected %r" % (where, got, want["per_source_reasons"]))
    if "scope" in want and err.scope != want["scope"]:
        raise Mismatch("%s: scope %r, expected %r" % (where, err.scope, want["scope"]))
    if "message_contains" in want and want["message_contains"] not in str(err):
        raise Mismatch("%s: message %r lacks %r" % (where, str(err), want["message_contains"]))


def check_outcome(expect: Optional[Dict[str, Any]], value: Any, err: Optional[BaseException], where: str,
                  ok_key: str) -> None:
    """``expect`` is ``{ok_key: {...}}`` or ``{"error": {...}}`` (or None = succeed)."""
    if expect is None:
        if err is not None:
            raise Mismatch("%s: unexpected %s: %s" % (where, type(err).__name__, err)) from err
        return
    check_keys(expect, {ok_key, "error"}, where + ".expect")
    if len(expect) != 1:
        raise Mismatch("%s: expect needs exactly one of %s / error" % (where, ok_key))
    if "error" in expect:
        if err is None:
            raise Mismatch("%s: expected an error %r, the step succeeded with %r" % (where, expect["error"], value))
        check_error(expect["error"], err, where)
        return
    if err is not None:
        raise Mismatch("%s: expected %s, got %s: %s" % (where, ok_key, type(err).__name__, err)) from err
    if ok_key == "grant":
        check_grant(expect["grant"], value, where)
    else:  # result of a report
        check_keys(expect[ok_key], RESULT_KEYS, where + ".result")
        if value is not None:
            got = {"applied": value.applied, "state": value.state, "retry_after_s": value.retry_after_s}
            match_value(expect[ok_key], got, where + ".result")


# ------------------------------------------------------------------ playing


def sidecar_config(text: str, own: Dict[str, str]) -> str:
    """The scenario's TOML with the runner's `[sidecar]` keys merged in."""
    for k in RUNNER_KEYS:
        for line in text.splitlines():
            if line.strip().startswith(k + " ") or line.strip().startswith(k + "="):
                raise Mismatch("scenario config sets %r, which the runner owns" % k)
    keys = "".join("%s = %s\n" % (k, v) for k, v in own.items())
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.strip() == "[sidecar]":
            return "".join(lines[: i + 1]) + keys + "".join(lines[i + 1:])
    return "[sidecar]\n" + keys + "\n" + text


class _Call:
    def __init__(self, cm: Any) -> None:
        self.cm = cm
        self.entered = False
        self.permit: Any = None
        self.pending_error: Optional[BaseException] = None


async def play(sc: Dict[str, Any], client: Any, label: str) -> None:
    calls: Dict[str, _Call] = {}

    def the_call(step: Dict[str, Any], where: str) -> _Call:
        c = calls.get(step["call"])
        if c is None:
            raise Mismatch("%s: call %r was never opened" % (where, step["call"]))
        return c

    def the_permit(c: _Call, where: str) -> Any:
        if c.permit is None:
            raise Mismatch("%s: call has no permit to report on" % where)
        return c.permit

    async def report(step: Dict[str, Any], where: str, fn, **kw) -> None:
        c = the_call(step, where)
        res, err = None, None
        try:
            res = await fn(the_permit(c, where), **kw)
        except Mismatch:
            raise
        except polygate.PolyGateError as e:
            err = e
        check_outcome(step.get("expect"), res, err, where, "result")

    for i, step in enumerate(sc["steps"]):
        op = step.get("op")
        where = "%s step %d (%s)" % (label, i, op)
        if op not in OPS:
            raise Mismatch("%s: unknown op %r" % (where, op))
        required, optional = OPS[op]
        missing = required - set(step)
        if missing:
            raise Mismatch("%s: missing field(s) %s" % (where, sorted(missing)))
        check_keys(step, required | optional | {"op"}, where)

        if op == "call":
            kw = {"est_tokens": step.get("est_tokens")}
            for k in ("priority", "est_input_tokens", "est_output_tokens"):
                if k in step:
                    kw[k] = step[k]
            c = _Call(client.call(step["scope"], **kw))
            calls[step["call"]] = c
            try:
                await c.cm.__aenter__()
                c.entered = True
            except polygate.PolyGateError as e:  # e.g. unknown scope: checked at the acquire
                c.pending_error = e
        elif op == "acquire":
            c = the_call(step, where)
            permit, err = None, None
            if c.pending_error is not None:
                err, c.pending_error = c.pending_error, None
            else:
                try:
                    permit = await c.cm.acquire()
                except polygate.PolyGateError as e:
                    err = e
            c.permit = permit
            check_outcome(step.get("expect", {"grant": {}}), permit, err, where, "grant")
        elif op == "acquire_cancel":
            c = the_call(step, where)
            task = asyncio.ensure_future(c.cm.acquire())
            await asyncio.sleep(step["after_s"])
            if task.done():
                exc = task.exception()
                raise Mismatch("%s: acquire ended before it was cancelled: %r"
                               % (where, exc if exc is not None else task.result()))
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            else:
                raise Mismatch("%s: a cancelled acquire returned a permit" % where)
            c.permit = None
        elif op == "success":
            kw: Dict[str, Any] = {"tokens": step.get("tokens"), "count_attempt": step.get("count_attempt", True)}
            for k in ("input_tokens", "output_tokens"):
                if k in step:
                    kw[k] = step[k]
            await report(step, where, lambda p, **k: p.success(**k), **kw)
        elif op == "failure":
            kw = {"tokens": step["tokens"]} if "tokens" in step else {}
            await report(step, where, lambda p, **k: p.failure(step["kind"], **k), **kw)
        elif op == "rate_limited":
            await report(step, where, lambda p: p.rate_limited(retry_after_s=step.get("retry_after_s")))
        elif op == "cancel":
            await report(step, where, lambda p: p.cancel())
        elif op == "end":
            c = the_call(step, where)
            if c.entered:
                await c.cm.__aexit__(None, None, None)
            c.permit = None
        elif op == "status":
            st = await client.status()
            match_value(step["expect"], st, where + " status")
        elif op == "admin":
            action = step["action"]
            err = None
            try:
                if action == "force_open":
                    await client.force_open(step["source"], seconds=step["seconds"])
                elif action == "force_close":
                    await client.force_close(step["source"])
                elif action == "reset":
                    await client.reset(step["source"])
                else:
                    raise Mismatch("%s: unknown admin action %r" % (where, action))
            except polygate.PolyGateError as e:
                err = e
            expect = step.get("expect")
            if expect is None:
                if err is not None:
                    raise Mismatch("%s: %s failed: %s" % (where, action, err))
            else:
                check_keys(expect, {"error"}, where + ".expect")
                if err is None:
                    raise Mismatch("%s: expected an error %r, %s succeeded" % (where, expect["error"], action))
                check_error(expect["error"], err, where)
        elif op == "sleep":
            await asyncio.sleep(step["seconds"])


# ------------------------------------------------------------------ tests


def test_scenarios_are_well_formed():
    names = set()
    for sc in load_scenarios():
        assert set(sc) - {"_file"} <= TOP_KEYS, "%s: unknown top-level keys" % sc["_file"]
        assert sc["name"] + ".json" == sc["_file"], "%s: name must match the file name" % sc["_file"]
        assert sc["name"] not in names
        names.add(sc["name"])
        assert set(sc.get("backends", [])) <= set(BACKENDS), sc["_file"]
        assert sc["steps"], sc["_file"]
        for step in sc["steps"]:
            assert step.get("op") in OPS, "%s: unknown op in %r" % (sc["_file"], step)
            if step["op"] == "sleep":
                assert step["seconds"] <= 2, "%s: sleeps are at most 2 s" % sc["_file"]


@pytest.mark.parametrize("scenario,backend", _params())
def test_conformance(scenario, backend, sidecar, tmp_path):
    label = "scenario %s [%s]" % (scenario["name"], backend)
    own = {
        "socket": json.dumps(sidecar.socket),
        "admin_uids": "[%d]" % os.getuid(),
        "shutdown_grace": '"1s"',
    }
    if "shutdown_grace" in scenario["config"]:
        del own["shutdown_grace"]
    redis = None
    if backend == "redis":
        redis = RedisServer(tmp_path / "redis")
        redis.start()  # fails under CI=true, skips loudly otherwise
        own["backend"] = '"redis"'
        own["redis_url"] = json.dumps("redis://127.0.0.1:%d/0" % redis.port)
        own["key_prefix"] = json.dumps("conf-" + uuid.uuid4().hex[:12])
        own["redis_timeout"] = '"2s"'  # a loaded machine must not degrade a source mid-scenario
    else:
        own["backend"] = '"memory"'
    try:
        sidecar.config_path.write_text(sidecar_config(scenario["config"], own))
        sidecar.start(timeout=10)

        async def main() -> None:
            client = await polygate.aio.connect(sidecar.socket)
            try:
                await asyncio.wait_for(play(scenario, client, label), scenario.get("timeout_s", 30))
            except asyncio.TimeoutError:
                raise Mismatch("%s: exceeded its time limit of %ss" % (label, scenario.get("timeout_s", 30)))
            finally:
                await client.close()

        asyncio.run(main())
    finally:
        sidecar.stop()
        if redis is not None:
            redis.kill()
