// Partial matching of the conformance scenarios' expectations (bindings/conformance/README.md):
// numbers exact or as {min, max} ranges, objects by their listed keys, recursively.

import { show } from "./support.js";

type Obj = Record<string, unknown>;

/** A scenario's expectation did not hold (as opposed to a bug of the runner). */
export class Mismatch extends Error {}

export function isRange(v: unknown): v is { min?: number; max?: number } {
  return typeof v === "object" && v !== null && !Array.isArray(v) && Object.keys(v).length > 0
    && Object.keys(v).every((k) => k === "min" || k === "max");
}

export function matchNumber(want: unknown, got: unknown, where: string): void {
  if (typeof got !== "number" && typeof got !== "bigint") throw new Mismatch(`${where}: expected a number, got ${show(got)}`);
  const g = Number(got);
  if (isRange(want)) {
    if ((want.min !== undefined && g < want.min) || (want.max !== undefined && g > want.max)) {
      throw new Mismatch(`${where}: ${g} is outside [${want.min}, ${want.max}]`);
    }
  } else if (g !== want) {
    throw new Mismatch(`${where}: expected ${show(want)}, got ${show(got)}`);
  }
}

export function matchValue(want: unknown, got: unknown, where: string): void {
  if (isRange(want) || typeof want === "number") return matchNumber(want, got, where);
  if (typeof want === "object" && want !== null && !Array.isArray(want)) {
    if (typeof got !== "object" || got === null) throw new Mismatch(`${where}: expected an object, got ${show(got)}`);
    for (const [k, w] of Object.entries(want)) {
      if (!(k in got)) throw new Mismatch(`${where}: key ${k} missing (have ${Object.keys(got).join(", ")})`);
      matchValue(w, (got as Obj)[k], `${where}.${k}`);
    }
    return;
  }
  if (want !== got) throw new Mismatch(`${where}: expected ${show(want)}, got ${show(got)}`);
}

export function checkKeys(o: Obj, allowed: string[], where: string): void {
  const bad = Object.keys(o).filter((k) => !allowed.includes(k));
  if (bad.length) throw new Mismatch(`${where}: unknown key(s) ${bad.join(", ")} (runner knows ${allowed.join(", ")})`);
}

