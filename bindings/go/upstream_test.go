package polygate

// A fake provider for the transport tests (DESIGN §17): an httptest server answering
// from a queue of canned responses (JSON, SSE or text, with a delay), recording every
// request it receives and the bytes of every answer it sent.

import (
	"bytes"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"
)

// canned is one queued answer.
type canned struct {
	status  int
	headers map[string]string
	// body is sent as is (JSON unless headers say otherwise); ignored with sse.
	body []byte
	// sse: each event is sent as "<event>\n\n", flushed (text/event-stream).
	sse   []string
	delay time.Duration
	// gap between SSE events.
	gap time.Duration
	// holdLast: awaited before the last SSE event (a stream held open by the test).
	holdLast chan struct{}
}

type upstreamHit struct {
	method, path string
	header       http.Header
	body         []byte
}

type fakeUpstream struct {
	srv   *httptest.Server
	mu    sync.Mutex
	queue []canned
	hits  []upstreamHit
	sent  [][]byte
}

func startUpstream(t testing.TB) *fakeUpstream {
	u := &fakeUpstream{}
	u.srv = httptest.NewServer(http.HandlerFunc(u.serve))
	t.Cleanup(func() {
		u.srv.CloseClientConnections()
		u.srv.Close()
	})
	return u
}

func (u *fakeUpstream) URL() string { return u.srv.URL }

func (u *fakeUpstream) respond(c canned, times int) {
	u.mu.Lock()
	defer u.mu.Unlock()
	for i := 0; i < times; i++ {
		u.queue = append(u.queue, c)
	}
}

func (u *fakeUpstream) hitCount() int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return len(u.hits)
}

func (u *fakeUpstream) lastHit() (upstreamHit, bool) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if len(u.hits) == 0 {
		return upstreamHit{}, false
	}
	return u.hits[len(u.hits)-1], true
}

func (u *fakeUpstream) sentCount() int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return len(u.sent)
}

func (u *fakeUpstream) lastSent() []byte {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.sent[len(u.sent)-1]
}

func (u *fakeUpstream) serve(w http.ResponseWriter, r *http.Request) {
	b, _ := io.ReadAll(r.Body)
	u.mu.Lock()
	u.hits = append(u.hits, upstreamHit{method: r.Method, path: r.URL.RequestURI(), header: r.Header.Clone(), body: b})
	c := canned{status: 200, body: []byte(`{"ok":true}`)}
	if len(u.queue) > 0 {
		c = u.queue[0]
		u.queue = u.queue[1:]
	}
	u.mu.Unlock()
	if c.delay > 0 {
		select {
		case <-time.After(c.delay):
		case <-r.Context().Done():
			return
		}
	}
	h := w.Header()
	switch {
	case c.sse != nil:
		h.Set("Content-Type", "text/event-stream")
	case c.body != nil && c.headers["content-type"] == "" && !strings.HasPrefix(string(c.body), "{"):
		h.Set("Content-Type", "text/plain")
	default:
		h.Set("Content-Type", "application/json")
	}
	for k, v := range c.headers {
		h.Set(k, v)
	}
	if c.status == 0 {
		c.status = 200
	}
	if c.sse == nil {
		u.record(c.body) // before the caller can have read it
		w.WriteHeader(c.status)
		w.Write(c.body)
		return
	}
	w.WriteHeader(c.status)
	fl, _ := w.(http.Flusher)
	var all bytes.Buffer
	for i, ev := range c.sse {
		if i == len(c.sse)-1 && c.holdLast != nil {
			select {
			case <-c.holdLast:
			case <-r.Context().Done():
				return
			}
		}
		if i > 0 && c.gap > 0 {
			select {
			case <-time.After(c.gap):
			case <-r.Context().Done():
				return
			}
		}
		b := []byte(ev + "\n\n")
		all.Write(b)
		if _, err := w.Write(b); err != nil {
			return
		}
		if fl != nil {
			fl.Flush()
		}
	}
	u.record(all.Bytes())
}

func (u *fakeUpstream) record(b []byte) {
	u.mu.Lock()
	u.sent = append(u.sent, append([]byte(nil), b...))
	u.mu.Unlock()
}
