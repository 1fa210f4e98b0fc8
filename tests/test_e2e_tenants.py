"""End-to-end, DESIGN §19 through the Python binding and the real daemon: a tenant's
limits refuse with the typed error naming the tenant and the limit, a spent dollar
budget is never waited on, a cached read is priced at the cached rate, and the
tenant's ledger is exact again after a killed worker and after a daemon's SIGTERM
(on memory and on Redis, read back by a fresh daemon on the same Redis)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest

import polygate
from .polygate_e2e import scope, wait_until

# One source priced $1 per 1M input tokens, $2 per 1M output, $0.10 per 1M cached.
PRICED = {"name": "a", "timeout": "5s", "usd_per_1m_input": 1.0, "usd_per_1m_output": 2.0,
          "usd_per_1m_cached_input": 0.1}


def _ledger(client, tenant, scope_name="chat"):
    doc = client.tenant_status(tenant)
    return doc["scopes"][scope_name]["ledger"] or {"in_flight": 0, "usd_spent_day": 0.0}


@pytest.fixture(params=["memory", "redis"])
def backend(request, redis_server):
    if request.param == "memory":
        return {"backend": "memory"}
    return {"backend": "redis", "redis_url": redis_server.url, "key_prefix": "pg-ten",
            "redis_timeout": "500ms"}


def test_a_tenant_over_its_rpm_is_refused_by_name_and_others_pass(sidecar, backend):
    sidecar.write_config({"chat": scope("a", quota_full="fail_fast", tenants={
        "default": {"rpm": 2}, "override": [{"name": "vip", "rpm": 100}]})}, **backend)
    sidecar.start()
    client = sidecar.client()
    for _ in range(2):
        assert client.run("chat", lambda p: p.source, tenant="acme") == "a"
    with pytest.raises(polygate.TenantLimitExceeded) as e:
        client.run("chat", lambda p: pytest.fail("no attempt may start"), tenant="acme")
    assert (e.value.tenant, e.value.limit) == ("acme", "rpm")
    assert 25 < e.value.retry_after_s <= 30.5  # 2 a minute: one request in 30 s
    # Another tenant, the override and the anonymous tenant are not held back.
    assert client.run("chat", lambda p: p.source, tenant="globex") == "a"
    for _ in range(5):
        assert client.run("chat", lambda p: p.source, tenant="vip") == "a"
    for _ in range(5):
        assert client.run("chat", lambda p: p.source) == "a"
    st = client.tenant_status("acme")["scopes"]["chat"]
    assert st["limits"]["rpm"] == 2 and st["ledger"]["in_flight"] == 0


def test_a_spent_dollar_budget_is_not_waited_on_and_cached_reads_cost_less(sidecar, backend):
    # $0.01 a day; quota_full = wait, yet the budget refuses at once (never refills).
    sidecar.write_config({"chat": scope(PRICED, quota_full="wait", stall_window="20s", tenants={
        "default": {"usd_per_day": 0.01}})}, **backend)
    sidecar.start()
    client = sidecar.client()
    # 1000 input + 500 cached + 1000 output: 1000*1 + 500*0.1 + 1000*2 = 3050 n$... per
    # million: $0.00305.
    with client.call("chat", est_input_tokens=1000, est_output_tokens=1000, tenant="acme") as c:
        c.acquire().success(input_tokens=1000, output_tokens=1000, cached_input_tokens=500)
    spent = _ledger(client, "acme")["usd_spent_day"]
    assert spent == pytest.approx(0.00305, abs=1e-8)
    # Two more such calls fit (0.0091), the next estimate (0.003) does not.
    for _ in range(2):
        with client.call("chat", est_input_tokens=1000, est_output_tokens=1000, tenant="acme") as c:
            c.acquire().success(input_tokens=1000, output_tokens=1000, cached_input_tokens=500)
    t0 = time.monotonic()
    with pytest.raises(polygate.TenantLimitExceeded) as e:
        with client.call("chat", est_input_tokens=1000, est_output_tokens=1000, tenant="acme") as c:
            c.acquire()
    assert time.monotonic() - t0 < 2.0, "a spent budget must not be waited on"
    assert e.value.limit == "usd_per_day"
    now = time.time()
    assert abs(e.value.retry_after_s - (86400 - now % 86400)) < 5, "until midnight UTC"
    assert _ledger(client, "acme")["in_flight"] == 0


def test_a_spent_budget_refuses_a_call_estimated_at_no_tokens(sidecar, backend):
    # A priced source without tpm estimates a call without an estimate at 0 tokens:
    # it still reserves 1 n$, so a spent budget refuses it (before, a 0 n$ estimate
    # skipped the budget check, and such calls spent past it without limit).
    sidecar.write_config({"chat": scope(dict(PRICED, rpm=600), quota_full="fail_fast",
                                        tenants={"default": {"usd_per_day": 0.001}})},
                         **backend)
    sidecar.start()
    client = sidecar.client()
    with client.call("chat", tenant="acme") as c:
        c.acquire().success(input_tokens=1_000_000, output_tokens=0)  # $1 spent
    assert _ledger(client, "acme")["usd_spent_day"] == pytest.approx(1.0, abs=1e-6)
    with pytest.raises(polygate.TenantLimitExceeded) as e:
        with client.call("chat", tenant="acme") as c:
            c.acquire()
    assert e.value.limit == "usd_per_day"
    assert _ledger(client, "acme")["in_flight"] == 0
    # Another tenant's untouched budget admits it.
    with client.call("chat", tenant="globex") as c:
        c.acquire().success(input_tokens=10, output_tokens=0)


WORKER = textwrap.dedent("""
    import sys, time, polygate
    client = polygate.connect(sys.argv[1])
    call = client.call("chat", est_tokens=100, tenant="acme")
    call.__enter__()
    call.acquire()
    print("held", flush=True)
    time.sleep(60)
""")


def test_a_killed_worker_s_permit_is_charged_and_released(sidecar, backend):
    sidecar.write_config({"chat": scope("a", tenants={"default": {"tpm": 1000, "rpm": 100}})},
                         **backend)
    sidecar.start()
    client = sidecar.client()
    w = subprocess.Popen([sys.executable, "-c", WORKER, sidecar.socket], stdout=subprocess.PIPE,
                         text=True)
    try:
        assert w.stdout.readline().strip() == "held"
        assert _ledger(client, "acme")["in_flight"] == 1
        w.send_signal(signal.SIGKILL)
        w.wait(timeout=10)
        # The connection closed: the permit is abandoned, its estimate kept.
        wait_until(lambda: _ledger(client, "acme")["in_flight"] == 0, 10, what="released")
        level = _ledger(client, "acme")["levels"]["tpm"]
        assert 895 <= level <= 910, level  # 100 charged, a few seconds of refill at most
    finally:
        if w.poll() is None:
            w.kill()


def test_sigterm_settles_the_tenants_holds_on_redis(sidecars, redis_server):
    keys = dict(backend="redis", redis_url=redis_server.url, key_prefix="pg-term",
                redis_timeout="500ms")
    # Per-day buckets: what the abandoned permit took does not refill within the test.
    cfg = {"chat": scope("a", tenants={"default": {"tpd": 10000, "rpd": 100}})}
    first = sidecars.new("first")
    first.write_config(cfg, **keys)
    first.start()
    w = subprocess.Popen([sys.executable, "-c", WORKER, first.socket], stdout=subprocess.PIPE,
                         text=True)
    try:
        assert w.stdout.readline().strip() == "held"
        assert _ledger(first.client(), "acme")["in_flight"] == 1
        rc = first.stop()  # SIGTERM with a permit outstanding
        assert rc == 0, first.stderr()[-2000:]
    finally:
        w.kill()
        w.wait(timeout=10)
    second = sidecars.new("second")
    second.write_config(cfg, **keys)
    second.start()
    led = _ledger(second.client(), "acme")
    assert led["in_flight"] == 0, "the SIGTERM left a hold on Redis"
    assert 98.5 < led["levels"]["rpd"] <= 99.01, "the abandoned request was charged"
    assert 9895 < led["levels"]["tpd"] <= 9901, "at its estimate"
