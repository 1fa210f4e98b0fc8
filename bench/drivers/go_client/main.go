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
//
// -mode transport (DESIGN §17 goals): the same concurrency of requests to a local fake
// upstream (this program with -serve, a child process, so its CPU is not counted),
// with a plain http.Client, through polygate.Transport, and inside Client.Run; prints
// the CPU (this process's user + system) and p50 per request of each, and the
// transport's overhead (gated − plain) over Run's (run − plain):
//
//	{"lang":"go","mode":"transport",...,"overhead_cpu_us":...,"run_overhead_cpu_us":...,"overhead_ratio":...}
//
// -mode stream: one stream of -chunks SSE events (sent -gap-ms apart, so each is its
// own read as a model's tokens are) at a time, read whole, plain and gated
// alternating for -seconds; prints the CPU per stream of each and cpu_ratio.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
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
	mode := flag.String("mode", "calls", "calls | transport | stream")
	chunks := flag.Int("chunks", 1000, "SSE events per stream (-mode stream)")
	gapMs := flag.Float64("gap-ms", 1, "milliseconds between SSE events (-mode stream)")
	serve := flag.Bool("serve", false, "be the fake upstream: print the port, serve until killed")
	flag.Parse()
	if *serve {
		fakeUpstream(*chunks, time.Duration(*gapMs*float64(time.Millisecond)))
		return
	}
	if *mode == "transport" || *mode == "stream" {
		line, err := transportBench(*mode, *socket, *scope, *concurrency, time.Duration(*seconds*float64(time.Second)), *chunks, *gapMs)
		if err != nil {
			fmt.Fprintln(os.Stderr, "go_client:", err)
			os.Exit(1)
		}
		out, _ := json.Marshal(line)
		fmt.Println(string(out))
		return
	}
	if *mode != "calls" {
		fmt.Fprintln(os.Stderr, "go_client: -mode must be calls, transport or stream")
		os.Exit(2)
	}
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

// fakeUpstream serves POST /json (a chat completion with usage) and POST /stream
// (chunks SSE events, gap apart, then a usage chunk) on a free port it prints.
func fakeUpstream(chunks int, gap time.Duration) {
	usage := `{"prompt_tokens":12,"completion_tokens":6,"total_tokens":18}`
	body := `{"id":"c1","object":"chat.completion","created":0,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"hello"},"finish_reason":"stop"}],"usage":` + usage + `}`
	ev := `data: {"id":"s1","object":"chat.completion.chunk","created":0,"model":"m","choices":[{"index":0,"delta":{"content":"tok "},"finish_reason":null}],"usage":null}` + "\n\n"
	last := `data: {"id":"s1","object":"chat.completion.chunk","created":0,"model":"m","choices":[],"usage":` + usage + "}\n\ndata: [DONE]\n\n"
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fmt.Fprintln(os.Stderr, "go_client -serve:", err)
		os.Exit(1)
	}
	fmt.Println(ln.Addr().(*net.TCPAddr).Port)
	http.Serve(ln, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		if r.URL.Path != "/stream" {
			w.Header().Set("Content-Type", "application/json")
			io.WriteString(w, body)
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		fl := w.(http.Flusher)
		for i := 0; i < chunks; i++ {
			io.WriteString(w, ev)
			fl.Flush()
			if gap > 0 {
				time.Sleep(gap)
			}
		}
		io.WriteString(w, last)
	}))
}

// cpuNow is this process's user + system CPU time.
func cpuNow() time.Duration {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

type measured struct {
	n   int
	p50 float64
	cpu float64 // µs per operation
}

// measure runs op from n goroutines for d (after a warm-up of d/10, at most 1 s).
func measure(n int, d time.Duration, op func() error) (measured, error) {
	var stop, counting atomic.Bool
	var firstErr atomic.Pointer[error]
	var wg sync.WaitGroup
	lat := make([][]float64, n)
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			for !stop.Load() {
				t0 := time.Now()
				if err := op(); err != nil {
					firstErr.CompareAndSwap(nil, &err)
					stop.Store(true)
					return
				}
				if counting.Load() {
					lat[i] = append(lat[i], float64(time.Since(t0).Nanoseconds())/1e3)
				}
			}
		}(i)
	}
	time.Sleep(min(d/10, time.Second))
	c0 := cpuNow()
	counting.Store(true)
	time.Sleep(d)
	counting.Store(false)
	cpu := cpuNow() - c0
	stop.Store(true)
	wg.Wait()
	if e := firstErr.Load(); e != nil {
		return measured{}, *e
	}
	var all []float64
	for _, l := range lat {
		all = append(all, l...)
	}
	if len(all) == 0 {
		return measured{}, fmt.Errorf("no operation completed in %v", d)
	}
	sort.Float64s(all)
	return measured{n: len(all), p50: all[len(all)/2], cpu: float64(cpu.Microseconds()) / float64(len(all))}, nil
}

func round(x float64, d int) float64 {
	p := 1.0
	for i := 0; i < d; i++ {
		p *= 10
	}
	return float64(int64(x*p+0.5)) / p
}

func transportBench(mode, socket, scope string, n int, d time.Duration, chunks int, gapMs float64) (map[string]any, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	srv := exec.Command(self, "-serve", "-chunks", fmt.Sprint(chunks), "-gap-ms", fmt.Sprint(gapMs))
	srv.Stderr = os.Stderr
	out, err := srv.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := srv.Start(); err != nil {
		return nil, err
	}
	defer func() {
		srv.Process.Kill()
		srv.Wait()
	}()
	port, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		return nil, fmt.Errorf("the fake upstream printed no port: %v", err)
	}
	base := "http://127.0.0.1:" + strings.TrimSpace(port)

	ctx := context.Background()
	c, err := polygate.Dial(ctx, socket)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	newBase := func() *http.Transport {
		t := http.DefaultTransport.(*http.Transport).Clone()
		t.MaxIdleConnsPerHost = n + 1
		return t
	}
	plain := &http.Client{Transport: newBase()}
	gated := &http.Client{Transport: &polygate.Transport{Base: newBase(), Client: c, Scope: scope}}
	body := `{"model":"m","max_tokens":10,"messages":[{"role":"user","content":"hello"}]}`
	request := func(hc *http.Client, path string) (int, error) {
		resp, err := hc.Post(base+path, "application/json", strings.NewReader(body))
		if err != nil {
			return 0, err
		}
		defer resp.Body.Close()
		if resp.StatusCode != 200 {
			return 0, fmt.Errorf("upstream answered %s", resp.Status)
		}
		k, err := io.Copy(io.Discard, resp.Body)
		return int(k), err
	}
	if mode == "transport" {
		p, err := measure(n, d, func() error { _, err := request(plain, "/json"); return err })
		if err != nil {
			return nil, err
		}
		g, err := measure(n, d, func() error { _, err := request(gated, "/json"); return err })
		if err != nil {
			return nil, err
		}
		// The same request inside Run: what gating it by hand costs.
		r, err := measure(n, d, func() error {
			return c.Run(ctx, scope, polygate.CallOptions{}, func(ctx context.Context, _ *polygate.Permit) error {
				_, err := request(plain, "/json")
				return err
			})
		})
		if err != nil {
			return nil, err
		}
		return map[string]any{
			"lang": "go", "mode": mode, "concurrency": n,
			"plain_p50_us": round(p.p50, 1), "gated_p50_us": round(g.p50, 1), "run_p50_us": round(r.p50, 1),
			"plain_cpu_us": round(p.cpu, 2), "gated_cpu_us": round(g.cpu, 2), "run_cpu_us": round(r.cpu, 2),
			"overhead_cpu_us": round(g.cpu-p.cpu, 2), "run_overhead_cpu_us": round(r.cpu-p.cpu, 2),
			"overhead_ratio": round((g.cpu-p.cpu)/(r.cpu-p.cpu), 3),
		}, nil
	}
	// Streams: plain and gated alternate one at a time, the order flipping every
	// round, so a change in the machine's load hits both alike.
	var cpuP, cpuG time.Duration
	rounds := 0
	one := func(hc *http.Client) (time.Duration, error) {
		c0 := cpuNow()
		k, err := request(hc, "/stream")
		if err == nil && k < chunks*50 {
			err = fmt.Errorf("short stream: %d bytes", k)
		}
		return cpuNow() - c0, err
	}
	if _, err := one(gated); err != nil {
		return nil, err
	}
	for stopAt := time.Now().Add(d); time.Now().Before(stopAt); rounds++ {
		order := []*http.Client{plain, gated}
		if rounds%2 == 1 {
			order = []*http.Client{gated, plain}
		}
		for _, hc := range order {
			t, err := one(hc)
			if err != nil {
				return nil, err
			}
			if hc == plain {
				cpuP += t
			} else {
				cpuG += t
			}
		}
	}
	p := float64(cpuP.Microseconds()) / float64(rounds)
	g := float64(cpuG.Microseconds()) / float64(rounds)
	return map[string]any{
		"lang": "go", "mode": mode, "chunks": chunks, "concurrency": 1, "streams": rounds,
		"plain_cpu_us_per_stream": round(p, 0), "gated_cpu_us_per_stream": round(g, 0), "cpu_ratio": round(g/p, 3),
	}, nil
}
