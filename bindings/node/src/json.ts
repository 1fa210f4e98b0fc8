/**
 * JSON that keeps big integers exact (bindings/PROTOCOL.md §12, §14.4): integers
 * beyond `Number.MAX_SAFE_INTEGER` (an `epoch`, a u64 id in the vectors) become
 * `bigint`s; every other number is a plain `number`. A document without a run of
 * 16 or more digits cannot hold such an integer, and goes through `JSON.parse`.
 */

export type Json = null | boolean | number | bigint | string | Json[] | { [key: string]: Json };

/** Parse `text`; integers that a double would round come back as `bigint`. */
export function parseJson(text: string): Json {
  if (!/\d{16}/.test(text)) return JSON.parse(text) as Json;
  const p = new Parser(text);
  p.ws();
  const v = p.value();
  p.ws();
  if (p.i !== text.length) p.fail("trailing characters");
  return v;
}

class Parser {
  i = 0;
  constructor(readonly s: string) {}

  fail(what: string): never {
    throw new SyntaxError(`JSON: ${what} at position ${this.i}`);
  }

  ws(): void {
    const s = this.s;
    while (this.i < s.length) {
      const c = s.charCodeAt(this.i);
      if (c === 0x20 || c === 0x0a || c === 0x0d || c === 0x09) this.i++;
      else break;
    }
  }

  value(): Json {
    const c = this.s[this.i];
    if (c === "{") return this.object();
    if (c === "[") return this.array();
    if (c === '"') return this.string();
    if (c === "-" || (c !== undefined && c >= "0" && c <= "9")) return this.number();
    for (const [word, v] of [["true", true], ["false", false], ["null", null]] as const) {
      if (this.s.startsWith(word, this.i)) {
        this.i += word.length;
        return v;
      }
    }
    return this.fail("unexpected character");
  }

  object(): Json {
    this.i++;
    const o: { [key: string]: Json } = {};
    this.ws();
    if (this.s[this.i] === "}") {
      this.i++;
      return o;
    }
    for (;;) {
      this.ws();
      if (this.s[this.i] !== '"') this.fail("expected a key");
      const k = this.string();
      this.ws();
      if (this.s[this.i] !== ":") this.fail("expected ':'");
      this.i++;
      this.ws();
      Object.defineProperty(o, k, { value: this.value(), enumerable: true, writable: true, configurable: true });
      this.ws();
      const c = this.s[this.i++];
      if (c === "}") return o;
      if (c !== ",") this.fail("expected ',' or '}'");
    }
  }

  array(): Json {
    this.i++;
    const a: Json[] = [];
    this.ws();
    if (this.s[this.i] === "]") {
      this.i++;
      return a;
    }
    for (;;) {
      this.ws();
      a.push(this.value());
      this.ws();
      const c = this.s[this.i++];
      if (c === "]") return a;
      if (c !== ",") this.fail("expected ',' or ']'");
    }
  }

  string(): string {
    // Find the closing quote, then let JSON.parse handle the escapes.
    const start = this.i;
    this.i++;
    const s = this.s;
    while (this.i < s.length) {
      const c = s[this.i];
      if (c === "\\") this.i += 2;
      else if (c === '"') {
        this.i++;
        return JSON.parse(s.slice(start, this.i)) as string;
      } else this.i++;
    }
    return this.fail("unterminated string");
  }

  number(): number | bigint {
    const m = /-?(?:0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?/y;
    m.lastIndex = this.i;
    const r = m.exec(this.s);
    if (r === null) return this.fail("bad number");
    this.i += r[0].length;
    if (r[1] === undefined && r[2] === undefined) {
      const n = Number(r[0]);
      return Number.isSafeInteger(n) ? n : BigInt(r[0]);
    }
    return Number(r[0]);
  }
}
