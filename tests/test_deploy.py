"""deploy/kubernetes/: the manifests' structure (what `kubectl apply` would take and
what makes the sidecar and its workers meet), checked without a cluster: every
document parses, the kinds are there, the sidecar and the workers mount the same
socket directory and agree on the socket path, every long-running container runs
as non-root, the probes point at the ConfigMap's admin port, the per-pod variant is
a native sidecar, and the ConfigMap's configuration passes the real binary's
--check-config. PyYAML is a test-only dependency (scripts/test.sh installs it)."""

from __future__ import annotations

import posixpath
import subprocess
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest

tomllib = pytest.importorskip("tomllib", reason="reading TOML needs Python >= 3.11 (tomllib)")

from .polygate_e2e import sidecar_bin

yaml = pytest.importorskip("yaml")

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"
SIDECAR = "polygate"


def _docs() -> List[Dict[str, Any]]:
    docs: List[Dict[str, Any]] = []
    for f in sorted(DEPLOY.glob("*.yaml")):
        for d in yaml.safe_load_all(f.read_text()):
            if d is not None:
                d["__file__"] = f.name
                docs.append(d)
    return docs


def _one(kind: str, name: str) -> Dict[str, Any]:
    found = [d for d in _docs() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, (kind, name, [d["__file__"] for d in found])
    return found[0]


def _config() -> Dict[str, Any]:
    cm = _one("ConfigMap", "polygate-config")
    return tomllib.loads(cm["data"]["polygate.toml"])


def _admin_port() -> int:
    return int(_config()["sidecar"]["admin_listen"].rsplit(":", 1)[1])


def _socket() -> str:
    return str(_config()["sidecar"]["socket"])


def _pod(workload: Dict[str, Any]) -> Dict[str, Any]:
    return workload["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def _containers(pod: Dict[str, Any]) -> Iterator[Dict[str, Any]]:
    yield from pod.get("initContainers", [])
    yield from pod["containers"]


def _container(pod: Dict[str, Any], name: str) -> Dict[str, Any]:
    found = [c for c in _containers(pod) if c["name"] == name]
    assert len(found) == 1, name
    return found[0]


def _mount_source(pod: Dict[str, Any], container: Dict[str, Any], path: str) -> Dict[str, Any]:
    """The volume mounted at `path` in `container`."""
    names = [m["name"] for m in container.get("volumeMounts", []) if m["mountPath"] == path]
    assert len(names) == 1, (container["name"], path, container.get("volumeMounts"))
    vols = [v for v in pod["volumes"] if v["name"] == names[0]]
    assert len(vols) == 1, names[0]
    return vols[0]


def _non_root(pod: Dict[str, Any], c: Dict[str, Any]) -> None:
    sc = {**pod.get("securityContext", {}), **c.get("securityContext", {})}
    assert sc.get("runAsNonRoot") is True, c["name"]
    assert int(sc.get("runAsUser", 0)) != 0, c["name"]
    assert sc.get("allowPrivilegeEscalation") is False, c["name"]
    assert "ALL" in sc.get("capabilities", {}).get("drop", []), c["name"]


def _probes_hit_admin(c: Dict[str, Any], port: int, kinds: List[str]) -> None:
    for kind in kinds:
        probe = c.get(kind)
        assert probe is not None, (c["name"], kind)
        got = probe["httpGet"]["port"]
        if isinstance(got, str):  # a named port
            got = next(p["containerPort"] for p in c["ports"] if p.get("name") == got)
        assert got == port, (c["name"], kind, got, port)
        assert probe["httpGet"]["path"] in ("/live", "/ready"), (c["name"], kind)


def _config_mount_matches_args(pod: Dict[str, Any], c: Dict[str, Any]) -> None:
    args = c["args"]
    cfg = args[args.index("--config") + 1]
    vol = _mount_source(pod, c, posixpath.dirname(cfg))
    assert vol["configMap"]["name"] == "polygate-config"
    assert posixpath.basename(cfg) == "polygate.toml"


def _worker_meets_sidecar(pod: Dict[str, Any], worker: Dict[str, Any], sidecar_vol: Dict[str, Any]) -> None:
    sock = _socket()
    env = {e["name"]: e.get("value") for e in worker.get("env", [])}
    assert env.get("POLYGATE_SOCKET") == sock, worker["name"]
    vol = _mount_source(pod, worker, posixpath.dirname(sock))
    if "hostPath" in sidecar_vol:
        assert vol["hostPath"]["path"] == sidecar_vol["hostPath"]["path"]
    else:
        assert vol is sidecar_vol or vol["name"] == sidecar_vol["name"]
    # The socket is 0660 in a 0750 directory of group 65532: the worker needs it.
    sidecar_gid = 65532
    groups = pod.get("securityContext", {}).get("supplementalGroups", [])
    assert sidecar_gid in groups, (worker["name"], groups)


def test_every_manifest_parses_and_the_kinds_are_there() -> None:
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in _docs())
    assert kinds == [
        ("ConfigMap", "polygate-config"),
        ("DaemonSet", "polygate-sidecar"),
        ("Deployment", "llm-worker"),
        ("Deployment", "llm-worker-with-sidecar"),
    ]
    for d in _docs():
        assert d["apiVersion"] in ("v1", "apps/v1"), d["__file__"]


def test_daemonset_shares_the_socket_directory_with_the_worker_deployment() -> None:
    port, sock = _admin_port(), _socket()
    ds = _pod(_one("DaemonSet", "polygate-sidecar"))
    sidecar = _container(ds, SIDECAR)
    assert sidecar in ds["containers"]
    _non_root(ds, sidecar)
    _probes_hit_admin(sidecar, port, ["livenessProbe", "readinessProbe"])
    _config_mount_matches_args(ds, sidecar)
    run = _mount_source(ds, sidecar, posixpath.dirname(sock))
    assert run["hostPath"]["path"] == posixpath.dirname(sock)
    worker_pod = _pod(_one("Deployment", "llm-worker"))
    worker = _container(worker_pod, "worker")
    _non_root(worker_pod, worker)
    _worker_meets_sidecar(worker_pod, worker, run)


def test_per_pod_variant_is_a_native_sidecar_on_an_empty_dir() -> None:
    port, sock = _admin_port(), _socket()
    pod = _pod(_one("Deployment", "llm-worker-with-sidecar"))
    sidecar = _container(pod, SIDECAR)
    assert sidecar in pod["initContainers"], "a native sidecar is an init container"
    assert sidecar.get("restartPolicy") == "Always"
    _non_root(pod, sidecar)
    _probes_hit_admin(sidecar, port, ["startupProbe", "livenessProbe", "readinessProbe"])
    _config_mount_matches_args(pod, sidecar)
    run = _mount_source(pod, sidecar, posixpath.dirname(sock))
    assert "emptyDir" in run
    worker = _container(pod, "worker")
    assert worker in pod["containers"]
    _non_root(pod, worker)
    _worker_meets_sidecar(pod, worker, run)


def test_the_only_root_step_just_hands_over_the_socket_directory() -> None:
    """An emptyDir (0777) or a new hostPath (root, 0755) is no socket directory the
    sidecar accepts; the one root container per variant may only chown/chmod it,
    with CHOWN and FOWNER, and must run before the sidecar."""
    for kind, name in [("DaemonSet", "polygate-sidecar"), ("Deployment", "llm-worker-with-sidecar")]:
        pod = _pod(_one(kind, name))
        init = pod["initContainers"]
        assert init[0]["name"] == "socket-dir", name
        sc = init[0]["securityContext"]
        assert sc["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}, name
        assert sc["allowPrivilegeEscalation"] is False
        assert "chown 65532:65532" in " ".join(init[0]["command"]), name
        assert init[0].get("restartPolicy") is None, "a plain init step, not a sidecar"
        for c in _containers(pod):
            if c["name"] != "socket-dir":
                _non_root(pod, c)


def test_the_config_map_passes_check_config(tmp_path: Path) -> None:
    cm = _one("ConfigMap", "polygate-config")
    f = tmp_path / "polygate.toml"
    f.write_text(cm["data"]["polygate.toml"])
    out = subprocess.run(
        [str(sidecar_bin()), "--config", str(f), "--check-config"],
        capture_output=True,
        text=True,
        timeout=30,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    assert "socket /run/polygate/sidecar.sock" in out.stdout, out.stdout
