package polygate

import (
	"fmt"
	"os"
	"testing"
)

// TestMain gives the Example functions a sidecar to talk to: an in-process fake
// with the README's scope, found through $POLYGATE_SOCKET exactly as a worker
// finds the real one.
func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "pg-go-example-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	s, err := newFake(dir,
		&fakeScope{name: "chat", sources: []string{"openai-gpt4o", "azure-gpt4o"}},
		&fakeScope{name: "embedding", sources: []string{"openai-embed"}},
	)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	os.Setenv(SocketEnv, s.path)
	code := m.Run()
	s.close()
	os.RemoveAll(dir)
	os.Exit(code)
}
