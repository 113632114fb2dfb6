/**
 * Errors raised by the SDK. Every error the daemon answers with becomes a
 * {@link TurndError} carrying the protocol's `code` and `retryable` flag; problems
 * of the connection itself are {@link ConnectionError}s (always retryable).
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
 * The connection failed or ended before an answer arrived. The request may or may
 * not have been applied; sending it again is safe only for idempotent requests.
 */
export class ConnectionError extends Error {
  readonly code = "connection" as const;
  readonly retryable = true;

  constructor(message: string, options?: { cause?: unknown }) {
    super(message, options);
    this.name = "ConnectionError";
  }
}
