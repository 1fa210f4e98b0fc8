package polygate

// An in-process fake sidecar on a temporary Unix socket: the wire codec of this
// package on the other side, a small engine (sources in configuration order,
// failed sources demoted within a call, max_attempts, forced-open breakers,
// waiting until Cancel) and hooks for the unit tests to misbehave on purpose.

import (
	"bufio"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"
)

type fakeScope struct {
	name        string
	sources     []string
	maxAttempts int
	// wait: when every source is forced open, hold the acquire until Cancel (or
	// the breaker closes) instead of answering CircuitOpen.
	wait bool
}

type fakeSourceStats struct {
	successes, failures, streak, inFlight int
	openUntil                             time.Time
}

type fakeCall struct {
	scope    *fakeScope
	attempts int
	failed   map[string]bool
	permit   uint64 // the unreported permit, 0 if none
	est      uint64
}

type fakePermit struct {
	call   uint64
	source string
}

type fakeLogEntry struct {
	conn int
	id   uint64
	req  request
}

type fakeSidecar struct {
	path string
	ln   net.Listener
	// version is the highest protocol version the fake speaks: a Hello above it is
	// refused, as a version-1 or version-2 sidecar does.
	version uint32
	// welcomeVersion, if set, is what Welcome announces instead of the Hello's.
	welcomeVersion uint32
	maxFrame       uint32

	mu     sync.Mutex
	scopes []*fakeScope
	stats  map[string]*fakeSourceStats
	log    []fakeLogEntry
	conns  []*fakeConn
	nextID uint64
	// hook, if set, sees every request first; returning true means it handled it.
	hook func(fc *fakeConn, id uint64, r *request) bool

	wg sync.WaitGroup
}

type fakeConn struct {
	s   *fakeSidecar
	idx int
	nc  net.Conn
	wmu sync.Mutex

	mu      sync.Mutex
	calls   map[uint64]*fakeCall
	permits map[uint64]*fakePermit
	waiting map[uint64]chan struct{}
	// version is the protocol version its Hello said.
	version uint32
	// raw holds the payload of every request after Hello, as received.
	raw [][]byte
}

// newFake starts a fake sidecar in dir with the given scopes.
func newFake(dir string, scopes ...*fakeScope) (*fakeSidecar, error) {
	path := filepath.Join(dir, "fake.sock")
	ln, err := net.Listen("unix", path)
	if err != nil {
		return nil, err
	}
	s := &fakeSidecar{path: path, ln: ln, version: 3, maxFrame: defaultMaxFrame, scopes: scopes, stats: map[string]*fakeSourceStats{}}
	for _, sc := range scopes {
		if sc.maxAttempts == 0 {
			sc.maxAttempts = 3
		}
		for _, src := range sc.sources {
			s.stats[src] = &fakeSourceStats{}
		}
	}
	s.wg.Add(1)
	go s.accept()
	return s, nil
}

// startFake is newFake for a test: it stops with the test.
func startFake(t testing.TB, scopes ...*fakeScope) *fakeSidecar {
	t.Helper()
	if len(scopes) == 0 {
		scopes = []*fakeScope{{name: "chat", sources: []string{"a", "b", "c"}}}
	}
	dir, err := os.MkdirTemp("", "pg-go-fake-")
	if err != nil {
		t.Fatal(err)
	}
	s, err := newFake(dir, scopes...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.close(); os.RemoveAll(dir) })
	return s
}

func (s *fakeSidecar) close() {
	s.ln.Close()
	s.mu.Lock()
	conns := append([]*fakeConn(nil), s.conns...)
	s.mu.Unlock()
	for _, c := range conns {
		c.nc.Close()
	}
	s.wg.Wait()
}

func (s *fakeSidecar) setHook(h func(fc *fakeConn, id uint64, r *request) bool) {
	s.mu.Lock()
	s.hook = h
	s.mu.Unlock()
}

// requests returns the tags of every request received (after Hello), in order.
func (s *fakeSidecar) requests() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]string, 0, len(s.log))
	for _, e := range s.log {
		out = append(out, requestNames[e.req.tag])
	}
	return out
}

func (s *fakeSidecar) entries() []fakeLogEntry {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]fakeLogEntry(nil), s.log...)
}

func (s *fakeSidecar) connCount() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.conns)
}

// dropConns closes every connection from the sidecar's side.
func (s *fakeSidecar) dropConns() {
	s.mu.Lock()
	conns := append([]*fakeConn(nil), s.conns...)
	s.mu.Unlock()
	for _, c := range conns {
		c.nc.Close()
	}
}

func (s *fakeSidecar) accept() {
	defer s.wg.Done()
	for {
		nc, err := s.ln.Accept()
		if err != nil {
			return
		}
		s.mu.Lock()
		c := &fakeConn{s: s, idx: len(s.conns), nc: nc, calls: map[uint64]*fakeCall{}, permits: map[uint64]*fakePermit{}, waiting: map[uint64]chan struct{}{}}
		s.conns = append(s.conns, c)
		s.mu.Unlock()
		s.wg.Add(1)
		go c.serve()
	}
}

func (c *fakeConn) reply(id uint64, r *reply) {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	c.nc.Write(appendReply(nil, id, r))
}

func (c *fakeConn) replyErr(id uint64, kind uint32, msg string) {
	c.reply(id, &reply{tag: repError, err: &errorReply{kind: kind, message: msg}})
}

func (c *fakeConn) serve() {
	defer c.s.wg.Done()
	defer c.release()
	br := bufio.NewReader(c.nc)
	payload, err := readFrame(br, nil)
	if err != nil {
		return
	}
	id, hello, err := decodeRequest(payload)
	if err != nil || hello.tag != reqHello {
		c.replyErr(id, kindProtocolViolation, "first frame must be Hello")
		return
	}
	if hello.version > c.s.version {
		if c.s.version == 1 {
			c.replyErr(id, kindProtocolViolation, fmt.Sprintf("protocol version %d not supported; this sidecar speaks %d", hello.version, c.s.version))
		} else { // what a version-2 sidecar says
			c.replyErr(id, kindProtocolViolation, fmt.Sprintf("protocol version mismatch: client %q speaks version %d, this sidecar speaks versions 1 to %d", hello.clientName, hello.version, c.s.version))
		}
		return
	}
	c.version = hello.version
	v := hello.version
	if c.s.welcomeVersion != 0 {
		v = c.s.welcomeVersion
	}
	c.reply(id, &reply{tag: repWelcome, version: v, sidecarVersion: "0.2.0-fake", maxFrame: c.s.maxFrame})
	var wg sync.WaitGroup
	for {
		payload, err := readFrame(br, nil)
		if err != nil {
			c.release() // ends the waits, then the request goroutines
			wg.Wait()
			return
		}
		id, r, err := decodeRequest(payload)
		if err != nil {
			c.replyErr(id, kindMalformed, err.Error())
			c.release()
			wg.Wait()
			return
		}
		c.s.mu.Lock()
		c.s.log = append(c.s.log, fakeLogEntry{c.idx, id, r})
		c.raw = append(c.raw, append([]byte(nil), payload...))
		hook := c.s.hook
		c.s.mu.Unlock()
		if hook != nil && hook(c, id, &r) {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			c.handle(id, &r)
		}()
	}
}

// release frees what the connection held, as the sidecar does when it closes.
func (c *fakeConn) release() {
	c.nc.Close()
	c.mu.Lock()
	defer c.mu.Unlock()
	c.s.mu.Lock()
	defer c.s.mu.Unlock()
	for _, p := range c.permits {
		c.s.stats[p.source].inFlight--
	}
	c.permits, c.calls = map[uint64]*fakePermit{}, map[uint64]*fakeCall{}
	for _, ch := range c.waiting {
		close(ch)
	}
	c.waiting = map[uint64]chan struct{}{}
}

func (s *fakeSidecar) scope(name string) *fakeScope {
	for _, sc := range s.scopes {
		if sc.name == name {
			return sc
		}
	}
	return nil
}

func (c *fakeConn) handle(id uint64, r *request) {
	s := c.s
	if c.version < tenantVersion && (r.tag == reqStartTenant || r.tag == reqBeginTenant || r.tag == reqTenantStatus ||
		((r.tag == reqRetry || r.tag == reqFinish || r.tag == reqReport) && r.outcome.tag == outSuccessCached)) {
		// as the sidecar does: a version-3 message on an older connection
		c.replyErr(id, kindInvalidArgument, requestNames[r.tag]+" needs protocol version 3")
		return
	}
	switch r.tag {
	case reqTenantStatus:
		scopes := map[string]any{}
		for _, sc := range s.scopes {
			if !r.scope.ok || r.scope.v == sc.name {
				scopes[sc.name] = map[string]any{"limits": map[string]any{"tpm": 1000}, "in_flight": 0, "waiting": 0}
			}
		}
		b, _ := json.Marshal(map[string]any{"tenant": r.tenant, "scopes": scopes})
		c.reply(id, &reply{tag: repStatusJSON, text: string(b)})
	case reqStart, reqBegin, reqBeginCall, reqStartTenant, reqBeginTenant:
		sc := s.scope(r.spec.scope)
		if sc == nil {
			c.reply(id, &reply{tag: repError, err: &errorReply{kind: kindUnknownScope, message: fmt.Sprintf("unknown scope %q", r.spec.scope), scope: optStr{r.spec.scope, true}}})
			return
		}
		s.mu.Lock()
		s.nextID++
		callID := s.nextID
		s.mu.Unlock()
		call := &fakeCall{scope: sc, failed: map[string]bool{}, est: r.spec.estTokens.v}
		if !r.spec.estTokens.ok {
			call.est = 100
		}
		c.mu.Lock()
		c.calls[callID] = call
		c.mu.Unlock()
		if r.tag != reqStart && r.tag != reqStartTenant {
			c.reply(id, &reply{tag: repCallBegun, call: callID})
			return
		}
		g, e := c.acquire(id, callID)
		if e != nil {
			c.dropCall(callID)
			c.reply(id, &reply{tag: repError, err: e})
			return
		}
		c.reply(id, &reply{tag: repStarted, call: callID, grant: g})
	case reqAcquire:
		g, e := c.acquire(id, r.target)
		if e != nil {
			c.reply(id, &reply{tag: repError, err: e})
			return
		}
		c.reply(id, &reply{tag: repGranted, grant: g})
	case reqRetry, reqFinish, reqReport:
		callID, e := c.apply(r.target, &r.outcome)
		if e != nil {
			c.reply(id, &reply{tag: repError, err: e})
			return
		}
		switch r.tag {
		case reqRetry:
			g, e := c.acquire(id, callID)
			if e != nil {
				c.dropCall(callID)
				c.reply(id, &reply{tag: repError, err: e})
				return
			}
			c.reply(id, &reply{tag: repGranted, grant: g})
		case reqFinish:
			c.dropCall(callID)
			fallthrough
		default:
			c.reply(id, &reply{tag: repReported, applied: true, state: 0})
		}
	case reqEndCall:
		c.mu.Lock()
		_, ok := c.calls[r.target]
		c.mu.Unlock()
		if !ok {
			c.replyErr(id, kindUnknownCall, fmt.Sprintf("no call %d on this connection", r.target))
			return
		}
		c.dropCall(r.target)
		c.reply(id, &reply{tag: repOk})
	case reqCancel:
		c.mu.Lock()
		if ch, ok := c.waiting[r.target]; ok {
			close(ch)
			delete(c.waiting, r.target)
		}
		c.mu.Unlock()
		c.reply(id, &reply{tag: repOk})
	case reqPing:
		c.reply(id, &reply{tag: repPong})
	case reqForceOpen, reqForceClose, reqReset:
		s.mu.Lock()
		st, ok := s.stats[r.source]
		if ok {
			switch r.tag {
			case reqForceOpen:
				st.openUntil = time.Now().Add(time.Duration(r.seconds * float64(time.Second)))
			case reqForceClose:
				st.openUntil = time.Time{}
			case reqReset:
				*st = fakeSourceStats{inFlight: st.inFlight}
			}
		}
		s.mu.Unlock()
		if !ok {
			c.replyErr(id, kindInvalidArgument, fmt.Sprintf("unknown source %q", r.source))
			return
		}
		c.reply(id, &reply{tag: repOk})
	case reqStatusJSON:
		c.reply(id, &reply{tag: repStatusJSON, text: s.statusJSON()})
	default:
		c.replyErr(id, kindInvalidArgument, "the fake does not serve "+requestNames[r.tag])
	}
}

func (c *fakeConn) dropCall(callID uint64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	call, ok := c.calls[callID]
	if !ok {
		return
	}
	delete(c.calls, callID)
	if p, ok := c.permits[call.permit]; ok && call.permit != 0 {
		delete(c.permits, call.permit)
		c.s.mu.Lock()
		c.s.stats[p.source].inFlight--
		c.s.mu.Unlock()
	}
}

// apply records a report; it returns the permit's call.
func (c *fakeConn) apply(permit uint64, o *outcome) (uint64, *errorReply) {
	c.mu.Lock()
	defer c.mu.Unlock()
	p, ok := c.permits[permit]
	if !ok {
		return 0, &errorReply{kind: kindUnknownPermit, message: fmt.Sprintf("no permit %d on this connection", permit)}
	}
	if o.tag == outRateLimited && o.retryAfter.ok && o.retryAfter.v < 0 {
		return 0, &errorReply{kind: kindInvalidArgument, message: "retry_after_s must be >= 0"}
	}
	delete(c.permits, permit)
	call := c.calls[p.call]
	call.permit = 0
	c.s.mu.Lock()
	defer c.s.mu.Unlock()
	st := c.s.stats[p.source]
	st.inFlight--
	switch o.tag {
	case outSuccess, outSuccessUsage, outSuccessCached:
		st.streak = 0
		if o.countAttempt {
			st.successes++
		} else {
			call.failed[p.source] = true
		}
	case outFailure, outFailureUsage:
		st.failures++
		st.streak++
		call.failed[p.source] = true
	case outRateLimited:
		call.failed[p.source] = true
	case outCancelled:
		call.attempts--
	}
	return p.call, nil
}

// acquire grants the call's next attempt, waiting (if the scope waits) until
// Cancel or the connection's end.
func (c *fakeConn) acquire(reqID, callID uint64) (grant, *errorReply) {
	c.mu.Lock()
	call, ok := c.calls[callID]
	if !ok {
		c.mu.Unlock()
		return grant{}, &errorReply{kind: kindUnknownCall, message: fmt.Sprintf("no call %d on this connection", callID)}
	}
	scopeName := optStr{call.scope.name, true}
	if call.attempts >= call.scope.maxAttempts {
		c.mu.Unlock()
		return grant{}, &errorReply{kind: kindAllSourcesExhausted, message: fmt.Sprintf("%d of max_attempts %d used", call.attempts, call.scope.maxAttempts), exhausted: optU32{2, true}, scope: scopeName}
	}
	var cancel chan struct{}
	for {
		now := time.Now()
		c.s.mu.Lock()
		var pick string
		var reasons []sourceReason
		minWait := time.Duration(0)
		for _, demoted := range []bool{false, true} {
			for _, src := range call.scope.sources {
				if call.failed[src] != demoted || pick != "" {
					continue
				}
				if st := c.s.stats[src]; st.openUntil.After(now) {
					reasons = append(reasons, sourceReason{src, 0})
					if w := st.openUntil.Sub(now); minWait == 0 || w < minWait {
						minWait = w
					}
					continue
				}
				pick = src
			}
		}
		if pick != "" {
			c.s.stats[pick].inFlight++
			c.s.nextID++
			permit := c.s.nextID
			c.s.mu.Unlock()
			call.attempts++
			call.permit = permit
			c.permits[permit] = &fakePermit{call: callID, source: pick}
			if cancel != nil {
				delete(c.waiting, reqID)
			}
			est := call.est
			attempt := call.attempts
			c.mu.Unlock()
			return grant{permit: permit, source: pick, attempt: uint32(attempt), estTokens: est}, nil
		}
		c.s.mu.Unlock()
		if !call.scope.wait {
			c.mu.Unlock()
			return grant{}, &errorReply{kind: kindCircuitOpen, message: "every source of scope " + call.scope.name + " has an open circuit", retryAfter: minWait.Seconds(), reasons: reasons, scope: scopeName}
		}
		if cancel == nil {
			cancel = make(chan struct{})
			c.waiting[reqID] = cancel
		}
		c.mu.Unlock()
		select {
		case <-cancel:
			return grant{}, &errorReply{kind: kindCancelled, message: fmt.Sprintf("request %d was cancelled", reqID)}
		case <-time.After(5 * time.Millisecond):
		}
		c.mu.Lock()
		if _, ok := c.calls[callID]; !ok {
			delete(c.waiting, reqID)
			c.mu.Unlock()
			return grant{}, &errorReply{kind: kindUnknownCall, message: "the call ended while waiting"}
		}
	}
}

// statusJSON renders the fake's state, with keys a future sidecar might add.
func (s *fakeSidecar) statusJSON() string {
	// Lock order: a connection's mu before the sidecar's.
	s.mu.Lock()
	conns := append([]*fakeConn(nil), s.conns...)
	s.mu.Unlock()
	calls := map[*fakeScope]int{}
	for _, c := range conns {
		c.mu.Lock()
		for _, call := range c.calls {
			calls[call.scope]++
		}
		c.mu.Unlock()
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	type m = map[string]any
	scopes := []any{}
	for _, sc := range s.scopes {
		srcs := []any{}
		for _, name := range sc.sources {
			st := s.stats[name]
			state := "closed"
			retry := 0.0
			if w := time.Until(st.openUntil); w > 0 {
				state, retry = "open", w.Seconds()
			}
			srcs = append(srcs, m{"name": name, "state": state, "epoch": uint64(1<<63 + 1), "retry_after_s": retry,
				"cooldown_level": 0, "window_successes": st.successes, "window_failures": st.failures, "streak": st.streak,
				"memo_remaining_s": 0.0, "pacer_ceiling": 8.0, "in_flight": st.inFlight, "tokens_available": 1500.5,
				"requests_available": nil, "quota_blocked_s": 0.0, "degraded": false, "future_source_key": []int{1}})
		}
		scopes = append(scopes, m{"name": sc.name, "circuit_open": "fail_fast", "quota_full": "wait", "waiters": 0,
			"calls": calls[sc], "sources": srcs, "priorities": []any{m{"name": "batch", "waiters": 0}}})
	}
	b, _ := json.Marshal(m{"sidecar_version": "0.2.0-fake", "backend": "memory", "protocol_version": 2, "scopes": scopes, "future_top_key": "x"})
	return string(b)
}
