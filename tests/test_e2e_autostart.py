"""Autostart (DESIGN §20, issue 31) against the real daemon: 100 processes racing
``connect(autostart=True)`` on one socket make exactly one sidecar and all get a
permit; an idle autostarted sidecar exits within ``idle_exit`` + 2 s, removing
socket and lock file; a bad config surfaces the sidecar's own message within 5 s;
autostart stays off unless asked for."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Iterator, List

import pytest

import polygate
import polygate.aio
from polygate.errors import SidecarError

from .polygate_e2e import wait_until


@pytest.fixture
def run_dir() -> Iterator[Path]:
    """A short directory (AF_UNIX paths are <= 108 bytes); any sidecar still
    serving there is stopped at teardown."""
    d = Path(tempfile.mkdtemp(prefix="pg-auto-"))
    yield d
    for pid in _sidecars_in(d):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def counting_bin(sidecar_bin: Path, run_dir: Path) -> Path:
    """A wrapper that records each start of the real binary in ``starts``, then
    execs it (the inherited lock descriptor survives the exec)."""
    w = run_dir / "polygate-sidecar"
    w.write_text("#!/bin/sh\necho $$ >> %s\nexec %s \"$@\"\n" % (run_dir / "starts", sidecar_bin))
    w.chmod(0o755)
    return w


def _sidecars_in(d: Path) -> List[int]:
    """Live autostarted sidecars whose socket is under ``d``."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path("/proc", entry, "cmdline").read_bytes().split(b"\0")
            env = Path("/proc", entry, "environ").read_bytes().split(b"\0")
            state = Path("/proc", entry, "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and b"--autostarted" in cmd and any(
                e.startswith(b"SIDECAR__SOCKET=" + os.fsencode(d)) for e in env):
            pids.append(int(entry))
    return pids


def _env(binary: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if "__" not in k and not k.startswith("POLYGATE_")}
    env["POLYGATE_SIDECAR"] = str(binary)
    env.update(extra)
    return env


WORKER = textwrap.dedent("""
    import sys, time
    import polygate
    path, start_at = sys.argv[1], float(sys.argv[2])
    time.sleep(max(0.0, start_at - time.time()))
    c = polygate.connect(path, autostart=True, timeout=60)
    with c.call("chat", est_tokens=10) as call:
        p = call.acquire()
        p.success(tokens=5)
    print("admitted", p.source)
    c.close()
""")


@pytest.mark.timeout(180)
def test_100_processes_racing_autostart_make_one_sidecar_and_all_are_admitted(run_dir, counting_bin):
    sock = run_dir / "run" / "s.sock"
    script = run_dir / "worker.py"
    script.write_text(WORKER)
    n = 100
    # Every worker imports first, then connects at the same instant.
    start_at = time.time() + 8.0
    env = _env(counting_bin)
    procs = [subprocess.Popen([sys.executable, str(script), str(sock), str(start_at)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(n)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=150)
        outs.append((p.returncode, out, err))
    failed = [o for o in outs if o[0] != 0 or not o[1].startswith("admitted ")]
    assert not failed, "%d of %d failed; first: %r" % (len(failed), n, failed[:1])
    starts = (run_dir / "starts").read_text().split()
    assert len(starts) == 1, "the binary was started %d times: %s" % (len(starts), starts)
    assert _sidecars_in(run_dir) == [int(starts[0])], "exactly one sidecar serves the socket"


@pytest.mark.timeout(60)
def test_an_idle_autostarted_sidecar_exits_and_removes_socket_and_lock(run_dir, sidecar_bin, monkeypatch):
    sock = run_dir / "s.sock"
    for k, v in _env(sidecar_bin, SIDECAR__IDLE_EXIT="1s").items():
        monkeypatch.setenv(k, v)
    c = polygate.connect(str(sock), autostart=True)
    (pid,) = _sidecars_in(run_dir)
    assert sock.exists() and Path(str(sock) + ".lock").exists()
    time.sleep(2.0)
    assert _sidecars_in(run_dir) == [pid], "it exited while a connection was open"
    c.close()
    closed = time.monotonic()
    wait_until(lambda: not _sidecars_in(run_dir), timeout=10, what="the idle sidecar to exit")
    took = time.monotonic() - closed
    assert 1.0 <= took <= 3.0, "exited %.2f s after the last connection closed (idle_exit 1s)" % took
    assert not sock.exists(), "socket removed"
    assert not Path(str(sock) + ".lock").exists(), "lock file removed"
    # The next connect with autostart starts a new one.
    with polygate.connect(str(sock), autostart=True) as c2:
        assert c2.sidecar_version
    assert [p for p in _sidecars_in(run_dir) if p != pid]


@pytest.mark.timeout(30)
def test_a_bad_config_gives_the_sidecars_message_within_5_s(run_dir, sidecar_bin, monkeypatch):
    bad = run_dir / "bad.toml"
    bad.write_text("[sidecar]\nmax_frame = 10\n\n[scopes.chat]\n[[scopes.chat.sources]]\nname = \"a\"\n")
    for k, v in _env(sidecar_bin, POLYGATE_CONFIG=str(bad)).items():
        monkeypatch.setenv(k, v)
    sock = run_dir / "s.sock"
    t0 = time.monotonic()
    with pytest.raises(SidecarError) as e:
        polygate.connect(str(sock), autostart=True)
    took = time.monotonic() - t0
    assert took < 5.0, took
    msg = str(e.value)
    assert "sidecar.max_frame" in msg and "10" in msg, msg
    assert "exited with status" in msg and str(sock) + ".log" in msg, msg
    assert not Path(str(sock) + ".lock").exists() or not _sidecars_in(run_dir)


@pytest.mark.timeout(30)
def test_autostart_is_opt_in_and_the_env_turns_it_on(run_dir, sidecar_bin, monkeypatch):
    for k, v in _env(sidecar_bin).items():
        monkeypatch.setenv(k, v)
    sock = run_dir / "s.sock"
    with pytest.raises(SidecarError, match="cannot connect"):
        polygate.connect(str(sock))
    assert not _sidecars_in(run_dir) and not sock.exists(), "nothing was started without autostart"
    monkeypatch.setenv("POLYGATE_AUTOSTART", "1")

    async def main() -> str:
        c = await polygate.aio.connect(str(sock))
        try:
            return c.sidecar_version
        finally:
            await c.close()
    assert asyncio.run(main())
    assert len(_sidecars_in(run_dir)) == 1
    # A sidecar already serving is used, not replaced: no second start.
    with polygate.connect(str(sock)) as c:
        assert c.sidecar_version
    assert len(_sidecars_in(run_dir)) == 1


@pytest.mark.timeout(30)
def test_sidecar_path_honours_the_override_and_names_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setenv("POLYGATE_SIDECAR", "/opt/x/polygate-sidecar")
    assert polygate.sidecar_path() == "/opt/x/polygate-sidecar"
    monkeypatch.delenv("POLYGATE_SIDECAR")
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(polygate._autostart, "_script_dirs", lambda: [str(tmp_path / "none")])
    with pytest.raises(SidecarError, match="POLYGATE_SIDECAR"):
        polygate.sidecar_path()
    exe = tmp_path / "polygate-sidecar"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    assert polygate.sidecar_path() == str(exe)


def _quick_idle(sidecar_bin: Path, monkeypatch: pytest.MonkeyPatch, **extra: str) -> None:
    """The environment of a test: the real binary, and an autostarted sidecar that
    closes an idle connection and then exits within a second."""
    env = _env(sidecar_bin, SIDECAR__IDLE_TIMEOUT="300ms", SIDECAR__IDLE_EXIT="300ms", **extra)
    for k in list(os.environ):
        if k not in env:
            monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)


@pytest.mark.timeout(60)
def test_a_client_with_autostart_starts_the_sidecar_again_after_idle_exit_and_a_kill(
        run_dir, sidecar_bin, monkeypatch):
    """A red team saw a client connected with autostart fail forever ("No such file
    or directory") once its idle connection was closed and the sidecar exited."""
    sock = run_dir / "s.sock"
    _quick_idle(sidecar_bin, monkeypatch)
    c = polygate.connect(str(sock), autostart=True)
    assert c.status()
    (first,) = _sidecars_in(run_dir)
    wait_until(lambda: not _sidecars_in(run_dir) and not sock.exists(), timeout=10,
               what="idle_timeout, then idle_exit")
    assert c.status(), "the reconnect starts a sidecar again"
    (second,) = _sidecars_in(run_dir)
    assert second != first
    os.kill(second, signal.SIGKILL)
    wait_until(lambda: not _sidecars_in(run_dir), timeout=10, what="the killed sidecar to go")
    assert c.status(), "after a kill -9 too"
    assert len(_sidecars_in(run_dir)) == 1
    c.close()


@pytest.mark.timeout(60)
def test_an_asyncio_client_with_autostart_starts_the_sidecar_again_after_idle_exit(run_dir, sidecar_bin, monkeypatch):
    sock = run_dir / "s.sock"
    _quick_idle(sidecar_bin, monkeypatch, POLYGATE_AUTOSTART="1")  # the env's autostart is remembered too

    async def main() -> None:
        c = await polygate.aio.connect(str(sock))
        try:
            assert await c.status()
            while _sidecars_in(run_dir) or sock.exists():
                await asyncio.sleep(0.05)
            # two tasks find the loss together: one reconnect, one sidecar
            a, b = await asyncio.gather(c.status(), c.status())
            assert a and b
        finally:
            await c.close()
    asyncio.run(asyncio.wait_for(main(), 30))
    assert len(_sidecars_in(run_dir)) == 1


@pytest.mark.timeout(60)
def test_a_client_without_autostart_does_not_start_one_at_reconnect(run_dir, sidecar_bin, monkeypatch):
    sock = run_dir / "s.sock"
    _quick_idle(sidecar_bin, monkeypatch)
    with polygate.connect(str(sock), autostart=True):
        pass
    c = polygate.connect(str(sock))  # the sidecar is there: a plain connect
    wait_until(lambda: not _sidecars_in(run_dir) and not sock.exists(), timeout=10, what="idle_exit")
    with pytest.raises(SidecarError, match="cannot connect"):
        c.status()
    assert not _sidecars_in(run_dir)
    c.close()


def _going_away(sock: Path) -> "threading.Thread":
    """A listener on ``sock`` that closes the first connection that says Hello,
    then removes the socket and stops listening: a sidecar caught by idle_exit
    between a connect (a probe's, which says nothing, passes) and its handshake."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(sock))
    listener.listen(16)

    def serve() -> None:
        while True:
            conn, _ = listener.accept()
            conn.settimeout(5)
            said = conn.recv(1)
            conn.close()
            if said:
                break
        os.unlink(str(sock))
        listener.close()
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return t


@pytest.mark.timeout(60)
def test_autostart_takes_a_connection_closed_by_an_exiting_sidecar_for_none(run_dir, sidecar_bin, monkeypatch):
    """idle_exit races a connect: the probe got into the backlog of a listener that
    was closing, and the caller got "Connection reset by peer" (3 in 200 rounds)."""
    sock = run_dir / "s.sock"
    _quick_idle(sidecar_bin, monkeypatch)
    t = _going_away(sock)
    with polygate.connect(str(sock), autostart=True) as c:
        assert c.status()
    t.join(5)
    assert len(_sidecars_in(run_dir)) == 1

    async def main() -> None:
        c = await polygate.aio.connect(str(sock), autostart=True)
        await c.close()
    for pid in _sidecars_in(run_dir):
        os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not _sidecars_in(run_dir), timeout=10, what="the killed sidecar to go")
    sock.unlink()
    t = _going_away(sock)
    asyncio.run(asyncio.wait_for(main(), 30))
    t.join(5)
    assert len(_sidecars_in(run_dir)) == 1


@pytest.mark.timeout(60)
def test_autostart_works_with_stdin_stdout_and_stderr_closed(run_dir, sidecar_bin):
    """With fd 0 closed the lock file got fd 0, which the child's stdin replaced
    ("--lock-fd 0: expected a descriptor above 2")."""
    sock = run_dir / "s.sock"
    script = "import polygate, sys; c = polygate.connect(sys.argv[1], autostart=True); c.status(); c.close()"
    r = subprocess.run(["sh", "-c", 'exec "$0" -c "$1" "$2" 0<&- 1>&- 2>"$3"', sys.executable, script, str(sock),
                        str(run_dir / "err")], env=_env(sidecar_bin), timeout=30)
    assert r.returncode == 0, (run_dir / "err").read_text()
    assert len(_sidecars_in(run_dir)) == 1


@pytest.mark.timeout(60)
def test_the_autostarted_sidecar_does_not_get_the_callers_service_manager_variables(run_dir, sidecar_bin, monkeypatch):
    """It sent READY=1 / STOPPING=1 to the caller's NOTIFY_SOCKET."""
    notify = run_dir / "notify"
    recv = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    recv.bind(str(notify))
    recv.settimeout(1.5)
    manager = dict(NOTIFY_SOCKET=str(notify), WATCHDOG_USEC="1000000", WATCHDOG_PID=str(os.getpid()),
                   LISTEN_FDS="1", LISTEN_PID=str(os.getpid()), LISTEN_FDNAMES="x")
    _quick_idle(sidecar_bin, monkeypatch, **manager)
    sock = run_dir / "s.sock"
    with polygate.connect(str(sock), autostart=True) as c:
        assert c.status()
        (pid,) = _sidecars_in(run_dir)
        env = Path("/proc", str(pid), "environ").read_bytes().split(b"\0")
        assert not [e for e in env if e.split(b"=")[0].decode() in manager], env
        with pytest.raises(socket.timeout):
            print("the sidecar notified:", recv.recv(4096))
    recv.close()
    for k, v in manager.items():
        assert os.environ[k] == v, "the caller's own environment is untouched"


@pytest.mark.timeout(30)
def test_autostart_names_a_socket_path_too_long_for_sun_path(run_dir, sidecar_bin, monkeypatch):
    """A relative path whose absolute form is over 107 bytes skipped autostart and
    reported ENOENT."""
    deep = run_dir / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.chdir(deep)
    for k, v in _env(sidecar_bin).items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SidecarError) as e:
        polygate.connect("s.sock", autostart=True, timeout=5)
    msg = str(e.value)
    assert str(deep / "s.sock") in msg and "107" in msg, msg
    for autostart in (True, False):  # a long absolute path: "AF_UNIX path too long" alone before
        with pytest.raises(SidecarError) as e:
            polygate.connect(str(deep / "s.sock"), autostart=autostart, timeout=5)
        assert str(deep / "s.sock") in str(e.value) and "107" in str(e.value), e.value
    assert not _sidecars_in(run_dir)


@pytest.mark.timeout(30)
def test_a_sidecar_killed_by_a_signal_is_named_so_and_the_log_is_0600(run_dir, monkeypatch):
    crash = run_dir / "polygate-sidecar"
    crash.write_text("#!/bin/sh\necho about to crash >&2\nkill -SEGV $$\n")
    crash.chmod(0o755)
    for k, v in _env(crash).items():
        monkeypatch.setenv(k, v)
    sock = run_dir / "s.sock"
    old = os.umask(0o022)
    try:
        with pytest.raises(SidecarError) as e:
            polygate.connect(str(sock), autostart=True, timeout=5)
    finally:
        os.umask(old)
    msg = str(e.value)
    assert "killed by signal 11 (SIGSEGV)" in msg and "about to crash" in msg, msg
    assert os.stat(str(sock) + ".log").st_mode & 0o777 == 0o600


@pytest.mark.timeout(30)
def test_sidecar_path_names_a_packaged_binary_that_is_not_executable(monkeypatch, tmp_path):
    monkeypatch.delenv("POLYGATE_SIDECAR", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    scripts = tmp_path / "bin"
    scripts.mkdir()
    (scripts / "polygate-sidecar").write_text("#!/bin/sh\n")
    (scripts / "polygate-sidecar").chmod(0o644)
    monkeypatch.setattr(polygate._autostart, "_script_dirs", lambda: [str(scripts)])
    with pytest.raises(SidecarError) as e:
        polygate.sidecar_path()
    assert str(scripts / "polygate-sidecar") in str(e.value) and "not executable" in str(e.value), e.value
