/**
 * polygate — Node.js client for the PolyGate admission sidecar (DESIGN §13, §14).
 *
 * ```ts
 * import { connect } from "polygate";
 * const client = await connect();   // path arg, else $POLYGATE_SOCKET, else defaultSocket()
 * const reply = await client.run("chat", { estTokens: 1200 }, async (permit) => callUpstream(permit.source));
 * ```
 */

export {
  Call, Client, DEFAULT_SOCKET, Permit, SOCKET_ENV, USER_SOCKET, VERSION, connect, defaultSocket, resolvePath,
} from "./client.js";
export type {
  AcquireOptions, CallOptions, ClassifyResult, ConnectOptions, FailureOptions, ReportResult, RunOptions,
  ScopeStatus, SourceStatus, Status, SuccessOptions, TenantStatusOptions,
} from "./client.js";
export {
  AllSourcesExhaustedError, CircuitOpenError, GatewayUnavailableError, PolyGateError, SidecarError,
  TenantLimitExceededError,
} from "./errors.js";
export type { ExhaustionReason, SkipReason } from "./errors.js";
export { cachedInputTokensOf, classifyError, retryAfterOf, statusOf, usageOf } from "./classify.js";
export type { FailureKind, Usage, Verdict } from "./classify.js";
export { MAX_TENANT_BYTES, PROTOCOL_VERSION } from "./wire.js";
export { AUTOSTART_ENV, CONFIG_ENV, SIDECAR_ENV, platformPackage, sidecarPath } from "./autostart.js";
export { limitsOf, parseDuration, parseRateLimitHeaders, toWireLimits } from "./ratelimit.js";
export type { HeaderSource, Limit, Limits } from "./ratelimit.js";
export { RouteMissingError, TENANT_HEADER, fetch } from "./transport.js";
export type { Estimate, EstimateRequest, FetchLike, FetchOptions, Route } from "./transport.js";
