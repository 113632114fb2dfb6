/**
 * Errors raised by the SDK. Every error the daemon answers with becomes a
 * {@link TurndError} carrying the protocol's `code` and `retryable` flag; problems
 * of the connection itself are {@link ConnectionError}s, retryable unless the URL
 * can never work ({@link BadUrl}).
 */

/** The protocol's error codes (docs/protocol.md, "Error codes"). */
export type ErrorCode =
  | "bad_frame"
  | "bad_request"
  | "unknown_op"
  | "unsupported_protocol"
  | "not_authenticated"
  | "forbidden"
  | "not_found"
  | "conflict"
  | "busy"
  | "too_large"
  | "rate_limited"
  | "unavailable"
  | "shutting_down"
  | "internal";

/** An error answer of the daemon: `{"error": {"code", "message", "retryable"}}`. */
export class TurndError extends Error {
  /** The protocol's error code, e.g. `not_found`. */
  readonly code: ErrorCode | (string & {});
  /** Whether the same request may succeed when sent again later. */
  readonly retryable: boolean;
  /** The op of the request that was refused. */
  readonly op: string | undefined;

  constructor(code: string, message: string, retryable: boolean, op?: string) {
    super(op === undefined ? `${code}: ${message}` : `${op}: ${code}: ${message}`);
    this.name = "TurndError";
    this.code = code;
    this.retryable = retryable;
    this.op = op;
  }
}

/**
 * `busy`: a submit with `onBusy: "reject"` while the session has an unfinished turn.
 * Nothing was stored; not retryable (the session stays busy until its turns end).
 */
export class BusyError extends TurndError {
  constructor(message: string, op?: string) {
    super("busy", message, false, op);
    this.name = "BusyError";
  }
}

/** The error of an error answer: a {@link BusyError} for `busy`, else a {@link TurndError}. */
export function errorFromWire(e: Record<string, unknown>, op?: string): TurndError {
  const code = String(e.code ?? "internal");
  const message = String(e.message ?? "");
  if (code === "busy") return new BusyError(message, op);
  return new TurndError(code, message, e.retryable === true, op);
}

/**
 * The connection failed or ended before an answer arrived. The request may or may
 * not have been applied; sending it again is safe only for idempotent requests.
 * Retryable, except for its subclass {@link BadUrl}.
 */
export class ConnectionError extends Error {
  readonly code = "connection" as const;
  readonly retryable: boolean = true;

  constructor(message: string, options?: { cause?: unknown }) {
    super(message, options);
    this.name = "ConnectionError";
  }
}

/**
 * The URL can never reach a daemon, so no retry is made: it is not a URL, its scheme
 * is not `ws:` or `wss:`, or the server answered the WebSocket upgrade with an HTTP
 * status that a retry will not change (turnd answers a path other than `/v1` with
 * 404 and `no such path; protocol v1 is served at /v1`; a proxy may answer 401 or
 * 403). A 5xx, 408 or 429 answer is a retryable {@link ConnectionError} instead.
 */
export class BadUrl extends ConnectionError {
  override readonly retryable: boolean = false;
  /** The HTTP status of a refused upgrade; `undefined` for a URL that is not valid. */
  readonly status: number | undefined;

  constructor(message: string, status?: number, options?: { cause?: unknown }) {
    super(message, options);
    this.name = "BadUrl";
    this.status = status;
  }
}

/** Whether the SDK may try again after `err`: only its own errors that say so. */
export function isRetryable(err: unknown): boolean {
  return (err instanceof TurndError || err instanceof ConnectionError) && err.retryable;
}
