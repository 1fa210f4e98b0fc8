package polygate

// The conformance scenarios (bindings/conformance/README.md, DESIGN §14) played by
// this binding against the real daemon, every scenario on every backend it lists:
// the shared files in ../conformance/scenarios and this binding's own in
// testdata/scenarios. Only the public API is used.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"sort"
	"strings"
	"testing"
	"time"
)

type scenario struct {
	Name        string           `json:"name"`
	Description string           `json:"description"`
	Backends    []string         `json:"backends"`
	TimeoutS    float64          `json:"timeout_s"`
	Config      string           `json:"config"`
	Steps       []map[string]any `json:"steps"`
	file        string
	extra       map[string]any
}

var scenarioDirs = []string{filepath.Join("..", "conformance", "scenarios"), filepath.Join("testdata", "scenarios")}

var runnerKeys = []string{"socket", "admin_uids", "backend", "redis_url", "key_prefix"}

// stepFields: op → required fields, optional fields.
var stepFields = map[string][2][]string{
	"call":           {{"call", "scope"}, {"est_tokens", "priority", "est_input_tokens", "est_output_tokens"}},
	"acquire":        {{"call"}, {"expect"}},
	"acquire_cancel": {{"call", "after_s"}, nil},
	"success":        {{"call"}, {"tokens", "input_tokens", "output_tokens", "count_attempt", "expect"}},
	"failure":        {{"call", "kind"}, {"tokens", "expect"}},
	"rate_limited":   {{"call"}, {"retry_after_s", "expect"}},
	"cancel":         {{"call"}, {"expect"}},
	"end":            {{"call"}, nil},
	"status":         {{"expect"}, nil},
	"admin":          {{"action", "source"}, {"seconds", "expect"}},
	"sleep":          {{"seconds"}, nil},
}

var (
	grantKeys  = []string{"source", "attempt", "is_probe", "est_tokens"}
	errorKeys  = []string{"type", "reason", "kind", "retry_after_s", "per_source_reasons", "scope", "message_contains"}
	resultKeys = []string{"applied", "state", "retry_after_s"}
)

func loadScenarios(t *testing.T) []*scenario {
	t.Helper()
	var out []*scenario
	for _, dir := range scenarioDirs {
		files, _ := filepath.Glob(filepath.Join(dir, "*.json"))
		sort.Strings(files)
		for _, f := range files {
			raw, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			sc := &scenario{file: f}
			d := json.NewDecoder(bytes.NewReader(raw))
			d.UseNumber()
			if err := d.Decode(sc); err != nil {
				t.Fatalf("%s: %v", f, err)
			}
			var top map[string]any
			json.Unmarshal(raw, &top)
			for _, k := range []string{"name", "description", "backends", "timeout_s", "config", "steps"} {
				delete(top, k)
			}
			sc.extra = top
			out = append(out, sc)
		}
	}
	if len(out) == 0 {
		t.Fatalf("no conformance scenarios in %v", scenarioDirs) // never pass vacuously
	}
	return out
}

func TestScenariosAreWellFormed(t *testing.T) {
	names := map[string]bool{}
	for _, sc := range loadScenarios(t) {
		if len(sc.extra) > 0 {
			t.Errorf("%s: unknown top-level keys %v", sc.file, keysOf(sc.extra))
		}
		if sc.Name+".json" != filepath.Base(sc.file) {
			t.Errorf("%s: name %q must match the file name", sc.file, sc.Name)
		}
		if names[sc.Name] {
			t.Errorf("%s: duplicate name", sc.file)
		}
		names[sc.Name] = true
		for _, b := range sc.Backends {
			if b != "memory" && b != "redis" {
				t.Errorf("%s: unknown backend %q", sc.file, b)
			}
		}
		for _, k := range runnerKeys {
			if configSets(sc.Config, k) {
				t.Errorf("%s: config sets %q, which the runner owns", sc.file, k)
			}
		}
		if len(sc.Steps) == 0 {
			t.Errorf("%s: no steps", sc.file)
		}
		for i, st := range sc.Steps {
			if err := checkStep(st); err != nil {
				t.Errorf("%s step %d: %v", sc.file, i, err)
			}
			if st["op"] == "sleep" && num(st["seconds"]) > 2 {
				t.Errorf("%s step %d: sleeps are at most 2 s", sc.file, i)
			}
		}
	}
}

func TestConformance(t *testing.T) {
	for _, sc := range loadScenarios(t) {
		backends := sc.Backends
		if len(backends) == 0 {
			backends = []string{"memory"}
		}
		for _, backend := range backends {
			t.Run(sc.Name+"/"+backend, func(t *testing.T) {
				d := startSidecar(t, sc.Config, backend)
				c := d.dial(t)
				limit := time.Duration(sc.TimeoutS * float64(time.Second))
				if limit == 0 {
					limit = 30 * time.Second
				}
				ctx, cancel := context.WithTimeout(context.Background(), limit)
				defer cancel()
				label := fmt.Sprintf("scenario %s [%s]", sc.Name, backend)
				done := make(chan error, 1)
				go func() { done <- play(ctx, sc, c, label) }()
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

func keysOf(m map[string]any) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

func checkKeys(m map[string]any, allowed []string, where string) error {
	var unknown []string
	for k := range m {
		found := false
		for _, a := range allowed {
			found = found || a == k
		}
		if !found {
			unknown = append(unknown, k)
		}
	}
	if len(unknown) > 0 {
		sort.Strings(unknown)
		return fmt.Errorf("%s: unknown key(s) %v (the Go runner knows %v)", where, unknown, allowed)
	}
	return nil
}

func checkStep(st map[string]any) error {
	op, _ := st["op"].(string)
	f, ok := stepFields[op]
	if !ok {
		return fmt.Errorf("unknown op %q", op)
	}
	for _, k := range f[0] {
		if _, ok := st[k]; !ok {
			return fmt.Errorf("op %s: missing field %q", op, k)
		}
	}
	return checkKeys(st, append(append([]string{"op"}, f[0]...), f[1]...), "op "+op)
}

// num reads a JSON number (json.Number or float64); NaN for anything else.
func num(v any) float64 {
	switch n := v.(type) {
	case json.Number:
		f, err := n.Float64()
		if err == nil {
			return f
		}
	case float64:
		return n
	case int:
		return float64(n)
	}
	return nanValue
}

var nanValue = func() float64 { var z float64; return z / z }()

func isRange(v any) bool {
	m, ok := v.(map[string]any)
	if !ok || len(m) == 0 {
		return false
	}
	for k := range m {
		if k != "min" && k != "max" {
			return false
		}
	}
	return true
}

func isNumber(v any) bool {
	switch v.(type) {
	case json.Number, float64, int:
		return true
	}
	return false
}

func matchNumber(want, got any, where string) error {
	g := num(got)
	if !isNumber(got) {
		return fmt.Errorf("%s: expected a number, got %v", where, got)
	}
	if isRange(want) {
		m := want.(map[string]any)
		if lo, ok := m["min"]; ok && g < num(lo) {
			return fmt.Errorf("%s: %v is below %v", where, g, lo)
		}
		if hi, ok := m["max"]; ok && g > num(hi) {
			return fmt.Errorf("%s: %v is above %v", where, g, hi)
		}
		return nil
	}
	if g != num(want) {
		return fmt.Errorf("%s: expected %v, got %v", where, want, got)
	}
	return nil
}

// matchValue is the README's partial match: objects compare the listed keys only.
func matchValue(want, got any, where string) error {
	if isRange(want) || isNumber(want) {
		return matchNumber(want, got, where)
	}
	if w, ok := want.(map[string]any); ok {
		g, ok := got.(map[string]any)
		if !ok {
			return fmt.Errorf("%s: expected an object, got %v", where, got)
		}
		for _, k := range keysOf(w) {
			gv, ok := g[k]
			if !ok {
				return fmt.Errorf("%s: key %q missing (have %v)", where, k, keysOf(g))
			}
			if err := matchValue(w[k], gv, where+"."+k); err != nil {
				return err
			}
		}
		return nil
	}
	if !reflect.DeepEqual(want, got) {
		return fmt.Errorf("%s: expected %#v, got %#v", where, want, got)
	}
	return nil
}

// keyedStatus is the status document as the scenarios see it: scopes and sources
// keyed by name (DESIGN §13).
func keyedStatus(st *Status) (map[string]any, error) {
	d := json.NewDecoder(bytes.NewReader(st.Raw))
	d.UseNumber()
	var doc map[string]any
	if err := d.Decode(&doc); err != nil {
		return nil, err
	}
	byName := func(v any) map[string]any {
		out := map[string]any{}
		l, _ := v.([]any)
		for _, x := range l {
			if m, ok := x.(map[string]any); ok {
				name, _ := m["name"].(string)
				out[name] = m
			}
		}
		return out
	}
	scopes := byName(doc["scopes"])
	for _, sc := range scopes {
		m := sc.(map[string]any)
		m["sources"] = byName(m["sources"])
	}
	doc["scopes"] = scopes
	return doc, nil
}

type scenarioCall struct {
	call       *Call
	permit     *Permit
	pendingErr error
}

func str(v any) string { s, _ := v.(string); return s }

func intField(st map[string]any, k string) int {
	if v, ok := st[k]; ok {
		return int(num(v))
	}
	return 0
}

func play(ctx context.Context, sc *scenario, c *Client, label string) error {
	calls := map[string]*scenarioCall{}
	for i, st := range sc.Steps {
		op := str(st["op"])
		where := fmt.Sprintf("%s step %d (%s)", label, i, op)
		if err := checkStep(st); err != nil {
			return fmt.Errorf("%s: %v", where, err)
		}
		theCall := func() (*scenarioCall, error) {
			sc, ok := calls[str(st["call"])]
			if !ok {
				return nil, fmt.Errorf("%s: call %q was never opened", where, st["call"])
			}
			return sc, nil
		}
		thePermit := func() (*Permit, error) {
			cl, err := theCall()
			if err != nil {
				return nil, err
			}
			if cl.permit == nil {
				return nil, fmt.Errorf("%s: the call has no permit to report on", where)
			}
			return cl.permit, nil
		}
		report := func(f func(p *Permit) error) error {
			p, err := thePermit()
			if err != nil {
				return err
			}
			rerr := f(p)
			var res any
			if r, ok := p.Result(); ok {
				res = r
			}
			return checkOutcome(st["expect"], res, rerr, where, "result")
		}
		var err error
		switch op {
		case "call":
			opts := CallOptions{EstTokens: intField(st, "est_tokens"), Priority: str(st["priority"]),
				EstInputTokens: intField(st, "est_input_tokens"), EstOutputTokens: intField(st, "est_output_tokens")}
			call, berr := c.Begin(ctx, str(st["scope"]), opts)
			calls[str(st["call"])] = &scenarioCall{call: call, pendingErr: berr}
		case "acquire":
			cl, cerr := theCall()
			if cerr != nil {
				return cerr
			}
			var p *Permit
			aerr := cl.pendingErr
			cl.pendingErr = nil
			if aerr == nil {
				p, aerr = cl.call.Acquire(ctx)
			}
			cl.permit = p
			expect, ok := st["expect"]
			if !ok {
				expect = map[string]any{"grant": map[string]any{}}
			}
			var value any
			if p != nil {
				value = p
			}
			err = checkOutcome(expect, value, aerr, where, "grant")
		case "acquire_cancel":
			cl, cerr := theCall()
			if cerr != nil {
				return cerr
			}
			cctx, cancel := context.WithCancel(ctx)
			type res struct {
				p   *Permit
				err error
			}
			ch := make(chan res, 1)
			go func() {
				p, err := cl.call.Acquire(cctx)
				ch <- res{p, err}
			}()
			select {
			case r := <-ch:
				cancel()
				return fmt.Errorf("%s: the acquire ended before it was cancelled: %v %v", where, r.p, r.err)
			case <-time.After(time.Duration(num(st["after_s"]) * float64(time.Second))):
			}
			cancel()
			r := <-ch
			if !errors.Is(r.err, context.Canceled) {
				return fmt.Errorf("%s: a cancelled acquire returned %v, %v; want context.Canceled", where, r.p, r.err)
			}
			cl.permit = nil
		case "success":
			count := true
			if v, ok := st["count_attempt"]; ok {
				count, _ = v.(bool)
			}
			o := SuccessOptions{Usage: Usage{Tokens: intField(st, "tokens"), InputTokens: intField(st, "input_tokens"), OutputTokens: intField(st, "output_tokens")}, NotCounted: !count}
			err = report(func(p *Permit) error { return p.SuccessWith(ctx, o) })
		case "failure":
			kind, kerr := ParseFailureKind(str(st["kind"]))
			if kerr != nil {
				return fmt.Errorf("%s: %v", where, kerr)
			}
			err = report(func(p *Permit) error { return p.FailureWith(ctx, kind, Usage{Tokens: intField(st, "tokens")}) })
		case "rate_limited":
			var ra time.Duration
			if v, ok := st["retry_after_s"]; ok {
				ra = time.Duration(num(v) * float64(time.Second))
			}
			err = report(func(p *Permit) error { return p.RateLimited(ctx, ra) })
		case "cancel":
			err = report(func(p *Permit) error { return p.Cancel(ctx) })
		case "end":
			cl, cerr := theCall()
			if cerr != nil {
				return cerr
			}
			if cl.call != nil {
				if eerr := cl.call.End(ctx); eerr != nil {
					return fmt.Errorf("%s: End: %v", where, eerr)
				}
			}
			cl.permit = nil
		case "status":
			s, serr := c.Status(ctx)
			if serr != nil {
				return fmt.Errorf("%s: %v", where, serr)
			}
			doc, kerr := keyedStatus(s)
			if kerr != nil {
				return fmt.Errorf("%s: %v", where, kerr)
			}
			err = matchValue(st["expect"], doc, where+" status")
		case "admin":
			src := str(st["source"])
			var aerr error
			switch action := str(st["action"]); action {
			case "force_open":
				aerr = c.ForceOpen(ctx, src, time.Duration(num(st["seconds"])*float64(time.Second)))
			case "force_close":
				aerr = c.ForceClose(ctx, src)
			case "reset":
				aerr = c.Reset(ctx, src)
			default:
				return fmt.Errorf("%s: unknown admin action %q", where, action)
			}
			expect, ok := st["expect"]
			switch {
			case !ok && aerr != nil:
				err = fmt.Errorf("%s: %v", where, aerr)
			case ok:
				m, _ := expect.(map[string]any)
				if kerr := checkKeys(m, []string{"error"}, where+".expect"); kerr != nil {
					return kerr
				}
				if aerr == nil {
					return fmt.Errorf("%s: expected an error %v, the admin request succeeded", where, m["error"])
				}
				err = checkError(m["error"], aerr, where)
			}
		case "sleep":
			select {
			case <-time.After(time.Duration(num(st["seconds"]) * float64(time.Second))):
			case <-ctx.Done():
				return fmt.Errorf("%s: %v", where, ctx.Err())
			}
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// checkOutcome checks {okKey: {...}} or {"error": {...}}; nil expects success.
func checkOutcome(expect, value any, err error, where, okKey string) error {
	if expect == nil {
		if err != nil {
			return fmt.Errorf("%s: unexpected error: %v", where, err)
		}
		return nil
	}
	m, ok := expect.(map[string]any)
	if !ok || len(m) != 1 {
		return fmt.Errorf("%s: expect needs exactly one of %s / error", where, okKey)
	}
	if kerr := checkKeys(m, []string{okKey, "error"}, where+".expect"); kerr != nil {
		return kerr
	}
	if want, ok := m["error"]; ok {
		if err == nil {
			return fmt.Errorf("%s: expected an error %v, the step succeeded with %v", where, want, value)
		}
		return checkError(want, err, where)
	}
	if err != nil {
		return fmt.Errorf("%s: expected %s, got the error %v (%T)", where, okKey, err, err)
	}
	want, _ := m[okKey].(map[string]any)
	if okKey == "grant" {
		if kerr := checkKeys(want, grantKeys, where+".grant"); kerr != nil {
			return kerr
		}
		p := value.(*Permit)
		got := map[string]any{"source": p.Source, "attempt": float64(p.Attempt), "is_probe": p.IsProbe, "est_tokens": float64(p.EstTokens)}
		return matchValue(want, got, where+".grant")
	}
	if kerr := checkKeys(want, resultKeys, where+".result"); kerr != nil {
		return kerr
	}
	if r, ok := value.(ReportResult); ok {
		got := map[string]any{"applied": r.Applied, "state": string(r.State), "retry_after_s": r.RetryAfter.Seconds()}
		return matchValue(want, got, where+".result")
	}
	return nil // a held report: no result to check (README: "when the binding returns one")
}

func checkError(wantAny any, err error, where string) error {
	want, _ := wantAny.(map[string]any)
	if kerr := checkKeys(want, errorKeys, where+".error"); kerr != nil {
		return kerr
	}
	var gu *GatewayUnavailableError
	isGateway := errors.As(err, &gu)
	var co *CircuitOpenError
	var ex *AllSourcesExhaustedError
	var se *SidecarError
	typ := str(want["type"])
	ok := false
	switch typ {
	case "circuit_open":
		ok = errors.As(err, &co)
	case "all_sources_exhausted":
		ok = errors.As(err, &ex)
	case "gateway_unavailable":
		_, ok = err.(*GatewayUnavailableError) // the base type only
	case "sidecar_error":
		ok = errors.As(err, &se)
	default:
		return fmt.Errorf("%s: unknown error type %q", where, typ)
	}
	if !ok {
		return fmt.Errorf("%s: expected %s, got %T: %v", where, typ, err, err)
	}
	if r, has := want["reason"]; has {
		if ex == nil || ex.Reason != str(r) {
			return fmt.Errorf("%s: reason of %v, expected %v", where, err, r)
		}
	}
	if k, has := want["kind"]; has {
		kind := ""
		switch {
		case se != nil:
			kind = se.Kind
		case isGateway:
			kind = gu.Kind
		}
		if kind != str(k) {
			return fmt.Errorf("%s: kind %q, expected %v (%v)", where, kind, k, err)
		}
	}
	if ra, has := want["retry_after_s"]; has {
		if !isGateway {
			return fmt.Errorf("%s: a %T carries no RetryAfter", where, err)
		}
		if merr := matchNumber(ra, gu.RetryAfter.Seconds(), where+".retry_after_s"); merr != nil {
			return merr
		}
	}
	if psr, has := want["per_source_reasons"]; has {
		got := map[string]any{}
		if isGateway {
			for k, v := range gu.PerSourceReasons {
				got[k] = v
			}
		}
		if !reflect.DeepEqual(psr, got) {
			return fmt.Errorf("%s: per_source_reasons %v, expected %v", where, got, psr)
		}
	}
	if s, has := want["scope"]; has {
		scope := ""
		switch {
		case isGateway:
			scope = gu.Scope
		case se != nil:
			scope = se.Scope
		}
		if scope != str(s) {
			return fmt.Errorf("%s: scope %q, expected %v", where, scope, s)
		}
	}
	if mc, has := want["message_contains"]; has && !strings.Contains(err.Error(), str(mc)) {
		return fmt.Errorf("%s: message %q lacks %q", where, err.Error(), mc)
	}
	return nil
}
