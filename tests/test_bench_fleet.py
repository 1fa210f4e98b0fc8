"""The fleet scenario (DESIGN §7a, §18) at a short duration: N sidecars on one throwaway
redis-server in front of a fake upstream that evaluates RPM per 1-second period and
charges prompt + max_tokens (Azure's rule). With the matching source block the
upstream answers under 1 % of requests with 429; with today's configuration (a
minute's bucket, actual usage) it answers more, so the check can fail."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .polygate_e2e import sidecar_bin

DRIVER = Path(__file__).resolve().parent.parent / "bench" / "fleet" / "fleet.py"


def _run(args) -> dict:
    if shutil.which("redis-server") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("redis-server is required with CI=true")
        pytest.skip("no redis-server")
    env = dict(os.environ, POLYGATE_SIDECAR_BIN=str(sidecar_bin()))
    out = subprocess.run([sys.executable, str(DRIVER), *args], capture_output=True, text=True,
                         timeout=80, env=env)
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip().splitlines()[-1]
    return json.loads(line)


def _fleet(config: str) -> dict:
    return _run(["--hosts", "2", "--workers", "4", "--seconds", "6", "--upstream", "per-second",
                 "--rpm", "600", "--tpm", "60000", "--config", config, "--observe", "off"])


@pytest.mark.timeout(180)
def test_fleet_per_second_matching_config_avoids_429s_and_the_default_does_not():
    m = _fleet("matching")
    assert m["upstream_requests"] > 40, m
    assert m["upstream_429s"] < 0.01 * m["upstream_requests"], m
    assert m["calls_failed"] == 0, m
    assert m["utilisation"] > 0.8, m
    d = _fleet("default")
    assert d["upstream_429s"] > 0.01 * d["upstream_requests"], d


@pytest.mark.timeout(120)
def test_fleet_survives_a_redis_pause_within_its_share():
    """Issue 25, DESIGN §10: 8 sidecars, Redis stopped (SIGSTOP) for 5 s mid-run. No
    call is lost, the fleet sends at most 1.25 x what the provider's rule admits in
    the run's rolling window (each degraded host uses 1/8 of the quota: with the
    whole limit per host the same run sent 1.38 x and drew 34 upstream 429s), and
    every host serves the source from Redis again within 2 s of Redis answering."""
    if shutil.which("redis-server") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("redis-server is required with CI=true")
        pytest.skip("no redis-server")
    env = dict(os.environ, POLYGATE_SIDECAR_BIN=str(sidecar_bin()))
    out = subprocess.run(
        [sys.executable, str(DRIVER), "--hosts", "8", "--workers", "2", "--seconds", "20",
         "--upstream", "token-bucket", "--rpm", "60", "--tpm", "6000",
         "--fault", "redis-pause", "--fault-at", "9", "--fault-for", "5"],
        capture_output=True, text=True, timeout=100, env=env)
    assert out.returncode == 0, out.stderr
    m = json.loads(out.stdout.strip().splitlines()[-1])
    assert m["fault"] == "redis-pause" and m["fault_end_s"] is not None, m
    assert m["calls_lost"] == 0, m
    assert m["max_rolling_60s_over_allowed"] <= 1.25, m
    assert m["upstream_requests"] > 40, m
    assert m["recovery_s"] is not None and m["recovery_s"] <= 2.0, m


def _foreign(observe: str) -> dict:
    return _run(["--hosts", "2", "--workers", "4", "--seconds", "10", "--upstream", "token-bucket",
                 "--rpm", "600", "--tpm", "60000", "--foreign", "0.8", "--observe", observe])


@pytest.mark.timeout(180)
def test_fleet_with_a_foreign_consumer_observed_limits_avoid_429s_and_without_them_do_not():
    """DESIGN §18: a consumer outside PolyGate uses 80 % of the limits of an upstream
    counting like Anthropic (whose headers it answers with). With the headers
    observed, PolyGate's share of 429s stays under 2 % and the foreign consumer is
    left its share; without (the control), PolyGate overruns what is left."""
    on = _foreign("on")
    assert on["upstream_requests"] > 300, on
    assert on["upstream_429s"] < 0.02 * on["upstream_requests"], on
    assert on["calls_failed"] == 0, on
    assert on["left_utilisation"] > 0.85, on
    off = _foreign("off")
    assert off["upstream_429s"] > 0.05 * off["upstream_requests"], off
