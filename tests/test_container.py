"""The Dockerfile builds an image that runs the sidecar as a non-root user, reports
healthy through its HEALTHCHECK (`polygate-sidecar health` on the admin listener)
and answers `status` on /run/polygate/sidecar.sock.

Needs a working container engine (docker or podman on PATH whose daemon answers)
and the base images (rust, debian:bookworm-slim) reachable. Without them the test
is skipped with the reason — also under CI=true: a missing container engine is a
fact of the machine, not a failure of the code (the manifests are still checked,
engine-free, by test_deploy.py)."""

from __future__ import annotations

import shutil
import subprocess
import time
import uuid
from pathlib import Path
from typing import List, Optional

import pytest

REPO = Path(__file__).resolve().parent.parent


def _engine() -> Optional[str]:
    for name in ("docker", "podman"):
        exe = shutil.which(name)
        if exe is None:
            continue
        ok = subprocess.run([exe, "info"], capture_output=True, timeout=30)
        if ok.returncode == 0:
            return exe
    return None


def _run(cmd: List[str], timeout: float) -> "subprocess.CompletedProcess[str]":
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(3600)
def test_image_builds_runs_non_root_and_turns_healthy() -> None:
    engine = _engine()
    if engine is None:
        pytest.skip(
            "no working container engine (docker/podman missing, or its daemon does not "
            "answer `info`): the image build is not tested on this machine"
        )
    tag = "polygate-sidecar:test-%s" % uuid.uuid4().hex[:8]
    build = _run([engine, "build", "-t", tag, str(REPO)], timeout=3000)
    if build.returncode != 0 and ("pull" in build.stderr.lower() or "resolve" in build.stderr.lower()):
        pytest.skip("the base images cannot be pulled here: %s" % build.stderr.strip()[-300:])
    assert build.returncode == 0, build.stderr[-3000:]
    name = "polygate-test-%s" % uuid.uuid4().hex[:8]
    try:
        user = _run([engine, "image", "inspect", "--format", "{{.Config.User}}", tag], timeout=60)
        assert user.stdout.strip() == "65532:65532", user.stdout
        version = _run([engine, "run", "--rm", tag, "--version"], timeout=120)
        assert version.returncode == 0 and "polygate-sidecar" in version.stdout, version
        started = _run([engine, "run", "-d", "--name", name, tag], timeout=120)
        assert started.returncode == 0, started.stderr
        deadline = time.monotonic() + 120
        health = ""
        while time.monotonic() < deadline:
            health = _run(
                [engine, "inspect", "--format", "{{.State.Health.Status}}", name], timeout=30
            ).stdout.strip()
            if health in ("healthy", "unhealthy"):
                break
            time.sleep(1)
        logs = _run([engine, "logs", name], timeout=30)
        assert health == "healthy", (health, logs.stdout, logs.stderr)
        status = _run(
            [engine, "exec", "-e", "POLYGATE_SOCKET=/run/polygate/sidecar.sock", name,
             "polygate-sidecar", "status"],
            timeout=60,
        )
        assert status.returncode == 0 and "scope chat" in status.stdout, status
        uid = _run([engine, "exec", name, "sh", "-c", "stat -c %u /run/polygate/sidecar.sock"], timeout=60)
        assert uid.stdout.strip() == "65532", uid
    finally:
        _run([engine, "rm", "-f", name], timeout=120)
        _run([engine, "rmi", "-f", tag], timeout=120)
