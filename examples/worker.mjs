// Example PolyGate worker for Node.js: the README's "Node.js quick start", runnable as
// written. Start the sidecar first (`cargo run --release -p polygate-sidecar`), make
// `polygate` importable (`npm install --no-save ./bindings/node` after building it),
// then `node examples/worker.mjs`. The upstream is simulated: 20% of requests time
// out, so you can watch failover, and status() shows the breaker state that results.
import { connect } from "polygate";

async function doRequest(source) {
  // Stand-in for your upstream call (OpenAI, Azure, vLLM, …).
  if (Math.random() < 0.2) throw new DOMException(`${source} timed out`, "TimeoutError");
  return { text: `hello from ${source}`, usage: { total_tokens: 200 + Math.floor(Math.random() * 700) } };
}

const client = await connect(); // path: arg, else $POLYGATE_SOCKET, else the default for this uid
const reply = await client.run("chat", { estTokens: 1200 }, async (permit) => {
  // A TimeoutError is reported as "timeout" and the next attempt fails over (failed
  // sources go last); the result's usage settles the quota. Errors after the last
  // attempt: CircuitOpenError / AllSourcesExhaustedError.
  return doRequest(permit.source);
});
console.log(reply.text);
console.log((await client.status()).scopes.chat.sources["openai-gpt4o"].state);
await client.close();
