// Command go_client is the Go driver of the PolyGate bench tool: N goroutines on
// one Client (one connection) make full success calls — Start, then Finish: two
// round trips — for S seconds, and it prints ONE JSON line:
//
//	{"lang":"go","concurrency":64,"calls":...,"seconds":...,"calls_per_s":...,"call_p50_us":...,"call_p99_us":...}
//
// Usage:
//
//	go run ./bench/drivers/go_client -socket /tmp/pg.sock -concurrency 64 -seconds 5 -scope chat [-est-tokens 100]
//
// A warm-up (a tenth of the run, at most 1 s) runs first and is not counted. Any
// error aborts the run with exit status 1: a bench of failing calls measures
// nothing.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	polygate "github.com/polygate/polygate/bindings/go"
)

type result struct {
	Lang        string  `json:"lang"`
	Concurrency int     `json:"concurrency"`
	Calls       int     `json:"calls"`
	Seconds     float64 `json:"seconds"`
	CallsPerS   float64 `json:"calls_per_s"`
	CallP50Us   float64 `json:"call_p50_us"`
	CallP99Us   float64 `json:"call_p99_us"`
}

func main() {
	socket := flag.String("socket", "", "sidecar socket (default $POLYGATE_SOCKET, else /run/polygate/sidecar.sock)")
	concurrency := flag.Int("concurrency", 64, "goroutines making calls on the one client")
	seconds := flag.Float64("seconds", 5, "measured duration")
	scope := flag.String("scope", "chat", "scope to call in")
	estTokens := flag.Int("est-tokens", 0, "per-call token estimate (0 = the source's default)")
	flag.Parse()
	if *concurrency < 1 || *seconds <= 0 {
		fmt.Fprintln(os.Stderr, "go_client: -concurrency must be >= 1 and -seconds > 0")
		os.Exit(2)
	}
	res, err := run(*socket, *scope, *concurrency, time.Duration(*seconds*float64(time.Second)), *estTokens)
	if err != nil {
		fmt.Fprintln(os.Stderr, "go_client:", err)
		os.Exit(1)
	}
	line, _ := json.Marshal(res)
	fmt.Println(string(line))
}

// oneCall is a full success call: Start (Acquire), Finish (Success).
func oneCall(ctx context.Context, c *polygate.Client, scope string, opts polygate.CallOptions) error {
	call, err := c.Begin(ctx, scope, opts)
	if err != nil {
		return err
	}
	defer call.End(ctx)
	p, err := call.Acquire(ctx)
	if err != nil {
		return err
	}
	return p.Success(ctx, 1)
}

func run(socket, scope string, n int, measure time.Duration, estTokens int) (*result, error) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	c, err := polygate.Dial(ctx, socket)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	opts := polygate.CallOptions{EstTokens: estTokens}
	if err := oneCall(ctx, c, scope, opts); err != nil {
		return nil, err
	}
	warm := min(measure/10, time.Second)

	var (
		counting atomic.Bool
		stop     atomic.Bool
		firstErr atomic.Pointer[error]
		wg       sync.WaitGroup
	)
	lat := make([][]float64, n)
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			samples := make([]float64, 0, 1<<14)
			for !stop.Load() {
				t0 := time.Now()
				if err := oneCall(ctx, c, scope, opts); err != nil {
					firstErr.CompareAndSwap(nil, &err)
					stop.Store(true)
					break
				}
				if counting.Load() {
					samples = append(samples, float64(time.Since(t0).Nanoseconds())/1e3)
				}
			}
			lat[i] = samples
		}(i)
	}
	time.Sleep(warm)
	counting.Store(true)
	t0 := time.Now()
	time.Sleep(measure)
	counting.Store(false)
	elapsed := time.Since(t0)
	stop.Store(true)
	wg.Wait()
	if e := firstErr.Load(); e != nil {
		return nil, *e
	}

	var all []float64
	for _, s := range lat {
		all = append(all, s...)
	}
	sort.Float64s(all)
	pct := func(q float64) float64 {
		if len(all) == 0 {
			return 0
		}
		return all[min(len(all)-1, int(q*float64(len(all))))]
	}
	return &result{
		Lang:        "go",
		Concurrency: n,
		Calls:       len(all),
		Seconds:     elapsed.Seconds(),
		CallsPerS:   float64(len(all)) / elapsed.Seconds(),
		CallP50Us:   pct(0.50),
		CallP99Us:   pct(0.99),
	}, nil
}
