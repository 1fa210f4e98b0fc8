package polygate_test

// These examples run under `go test` against an in-process fake sidecar (scope
// "chat" with sources "openai-gpt4o" and "azure-gpt4o"), found through
// $POLYGATE_SOCKET exactly as they would find the real one.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"strings"
	"time"

	polygate "github.com/polygate/polygate/bindings/go"
)

type upstreamReply struct {
	Text        string
	TotalTokens int
}

// callUpstream stands in for an LLM request; the first source times out.
func callUpstream(ctx context.Context, source string) (upstreamReply, error) {
	if source == "openai-gpt4o" {
		return upstreamReply{}, context.DeadlineExceeded
	}
	return upstreamReply{Text: "hello from " + source, TotalTokens: 812}, nil
}

// Run does the whole call: acquire, call, classify the error, report, fail over,
// end.
func Example() {
	ctx := context.Background()
	c, err := polygate.Dial(ctx, "") // "" → $POLYGATE_SOCKET → /run/polygate/sidecar.sock
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()

	var reply upstreamReply
	err = c.Run(ctx, "chat", polygate.CallOptions{EstTokens: 1200}, func(ctx context.Context, p *polygate.Permit) error {
		r, err := callUpstream(ctx, p.Source)
		if err != nil {
			fmt.Printf("attempt %d on %s: %v\n", p.Attempt, p.Source, err)
			return err // a timeout: reported, and the next attempt fails over
		}
		p.SetTokens(r.TotalTokens)
		reply = r
		return nil
	})
	var co *polygate.CircuitOpenError
	if errors.As(err, &co) {
		log.Fatalf("every circuit is open; retry the job in %v", co.RetryAfter)
	} else if err != nil {
		log.Fatal(err)
	}
	fmt.Println(reply.Text)
	// Output:
	// attempt 1 on openai-gpt4o: context deadline exceeded
	// hello from azure-gpt4o
}

// The low-level loop: Begin, Acquire and report until done, End on every path.
func ExampleClient_Begin() {
	ctx := context.Background()
	c, err := polygate.Dial(ctx, "")
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()

	call, err := c.Begin(ctx, "chat", polygate.CallOptions{EstTokens: 1200})
	if err != nil {
		log.Fatal(err)
	}
	defer call.End(context.Background())
	for {
		p, err := call.Acquire(ctx) // blocks in wait mode; ctx cancel sends Cancel
		if err != nil {
			log.Fatal(err) // *CircuitOpenError / *AllSourcesExhaustedError: final for the call
		}
		reply, err := callUpstream(ctx, p.Source)
		if err != nil {
			p.Failure(ctx, polygate.Timeout) // travels with the next Acquire
			continue
		}
		if err := p.Success(ctx, reply.TotalTokens); err != nil {
			log.Fatal(err)
		}
		res, _ := p.Result()
		fmt.Println(reply.Text, "- breaker", res.State)
		return
	}
	// Output: hello from azure-gpt4o - breaker closed
}

// An upstream reached with net/http: ResponseError turns a status >= 400 into an
// error Run classifies (429 with its Retry-After → rate limited, 5xx → server
// error, other 4xx → returned at once).
func ExampleResponseError() {
	hits := 0
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if hits++; hits == 1 {
			w.Header().Set("Retry-After", "2")
			http.Error(w, "slow down", http.StatusTooManyRequests)
			return
		}
		fmt.Fprint(w, "ok")
	}))
	defer upstream.Close()

	ctx := context.Background()
	c, err := polygate.Dial(ctx, "")
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	err = c.Run(ctx, "embedding", polygate.CallOptions{}, func(ctx context.Context, p *polygate.Permit) error {
		req, _ := http.NewRequestWithContext(ctx, "POST", upstream.URL+"/"+p.Source, nil)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		if resp.StatusCode >= 400 {
			e := polygate.ResponseError(resp)
			fmt.Println("attempt", p.Attempt, "→", e.StatusCode, "retry after", e.RetryAfter())
			return e
		}
		fmt.Println("attempt", p.Attempt, "→", resp.StatusCode)
		return nil
	})
	fmt.Println("err:", err)
	// Output:
	// attempt 1 → 429 retry after 2s
	// attempt 2 → 200
	// err: <nil>
}

// Status reports every scope and source; unknown keys of newer sidecars are kept.
func ExampleClient_Status() {
	ctx := context.Background()
	c, err := polygate.Dial(ctx, "")
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	st, err := c.Status(ctx)
	if err != nil {
		log.Fatal(err)
	}
	for _, src := range st.Scope("chat").Sources {
		fmt.Println(src.Name, src.State, src.InFlight)
	}
	// Output:
	// openai-gpt4o closed 0
	// azure-gpt4o closed 0
}

// Gateway errors are final for the call; RetryAfter says when re-submitting the
// job is certainly worth it.
func ExampleCircuitOpenError() {
	ctx := context.Background()
	c, err := polygate.Dial(ctx, "")
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	c.ForceOpen(ctx, "openai-embed", time.Minute) // admin: needs a uid in admin_uids
	defer c.ForceClose(ctx, "openai-embed")

	err = c.Run(ctx, "embedding", polygate.CallOptions{}, func(ctx context.Context, p *polygate.Permit) error {
		return nil
	})
	var co *polygate.CircuitOpenError
	var gu *polygate.GatewayUnavailableError
	fmt.Println(errors.As(err, &co), errors.As(err, &gu), co.PerSourceReasons, co.RetryAfter > 59*time.Second)
	// Output: true true map[openai-embed:circuit_open] true
}

// Transport gates every request of an http.Client (DESIGN §17): install it where
// the client is built (openai-go: option.WithHTTPClient(hc)); the call sites stay
// as they are. Routes sends each request to the granted source's deployment with
// that source's headers.
func ExampleTransport() {
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"key":%q,"usage":{"prompt_tokens":12,"completion_tokens":6,"total_tokens":18}}`, r.Header.Get("Api-Key"))
	}))
	defer upstream.Close()

	hc := &http.Client{Transport: &polygate.Transport{
		Scope: "chat", // $POLYGATE_SOCKET, else the default socket
		Routes: map[string]polygate.Route{
			"openai-gpt4o": {BaseURL: upstream.URL, Headers: map[string]string{"Api-Key": "key-openai"}},
			"azure-gpt4o":  {BaseURL: upstream.URL, Headers: map[string]string{"Api-Key": "key-azure"}},
		},
	}}
	resp, err := hc.Post("https://api.openai.com/v1/chat/completions", "application/json",
		strings.NewReader(`{"model":"gpt-4o","max_tokens":200,"messages":[]}`))
	if err != nil {
		log.Fatal(err) // *CircuitOpenError etc. only with OnRefusal: RefuseWithError
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	fmt.Println(resp.StatusCode, string(b))
	// Output: 200 {"key":"key-openai","usage":{"prompt_tokens":12,"completion_tokens":6,"total_tokens":18}}
}
