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
	"os"
	"path/filepath"
	"strings"
	"sync"
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
