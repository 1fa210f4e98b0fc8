"""client.run / client.gated (sync and asyncio) against the fake sidecar, with
stand-in exception classes shaped like the openai SDK's and httpx's (the binding
must not need them: they are test-only dependencies, blocked where that matters)."""

import asyncio
import os
import subprocess
import sys
import types

import pytest

import polygate
import polygate.aio
from fake_sidecar import HOLD, error
from polygate import Outcome, _core


def _variant(x):
    return x if isinstance(x, str) else next(iter(x))


def _wire(fake):
    """[(variant, outcome or None)] of everything after Hello."""
    out = []
    for f in fake.requests():
        name = _variant(f["request"])
        if name == "Hello":
            continue
        body = f["request"][name] if isinstance(f["request"], dict) else None
        out.append((name, body.get("outcome") if isinstance(body, dict) else None))
    return out


def arun(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


# ---------------------------------------------------------------- stand-ins


class _Headers(dict):
    """Case-insensitive like httpx.Headers."""

    def get(self, key, default=None):
        for k, v in self.items():
            if k.lower() == key.lower():
                return v
        return default


class _Response:
    def __init__(self, status_code, headers=None):
        self.status_code = status_code
        self.headers = _Headers(headers or {})


class HTTPError(Exception):
    """Shaped like openai.APIStatusError / anthropic errors: status_code + response."""

    def __init__(self, status, headers=None):
        super().__init__("HTTP %d" % status)
        self.status_code = status
        self.response = _Response(status, headers)


class ResponseOnlyError(Exception):
    """Shaped like httpx.HTTPStatusError / requests.HTTPError: only .response.status_code."""

    def __init__(self, status, headers=None):
        super().__init__("HTTP %d" % status)
        self.response = _Response(status, headers)


class Usage:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class Reply:
    def __init__(self, usage):
        self.usage = usage


def _stand_in_openai():
    m = types.ModuleType("openai")

    class APIError(Exception):
        pass

    class APIConnectionError(APIError):
        pass

    class APITimeoutError(APIConnectionError):
        pass

    class APIStatusError(APIError):
        def __init__(self, status, headers=None):
            super().__init__("status %d" % status)
            self.status_code = status
            self.response = _Response(status, headers)

    class RateLimitError(APIStatusError):
        pass

    m.APIError, m.APIConnectionError, m.APITimeoutError = APIError, APIConnectionError, APITimeoutError
    m.APIStatusError, m.RateLimitError = APIStatusError, RateLimitError
    return m


def _stand_in_httpx():
    m = types.ModuleType("httpx")

    class HTTPError(Exception):
        pass

    class TransportError(HTTPError):
        pass

    class TimeoutException(TransportError):
        pass

    class ReadTimeout(TimeoutException):
        pass

    class ConnectError(TransportError):
        pass

    class HTTPStatusError(HTTPError):
        def __init__(self, status, headers=None):
            super().__init__("status %d" % status)
            self.response = _Response(status, headers)

    for c in (HTTPError, TransportError, TimeoutException, ReadTimeout, ConnectError, HTTPStatusError):
        setattr(m, c.__name__, c)
    return m


# ---------------------------------------------------------------- the environment


def test_the_binding_works_without_openai_and_httpx_and_never_imports_them():
    """The SDKs and HTTP libraries are test-only dependencies (the transports'
    tests use them): with them blocked, ``polygate`` and its classification still
    work; with them installed, importing ``polygate`` does not import them."""
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(polygate.__file__))))
    blocked = ("import sys\n"
               "for m in ('openai', 'httpx', 'httpx2', 'anthropic'):\n"
               "    sys.modules[m] = None\n")
    use = ("import sys, polygate, polygate.aio\n"
           "from polygate import _core\n"
           "assert _core.classify_exception(TimeoutError()).kind == 'timeout'\n"
           "assert not [m for m in ('openai', 'httpx', 'httpx2', 'anthropic') if sys.modules.get(m)], "
           "sorted(sys.modules)\n")
    for code in (blocked + use, use):
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr


# ---------------------------------------------------------------- classification (pure)


@pytest.mark.parametrize("exc, want", [
    (TimeoutError("t"), Outcome.failure("timeout")),
    (asyncio.TimeoutError(), Outcome.failure("timeout")),
    (ConnectionResetError(), Outcome.failure("connection")),
    (ConnectionRefusedError(), Outcome.failure("connection")),
    (OSError(101, "Network is unreachable"), Outcome.failure("connection")),
    (FileNotFoundError(2, "no such file"), Outcome.failure("error", retry=False)),
    (HTTPError(429, {"Retry-After": "7"}), Outcome.rate_limited(7.0)),
    (HTTPError(429, {"retry-after-ms": "1500", "retry-after": "9"}), Outcome.rate_limited(1.5)),
    (HTTPError(429), Outcome.rate_limited(None)),
    (HTTPError(429, {"retry-after": "soon"}), Outcome.rate_limited(None)),
    (ResponseOnlyError(429, {"retry-after": "3"}), Outcome.rate_limited(3.0)),
    (HTTPError(500), Outcome.failure("server_error")),
    (HTTPError(503), Outcome.failure("server_error")),
    (HTTPError(529), Outcome.failure("server_error")),
    (HTTPError(408), Outcome.failure("timeout")),
    (HTTPError(401), Outcome.failure("error", retry=True)),
    (HTTPError(404), Outcome.failure("error", retry=True)),
    (HTTPError(400), Outcome.rejected()),
    (HTTPError(422), Outcome.rejected()),
    (ValueError("bug"), Outcome.failure("error", retry=False)),
    (KeyboardInterrupt(), Outcome.cancelled()),
    (asyncio.CancelledError(), Outcome.cancelled()),
])
def test_builtin_classification(exc, want):
    assert _core.classify_exception(exc) == want


def test_retry_after_http_date():
    hdr = {"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}
    from email.utils import parsedate_to_datetime
    at = parsedate_to_datetime(hdr["retry-after"]).timestamp()
    assert _core.retry_after_seconds(hdr, now=at - 12) == pytest.approx(12.0)
    assert _core.retry_after_seconds(hdr, now=at + 5) == 0.0


def test_stand_in_sdks_are_recognised_when_loaded(monkeypatch):
    oa, hx = _stand_in_openai(), _stand_in_httpx()
    # not loaded: a bare class of the same name means nothing
    assert _core.classify_exception(oa.APITimeoutError()) == Outcome.failure("error", retry=False)
    monkeypatch.setitem(sys.modules, "openai", oa)
    monkeypatch.setitem(sys.modules, "httpx", hx)
    assert _core.classify_exception(oa.APITimeoutError()) == Outcome.failure("timeout")
    assert _core.classify_exception(oa.APIConnectionError()) == Outcome.failure("connection")
    assert _core.classify_exception(oa.RateLimitError(429, {"retry-after": "2"})) == Outcome.rate_limited(2.0)
    assert _core.classify_exception(oa.APIStatusError(502)) == Outcome.failure("server_error")
    assert _core.classify_exception(oa.APIStatusError(400)) == Outcome.rejected()
    assert _core.classify_exception(hx.ReadTimeout()) == Outcome.failure("timeout")
    assert _core.classify_exception(hx.ConnectError()) == Outcome.failure("connection")
    assert _core.classify_exception(hx.HTTPStatusError(429, {"Retry-After": "4"})) == Outcome.rate_limited(4.0)
    assert _core.classify_exception(hx.HTTPStatusError(500)) == Outcome.failure("server_error")


@pytest.mark.parametrize("result, permit_tokens, want", [
    (Reply(Usage(prompt_tokens=900, completion_tokens=100, total_tokens=1000,
                 prompt_tokens_details=Usage(cached_tokens=300))), None, (1000, 600, 100, 300)),
    (Reply(Usage(prompt_tokens=900, completion_tokens=100, total_tokens=1000)), None, (1000, 900, 100, None)),
    (Reply(Usage(input_tokens=700, output_tokens=50, cache_read_input_tokens=5000)), None, (None, 700, 50, 5000)),
    (Reply(Usage(input_tokens=700, output_tokens=50, total_tokens=750,
                 input_tokens_details=Usage(cached_tokens=200))), None, (750, 500, 50, 200)),
    ({"usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15,
                "prompt_tokens_details": {"cached_tokens": 4}}}, None, (15, 6, 5, 4)),
    ({"usage": {"input_tokens": 10, "output_tokens": 5, "cache_read_input_tokens": -3}}, None, (None, 10, 5, None)),
    ({"usage": {"total_tokens": 42}}, None, (42, None, None, None)),
    ("plain text", None, (None, None, None, None)),
    (None, None, (None, None, None, None)),
    (Reply(Usage(total_tokens=-5, prompt_tokens="x")), None, (None, None, None, None)),
    (Reply(Usage(total_tokens=1000, prompt_tokens_details=Usage(cached_tokens=9))), 812, (812, None, None, None)),
])
def test_usage_of(result, permit_tokens, want):
    assert _core.usage_of(result, permit_tokens) == want


def test_outcome_validation():
    with pytest.raises(ValueError, match="unknown outcome kind"):
        Outcome("oops")
    with pytest.raises(ValueError, match="unknown failure kind"):
        Outcome.failure("rate_limited")


# ---------------------------------------------------------------- sync run


def _script(fake, *replies):
    """on_acquire answers: None = grant, else the given reply (for Start and Retry alike)."""
    it = iter(replies)

    def on_acquire(conn, rid, call):
        r = next(it, None)
        return fake.grant(conn, rid, call) if r is None else r
    fake.on_acquire = on_acquire


def _attempts(*steps):
    """fn for run(): each step is an exception to raise or a result to return."""
    seen = []

    def fn(permit):
        seen.append(permit)
        step = steps[len(seen) - 1]
        if isinstance(step, BaseException):
            raise step
        return step(permit) if callable(step) else step
    fn.seen = seen
    return fn


def test_run_success_reports_usage_from_the_result(fake):
    reply = Reply(Usage(prompt_tokens=900, completion_tokens=100, total_tokens=1000))
    with polygate.connect(fake.path) as client:
        assert client.run("chat", _attempts(reply), est_tokens=1200) is reply
    assert _wire(fake) == [("Start", None), ("Finish", {"SuccessUsage": {"usage": {
        "tokens": 1000, "input_tokens": 900, "output_tokens": 100}, "count_attempt": True}})]
    assert fake.requests("Start")[0]["request"]["Start"]["est_tokens"] == 1200


@pytest.mark.parametrize("version", [3, 2])
def test_run_reports_cached_input_as_success_cached_on_v3_only(fake, version):
    """OpenAI's prompt_tokens_details.cached_tokens and Anthropic's
    cache_read_input_tokens go out as SuccessCached (outcome tag 6) on a version-3
    connection; a version-2 one gets SuccessUsage, the cached count dropped."""
    fake.protocol_version = version
    openai_reply = Reply(Usage(prompt_tokens=900, completion_tokens=100, total_tokens=1000,
                               prompt_tokens_details=Usage(cached_tokens=300)))
    anthropic_reply = {"usage": {"input_tokens": 700, "output_tokens": 50, "cache_read_input_tokens": 5000}}
    with polygate.connect(fake.path) as client:
        assert client.protocol_version == version
        assert client.run("chat", _attempts(openai_reply)) is openai_reply
        assert client.run("chat", _attempts(anthropic_reply)) is anthropic_reply
    finishes = [f["request"]["Finish"]["outcome"] for f in fake.requests("Finish")]
    usages = [{"tokens": 1000, "input_tokens": 600, "output_tokens": 100},
              {"tokens": None, "input_tokens": 700, "output_tokens": 50}]
    if version == 3:
        assert finishes == [{"SuccessCached": {"usage": u, "cached_input_tokens": c, "count_attempt": True}}
                            for u, c in zip(usages, (300, 5000))]
    else:
        assert finishes == [{"SuccessUsage": {"usage": u, "count_attempt": True}} for u in usages]


def test_run_permit_tokens_and_no_usage(fake):
    def fn(permit):
        permit.tokens = 77
        return "done"
    with polygate.connect(fake.path) as client:
        assert client.run("chat", fn) == "done"
        assert client.run("chat", lambda p: "no usage here") == "no usage here"
    outcomes = [o for n, o in _wire(fake) if n == "Finish"]
    assert outcomes == [{"Success": {"tokens": 77, "count_attempt": True}},
                        {"Success": {"tokens": None, "count_attempt": True}}]


def test_run_fails_over_on_timeout(fake):
    fn = _attempts(TimeoutError("slow"), ConnectionResetError(), "ok")
    with polygate.connect(fake.path) as client:
        assert client.run("chat", fn) == "ok"
    assert [p.attempt for p in fn.seen] == [1, 2, 3]
    assert _wire(fake) == [
        ("Start", None),
        ("Retry", {"Failure": {"kind": "Timeout"}}),
        ("Retry", {"Failure": {"kind": "Connection"}}),
        ("Finish", {"Success": {"tokens": None, "count_attempt": True}}),
    ]


def test_run_429_is_rate_limited_with_retry_after(fake):
    fn = _attempts(HTTPError(429, {"Retry-After": "7"}), "ok")
    with polygate.connect(fake.path) as client:
        assert client.run("chat", fn) == "ok"
    assert _wire(fake)[1] == ("Retry", {"RateLimited": {"retry_after_s": 7.0}})


def test_run_final_error_is_raised_from_the_last_exception(fake):
    _script(fake, None, None, error("AllSourcesExhausted", "3 of 3", exhausted="RetryExhausted", scope="chat"))
    last = HTTPError(503)
    fn = _attempts(TimeoutError("slow"), last)
    with polygate.connect(fake.path) as client:
        with pytest.raises(polygate.AllSourcesExhausted) as ei:
            client.run("chat", fn)
    assert ei.value.reason == "retry_exhausted" and ei.value.__cause__ is last
    assert [n for n, _ in _wire(fake)] == ["Start", "Retry", "Retry"]  # the call is gone: nothing more


def test_run_circuit_open_is_re_raised(fake):
    _script(fake, error("CircuitOpen", "all open", retry_after_s=9.5, reasons=(("src-a", "CircuitOpen"),),
                        scope="chat"))
    fn = _attempts("never")
    with polygate.connect(fake.path) as client:
        with pytest.raises(polygate.CircuitOpenError) as ei:
            client.run("chat", fn)
    assert ei.value.retry_after_s == 9.5 and ei.value.__cause__ is None and not fn.seen
    assert [n for n, _ in _wire(fake)] == ["Start"]


@pytest.mark.parametrize("exc, outcome", [
    (HTTPError(400), {"Success": {"tokens": 0, "count_attempt": False}}),
    (ValueError("parsing bug"), {"Failure": {"kind": "Error"}}),
])
def test_run_does_not_retry_the_callers_errors(fake, exc, outcome):
    fn = _attempts(exc, "never")
    with polygate.connect(fake.path) as client:
        with pytest.raises(type(exc)) as ei:
            client.run("chat", fn)
        assert ei.value is exc and len(fn.seen) == 1
        fake.wait_for(lambda: fake.requests("Finish"))
        assert client.ping() >= 0
    assert _wire(fake)[:2] == [("Start", None), ("Finish", outcome)]
    assert not fake.calls and not fake.permits


def test_run_classify_hook(fake):
    class Garbage(Exception):
        pass

    def classify(exc):
        if isinstance(exc, Garbage):
            return Outcome.failure("bad_result", tokens=321)
        if isinstance(exc, LookupError):
            return Outcome.failure("server_error", retry=False)
        return None  # the built-in rules

    fn = _attempts(Garbage(), TimeoutError(), "ok")
    with polygate.connect(fake.path) as client:
        assert client.run("chat", fn, classify=classify) == "ok"
        with pytest.raises(KeyError):
            client.run("chat", _attempts(KeyError("x")), classify=classify)
        with pytest.raises(TypeError, match="classify must return"):
            client.run("chat", _attempts(KeyError("x")), classify=lambda e: "timeout")
    w = _wire(fake)
    assert w[1] == ("Retry", {"FailureUsage": {"kind": "BadResult", "usage": {
        "tokens": 321, "input_tokens": None, "output_tokens": None}}})
    assert w[2] == ("Retry", {"Failure": {"kind": "Timeout"}})
    # the bad classify left its permit unreported: the call ends, the permit abandoned
    fake.wait_for(lambda: len(fake.requests("Finish")) == 2 and fake.requests("EndCall"))
    assert [o for n, o in _wire(fake) if n == "Finish"][1] == {"Failure": {"kind": "ServerError"}}
    assert not fake.calls


def test_run_keyboard_interrupt_in_fn_releases(fake):
    with polygate.connect(fake.path) as client:
        with pytest.raises(KeyboardInterrupt):
            client.run("chat", _attempts(KeyboardInterrupt()))
        fake.wait_for(lambda: fake.requests("Finish"))
        assert client.ping() >= 0
    assert _wire(fake)[:2] == [("Start", None), ("Finish", "Cancelled")]
    assert not fake.calls and not fake.permits


def test_run_fn_that_reports_itself(fake):
    def fn(permit):
        permit.success(tokens=5)
        return "mine"
    with polygate.connect(fake.path) as client:
        assert client.run("chat", fn) == "mine"
    assert _wire(fake) == [("Start", None), ("Finish", {"Success": {"tokens": 5, "count_attempt": True}})]


def test_gated_decorator(fake):
    with polygate.connect(fake.path) as client:
        @client.gated("chat", est_tokens=50)
        def ask(permit, prompt, *, suffix=""):
            """Ask the model."""
            return "%s@%s%s" % (prompt, permit.source, suffix)

        assert ask("hi", suffix="!") == "hi@src-a!"
        assert ask.__name__ == "ask" and ask.__doc__ == "Ask the model."
    assert fake.requests("Start")[0]["request"]["Start"]["est_tokens"] == 50


# ---------------------------------------------------------------- asyncio run


def _aattempts(*steps):
    seen = []

    async def fn(permit):
        seen.append(permit)
        await asyncio.sleep(0)
        step = steps[len(seen) - 1]
        if isinstance(step, BaseException):
            raise step
        return step
    fn.seen = seen
    return fn


def test_aio_run_success_failover_and_429(fake):
    reply = {"usage": {"input_tokens": 70, "output_tokens": 30}}

    async def main():
        async with await polygate.aio.connect(fake.path) as client:
            fn = _aattempts(asyncio.TimeoutError(), HTTPError(429, {"retry-after": "2"}), reply)
            assert await client.run("chat", fn, est_tokens=100) is reply
            assert [p.attempt for p in fn.seen] == [1, 2, 3]
    arun(main())
    assert _wire(fake) == [
        ("Start", None),
        ("Retry", {"Failure": {"kind": "Timeout"}}),
        ("Retry", {"RateLimited": {"retry_after_s": 2.0}}),
        ("Finish", {"SuccessUsage": {"usage": {"tokens": None, "input_tokens": 70, "output_tokens": 30},
                                     "count_attempt": True}}),
    ]


def test_aio_run_final_errors(fake):
    _script(fake, None, error("CircuitOpen", "opened meanwhile", retry_after_s=3.0, scope="chat"))
    last = HTTPError(500)

    async def main():
        async with await polygate.aio.connect(fake.path) as client:
            with pytest.raises(polygate.CircuitOpenError) as ei:
                await client.run("chat", _aattempts(last))
            assert ei.value.__cause__ is last
    arun(main())
    assert [n for n, _ in _wire(fake)] == ["Start", "Retry"]


def test_aio_run_classify_and_callers_errors(fake):
    def classify(exc):
        return Outcome.rate_limited(1.25) if isinstance(exc, RuntimeError) else None

    async def main():
        async with await polygate.aio.connect(fake.path) as client:
            assert await client.run("chat", _aattempts(RuntimeError("busy"), "ok"), classify=classify) == "ok"
            with pytest.raises(HTTPError):
                await client.run("chat", _aattempts(HTTPError(422)))
            await client.ping()
    arun(main())
    assert _wire(fake)[1] == ("Retry", {"RateLimited": {"retry_after_s": 1.25}})
    assert ("Finish", {"Success": {"tokens": 0, "count_attempt": False}}) in _wire(fake)
    assert not fake.calls


def test_aio_run_cancelled_inside_fn_releases_everything(fake):
    entered = []

    async def fn(permit):
        entered.append(permit)
        await asyncio.sleep(3600)

    async def main():
        async with await polygate.aio.connect(fake.path) as client:
            task = asyncio.ensure_future(client.run("chat", fn))
            while not entered:
                await asyncio.sleep(0.005)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await client.ping()
    arun(main())
    assert _wire(fake)[:2] == [("Start", None), ("Finish", "Cancelled")]
    assert not fake.calls and not fake.permits


def test_aio_run_cancelled_while_waiting_for_a_permit(fake):
    fake.on_acquire = lambda conn, rid, call: HOLD

    async def main():
        async with await polygate.aio.connect(fake.path) as client:
            task = asyncio.ensure_future(client.run("chat", _aattempts("never")))
            await asyncio.get_event_loop().run_in_executor(None, fake.wait_held, 1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await client.ping()
    arun(main())
    assert [n for n, _ in _wire(fake)] == ["Start", "Cancel", "Ping"]
    assert fake.held_count() == 0 and not fake.calls


def test_aio_gated_decorator(fake):
    async def main():
        async with await polygate.aio.connect(fake.path) as client:
            @client.gated("chat")
            async def ask(permit, n):
                return n * 2, permit.source
            assert await ask(21) == (42, "src-a")
    arun(main())
    assert [n for n, _ in _wire(fake)] == ["Start", "Finish"]
