package polygate

// The transport conformance scenarios (DESIGN §17, bindings/conformance/README.md
// "Transport scenarios") played by Transport against the real daemon and one fake
// upstream (httptest) per name in "upstreams", through a plain http.Client.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"reflect"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"
)

type transportScenario struct {
	Name        string   `json:"name"`
	Description string   `json:"description"`
	Backends    []string `json:"backends"`
	TimeoutS    float64  `json:"timeout_s"`
	Config      string   `json:"config"`
	Upstreams   []string `json:"upstreams"`
	Transport   struct {
		Scope    string `json:"scope"`
		Upstream string `json:"upstream"`
		BasePath string `json:"base_path"`
		Routes   map[string]struct {
			Upstream string            `json:"upstream"`
			Path     string            `json:"path"`
			Headers  map[string]string `json:"headers"`
			Query    map[string]string `json:"query"`
			Model    string            `json:"model"`
		} `json:"routes"`
		OnRefusal string `json:"on_refusal"`
		Tenant    string `json:"tenant"`
	} `json:"transport"`
	Steps []map[string]any `json:"steps"`
}

var transportScenarioDir = filepath.Join("..", "conformance", "transport")

var transportStepFields = map[string][2][]string{
	"respond":       {{"upstream", "status"}, {"headers", "json", "sse", "body", "delay_s", "times"}},
	"request":       {{"method", "path"}, {"json", "headers", "stream", "read_events", "expect"}},
	"upstream_hits": {{"upstream", "expect"}, {"header", "header_absent", "path", "json_subset"}},
	"status":        {{"expect"}, nil},
	"sleep":         {{"seconds"}, nil},
}

var transportExpectKeys = []string{"status", "headers", "retry_after_range", "json_subset", "body_unchanged", "error"}

func loadTransportScenarios(t *testing.T) []*transportScenario {
	t.Helper()
	files, _ := filepath.Glob(filepath.Join(transportScenarioDir, "*.json"))
	if len(files) == 0 {
		t.Fatalf("no transport conformance scenarios in %s", transportScenarioDir)
	}
	sort.Strings(files)
	var out []*transportScenario
	for _, f := range files {
		raw, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		sc := &transportScenario{}
		d := json.NewDecoder(bytes.NewReader(raw))
		d.UseNumber()
		d.DisallowUnknownFields()
		if err := d.Decode(sc); err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		if sc.Name+".json" != filepath.Base(f) {
			t.Fatalf("%s: name %q must match the file name", f, sc.Name)
		}
		out = append(out, sc)
	}
	return out
}

func TestTransportConformance(t *testing.T) {
	for _, sc := range loadTransportScenarios(t) {
		backends := sc.Backends
		if len(backends) == 0 {
			backends = []string{"memory"}
		}
		for _, backend := range backends {
			t.Run(sc.Name+"/"+backend, func(t *testing.T) {
				d := startSidecar(t, sc.Config, backend)
				c := d.dial(t)
				ups := map[string]*fakeUpstream{}
				for _, n := range sc.Upstreams {
					ups[n] = startUpstream(t)
				}
				limit := time.Duration(sc.TimeoutS * float64(time.Second))
				if limit == 0 {
					limit = 30 * time.Second
				}
				ctx, cancel := context.WithTimeout(context.Background(), limit)
				defer cancel()
				label := fmt.Sprintf("transport scenario %s [%s]", sc.Name, backend)
				done := make(chan error, 1)
				go func() { done <- playTransport(ctx, sc, c, ups, label) }()
				select {
				case err := <-done:
					if err != nil {
						t.Fatalf("%v\nsidecar output:\n%s", err, d.out)
					}
				case <-time.After(limit + 5*time.Second):
					t.Fatalf("%s: exceeded its time limit of %v", label, limit)
				}
			})
		}
	}
}

// jsonSubset: objects by their listed keys (recursively), anything else exactly.
func jsonSubset(want, got any, where string) error {
	if w, ok := want.(map[string]any); ok {
		g, ok := got.(map[string]any)
		if !ok {
			return fmt.Errorf("%s: expected an object, got %#v", where, got)
		}
		for _, k := range keysOf(w) {
			gv, ok := g[k]
			if !ok {
				return fmt.Errorf("%s: key %q missing in %v", where, k, g)
			}
			if err := jsonSubset(w[k], gv, where+"."+k); err != nil {
				return err
			}
		}
		return nil
	}
	if isNumber(want) && isNumber(got) {
		if num(want) != num(got) {
			return fmt.Errorf("%s: expected %v, got %v", where, want, got)
		}
		return nil
	}
	if !reflect.DeepEqual(want, got) {
		return fmt.Errorf("%s: expected %#v, got %#v", where, want, got)
	}
	return nil
}

func headerSubset(want any, got http.Header, where string) error {
	w, _ := want.(map[string]any)
	for k, v := range w {
		if g := strings.Join(got.Values(k), ", "); g != str(v) {
			return fmt.Errorf("%s: header %s is %q, expected %v", where, k, g, v)
		}
	}
	return nil
}

func checkTransportError(wantAny any, err error, where string) error {
	want, _ := wantAny.(map[string]any)
	if kerr := checkKeys(want, []string{"kind", "reason", "message_contains"}, where+".expect.error"); kerr != nil {
		return kerr
	}
	var co *CircuitOpenError
	var ex *AllSourcesExhaustedError
	var rm *RouteMissingError
	var te *TenantLimitError
	ok := false
	switch k := str(want["kind"]); k {
	case "CircuitOpen":
		ok = errors.As(err, &co)
	case "AllSourcesExhausted":
		ok = errors.As(err, &ex)
	case "RouteMissing":
		ok = errors.As(err, &rm)
	case "TenantLimited":
		ok = errors.As(err, &te)
	default:
		return fmt.Errorf("%s: unknown error kind %q", where, k)
	}
	if !ok {
		return fmt.Errorf("%s: expected %v, got %T: %v", where, want["kind"], err, err)
	}
	if r, has := want["reason"]; has && (ex == nil || ex.Reason != str(r)) {
		return fmt.Errorf("%s: reason of %v, expected %v", where, err, r)
	}
	if mc, has := want["message_contains"]; has && !strings.Contains(err.Error(), str(mc)) {
		return fmt.Errorf("%s: message %q lacks %q", where, err.Error(), mc)
	}
	return nil
}

// readEvents reads body whole, or until n SSE events were seen, then closes it.
func readEvents(body io.ReadCloser, n int) ([]byte, error) {
	defer body.Close()
	if n <= 0 {
		return io.ReadAll(body)
	}
	var got []byte
	buf := make([]byte, 4096)
	for bytes.Count(got, []byte("\n\n")) < n {
		k, err := body.Read(buf)
		got = append(got, buf[:k]...)
		if err == io.EOF {
			return got, nil
		}
		if err != nil {
			return got, err
		}
	}
	return got, nil
}

func playTransport(ctx context.Context, sc *transportScenario, c *Client, ups map[string]*fakeUpstream, label string) error {
	up := func(name any, where string) (*fakeUpstream, error) {
		u, ok := ups[str(name)]
		if !ok {
			return nil, fmt.Errorf("%s: upstream %v is not in \"upstreams\"", where, name)
		}
		return u, nil
	}
	tr := &Transport{Client: c, Scope: sc.Transport.Scope, Tenant: sc.Transport.Tenant}
	switch sc.Transport.OnRefusal {
	case "", "response":
	case "raise":
		tr.OnRefusal = RefuseWithError
	default:
		return fmt.Errorf("%s: unknown on_refusal %q", label, sc.Transport.OnRefusal)
	}
	if sc.Transport.Routes != nil {
		tr.Routes = map[string]Route{}
		for src, r := range sc.Transport.Routes {
			u, err := up(r.Upstream, label+" routes")
			if err != nil {
				return err
			}
			tr.Routes[src] = Route{BaseURL: u.URL() + r.Path, Headers: r.Headers, Query: r.Query, Model: r.Model}
		}
	}
	base, err := up(sc.Transport.Upstream, label+" transport")
	if err != nil {
		return err
	}
	hc := &http.Client{Transport: tr}

	for i, st := range sc.Steps {
		op := str(st["op"])
		where := fmt.Sprintf("%s step %d (%s)", label, i, op)
		fields, known := transportStepFields[op]
		if !known {
			return fmt.Errorf("%s: unknown op %q", where, op)
		}
		for _, k := range fields[0] {
			if _, ok := st[k]; !ok {
				return fmt.Errorf("%s: missing field %q", where, k)
			}
		}
		if err := checkKeys(st, append(append([]string{"op"}, fields[0]...), fields[1]...), where); err != nil {
			return err
		}
		switch op {
		case "respond":
			u, err := up(st["upstream"], where)
			if err != nil {
				return err
			}
			cn := canned{status: int(num(st["status"]))}
			if h, ok := st["headers"].(map[string]any); ok {
				cn.headers = map[string]string{}
				for k, v := range h {
					cn.headers[strings.ToLower(k)] = str(v)
				}
			}
			if j, ok := st["json"]; ok {
				cn.body, _ = json.Marshal(j)
			}
			if b, ok := st["body"]; ok {
				cn.body = []byte(str(b))
				if cn.headers["content-type"] == "" {
					if cn.headers == nil {
						cn.headers = map[string]string{}
					}
					cn.headers["content-type"] = "text/plain"
				}
			}
			if ev, ok := st["sse"].([]any); ok {
				cn.sse = []string{}
				for _, e := range ev {
					cn.sse = append(cn.sse, str(e))
				}
			}
			if d, ok := st["delay_s"]; ok {
				cn.delay = time.Duration(num(d) * float64(time.Second))
			}
			times := 1
			if n, ok := st["times"]; ok {
				times = int(num(n))
			}
			u.respond(cn, times)
		case "request":
			expect, _ := st["expect"].(map[string]any)
			if err := checkKeys(expect, transportExpectKeys, where+".expect"); err != nil {
				return err
			}
			before := map[string][2]int{}
			for n, u := range ups {
				before[n] = [2]int{u.hitCount(), u.sentCount()}
			}
			var body io.Reader
			if j, ok := st["json"]; ok {
				b, _ := json.Marshal(j)
				body = bytes.NewReader(b)
			}
			req, err := http.NewRequestWithContext(ctx, str(st["method"]), base.URL()+sc.Transport.BasePath+str(st["path"]), body)
			if err != nil {
				return err
			}
			if body != nil {
				req.Header.Set("Content-Type", "application/json")
			}
			if h, ok := st["headers"]; ok {
				hm, ok := h.(map[string]any)
				if !ok {
					return fmt.Errorf("%s: headers must be an object, got %#v", where, h)
				}
				for k, v := range hm {
					req.Header.Set(k, str(v))
				}
			}
			sentHeader := req.Header.Clone()
			resp, err := hc.Do(req)
			// RoundTrip must not modify the caller's request (the tenant header
			// stays on it, though it is not sent).
			if !reflect.DeepEqual(req.Header, sentHeader) {
				if resp != nil {
					resp.Body.Close()
				}
				return fmt.Errorf("%s: the transport changed the caller's request headers: %v, sent %v", where, req.Header, sentHeader)
			}
			if err != nil {
				if expect["error"] == nil {
					return fmt.Errorf("%s: the request failed: %v", where, err)
				}
				if err := checkTransportError(expect["error"], err, where); err != nil {
					return err
				}
				continue
			}
			if expect["error"] != nil {
				resp.Body.Close()
				return fmt.Errorf("%s: expected an error %v, got status %d", where, expect["error"], resp.StatusCode)
			}
			n := 0
			if st["stream"] == true {
				if v, ok := st["read_events"]; ok {
					n = int(num(v))
				}
			}
			got, err := readEvents(resp.Body, n)
			if err != nil {
				return fmt.Errorf("%s: reading the body: %v", where, err)
			}
			if s, ok := expect["status"]; ok && float64(resp.StatusCode) != num(s) {
				return fmt.Errorf("%s: status %d, expected %v; body %.300s", where, resp.StatusCode, s, got)
			}
			if h, ok := expect["headers"]; ok {
				if err := headerSubset(h, resp.Header, where); err != nil {
					return err
				}
			}
			if r, ok := expect["retry_after_range"].([]any); ok {
				ra := resp.Header.Get("Retry-After")
				v, perr := strconv.ParseFloat(ra, 64)
				if perr != nil || len(r) != 2 || v < num(r[0]) || v > num(r[1]) {
					return fmt.Errorf("%s: Retry-After %q is not a number within %v", where, ra, r)
				}
			}
			if js, ok := expect["json_subset"]; ok {
				d := json.NewDecoder(bytes.NewReader(got))
				d.UseNumber()
				var doc any
				if err := d.Decode(&doc); err != nil {
					return fmt.Errorf("%s: the body is not JSON: %.300s", where, got)
				}
				if err := jsonSubset(js, doc, where+".json"); err != nil {
					return err
				}
			}
			if expect["body_unchanged"] == true {
				var answered []*fakeUpstream
				for n, u := range ups {
					if u.hitCount() > before[n][0] && u.sentCount() > before[n][1] {
						answered = append(answered, u)
					}
				}
				if len(answered) != 1 {
					return fmt.Errorf("%s: body_unchanged needs exactly one upstream to have answered, got %d", where, len(answered))
				}
				if sent := answered[0].lastSent(); !bytes.Equal(sent, got) {
					return fmt.Errorf("%s: body changed: sent %q, caller read %q", where, sent, got)
				}
			}
		case "upstream_hits":
			u, err := up(st["upstream"], where)
			if err != nil {
				return err
			}
			if got := u.hitCount(); float64(got) != num(st["expect"]) {
				return fmt.Errorf("%s: upstream %v got %d requests, expected %v", where, st["upstream"], got, st["expect"])
			}
			if h, ok := st["header"]; ok {
				last, ok := u.lastHit()
				if !ok {
					return fmt.Errorf("%s: no request to check headers of", where)
				}
				if err := headerSubset(h, last.header, where); err != nil {
					return err
				}
			}
			if ha, ok := st["header_absent"]; ok {
				names, ok := ha.([]any)
				if !ok {
					return fmt.Errorf("%s: header_absent must be a list of names, got %#v", where, ha)
				}
				last, ok := u.lastHit()
				if !ok {
					return fmt.Errorf("%s: no request to check headers of", where)
				}
				for _, n := range names {
					for k, v := range last.header {
						if strings.EqualFold(k, str(n)) {
							return fmt.Errorf("%s: the last request carried %s: %q", where, k, v)
						}
					}
				}
			}
			if p, ok := st["path"]; ok {
				if last, _ := u.lastHit(); last.path != str(p) {
					return fmt.Errorf("%s: last request's path is %q, expected %v", where, last.path, p)
				}
			}
			if js, ok := st["json_subset"]; ok {
				last, ok := u.lastHit()
				if !ok {
					return fmt.Errorf("%s: no request to check the body of", where)
				}
				if cl := last.header.Get("Content-Length"); cl != "" && cl != strconv.Itoa(len(last.body)) {
					return fmt.Errorf("%s: last request's Content-Length %s, its body %d bytes", where, cl, len(last.body))
				}
				d := json.NewDecoder(bytes.NewReader(last.body))
				d.UseNumber()
				var doc any
				if err := d.Decode(&doc); err != nil {
					return fmt.Errorf("%s: last request's body is not JSON: %.300s", where, last.body)
				}
				if err := jsonSubset(js, doc, where+".json"); err != nil {
					return err
				}
			}
		case "status":
			s, err := c.Status(ctx)
			if err != nil {
				return fmt.Errorf("%s: %v", where, err)
			}
			doc, err := keyedStatus(s)
			if err != nil {
				return fmt.Errorf("%s: %v", where, err)
			}
			if err := matchValue(st["expect"], doc, where+" status"); err != nil {
				return err
			}
		case "sleep":
			select {
			case <-time.After(time.Duration(num(st["seconds"]) * float64(time.Second))):
			case <-ctx.Done():
				return ctx.Err()
			}
		}
	}
	return nil
}
