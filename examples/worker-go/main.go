// Command worker-go is the README's Go quick start, runnable as written: start the
// sidecar first (`cargo run --release -p polygate-sidecar`), then
// `go run ./examples/worker-go`. The upstream is simulated: 20% of requests time
// out, so you can watch failover, and Status shows the breaker, pacer and quota
// state that results.
package main

import (
	"context"
	"fmt"
	"log"
	"math/rand"
	"time"

	polygate "github.com/polygate/polygate/bindings/go"
)

type reply struct {
	Text        string
	TotalTokens int
}

// doRequest stands in for your upstream call (OpenAI, Azure, vLLM, …).
func doRequest(ctx context.Context, source string) (reply, error) {
	if rand.Float64() < 0.2 {
		return reply{}, fmt.Errorf("%s: %w", source, context.DeadlineExceeded) // classified as a timeout
	}
	return reply{Text: "hello from " + source, TotalTokens: 200 + rand.Intn(700)}, nil
}

func main() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	c, err := polygate.Dial(ctx, "") // "" → $POLYGATE_SOCKET → the default for this uid
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()

	var out reply
	err = c.Run(ctx, "chat", polygate.CallOptions{EstTokens: 1200}, func(ctx context.Context, p *polygate.Permit) error {
		r, err := doRequest(ctx, p.Source)
		if err != nil {
			return err // reported as a timeout; Run fails over (failed sources go last)
		}
		p.SetTokens(r.TotalTokens)
		out = r
		return nil
	})
	if err != nil {
		log.Fatal(err) // *polygate.CircuitOpenError, *polygate.AllSourcesExhaustedError, ...
	}
	fmt.Println(out.Text)

	st, err := c.Status(ctx)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(st.Scope("chat").Source("openai-gpt4o").State)
}
