/**
 * Errors of the PolyGate client (DESIGN §13, §14): the same classes and fields as
 * the Python binding's, in camelCase.
 *
 * - {@link GatewayUnavailableError} (`retryAfterS`, `perSourceReasons`, `scope`) and
 *   its subclasses {@link CircuitOpenError}, {@link AllSourcesExhaustedError}
 *   (`reason`) and {@link TenantLimitExceededError} (`tenant`, `limit`): the sidecar answered, and the call-level budget is spent — retries,
 *   back-off, failover and waiting already happened inside PolyGate. Re-submitting
 *   the job later is a task-level retry; `retryAfterS` says when that is certainly
 *   worth it (0 = now or unknown).
 * - {@link SidecarError} (`kind`): trouble with the sidecar or the request — cannot
 *   connect, connection lost (`kind` `"connection"`), undecodable reply
 *   (`"protocol"`), or a sidecar error such as `"unknown_scope"`, `"busy"`,
 *   `"invalid_argument"`, `"permission_denied"`, `"shutting_down"`.
 */

import type { WireErrorReply, WireTenantRefusal } from "./wire.js";

/** Why a source was skipped in the last admission pass (PROTOCOL §4.9). */
export type SkipReason = "circuit_open" | "paced" | "rate_limited" | "backend_unavailable" | "tenant_limited";
/** Which budget of the call ran out (PROTOCOL §4.11). */
export type ExhaustionReason = "stalled" | "quota_exhausted" | "retry_exhausted";

/** `CircuitOpen` → `circuit_open`. */
export function snake(name: string): string {
  return name.replace(/(?<!^)(?=[A-Z])/g, "_").toLowerCase();
}

/** Base class of every error this package raises about the sidecar. */
export class PolyGateError extends Error {
  /** What went wrong, in snake_case (the wire `ErrorKind`, or `connection` / `protocol`). */
  readonly kind: string;
  /** The scope the error concerns, when it concerns one. */
  readonly scope: string | null;

  constructor(message: string, kind: string, scope: string | null = null, options?: { cause?: unknown }) {
    super(message, options);
    this.name = new.target.name;
    this.kind = kind;
    this.scope = scope;
  }
}

/** Protocol or connection trouble, or a sidecar error that is not about the gateway. */
export class SidecarError extends PolyGateError {
  /** Seconds until retrying is worth it, when the sidecar said (0 otherwise). */
  readonly retryAfterS: number;

  constructor(message: string, kind = "connection", opts: { scope?: string | null; retryAfterS?: number; cause?: unknown } = {}) {
    super(message, kind, opts.scope ?? null, opts.cause === undefined ? undefined : { cause: opts.cause });
    this.retryAfterS = opts.retryAfterS ?? 0;
  }
}

/** The call-level budget is spent: no source can serve this call now. */
export class GatewayUnavailableError extends PolyGateError {
  /** Seconds until a retry is certainly worth attempting (0 = now or unknown). */
  readonly retryAfterS: number;
  /** Each source skipped in the last admission pass, with why, in configuration order. */
  readonly perSourceReasons: Record<string, SkipReason>;

  constructor(
    message: string,
    opts: { kind?: string; retryAfterS?: number; perSourceReasons?: Record<string, SkipReason>; scope?: string | null } = {},
  ) {
    super(message, opts.kind ?? "backend_unavailable", opts.scope ?? null);
    this.retryAfterS = opts.retryAfterS ?? 0;
    this.perSourceReasons = opts.perSourceReasons ?? {};
  }
}

/** Every source of the scope refused for circuit-breaker reasons (fail-fast mode). */
export class CircuitOpenError extends GatewayUnavailableError {
  constructor(message: string, opts: { retryAfterS?: number; perSourceReasons?: Record<string, SkipReason>; scope?: string | null } = {}) {
    super(message, { ...opts, kind: "circuit_open" });
  }
}

/** The call ran out of a budget; {@link reason} says which. */
export class AllSourcesExhaustedError extends GatewayUnavailableError {
  /** `stalled`, `quota_exhausted` or `retry_exhausted`. */
  readonly reason: ExhaustionReason | null;

  constructor(
    message: string,
    opts: { reason?: ExhaustionReason | null; retryAfterS?: number; perSourceReasons?: Record<string, SkipReason>; scope?: string | null } = {},
  ) {
    super(message, { ...opts, kind: "all_sources_exhausted" });
    this.reason = opts.reason ?? null;
  }
}

/**
 * The call's tenant is over one of its limits (DESIGN §19, PROTOCOL §15): the call is
 * over, and `run` throws it at once, without another attempt. `limit` is `tpm`, `rpm`,
 * `tpd`, `rpd`, `usd_per_day` or `usd_per_month`; `retryAfterS` is how long until the
 * tenant's bucket certainly holds the call, or, for a spent dollar budget, until its
 * calendar window (UTC day or month) ends.
 */
export class TenantLimitExceededError extends GatewayUnavailableError {
  /** The tenant whose limit refused (`""`: the scope's anonymous tenant). */
  readonly tenant: string;
  /** The limit that refused. */
  readonly limit: string;

  constructor(
    message: string,
    opts: { tenant: string; limit: string; retryAfterS?: number; perSourceReasons?: Record<string, SkipReason>; scope?: string | null },
  ) {
    super(message, { ...opts, kind: "tenant_limited" });
    this.tenant = opts.tenant;
    this.limit = opts.limit;
  }
}

function reasonsOf(e: WireErrorReply): Record<string, SkipReason> {
  const perSourceReasons: Record<string, SkipReason> = {};
  for (const [src, why] of e.per_source_reasons) perSourceReasons[src] = snake(why) as SkipReason;
  return perSourceReasons;
}

/** The error for a wire `TenantRefusal` (`Reply::TenantLimited`, v3). */
export function errorFromTenantRefusal(r: WireTenantRefusal): TenantLimitExceededError {
  const e = r.error;
  return new TenantLimitExceededError(e.message || `tenant "${r.tenant}" is over its ${r.limit} limit`, {
    tenant: r.tenant, limit: r.limit, retryAfterS: e.retry_after_s, perSourceReasons: reasonsOf(e), scope: e.scope,
  });
}

/** The error class and fields for a wire `ErrorReply`. */
export function errorFromReply(e: WireErrorReply): PolyGateError {
  const message = e.message || e.kind;
  const scope = e.scope;
  const retryAfterS = e.retry_after_s;
  const perSourceReasons = reasonsOf(e);
  switch (e.kind) {
    case "CircuitOpen":
      return new CircuitOpenError(message, { retryAfterS, perSourceReasons, scope });
    case "AllSourcesExhausted":
      return new AllSourcesExhaustedError(message, {
        reason: e.exhausted === null ? null : (snake(e.exhausted) as ExhaustionReason),
        retryAfterS, perSourceReasons, scope,
      });
    case "BackendUnavailable":
      return new GatewayUnavailableError(message, { kind: "backend_unavailable", retryAfterS, perSourceReasons, scope });
    default:
      return new SidecarError(message, snake(e.kind), { scope, retryAfterS });
  }
}
