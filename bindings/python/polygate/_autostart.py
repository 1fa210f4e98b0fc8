"""Autostart (DESIGN §20): start a sidecar for this socket when none answers.

Opt-in (``connect(autostart=True)`` or ``$POLYGATE_AUTOSTART=1``). When nothing
answers on the socket, take ``SOCKET.lock`` (``flock``, exclusive, not waiting),
look once more, and start :func:`sidecar_path` detached (its own session, so it
outlives this process) as ``polygate-sidecar --autostarted --lock-fd N`` on the
embedded default configuration (or ``$POLYGATE_CONFIG``), bound to this socket
(``SIDECAR__SOCKET``). The locked descriptor is inherited: the lock becomes the
sidecar's and is held until it exits, so of any number of processes starting at
once exactly one starts a sidecar and the others connect to it. The sidecar's
stderr goes to ``SOCKET.log``; if it exits before it listens, the caller gets a
:class:`~polygate.errors.SidecarError` carrying its first lines and the log path.
An autostarted sidecar exits after ``sidecar.idle_exit`` (10 min unless set)
without a connection, removing socket and lock file; a client connected with
autostart runs :func:`ensure` again at any reconnect that finds no sidecar
(``_sync._dial``, ``aio._dial``).

Blocking; :mod:`polygate.aio` runs it in a thread.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
from typing import List, Optional

from ._core.errmap import SUN_PATH_MAX
from .errors import SidecarError

AUTOSTART_ENV = "POLYGATE_AUTOSTART"
SIDECAR_ENV = "POLYGATE_SIDECAR"
CONFIG_ENV = "POLYGATE_CONFIG"
BINARY = "polygate-sidecar"
EXIT_BUSY = 75
"""The sidecar's exit status when another process holds the lock (``EX_TEMPFAIL``)."""
START_TIMEOUT = 10.0
"""How long a start may take when the caller set no timeout, in seconds."""
POLL = 0.01
_ERROR_LINES = 12

# A connect that fails with one of these means "nobody is serving there".
_ABSENT = (errno.ENOENT, errno.ECONNREFUSED)
# ... and with one of these during the connect or the handshake: "a sidecar on its
# way out" (idle_exit, SIGTERM: the probe got into the backlog of a listener that
# was closing). With autostart both mean "start one" (DESIGN §20).
GONE = _ABSENT + (errno.ECONNRESET, errno.EPIPE)


class Gone(Exception):
    """Internal to the clients' dials (``_sync._dial``, ``aio._dial``): the connect
    or the handshake found no sidecar, or one on its way out (refused, reset,
    closed: :data:`GONE`); ``error`` is what to raise."""

    def __init__(self, error: SidecarError) -> None:
        super().__init__(error.message)
        self.error = error


# The caller's service-manager protocol is the caller's: an autostarted sidecar
# must not send READY=1 / STOPPING=1 to its NOTIFY_SOCKET, nor take its sockets.
CHILD_ENV_DROPPED = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID",
                     "LISTEN_FDNAMES")


def wanted(autostart: Optional[bool]) -> bool:
    """``autostart`` as given, else ``$POLYGATE_AUTOSTART`` (``1``/``true``/``yes``)."""
    if autostart is not None:
        return autostart
    return os.environ.get(AUTOSTART_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def sidecar_path() -> str:
    """The ``polygate-sidecar`` binary: ``$POLYGATE_SIDECAR``, else the one the
    platform wheel installed beside this environment's scripts, else ``PATH``.
    Raises :class:`SidecarError` when there is none."""
    env = os.environ.get(SIDECAR_ENV)
    if env:
        return env
    not_executable = None
    for scripts in _script_dirs():
        candidate = os.path.join(scripts, BINARY)
        if os.path.isfile(candidate):
            if os.access(candidate, os.X_OK):
                return candidate
            not_executable = not_executable or candidate
    found = shutil.which(BINARY)
    if found:
        return found
    if not_executable is not None:
        raise SidecarError(
            "%s is not executable (chmod +x it, reinstall the platform wheel of polygate, "
            "or set $%s)" % (not_executable, SIDECAR_ENV),
            kind="connection",
        )
    raise SidecarError(
        "no %s binary: install the platform wheel of polygate (it carries one), put it on PATH, "
        "or set $%s" % (BINARY, SIDECAR_ENV),
        kind="connection",
    )


def _script_dirs() -> List[str]:
    """Where an installed wheel's scripts land: this scheme's, the user scheme's,
    and beside the interpreter (the ruff/uv ``find_*_bin`` rule)."""
    dirs = []
    for scheme in (None, "%s_user" % os.name):
        try:
            d = sysconfig.get_path("scripts") if scheme is None else sysconfig.get_path("scripts", scheme)
        except KeyError:
            continue
        if d:
            dirs.append(d)
    dirs.append(os.path.dirname(sys.executable))
    return dirs


def _answers(path: str) -> bool:
    """True when something listens on ``path`` (or a connect fails for a reason a
    start cannot fix, which ``connect`` then reports)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(1.0)
        s.connect(path)
        return True
    except OSError as e:
        return e.errno not in _ABSENT
    finally:
        s.close()


def bound(timeout: Optional[float]) -> float:
    """The bound of a start, in seconds: ``timeout``, else :data:`START_TIMEOUT`."""
    return timeout if timeout is not None else START_TIMEOUT


def ensure(path: str, timeout: Optional[float]) -> None:
    """Return once a sidecar answers on ``path``, starting one if none does (see
    the module text). ``timeout``: the bound in seconds (``None``: 10 s)."""
    if _answers(path):
        return
    path = os.path.abspath(path)
    size = len(os.fsencode(path))
    if size > SUN_PATH_MAX:
        raise SidecarError(
            "autostart: the socket path %s is %d bytes, longer than the %d bytes a Unix socket path may "
            "have (sun_path): use a shorter one" % (path, size, SUN_PATH_MAX),
            kind="connection",
        )
    lock_path = path + ".lock"
    deadline = time.monotonic() + bound(timeout)
    directory = os.path.dirname(path)
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
    except OSError as e:
        raise SidecarError("autostart: cannot create the socket directory %s: %s" % (directory, e),
                           kind="connection") from None
    while True:
        if _answers(path):
            return
        fd = _try_lock(lock_path)
        if fd is not None:
            try:
                if _answers(path):  # a daemon that is not ours came up meanwhile
                    return
                proc, log_path = _spawn(path, fd)
            finally:
                os.close(fd)  # the sidecar holds the lock now
            if _wait(proc, path, log_path, deadline):
                return
            continue  # it found the lock taken (exit 75): look again
        if time.monotonic() > deadline:
            raise SidecarError(
                "autostart: no sidecar answers on %s and another process holds %s (starting one?) "
                "past the timeout" % (path, lock_path),
                kind="connection",
            )
        time.sleep(POLL)


def _try_lock(lock_path: str) -> Optional[int]:
    """``lock_path`` opened and locked (exclusive, not waiting), or ``None`` when
    another process holds it or the file was replaced under us."""
    try:
        fd = _above_stdio(os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
    except OSError as e:
        raise SidecarError("autostart: cannot open the lock file %s: %s" % (lock_path, e),
                           kind="connection") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except OSError as e:
        os.close(fd)
        raise SidecarError("autostart: cannot lock %s: %s" % (lock_path, e), kind="connection") from None
    # An exiting sidecar unlinks the file: a lock on the unlinked one guards nothing.
    try:
        same = os.path.samestat(os.fstat(fd), os.stat(lock_path))
    except OSError:
        same = False
    if not same:
        os.close(fd)
        return None
    return fd


def _above_stdio(fd: int) -> int:
    """``fd``, moved above 2 if it is not: with this process's stdin, stdout or
    stderr closed, ``os.open`` returns 0, 1 or 2, which the child's own stdio
    would replace (the sidecar refuses ``--lock-fd`` 0 to 2)."""
    if fd > 2:
        return fd
    try:
        return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
    finally:
        os.close(fd)


def child_env(path: str) -> "dict[str, str]":
    """The sidecar's environment: this process's, bound to ``path``, without the
    caller's service-manager variables (:data:`CHILD_ENV_DROPPED`)."""
    env = {k: v for k, v in os.environ.items() if k not in CHILD_ENV_DROPPED}
    env["SIDECAR__SOCKET"] = path
    return env


def _spawn(path: str, lock_fd: int) -> "tuple[subprocess.Popen[bytes], str]":
    """Start the sidecar detached on ``path`` with the locked ``lock_fd``."""
    binary = sidecar_path()
    args = [binary, "--autostarted", "--lock-fd", str(lock_fd)]
    config = os.environ.get(CONFIG_ENV)
    if config:
        args[1:1] = ["--config", os.path.abspath(config)]
    env = child_env(path)
    log_path = path + ".log"
    try:
        # we hold the lock: nobody else writes it now; 0600 as the lock file
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(log_fd, 0o600)  # one an older start left with the umask's mode
        except OSError:
            pass
        log = os.fdopen(log_fd, "wb")
    except OSError as e:
        raise SidecarError("autostart: cannot open the log file %s: %s" % (log_path, e),
                           kind="connection") from None
    try:
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                                pass_fds=(lock_fd,), start_new_session=True, cwd="/")
    except OSError as e:
        raise SidecarError("autostart: cannot start %s: %s" % (binary, e), kind="connection") from None
    finally:
        log.close()
    return proc, log_path


def _wait(proc: "subprocess.Popen[bytes]", path: str, log_path: str, deadline: float) -> bool:
    """Wait until ``proc`` listens on ``path`` (True), found the lock taken (False),
    or failed (raise, with its first stderr lines)."""
    while True:
        if _answers(path):
            # Reap it when it exits some day, so it leaves no zombie behind.
            threading.Thread(target=proc.wait, name="polygate-sidecar-reaper", daemon=True).start()
            return True
        code = proc.poll()
        if code == EXIT_BUSY:
            return False
        if code is not None:
            raise SidecarError(
                "autostart: the sidecar %s before listening on %s:\n%s\n(log: %s)"
                % (exit_text(code), path, _first_lines(log_path), log_path),
                kind="connection",
            )
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise SidecarError(
                "autostart: the sidecar did not listen on %s in time (killed it):\n%s\n(log: %s)"
                % (path, _first_lines(log_path), log_path),
                kind="connection",
            )
        time.sleep(POLL)


def exit_text(code: int) -> str:
    """How the sidecar ended, from ``Popen.returncode``: "exited with status 1" or
    "was killed by signal 11 (SIGSEGV)" (the words of the Go and Node bindings)."""
    if code >= 0:
        return "exited with status %d" % code
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = "unknown"
    return "was killed by signal %d (%s)" % (-code, name)


def _first_lines(log_path: str) -> str:
    try:
        with open(log_path, "rb") as f:
            text = f.read(16384).decode("utf-8", "replace")
    except OSError as e:
        return "(cannot read the log: %s)" % e
    lines = [line for line in text.splitlines() if line.strip()][:_ERROR_LINES]
    return "\n".join(lines) if lines else "(it wrote nothing)"
