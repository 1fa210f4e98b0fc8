"""Helpers for the workspace-level end-to-end tests: the real `polygate-sidecar`
binary, throwaway `redis-server` instances, TOML configs, raw-socket frames.

Imported by ``tests/conftest.py`` and the test modules (the name is unique so it
cannot collide with modules of ``bindings/python/tests`` in one pytest run).
Mirrors ``sidecar/tests/support/redis_server.rs`` for Redis.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLE_CONFIG = REPO / "examples" / "polygate.toml"

# ------------------------------------------------------------------ processes


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    """preexec_fn: SIGKILL the child when the test process dies (Linux prctl)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def sidecar_bin() -> Path:
    """`$POLYGATE_SIDECAR_BIN`, else `<repo>/target/debug/polygate-sidecar`."""
    env = os.environ.get("POLYGATE_SIDECAR_BIN")
    path = Path(env) if env else REPO / "target" / "debug" / "polygate-sidecar"
    if not (path.is_file() and os.access(path, os.X_OK)):
        pytest.fail(
            "polygate-sidecar binary not found at %s: build it with `cargo build -p polygate-sidecar` "
            "or set POLYGATE_SIDECAR_BIN" % path,
            pytrace=False,
        )
    return path


def stop_process(proc: subprocess.Popen, term_timeout: float = 5.0) -> Optional[int]:
    """SIGTERM, wait up to ``term_timeout``, then SIGKILL. The exit status."""
    if proc.poll() is not None:
        return proc.returncode
    try:
        proc.send_signal(signal.SIGTERM)
        return proc.wait(timeout=term_timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(timeout=5)
    except ProcessLookupError:
        return proc.wait(timeout=5)


# ------------------------------------------------------------------ TOML


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):  # an inline table
        return "{ " + ", ".join("%s = %s" % (k, _toml_value(x)) for k, x in v.items()) + " }"
    raise TypeError("cannot write %r as TOML" % (v,))


def render_config(sidecar: Dict[str, Any], scopes: Dict[str, Dict[str, Any]]) -> str:
    """A TOML config: ``[sidecar]`` keys, and per scope its scalar keys, optional
    ``breaker`` / ``pacer`` tables, the ``sources`` list of tables and an optional
    ``priorities`` list of tables (DESIGN §15) and an optional ``tenants`` table
    (DESIGN §19: its keys, ``default`` / ``anonymous`` as inline tables, and an
    ``override`` list of tables)."""
    out: List[str] = ["[sidecar]"]
    out += ["%s = %s" % (k, _toml_value(v)) for k, v in sidecar.items()]
    for name, scope in scopes.items():
        scope = dict(scope)
        sources = scope.pop("sources")
        priorities = scope.pop("priorities", [])
        tenants = dict(scope.pop("tenants", None) or {})
        overrides = tenants.pop("override", [])
        tables = {k: scope.pop(k) for k in ("breaker", "pacer") if k in scope}
        if tenants or overrides:
            tables["tenants"] = tenants
        out += ["", "[scopes.%s]" % name]
        out += ["%s = %s" % (k, _toml_value(v)) for k, v in scope.items()]
        for t, body in tables.items():
            out += ["", "[scopes.%s.%s]" % (name, t)]
            out += ["%s = %s" % (k, _toml_value(v)) for k, v in body.items()]
        for src in sources:
            out += ["", "[[scopes.%s.sources]]" % name]
            out += ["%s = %s" % (k, _toml_value(v)) for k, v in src.items()]
        for cls in priorities:
            out += ["", "[[scopes.%s.priorities]]" % name]
            out += ["%s = %s" % (k, _toml_value(v)) for k, v in cls.items()]
        for o in overrides:
            out += ["", "[[scopes.%s.tenants.override]]" % name]
            out += ["%s = %s" % (k, _toml_value(v)) for k, v in o.items()]
    return "\n".join(out) + "\n"


def scope(*sources: Any, **keys: Any) -> Dict[str, Any]:
    """A scope table: sources given as names (or dicts), fast test defaults."""
    srcs = [{"name": s, "timeout": "5s"} if isinstance(s, str) else dict(s) for s in sources]
    d: Dict[str, Any] = {
        "circuit_open": "fail_fast",
        "quota_full": "wait",
        "max_attempts": 3,
        "poll_interval": "20ms",
        "stall_window": "10s",
    }
    d.update(keys)
    d["sources"] = srcs
    return d


# ------------------------------------------------------------------ sidecar


class Sidecar:
    """One `polygate-sidecar` process with its config and socket in ``dir``."""

    def __init__(self, binary: Path, dir: Path, name: str = "sidecar") -> None:
        self.binary = binary
        self.dir = dir
        self.name = name
        self.socket = str(dir / ("%s.sock" % name))
        self.config_path = dir / ("%s.toml" % name)
        self.stderr_path = dir / ("%s.stderr" % name)
        self.proc: Optional[subprocess.Popen] = None
        self._clients: List[Any] = []

    def write_config(self, scopes: Dict[str, Dict[str, Any]], **sidecar: Any) -> Path:
        base = {
            "socket": self.socket,
            "admin_uids": [os.getuid()],
            "shutdown_grace": "1s",
            "backend": "memory",
        }
        base.update(sidecar)
        self.config_path.write_text(render_config(base, scopes))
        return self.config_path

    def start(self, env: Optional[Dict[str, str]] = None, timeout: float = 15.0) -> "Sidecar":
        full_env = dict(os.environ)
        full_env.setdefault("RUST_LOG", "info")
        full_env.pop("POLYGATE_SOCKET", None)
        full_env.update(env or {})
        self._stderr = open(self.stderr_path, "ab")
        self.proc = subprocess.Popen(
            [str(self.binary), "--config", str(self.config_path)],
            stdin=subprocess.DEVNULL,
            stdout=self._stderr,
            stderr=self._stderr,
            env=full_env,
            preexec_fn=_die_with_parent,
        )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                pytest.fail(
                    "%s exited with %s during startup; stderr:\n%s" % (self.name, self.proc.returncode, self.stderr()),
                    pytrace=False,
                )
            if os.path.exists(self.socket):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    s.connect(self.socket)
                    return self
                except OSError:
                    pass
                finally:
                    s.close()
            if time.monotonic() > deadline:
                pytest.fail("%s did not accept on %s within %ss; stderr:\n%s"
                            % (self.name, self.socket, timeout, self.stderr()), pytrace=False)
            time.sleep(0.01)

    def stderr(self) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def client(self, **kw: Any):
        import polygate

        c = polygate.connect(self.socket, **kw)
        self._clients.append(c)
        return c

    def stop(self) -> Optional[int]:
        for c in self._clients:
            try:
                c.close()
            except Exception:
                pass
        self._clients.clear()
        if self.proc is None:
            return None
        rc = stop_process(self.proc)
        self._stderr.close()
        return rc

    def source_status(self, client: Any, source: str) -> Dict[str, Any]:
        for sc in client.status()["scopes"].values():
            if source in sc["sources"]:
                return sc["sources"][source]
        raise KeyError(source)


# ------------------------------------------------------------------ redis


def _port_free(port: int) -> bool:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def free_port() -> int:
    for _ in range(200):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind(("127.0.0.1", 0))
        p = s.getsockname()[1]
        s.close()
        if p < 55000 and _port_free(p + 10000):
            return p
    raise RuntimeError("no free port found")


def redis_unavailable(why: str) -> None:
    """Fail under CI=true, else skip loudly."""
    if os.environ.get("CI") == "true":
        pytest.fail("redis-server unavailable under CI=true: %s" % why, pytrace=False)
    banner = "#" * 60
    sys.stderr.write("\n%s\n## WARNING: redis-server unavailable, SKIPPING: %s\n%s\n" % (banner, why, banner))
    pytest.skip("WARNING: redis-server unavailable, SKIPPING (set CI=true to fail instead): %s" % why)


def raw_redis(port: int, *args: str, timeout: float = 2.0) -> bytes:
    """One RESP command over a fresh TCP connection; the raw reply (first read
    until a complete-looking reply; enough for PING/INFO/simple replies)."""
    parts = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a.encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(b), b))
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(b"".join(parts))
        buf = s.recv(65536)
        if buf.startswith(b"$"):
            n = int(buf[1:buf.index(b"\r\n")])
            head = buf.index(b"\r\n") + 2
            while n >= 0 and len(buf) < head + n + 2:
                more = s.recv(65536)
                if not more:
                    break
                buf += more
        return buf


class RedisServer:
    """A throwaway redis-server on a free port with its own dir."""

    def __init__(self, dir: Path) -> None:
        self.dir = dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.proc: Optional[subprocess.Popen] = None
        self.binary = os.environ.get("REDIS_SERVER", "redis-server")

    @property
    def url(self) -> str:
        return "redis://127.0.0.1:%d/" % self.port

    def ping(self) -> bool:
        try:
            return raw_redis(self.port, "PING", timeout=0.2).startswith(b"+PONG")
        except OSError:
            return False

    def spawn(self) -> Optional[str]:
        """Start; None, or why it could not start."""
        if shutil.which(self.binary) is None and not os.path.exists(self.binary):
            return "%s not found on PATH" % self.binary
        log = self.dir / "redis.log"
        try:
            self.proc = subprocess.Popen(
                [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", str(self.dir), "--logfile", str(log),
                 "--protected-mode", "no", "--daemonize", "no"],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                preexec_fn=_die_with_parent,
            )
        except OSError as e:
            return "cannot run %s: %s" % (self.binary, e)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if self.ping():
                return None
            if self.proc.poll() is not None:
                text = log.read_text(errors="replace") if log.exists() else ""
                self.proc = None
                return "redis-server exited: %s" % text[-2000:]
            time.sleep(0.01)
        return "redis-server on port %d not answering PING after 5 s" % self.port

    def start(self) -> "RedisServer":
        why = self.spawn()
        if why is not None:
            self.kill()
            redis_unavailable(why)
        return self

    def kill(self) -> None:
        """SIGKILL (the port stops answering at once)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=5)
            self.proc = None

    def restart(self) -> None:
        """Start again on the same port (empty: nothing was saved)."""
        self.kill()
        deadline = time.monotonic() + 5
        while True:
            why = self.spawn()
            if why is None:
                return
            if time.monotonic() > deadline:
                pytest.fail("redis-server restart failed: %s" % why, pytrace=False)
            time.sleep(0.05)

    def cli(self, *args: str) -> str:
        exe = os.environ.get("REDIS_CLI", "redis-cli")
        if shutil.which(exe):
            out = subprocess.run([exe, "-h", "127.0.0.1", "-p", str(self.port), *args],
                                 capture_output=True, timeout=10)
            return out.stdout.decode(errors="replace")
        reply = raw_redis(self.port, *args)
        return reply.decode(errors="replace")

    def commandstats(self) -> Dict[str, int]:
        """`INFO commandstats` → {command: calls}."""
        stats: Dict[str, int] = {}
        for line in self.cli("INFO", "commandstats").splitlines():
            line = line.strip()
            if line.startswith("cmdstat_") and ":calls=" in line:
                name, rest = line[len("cmdstat_"):].split(":", 1)
                stats[name] = int(rest.split(",")[0].split("=")[1])
        return stats

    def script_calls(self) -> int:
        """gate.lua's calls: FCALL (Redis 7) or EVALSHA. A plain EVAL is only ever
        a sidecar's heartbeat (once a second, DESIGN §10), not a call's cost."""
        s = self.commandstats()
        return s.get("evalsha", 0) + s.get("evalsha_ro", 0) + s.get("fcall", 0)

    # What a sidecar's once-a-second heartbeat (DESIGN §10) runs: one EVAL and the
    # commands inside it. Tests counting a call's commands leave these out.
    HEARTBEAT_COMMANDS = frozenset({"eval", "time", "zadd", "zremrangebyscore", "pexpire", "zcard"})

    def log(self) -> str:
        p = self.dir / "redis.log"
        return p.read_text(errors="replace") if p.exists() else ""


# ------------------------------------------------------------------ misc


def wait_until(pred, timeout: float, interval: float = 0.02, what: str = "condition"):
    """Poll ``pred`` until truthy; its value, or pytest.fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        try:
            last = pred()
        except Exception as e:  # keep polling; report the last error
            last = e
        if last and not isinstance(last, Exception):
            return last
        if time.monotonic() > deadline:
            pytest.fail("timed out after %ss waiting for %s (last: %r)" % (timeout, what, last), pytrace=False)
        time.sleep(interval)
