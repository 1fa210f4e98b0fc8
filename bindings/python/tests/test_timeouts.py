"""Nothing may hang the test run (issue 10, item 9).

Every test runs under pytest-timeout (configured in the root ``pytest.ini`` and in
``bindings/python/pyproject.toml``). These tests prove the mechanism on hangs run
in a child pytest, so no hanging test stays in the suite itself, and that the
signal-based tests pass in an environment that ignores SIGINT (a shell that
starts the run in the background does that).
"""

import os
import signal
import subprocess
import sys
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))


def _ignore_sigint() -> None:  # runs in the child before exec: SIG_IGN is inherited
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _pytest(args, cwd, ignore_sigint=True):
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=_ignore_sigint if ignore_sigint else None,
        timeout=120,  # the guard of the guard: the child must end long before this
    )


def test_every_test_has_a_timeout(pytestconfig):
    assert pytestconfig.pluginmanager.hasplugin("timeout"), "pytest-timeout is not loaded"
    assert 0 < float(pytestconfig.getini("timeout")) <= 120, pytestconfig.getini("timeout")
    assert "pytest-timeout" in pytestconfig.getini("required_plugins")


def test_hanging_tests_are_killed_and_reported(tmp_path, pytestconfig):
    (tmp_path / "test_hang.py").write_text(textwrap.dedent("""
        import signal, socket, threading

        def test_hangs_in_a_socket_read():
            a, b = socket.socketpair()
            a.recv(1)  # nobody ever writes

        def test_hangs_waiting_for_an_ignored_sigint():
            # the shape of the old keyboard-interrupt test when SIGINT is ignored
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            threading.Event().wait()

        def test_after_the_hangs_the_run_goes_on():
            pass
    """))
    # Our configuration (required plugin and all), with a short timeout so the proof is quick.
    r = _pytest(["-c", str(pytestconfig.inipath), "--rootdir", str(tmp_path), "-o", "timeout=1",
                 str(tmp_path / "test_hang.py")], cwd=str(tmp_path))
    out = r.stdout
    assert r.returncode == 1, out
    assert "2 failed, 1 passed" in out, out
    assert out.count("Timeout (>1.0s)") >= 2 or out.count("Failed: Timeout") >= 2, out
    for name in ("test_hangs_in_a_socket_read", "test_hangs_waiting_for_an_ignored_sigint"):
        assert "FAILED test_hang.py::%s" % name in out, out


def test_interrupt_tests_pass_when_sigint_is_ignored(pytestconfig):
    # These tests deliver SIGINT to the main thread; they install their own handler,
    # so an inherited SIG_IGN must not make them wait forever.
    tests = ["test_keyboard_interrupt_cancels_waiting_acquire", "test_late_grant_after_interrupt_is_released",
             "test_interrupts_racing_replies_never_cut_the_stream"]
    r = _pytest(["-c", str(pytestconfig.inipath), "-o", "timeout=30",
                 *["%s::%s" % (os.path.join(HERE, "test_sync.py"), t) for t in tests]],
                cwd=str(pytestconfig.rootpath))
    assert r.returncode == 0 and "4 passed" in r.stdout, r.stdout  # late_grant runs twice
