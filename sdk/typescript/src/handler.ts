/**
 * What a handler sees and says: its {@link TurnContext}, and the values it returns
 * or throws to continue ({@link Continue}), fail ({@link Fail}) or answer a cancel
 * ({@link Cancelled}); with the options a function is registered with. Kept apart
 * from the worker's connection handling, which turns these into results.
 */

/** Return `new Continue(state)` from a handler to run another step with `state` as its input. */
export class Continue {
  constructor(readonly state: unknown) {}
}

/** Throw from a handler to fail the step with a code of your own. */
export class Fail extends Error {
  readonly code: string;
  readonly retryable: boolean;

  constructor(code: string, message: string, options: { retryable?: boolean } = {}) {
    super(message);
    this.name = "Fail";
    this.code = code;
    this.retryable = options.retryable ?? false;
  }
}

/**
 * Throw from a handler to answer `cancelled`. A handler whose `ctx.signal` was
 * aborted and that throws anything other than {@link Fail} answers `cancelled` too.
 */
export class Cancelled extends Error {
  constructor(message = "cancelled") {
    super(message);
    this.name = "Cancelled";
  }
}

/** What a handler gets for one invocation. */
export interface TurnContext {
  readonly sessionId: string;
  readonly turnId: string;
  readonly functionId: string;
  /** Step number, from 0; goes up by one per `Continue`. */
  readonly step: number;
  /** Attempt number of this step, from 1. */
  readonly attempt: number;
  readonly invocationId: string;
  /**
   * `<turnId>/<step>`: the same for every attempt and redispatch of this step, so a
   * side effect keyed by it happens once even when the step runs again.
   */
  readonly idempotencyKey: string;
  /** The attempt deadline (Unix ms) as dispatched; heartbeats move it. */
  readonly deadlineMs: number;
  /**
   * Aborted when the daemon sends `cancel` (a stop, or an attempt past its deadline),
   * when a heartbeat learns the invocation is no longer current, or when the worker
   * stops without finishing its drain. The handler should then end; whatever it
   * throws is answered as `cancelled`.
   */
  readonly signal: AbortSignal;
  /**
   * Tell the daemon this invocation is still working (the SDK does this on its own
   * while the handler runs); resolves with the new deadline (Unix ms).
   */
  heartbeat(): Promise<number>;
}

export type Handler<I = unknown> = (ctx: TurnContext, input: I) => unknown | Promise<unknown>;

export interface FunctionOptions {
  /** Invocations this worker runs at once for this function (default 1). */
  concurrency?: number;
  /** Attempt deadline, renewed by heartbeats; default the daemon's `turns.default_timeout_ms`. */
  timeoutMs?: number;
  delivery?: "at_most_once" | "at_least_once";
  /** Attempts per step; default 1 (`at_most_once`) or 3 (`at_least_once`). */
  maxAttempts?: number;
  /** Send heartbeats on their own while a handler runs (default true). */
  autoHeartbeat?: boolean;
}
