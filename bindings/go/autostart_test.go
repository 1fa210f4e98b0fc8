package polygate

// Autostart (DESIGN §20) against the real daemon: off unless asked for; 20
// goroutines dialing at once with Autostart start the binary exactly once (the
// flock is per open file, so goroutines race as processes do); an idle
// autostarted sidecar exits and removes socket and lock; a bad config's message
// reaches the caller within 5 s.

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// autostartEnv points autostart at a wrapper around the real binary that records
// each start in dir/starts.
func autostartEnv(t *testing.T) (dir, sock string) {
	t.Helper()
	bin := sidecarBin(t)
	dir = shortTempDir(t)
	wrapper := filepath.Join(dir, "polygate-sidecar")
	script := fmt.Sprintf("#!/bin/sh\necho $$ >> %s/starts\nexec %s \"$@\"\n", dir, bin)
	if err := os.WriteFile(wrapper, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		if strings.Contains(k, "__") || strings.HasPrefix(k, "POLYGATE_") {
			t.Setenv(k, "")
			os.Unsetenv(k)
		}
	}
	t.Setenv(SidecarEnv, wrapper)
	sock = filepath.Join(dir, "run", "s.sock")
	t.Cleanup(func() { stopAutostarted(dir) })
	return dir, sock
}

func starts(dir string) []string {
	b, _ := os.ReadFile(filepath.Join(dir, "starts"))
	return strings.Fields(string(b))
}

// stopAutostarted kills what the wrapper started (test cleanup).
func stopAutostarted(dir string) {
	for _, pid := range starts(dir) {
		var n int
		if _, err := fmt.Sscan(pid, &n); err == nil {
			if p, err := os.FindProcess(n); err == nil {
				_ = p.Kill()
			}
		}
	}
}

func TestAutostartRaceStartsOneSidecarAndIdleExitCleansUp(t *testing.T) {
	dir, sock := autostartEnv(t)
	t.Setenv("SIDECAR__IDLE_EXIT", "1s")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := Dial(ctx, sock); err == nil {
		t.Fatal("connected with no sidecar and no autostart")
	}
	if len(starts(dir)) != 0 {
		t.Fatal("started without autostart")
	}

	const n = 20
	var wg sync.WaitGroup
	clients := make([]*Client, n)
	errs := make([]error, n)
	for i := range clients {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			clients[i], errs[i] = DialOptions(ctx, sock, Options{Autostart: true})
		}(i)
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("client %d: %v", i, err)
		}
	}
	if s := starts(dir); len(s) != 1 {
		t.Fatalf("the binary was started %d times: %v", len(s), s)
	}
	call, err := clients[0].Begin(ctx, "chat", CallOptions{EstTokens: 10})
	if err != nil {
		t.Fatal(err)
	}
	permit, err := call.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := permit.Success(ctx, 5); err != nil {
		t.Fatal(err)
	}
	for _, c := range clients {
		c.Close()
	}
	closed := time.Now()
	for fileExists(sock) || fileExists(sock+".lock") {
		if time.Since(closed) > 10*time.Second {
			t.Fatal("the idle sidecar did not remove socket and lock")
		}
		time.Sleep(20 * time.Millisecond)
	}
	if took := time.Since(closed); took < time.Second || took > 3*time.Second {
		t.Fatalf("socket and lock removed %v after the last close (idle_exit 1s)", took)
	}
}

func TestAutostartBadConfigGivesTheSidecarsMessage(t *testing.T) {
	dir, sock := autostartEnv(t)
	bad := filepath.Join(dir, "bad.toml")
	if err := os.WriteFile(bad, []byte("[sidecar]\nmax_frame = 10\n\n[scopes.chat]\n[[scopes.chat.sources]]\nname = \"a\"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv(ConfigEnv, bad)
	t.Setenv(AutostartEnv, "1")
	t0 := time.Now()
	_, err := Dial(context.Background(), sock)
	var se *SidecarError
	if !errors.As(err, &se) || se.Kind != "connection" {
		t.Fatalf("want a connection SidecarError, got %v", err)
	}
	if time.Since(t0) > 5*time.Second {
		t.Fatalf("took %v", time.Since(t0))
	}
	if !strings.Contains(se.Message, "sidecar.max_frame") || !strings.Contains(se.Message, sock+".log") {
		t.Fatalf("the sidecar's message and the log path are missing: %s", se.Message)
	}
}

func fileExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}

// quickIdle makes an autostarted sidecar close an idle connection and then exit
// within a second.
func quickIdle(t *testing.T) {
	t.Setenv("SIDECAR__IDLE_TIMEOUT", "300ms")
	t.Setenv("SIDECAR__IDLE_EXIT", "300ms")
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func lastStart(t *testing.T, dir string) int {
	t.Helper()
	s := starts(dir)
	var pid int
	if len(s) == 0 {
		t.Fatal("nothing was started")
	}
	if _, err := fmt.Sscan(s[len(s)-1], &pid); err != nil {
		t.Fatal(err)
	}
	return pid
}

// A red team saw a client dialled with Autostart fail forever ("no such file or
// directory") once idle_timeout closed its connection and idle_exit stopped the
// sidecar; the same after a kill -9.
func TestAutostartClientStartsTheSidecarAgainAfterIdleExitAndAKill(t *testing.T) {
	dir, sock := autostartEnv(t)
	quickIdle(t)
	ctx, cancel := context.WithTimeout(context.Background(), 40*time.Second)
	defer cancel()
	c, err := DialOptions(ctx, sock, Options{Autostart: true})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Status(ctx); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "idle_timeout, then idle_exit", func() bool { return !fileExists(sock) })
	if _, err := c.Status(ctx); err != nil {
		t.Fatalf("the reconnect did not start a sidecar again: %v", err)
	}
	if n := len(starts(dir)); n != 2 {
		t.Fatalf("started %d times, want 2", n)
	}
	pid := lastStart(t, dir)
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the killed sidecar to go", func() bool { return syscall.Kill(pid, 0) != nil })
	if _, err := c.Status(ctx); err != nil {
		t.Fatalf("after a kill -9: %v", err)
	}
	if n := len(starts(dir)); n != 3 {
		t.Fatalf("started %d times, want 3", n)
	}

	// Two goroutines that find the loss together make one sidecar.
	waitFor(t, "idle_exit", func() bool { return !fileExists(sock) })
	var wg sync.WaitGroup
	errs := make([]error, 2)
	for i := range errs {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			_, errs[i] = c.Status(ctx)
		}(i)
	}
	wg.Wait()
	if errs[0] != nil || errs[1] != nil {
		t.Fatal(errs)
	}
	if n := len(starts(dir)); n != 4 {
		t.Fatalf("started %d times, want 4", n)
	}
}

func TestAutostartOffAClientDoesNotStartOneAtReconnect(t *testing.T) {
	dir, sock := autostartEnv(t)
	quickIdle(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	first, err := DialOptions(ctx, sock, Options{Autostart: true})
	if err != nil {
		t.Fatal(err)
	}
	first.Close()
	c, err := Dial(ctx, sock) // the sidecar is there: a plain dial
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	waitFor(t, "idle_exit", func() bool { return !fileExists(sock) })
	if _, err := c.Status(ctx); err == nil {
		t.Fatal("a client without autostart reconnected to a sidecar nobody started")
	}
	if n := len(starts(dir)); n != 1 {
		t.Fatalf("started %d times, want 1", n)
	}
}

// goingAway listens on sock and closes the first connection that says Hello,
// then stops listening and removes the socket: a sidecar caught by idle_exit
// between a connect (a probe's, which says nothing, passes) and its handshake.
func goingAway(t *testing.T, sock string) <-chan struct{} {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(sock), 0o700); err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer l.Close() // removes the socket
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
			n, _ := c.Read(make([]byte, 1))
			c.Close()
			if n > 0 {
				return
			}
		}
	}()
	return done
}

// idle_exit raced a new connect: the probe got into the backlog of a listener that
// was closing, and the caller got "broken pipe" / "connection reset by peer".
func TestAutostartTakesAConnectionClosedByAnExitingSidecarForNone(t *testing.T) {
	dir, sock := autostartEnv(t)
	quickIdle(t)
	done := goingAway(t, sock)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	c, err := DialOptions(ctx, sock, Options{Autostart: true})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	<-done
	if _, err := c.Status(ctx); err != nil {
		t.Fatal(err)
	}
	if n := len(starts(dir)); n != 1 {
		t.Fatalf("started %d times, want 1", n)
	}
}

// The autostarted sidecar sent READY=1 / STOPPING=1 to the caller's NOTIFY_SOCKET.
func TestAutostartSidecarDoesNotGetTheCallersServiceManagerVariables(t *testing.T) {
	dir, sock := autostartEnv(t)
	notify := filepath.Join(dir, "notify")
	recv, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: notify, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	defer recv.Close()
	manager := map[string]string{"NOTIFY_SOCKET": notify, "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": fmt.Sprint(os.Getpid()),
		"LISTEN_FDS": "1", "LISTEN_PID": fmt.Sprint(os.Getpid()), "LISTEN_FDNAMES": "x"}
	for k, v := range manager {
		t.Setenv(k, v)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	c, err := DialOptions(ctx, sock, Options{Autostart: true})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	environ, err := os.ReadFile(fmt.Sprintf("/proc/%d/environ", lastStart(t, dir)))
	if err != nil {
		t.Fatal(err)
	}
	for _, kv := range strings.Split(string(environ), "\x00") {
		if k, _, _ := strings.Cut(kv, "="); manager[k] != "" {
			t.Errorf("the sidecar got the caller's %s", kv)
		}
	}
	_ = recv.SetReadDeadline(time.Now().Add(1500 * time.Millisecond))
	if n, err := recv.Read(make([]byte, 4096)); err == nil {
		t.Errorf("the sidecar notified the caller's service manager (%d bytes)", n)
	}
	for k, v := range manager {
		if os.Getenv(k) != v {
			t.Errorf("the caller's own %s changed", k)
		}
	}
}

// A relative path whose absolute form is over 107 bytes skipped autostart and
// reported ENOENT; a long absolute path said only "connect: invalid argument".
func TestAutostartNamesASocketPathTooLongForSunPath(t *testing.T) {
	dir, _ := autostartEnv(t)
	deep := filepath.Join(dir, strings.Repeat("d", 60), strings.Repeat("e", 60))
	if err := os.MkdirAll(deep, 0o700); err != nil {
		t.Fatal(err)
	}
	wd, _ := os.Getwd()
	if err := os.Chdir(deep); err != nil {
		t.Fatal(err)
	}
	defer os.Chdir(wd)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, p := range []string{"s.sock", filepath.Join(deep, "s.sock")} {
		for _, auto := range []bool{true, false} {
			_, err := DialOptions(ctx, p, Options{Autostart: auto})
			if err == nil || !strings.Contains(err.Error(), "107") {
				if p == "s.sock" && !auto {
					continue // a short relative path: only ENOENT, as any missing socket
				}
				t.Errorf("%s (autostart %v): want the 107-byte limit named, got %v", p, auto, err)
			} else if !strings.Contains(err.Error(), filepath.Join(deep, "s.sock")) && !strings.Contains(err.Error(), p) {
				t.Errorf("%s: the path is not named: %v", p, err)
			}
		}
	}
	if n := len(starts(dir)); n != 0 {
		t.Fatalf("started %d times", n)
	}
}

// A sidecar killed by a signal before listening was reported as "status -1".
func TestAutostartNamesTheSignalThatKilledTheSidecar(t *testing.T) {
	dir, sock := autostartEnv(t)
	crash := filepath.Join(dir, "crash")
	if err := os.WriteFile(crash, []byte("#!/bin/sh\necho about to crash >&2\nkill -SEGV $$\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Setenv(SidecarEnv, crash)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err := DialOptions(ctx, sock, Options{Autostart: true})
	if err == nil || !strings.Contains(err.Error(), "killed by signal 11 (SIGSEGV)") || !strings.Contains(err.Error(), "about to crash") {
		t.Fatalf("want the signal named and the log's lines, got %v", err)
	}
}
