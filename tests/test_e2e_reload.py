"""End-to-end: SIGHUP reloads the configuration into the running daemon (DESIGN §12),
the README's example worker runs as written, and the embedded default config serves."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import polygate
from .polygate_e2e import scope, wait_until

REPO = Path(__file__).resolve().parent.parent


def test_sighup_applies_a_new_policy_without_dropping_connections(sidecar):
    sidecar.write_config({"chat": scope("a", "b", circuit_open="fail_fast")})
    sidecar.start()
    client = sidecar.client()
    client.force_open("a", seconds=60)
    client.force_open("b", seconds=60)
    with client.call("chat") as call:
        with pytest.raises(polygate.CircuitOpenError):
            call.acquire()
    # Same scopes and sources, new policy: circuit_open = wait, short stall window.
    sidecar.write_config({"chat": scope("a", "b", circuit_open="wait", stall_window="300ms")})
    os.kill(sidecar.proc.pid, signal.SIGHUP)
    wait_until(lambda: client.status()["scopes"]["chat"]["circuit_open"] == "wait",
               timeout=5, what="the reloaded policy in status")
    assert "configuration reloaded" in sidecar.stderr()
    # The same connection now waits instead of failing fast, then stalls out.
    with client.call("chat") as call:
        with pytest.raises(polygate.AllSourcesExhausted) as e:
            call.acquire()
    assert e.value.reason == "stalled"


def test_sighup_with_an_invalid_or_reshaped_config_keeps_the_running_one(sidecar):
    sidecar.write_config({"chat": scope("a", "b")})
    sidecar.start()
    client = sidecar.client()
    sidecar.config_path.write_text("this is = not [valid toml\n")
    os.kill(sidecar.proc.pid, signal.SIGHUP)
    wait_until(lambda: "keeping the running configuration" in sidecar.stderr(),
               timeout=5, what="the invalid-config log line")
    sidecar.write_config({"chat": scope("a", "b", "c")})
    os.kill(sidecar.proc.pid, signal.SIGHUP)
    wait_until(lambda: "needs a restart" in sidecar.stderr(), timeout=5,
               what="the topology-change refusal")
    assert sidecar.alive()
    assert sorted(client.status()["scopes"]["chat"]["sources"]) == ["a", "b"]
    with client.call("chat") as call:
        assert call.acquire().success().applied


def test_readme_example_worker_runs_as_written(sidecar):
    # The README quick start targets the example config's `chat` scope.
    sidecar.write_config({"chat": scope("openai-gpt4o", "azure-gpt4o-eu", "vllm-llama-local")})
    sidecar.start()
    env = dict(os.environ, POLYGATE_SOCKET=sidecar.socket)
    out = subprocess.run([sys.executable, str(REPO / "examples" / "worker.py")],
                         env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert "hello from" in out.stdout
    assert out.stdout.strip().splitlines()[-1] in ("closed", "open", "half_open")
