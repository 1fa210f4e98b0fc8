package polygate

// Autostart (DESIGN §20): start a sidecar for this socket when none answers.
//
// Opt-in (Options.Autostart or POLYGATE_AUTOSTART=1). When nothing answers on the
// socket, take SOCKET.lock (flock, exclusive, not waiting), look once more, and
// start the sidecar binary ($POLYGATE_SIDECAR, else polygate-sidecar on PATH)
// detached (its own session) as `polygate-sidecar --autostarted --lock-fd 3` on
// the embedded default configuration (or $POLYGATE_CONFIG), bound to this socket
// (SIDECAR__SOCKET). The locked descriptor is inherited: the lock becomes the
// sidecar's until it exits, so concurrent starters make exactly one sidecar. Its
// stderr goes to SOCKET.log; if it exits before listening, Dial returns a
// *SidecarError carrying its first lines and the log path. A Client dialled with
// autostart runs this again at any reconnect that finds no sidecar (dialAutostart).

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"
)

const (
	// AutostartEnv turns autostart on for every Dial ("1", "true", "yes", "on").
	AutostartEnv = "POLYGATE_AUTOSTART"
	// SidecarEnv names the sidecar binary autostart runs (default: PATH).
	SidecarEnv = "POLYGATE_SIDECAR"
	// ConfigEnv names the configuration file an autostarted sidecar reads.
	ConfigEnv = "POLYGATE_CONFIG"

	exitBusy          = 75  // the sidecar found the lock held (EX_TEMPFAIL)
	sunPathMax        = 107 // the longest Unix socket path in bytes (sun_path is 108 with its NUL)
	autostartTimeout  = 10 * time.Second
	autostartPoll     = 10 * time.Millisecond
	autostartErrLines = 12
)

// childEnvDropped are the caller's service-manager variables: an autostarted
// sidecar must not send READY=1 / STOPPING=1 to the caller's NOTIFY_SOCKET, nor
// take its socket-activation descriptors.
var childEnvDropped = []string{"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES"}

// childEnv is the sidecar's environment: this process's without childEnvDropped,
// bound to sock.
func childEnv(sock string) []string {
	var env []string
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		if !slices.Contains(childEnvDropped, k) {
			env = append(env, kv)
		}
	}
	return append(env, "SIDECAR__SOCKET="+sock)
}

func autostartWanted(opt bool) bool {
	if opt {
		return true
	}
	switch strings.ToLower(strings.TrimSpace(os.Getenv(AutostartEnv))) {
	case "1", "true", "yes", "on":
		return true
	}
	return false
}

// SidecarPath is the binary autostart runs: $POLYGATE_SIDECAR, else
// polygate-sidecar on PATH.
func SidecarPath() (string, error) {
	if p := os.Getenv(SidecarEnv); p != "" {
		return p, nil
	}
	p, err := exec.LookPath("polygate-sidecar")
	if err != nil {
		return "", &SidecarError{Kind: "connection", Err: err, Message: "no polygate-sidecar binary on PATH: " +
			"install it (pip install polygate, npm install polygate, or cargo install --path sidecar) or set $" + SidecarEnv}
	}
	return p, nil
}

// answers reports whether something listens on path (or a connect fails for a
// reason a start cannot fix, which Dial then reports).
func answers(path string) bool {
	c, err := net.DialTimeout("unix", path, time.Second)
	if err == nil {
		c.Close()
		return true
	}
	return !errors.Is(err, syscall.ENOENT) && !errors.Is(err, syscall.ECONNREFUSED)
}

func autostartError(format string, args ...any) *SidecarError {
	return &SidecarError{Kind: "connection", Message: "autostart: " + fmt.Sprintf(format, args...)}
}

// dialAutostart is dial; with autostart, a connect or handshake that finds no
// sidecar (nothing listening, or one exiting after idle_exit that refused, reset
// or closed the connection) runs ensureSidecar, whose lock makes one sidecar of
// any number of concurrent starters, and dials again; ctx bounds it all (10 s
// when ctx has no deadline).
func dialAutostart(ctx context.Context, path, name string, autostart bool) (*conn, error) {
	if !autostart {
		return dial(ctx, path, name)
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, autostartTimeout)
		defer cancel()
	}
	for tries := 0; ; tries++ {
		c, err := dial(ctx, path, name)
		if err == nil || !sidecarGone(err) || ctx.Err() != nil {
			return c, err
		}
		if tries > 0 { // a listener still closing: let it go
			select {
			case <-ctx.Done():
				return nil, err
			case <-time.After(autostartPoll):
			}
		}
		if err := ensureSidecar(ctx, path); err != nil {
			return nil, err
		}
	}
}

// sidecarGone reports whether a dial's error means "no sidecar there": nothing
// listening (ENOENT, ECONNREFUSED) or one on its way out (reset, broken pipe,
// EOF during the handshake).
func sidecarGone(err error) bool {
	for _, e := range []error{syscall.ENOENT, syscall.ECONNREFUSED, syscall.ECONNRESET, syscall.EPIPE,
		io.EOF, io.ErrUnexpectedEOF} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}

// ensureSidecar returns once a sidecar answers on path, starting one if none does.
// ctx bounds it (10 s when ctx has no deadline).
func ensureSidecar(ctx context.Context, path string) error {
	if answers(path) {
		return nil
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, autostartTimeout)
		defer cancel()
	}
	abs, err := filepath.Abs(path)
	if err != nil {
		return autostartError("socket path %s: %v", path, err)
	}
	if err := os.MkdirAll(filepath.Dir(abs), 0o700); err != nil {
		return autostartError("cannot create the socket directory: %v", err)
	}
	if len(abs) > sunPathMax {
		return autostartError("the socket path %s is %d bytes, longer than the %d bytes a Unix socket path may have (sun_path): use a shorter one",
			abs, len(abs), sunPathMax)
	}
	lockPath := abs + ".lock"
	for {
		if answers(abs) {
			return nil
		}
		lock, err := tryLock(lockPath)
		if err != nil {
			return err
		}
		if lock != nil {
			started, err := startLocked(ctx, abs, lock)
			if err != nil || started {
				return err
			}
			continue // it found the lock taken (exit 75): look again
		}
		select {
		case <-ctx.Done():
			return autostartError("no sidecar answers on %s and another process holds %s (starting one?): %v",
				abs, lockPath, ctx.Err())
		case <-time.After(autostartPoll):
		}
	}
}

// tryLock opens and locks lockPath without waiting; nil when another process holds
// it or the file was replaced meanwhile (an exiting sidecar unlinks it).
func tryLock(lockPath string) (*os.File, error) {
	f, err := os.OpenFile(lockPath, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, autostartError("cannot open the lock file: %v", err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			return nil, nil
		}
		return nil, autostartError("cannot lock %s: %v", lockPath, err)
	}
	ours, err1 := f.Stat()
	now, err2 := os.Stat(lockPath)
	if err1 != nil || err2 != nil || !os.SameFile(ours, now) {
		f.Close()
		return nil, nil
	}
	return f, nil
}

// startLocked starts the sidecar with the locked file and waits for it: true once
// it listens, false when it found the lock taken, an error when it failed.
func startLocked(ctx context.Context, sock string, lock *os.File) (bool, error) {
	defer lock.Close() // the sidecar holds the lock from here on
	if answers(sock) { // a daemon that is not ours came up meanwhile
		return true, nil
	}
	bin, err := SidecarPath()
	if err != nil {
		return false, err
	}
	logPath := sock + ".log"
	logf, err := os.OpenFile(logPath, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return false, autostartError("cannot open the log file: %v", err)
	}
	args := []string{"--autostarted", "--lock-fd", "3"}
	if cfg := os.Getenv(ConfigEnv); cfg != "" {
		if abs, err := filepath.Abs(cfg); err == nil {
			cfg = abs
		}
		args = append([]string{"--config", cfg}, args...)
	}
	// Not CommandContext: the sidecar outlives ctx and this process.
	cmd := exec.Command(bin, args...)
	cmd.Dir = "/"
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.ExtraFiles = []*os.File{lock}
	cmd.Env = childEnv(sock)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	err = cmd.Start()
	logf.Close()
	if err != nil {
		return false, autostartError("cannot start %s: %v", bin, err)
	}
	exited := make(chan struct{})
	go func() { // reaps it whenever it exits, so no zombie stays behind
		_ = cmd.Wait()
		close(exited)
	}()
	tick := time.NewTicker(autostartPoll)
	defer tick.Stop()
	for {
		if answers(sock) {
			return true, nil
		}
		select {
		case <-exited:
			if cmd.ProcessState.ExitCode() == exitBusy {
				return false, nil
			}
			return false, autostartError("the sidecar %s before listening on %s:\n%s\n(log: %s)",
				exitText(cmd.ProcessState), sock, firstLines(logPath), logPath)
		case <-ctx.Done():
			_ = cmd.Process.Kill()
			<-exited
			return false, autostartError("the sidecar did not listen on %s in time (killed it): %v\n%s\n(log: %s)",
				sock, ctx.Err(), firstLines(logPath), logPath)
		case <-tick.C:
		}
	}
}

// exitText is how the sidecar ended: "exited with status 1" or "was killed by
// signal 11 (SIGSEGV)" (the words of the Python and Node bindings).
func exitText(ps *os.ProcessState) string {
	if ws, ok := ps.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		sig := ws.Signal()
		name, ok := signalNames[sig]
		if !ok {
			name = "unknown"
		}
		return fmt.Sprintf("was killed by signal %d (%s)", int(sig), name)
	}
	return fmt.Sprintf("exited with status %d", ps.ExitCode())
}

var signalNames = map[syscall.Signal]string{
	syscall.SIGHUP: "SIGHUP", syscall.SIGINT: "SIGINT", syscall.SIGQUIT: "SIGQUIT", syscall.SIGILL: "SIGILL",
	syscall.SIGTRAP: "SIGTRAP", syscall.SIGABRT: "SIGABRT", syscall.SIGBUS: "SIGBUS", syscall.SIGFPE: "SIGFPE",
	syscall.SIGKILL: "SIGKILL", syscall.SIGUSR1: "SIGUSR1", syscall.SIGSEGV: "SIGSEGV", syscall.SIGUSR2: "SIGUSR2",
	syscall.SIGPIPE: "SIGPIPE", syscall.SIGALRM: "SIGALRM", syscall.SIGTERM: "SIGTERM", syscall.SIGXCPU: "SIGXCPU",
	syscall.SIGXFSZ: "SIGXFSZ", syscall.SIGSYS: "SIGSYS",
}

func firstLines(logPath string) string {
	b, err := os.ReadFile(logPath)
	if err != nil {
		return "(cannot read the log: " + err.Error() + ")"
	}
	var out []string
	for _, l := range bytes.Split(b, []byte("\n")) {
		if len(bytes.TrimSpace(l)) > 0 && len(out) < autostartErrLines {
			out = append(out, string(l))
		}
	}
	if len(out) == 0 {
		return "(it wrote nothing)"
	}
	return strings.Join(out, "\n")
}
