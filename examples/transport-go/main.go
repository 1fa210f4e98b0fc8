// Command transport-go puts PolyGate in front of a plain net/http client (DESIGN
// §17), runnable offline: one line where the client is built, and every request
// sent through it is admitted, reported and settled. A fake OpenAI (httptest, in
// this process) answers, so no key or network is needed. Start the sidecar first
// (`cargo run --release -p polygate-sidecar`), then `go run ./examples/transport-go`.
// With openai-go the same client goes in through option.WithHTTPClient(hc).
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"strings"

	polygate "github.com/polygate/polygate/bindings/go"
)

// fakeOpenAI answers a chat completion with its usage, or an SSE stream ending in a
// usage chunk.
func fakeOpenAI(w http.ResponseWriter, r *http.Request) {
	var req struct {
		Stream bool `json:"stream"`
	}
	json.NewDecoder(r.Body).Decode(&req)
	if !req.Stream {
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"id":"c1","object":"chat.completion","model":"gpt-4o","choices":[{"index":0,"message":{"role":"assistant","content":"hello from the fake upstream"},"finish_reason":"stop"}],"usage":{"prompt_tokens":12,"completion_tokens":6,"total_tokens":18}}`)
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	for _, word := range []string{"streamed ", "hello"} {
		fmt.Fprintf(w, "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":%q}}],\"usage\":null}\n\n", word)
	}
	io.WriteString(w, "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":12,\"completion_tokens\":2,\"total_tokens\":14}}\n\n")
	io.WriteString(w, "data: [DONE]\n\n")
}

func post(hc *http.Client, url, body string) *http.Response {
	req, err := http.NewRequest("POST", url, strings.NewReader(body))
	if err != nil {
		log.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := hc.Do(req)
	if err != nil {
		log.Fatal(err) // RefuseWithError would surface *polygate.CircuitOpenError here
	}
	return resp
}

func main() {
	upstream := httptest.NewServer(http.HandlerFunc(fakeOpenAI))
	defer upstream.Close()
	url := upstream.URL + "/v1/chat/completions"

	hc := &http.Client{Transport: &polygate.Transport{Scope: "chat"}} // ← the one line ($POLYGATE_SOCKET, else the default socket)

	resp := post(hc, url, `{"model":"gpt-4o","max_tokens":200,"messages":[{"role":"user","content":"hi"}]}`)
	var out struct {
		Choices []struct {
			Message struct{ Content string }
		}
		Usage struct {
			TotalTokens int `json:"total_tokens"`
		}
	}
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
		log.Fatal(err)
	}
	resp.Body.Close()
	fmt.Printf("%s (%d tokens settled)\n", out.Choices[0].Message.Content, out.Usage.TotalTokens)

	// A stream: the permit is held until the body ends, then settled with its usage.
	resp = post(hc, url, `{"model":"gpt-4o","max_tokens":200,"stream":true,"messages":[{"role":"user","content":"hi"}]}`)
	var text strings.Builder
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		var ev struct {
			Choices []struct {
				Delta struct{ Content string }
			}
		}
		if data, ok := strings.CutPrefix(sc.Text(), "data: "); ok && json.Unmarshal([]byte(data), &ev) == nil && len(ev.Choices) > 0 {
			text.WriteString(ev.Choices[0].Delta.Content)
		}
	}
	resp.Body.Close()
	fmt.Println(text.String())

	c, err := polygate.Dial(context.Background(), "")
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	st, err := c.Status(context.Background())
	if err != nil {
		log.Fatal(err)
	}
	successes := uint64(0)
	for _, s := range st.Scope("chat").Sources {
		successes += s.WindowSuccesses
	}
	fmt.Printf("calls %d, successes %d\n", st.Scope("chat").Calls, successes)
}
