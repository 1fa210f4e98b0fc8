// PolyGate in front of the openai-node SDK (DESIGN §17), runnable offline: one line
// where the client is built, and every request the SDK sends is admitted, reported
// and settled. A fake OpenAI (node:http, in this process) answers, so no key or
// network is needed. Start the sidecar first (`cargo run --release -p polygate-sidecar`),
// make `polygate` and `openai` importable (`npm install --no-save ./bindings/node openai`
// after building the binding), then `node examples/transport-openai.mjs`.
import * as http from "node:http";

import OpenAI from "openai";
import * as polygate from "polygate";

// The fake upstream: a chat completion with its usage, or an SSE stream ending in a usage chunk.
const upstream = http.createServer(async (req, res) => {
  let body = "";
  for await (const c of req) body += c;
  const stream = JSON.parse(body).stream === true;
  if (!stream) {
    res.writeHead(200, { "content-type": "application/json" });
    res.end(JSON.stringify({
      id: "c1", object: "chat.completion", created: 0, model: "gpt-4o",
      choices: [{ index: 0, message: { role: "assistant", content: "hello from the fake upstream" }, finish_reason: "stop" }],
      usage: { prompt_tokens: 12, completion_tokens: 6, total_tokens: 18 },
    }));
    return;
  }
  res.writeHead(200, { "content-type": "text/event-stream" });
  const chunk = (delta, usage = null) => `data: ${JSON.stringify({
    id: "s1", object: "chat.completion.chunk", created: 0, model: "gpt-4o",
    choices: delta === null ? [] : [{ index: 0, delta: { content: delta }, finish_reason: null }], usage,
  })}\n\n`;
  for (const w of ["streamed ", "hello"]) res.write(chunk(w));
  res.write(chunk(null, { prompt_tokens: 12, completion_tokens: 2, total_tokens: 14 }));
  res.end("data: [DONE]\n\n");
});
await new Promise((r) => upstream.listen(0, "127.0.0.1", r));

const client = await polygate.connect(); // $POLYGATE_SOCKET, else the default socket
const openai = new OpenAI({
  apiKey: "sk-offline",
  baseURL: `http://127.0.0.1:${upstream.address().port}/v1`,
  fetch: polygate.fetch({ scope: "chat", client }), // ← the one line
});

const r = await openai.chat.completions.create({ model: "gpt-4o", max_tokens: 200, messages: [{ role: "user", content: "hi" }] });
console.log(r.choices[0].message.content, `(${r.usage.total_tokens} tokens settled)`);

let text = "";
const stream = await openai.chat.completions.create({
  model: "gpt-4o", max_tokens: 200, messages: [{ role: "user", content: "hi" }], stream: true, stream_options: { include_usage: true },
});
for await (const c of stream) text += c.choices[0]?.delta.content ?? "";
console.log(text);

const chat = (await client.status()).scopes.chat;
console.log(`calls ${chat.calls}, successes ${Object.values(chat.sources).reduce((n, s) => n + Number(s.window_successes), 0)}`);
await client.close();
upstream.close();
